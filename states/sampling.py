"""A parallel-sampling group (n > 1): the bookkeeping parent of a batch's prompts.

    created ──Submitted──► acquiring_lora ──LoRAAcquired──► validating ──Validated──► warming_up
       [no LoRA]───────────────────────────────────────────────▲                 │ WarmupFinished
                                                                      [warm-ups pending] ↺ │
                                                                                         ▼
                                               fanned_out ◄──FanOut (▸ fan_out)──── ready

    failures before fan-out: AcquireFailed / ValidationFailed / BatchFailed ► rejected
    [4xx] | errored [5xx]; RequestAbort ► aborted — each releasing every reference the parent
    still owns. BatchFailed (a sibling parent of the batch failed) is accepted in every
    live state, since the parents of a batch progress concurrently.

`Submitted(acquire=)` decides with the guard `wants_lora`; a driver that knows which it
is fires `SubmittedAcquiring` or `SubmittedNoAcquire`, the same two edges unguarded (as
in `states.request`).

The parent owns `len(prompts) x n` LoRA references (handle kind ``"lora"``) from the
acquire until fan-out. The prefix warm-up request of each prompt is a non-owner observer
of them. Fan-out is the parent's terminal transition: its plan transfers exactly one
reference to each child request, in order, so afterwards the parent owns nothing and each
child releases its own reference on its own terminal transition. Any failure or abort
before fan-out releases all of them from the parent, exactly once.

A batch may be one parent owning every prompt's references, or (an explicit list of
parent rids) one parent per prompt owning that prompt's `n`; the driver fires `FanOut` on
every parent once all of them are `ready`, so a late failure of one prompt still finds
no child running.
"""

from __future__ import annotations

from typing import Any

from terminus.fsm import ANY, ERROR, IGNORE, Event, Instance, Machine, Spec, State, go

from .request import (
    AcquireFailed,
    LoRAAcquired,
    RequestAbort,
    Submitted,
    SubmittedAcquiring,
    SubmittedNoAcquire,
    Validated,
    ValidationFailed,
    client_error,
    client_rid,
    wants_lora,
)

__all__ = [
    "SAMPLING",
    "SAMPLING_PLANS",
    "BatchFailed",
    "FanOut",
    "SamplingGroup",
    "WarmupFinished",
]


class WarmupFinished(Event):
    """One prefix warm-up request of the group finished."""


class BatchFailed(Event):
    """The batch failed before fan-out: a warm-up of this group failed, or a sibling
    parent's prompt or warm-up did (a batch fans out whole or not at all)."""

    status: int = 500
    message: str = ""


class FanOut(Event):
    """Every parent of the batch is ready: hand each child its reference and send it."""


_instance_init = Instance.__init__  # (the engine's: a global, not a class attribute read)


class SamplingGroup(Instance):
    """A parallel-sampling parent. `key` is its `RequestKey` (role "group"); `rid` the
    id its client uses.

    Fields for the driver: `prompts`, `loras` (one adapter name or None per prompt), `n`,
    `tokens` (per prompt, once tokenized), `pending_warmups` (warm-ups not yet finished;
    the driver lowers it before firing WarmupFinished), `warmups` and `children` (request
    instances; `children` is in reference order: prompt-major, then sample),
    `live_members` (the warm-ups and children the driver made and has not retired yet:
    the driver raises it when it makes them and lowers it as each one is retired).
    """

    __slots__ = ("children", "live_members", "loras", "n", "pending_warmups", "prompts",
                 "tokens", "warmups")

    def __init__(self, machine: Machine, key: Any = None, prompts: list[Any] | None = None,
                 loras: list[str | None] | None = None, n: int = 2) -> None:
        # (`prompts`, `loras` and `n` may be passed by position, as the tokenizer side
        # does: a call with keywords builds a dict for them, per group.)
        _instance_init(self, machine, key)  # not super(): no lookup per group
        self.prompts: list[Any] = list(prompts or ())
        self.loras: list[str | None] = list(loras or [None] * len(self.prompts))
        self.n = n
        self.tokens: list[Any] = []
        self.pending_warmups = 0
        self.live_members = 0
        self.warmups: list[Any] = []
        self.children: list[Any] = []

    @property
    def rid(self) -> Any:
        """The id the client sees (`RequestKey.rid` of the key, or the key itself)."""
        return client_rid(self.key)


def warmups_pending(inst: Any, ev: Any) -> bool:
    """Some prefix warm-up of the group has not finished yet."""
    return inst.pending_warmups > 0  # (an int's comparison: a bool, without bool())


_aborted = go("aborted", plan="release_aborted")
_failed = [go("rejected", plan="release_rejected", when="client_error"),
           go("errored", plan="release_errored")]
# After fan-out or a failure, late events are absorbed: an abort of a parent whose
# children now carry the work, a warm-up result after an abort, a FanOut the driver sent
# to a sibling that had already failed. Submitted twice is a driver bug.
_terminal_row: dict[Any, Any] = {ANY: IGNORE, Submitted: ERROR, SubmittedAcquiring: ERROR,
                                 SubmittedNoAcquire: ERROR}

SPEC = Spec(
    "sampling",
    states=(
        State("created", initial=True, doc="known to the tokenizer, nothing acquired"),
        State("acquiring_lora", doc="acquiring len(prompts) x n references at once"),
        State("validating", doc="tokenizing every prompt; owns every reference"),
        State("warming_up", doc="prefix warm-up requests (non-owners) in flight"),
        State("ready", doc="warmed up; waits for every parent of the batch"),
        State("fanned_out", terminal=True, doc="each child owns one reference"),
        State("aborted", terminal=True, doc="aborted before fan-out; all released"),
        State("rejected", terminal=True, doc="4xx before fan-out; all released"),
        State("errored", terminal=True, doc="5xx before fan-out; all released"),
    ),
    events=(Submitted, SubmittedAcquiring, SubmittedNoAcquire,
            LoRAAcquired, AcquireFailed, Validated, ValidationFailed,
            WarmupFinished, BatchFailed, FanOut, RequestAbort),
    table={
        "created": {
            Submitted: [go("acquiring_lora", when="wants_lora"), go("validating")],
            SubmittedAcquiring: go("acquiring_lora"),
            SubmittedNoAcquire: go("validating"),
            BatchFailed: _failed,
            RequestAbort: _aborted,
            ANY: ERROR,
        },
        "acquiring_lora": {
            LoRAAcquired: go("validating"),
            AcquireFailed: _failed,
            BatchFailed: _failed,
            RequestAbort: _aborted,
            ANY: ERROR,
        },
        "validating": {
            Validated: go("warming_up"),
            ValidationFailed: _failed,
            BatchFailed: _failed,  # a sibling's prompt failed while this one tokenized
            RequestAbort: _aborted,
            ANY: ERROR,
        },
        "warming_up": {
            WarmupFinished: [go("warming_up", when="warmups_pending"), go("ready")],
            BatchFailed: _failed,
            RequestAbort: _aborted,
            ANY: ERROR,
        },
        "ready": {
            FanOut: go("fanned_out", plan="fan_out"),
            BatchFailed: _failed,
            RequestAbort: _aborted,
            ANY: ERROR,
        },
        "fanned_out": _terminal_row,
        "aborted": _terminal_row,
        "rejected": _terminal_row,
        "errored": _terminal_row,
    },
    guards={"wants_lora": wants_lora, "client_error": client_error,
            "warmups_pending": warmups_pending},
    doc="Parallel-sampling parent: owns batch x n LoRA references until fan-out.",
)

SAMPLING: Machine = SPEC.build()
SAMPLING_PLANS = SAMPLING.plan_names
"""The plans SAMPLING's terminal edges name (sorted); `effects.request` implements them."""
"""The built sampling-group machine (unbound: bind plans with `effects.request`)."""
