"""Release plans of the tokenizer-side machines: REQUEST and SAMPLING.

Every plan releases what the ledger says the instance owns *now* (handle kind
``"lora"``, value the id the registry handed out), then streams the instance's one
terminal output (`terminus.effects.output.TerminalOutput`, into an `OutputSink`); the
terminal transition runs once, so the output is streamed once::

    request  finished | rejected | errored | dispatch_failed:
                 Release("lora") ─► stream terminal output (best effort, I5)
             aborted:
                 tell the scheduler (best effort, only once dispatched) ─► Release("lora")
                 ─► stream the abort (best effort)
    sampling fan_out: transfer one reference to each child, in order (owns none after)
             aborted | rejected | errored: Release("lora") (all batch x n) ─► stream

A reference is released through the registry by its acquired id, never by adapter name
or path: an upsert keeps the id, a re-registered name gets a new one, and either way the
reference goes back to the counter it was taken from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from terminus.fsm import Action, Ledger, Machine, Plan, Release, release_effect
from terminus.kernels.protocols import LoRARegistry
from terminus.states.request import REQUEST, Finished, Request, client_rid
from terminus.states.sampling import SAMPLING

from .output import OutputSink, TerminalOutput

__all__ = [
    "LORA",
    "FanOutMismatch",
    "OutputSink",
    "RequestResources",
    "SchedulerLink",
    "TerminalOutput",
    "bind_request",
    "bind_sampling",
    "lora_ledger",
    "release_lora",
    "request_plans",
    "sampling_plans",
]

LORA = "lora"
"""The ledger handle kind of a LoRA reference; its value is the acquired adapter id."""


@runtime_checkable
class SchedulerLink(Protocol):
    """The tokenizer's connection to the scheduler (a socket in a real engine).

    `rid` is the request's `states.request.RequestKey`: a link that serializes writes
    `str(rid)` (or `rid.rid`) on the wire, and reports results back to the tokenizer side
    with that id or with the key itself; both find the request.
    """

    def send(self, rid: Any, tokens: Any, lora_id: int | None) -> None:
        """Send a tokenized request; raises when it cannot be sent."""

    def abort(self, rid: Any) -> None:
        """Ask the scheduler to abort `rid` (it answers with an abort echo)."""


@dataclass
class RequestResources:
    """What the tokenizer-side release effects use (`Ledger(resources=...)`).

    Any object with these attributes will do, so a serving loop can share one ledger
    (and one resources object) across every machine. `async_release=True` releases
    through the registry's awaitable `release` even when it has a synchronous
    `release_nowait`; the ledger keeps those tasks referenced until they finish.
    """

    lora_registry: LoRARegistry
    sink: OutputSink
    scheduler: SchedulerLink
    async_release: bool = False


class FanOutMismatch(RuntimeError):
    """A sampling group owns a different number of references than children need them."""


# -- effects ----------------------------------------------------------------------------


@release_effect
def release_lora(ctx: Any, handle: Any) -> Any:
    """Return one reference to the registry by its acquired id (the `"lora"` releaser)."""
    res = ctx.resources
    reg = res.lora_registry
    # (`RequestResources.async_release` read as a field: no getattr for ours)
    if not (res.async_release if res.__class__ is RequestResources
            else getattr(res, "async_release", False)):
        try:  # `getattr(reg, "release_nowait", None)`, without the call
            nowait = reg.release_nowait
        except AttributeError:
            nowait = None
        if nowait is not None:
            nowait(handle.value)
            return None
    return reg.release(handle.value)  # a coroutine: the ledger keeps its task alive


_STATUS = {"finished": 200, "aborted": 499, "dispatch_failed": 503}


def terminal_output(rid: Any, outcome: str, event: Any) -> TerminalOutput:
    """The terminal output for a transition into `outcome` caused by `event`."""
    if event.__class__ is Finished and outcome == "finished":  # the common case, direct
        return TerminalOutput(rid, outcome, 200, "", event.reason)
    status = getattr(event, "status", None)
    if status is None:
        status = _STATUS.get(outcome, 500)
    return TerminalOutput(
        rid,
        outcome,
        int(status),
        str(getattr(event, "message", "")),
        getattr(event, "reason", None) if outcome == "finished" else None,
    )


@release_effect
def stream_terminal(ctx: Any) -> None:
    """Stream the instance's terminal output; internal requests (warm-ups) stream none."""
    inst = ctx.instance
    if inst.__class__ is Request:  # (its `stream` and `rid` without getattr, property)
        if not inst.stream:
            return
        rid = inst._rid  # given by the side, which made its key
        if rid is None:
            rid = client_rid(inst.key)
    elif getattr(inst, "stream", True):
        rid = client_rid(inst.key)
    else:
        return
    event = ctx.event
    outcome = ctx.target
    ctx.resources.sink.put(
        TerminalOutput(rid, outcome, 200, "", event.reason)  # `terminal_output`'s
        if event.__class__ is Finished and outcome == "finished"  # common case, inline
        else terminal_output(rid, outcome, event))


@release_effect
def tell_scheduler_abort(ctx: Any) -> None:
    """Ask the scheduler to drop an aborted request it already has."""
    if ctx.source in ("dispatched", "running"):
        ctx.resources.scheduler.abort(ctx.instance.key)


@release_effect
def transfer_to_children(ctx: Any) -> None:
    """Hand each child that uses a LoRA exactly one of the group's references, in order.

    Runs inside the group's terminal transition, so the group is still the owner; the
    engine releases anything left over afterwards (it never leaks on a mismatch).
    """
    group = ctx.instance
    ledger = ctx.ledger
    owned = ledger.owned(group, LORA)
    takers = [c for c in group.children if c.lora is not None]
    if len(owned) != len(takers):
        raise FanOutMismatch(
            f"sampling group {group.key!r} owns {len(owned)} LoRA reference(s) but "
            f"{len(takers)} child request(s) use a LoRA; each child needs exactly one. "
            "The group's references are released instead of transferred."
        )
    for handle, child in zip(owned, takers, strict=True):
        ledger.transfer(handle, to=child)
        child.lora_id = handle.value


# -- plans and binding ------------------------------------------------------------------

_stream = Action(stream_terminal, best_effort=True)


def request_plans() -> dict[str, Plan]:
    """The implementations of `states.request.REQUEST_PLANS`."""
    done = Plan(Release(LORA), _stream)
    return {
        "release_finished": done,
        "release_rejected": done,
        "release_errored": done,
        "release_dispatch_failed": done,
        "release_aborted": Plan(Action(tell_scheduler_abort, best_effort=True),
                                Release(LORA), _stream),
    }


def sampling_plans() -> dict[str, Plan]:
    """The implementations of `states.sampling.SAMPLING_PLANS`."""
    failed = Plan(Release(LORA), _stream)
    return {
        "fan_out": Plan(Action(transfer_to_children)),
        "release_aborted": failed,
        "release_rejected": failed,
        "release_errored": failed,
    }


def lora_ledger(resources: Any, ledger: Ledger | None = None) -> Ledger:
    """A ledger whose `"lora"` handles go back through `release_lora`.

    Pass an existing `ledger` to add the kind to it (its `resources` must have the
    attributes of `RequestResources`).
    """
    if ledger is None:
        return Ledger({LORA: release_lora}, resources=resources)
    ledger.register_kind(LORA, release_lora)
    return ledger


def bind_request(ledger: Ledger) -> Machine:
    """REQUEST bound to its release plans over `ledger`."""
    return REQUEST.bind(request_plans(), ledger)


def bind_sampling(ledger: Ledger) -> Machine:
    """SAMPLING bound to its release plans over `ledger`."""
    return SAMPLING.bind(sampling_plans(), ledger)
