"""The tokenizer-side request: one client request from arrival to its one terminal output.

    created ──Submitted──► acquiring_lora ──LoRAAcquired──► validating ──Validated──► dispatched
       │  [no LoRA to acquire]─────────────────────────────────▲            │ Output
       │                                                                     ▼
       │                                                            running ──Finished──► finished
       │    AcquireFailed, ValidationFailed ► rejected [4xx] | errored [5xx]
       │                 DispatchFailed   ► dispatch_failed (from dispatched)
       │                 SchedulerError   ► rejected [4xx] | errored [5xx]
       └── RequestAbort (from any live state) ► aborted

The request owns its LoRA reference (handle kind ``"lora"``, value the acquired id) from
the moment the registry hands the id out until its terminal transition, whose plan
releases it and streams the request's one terminal output. Terminal states absorb what
can still arrive late (an abort echo after finish, the result of an acquire that an abort
overtook, a duplicate scheduler error) as IGNORE, so no release can run twice; an acquire
completing after an abort is released at once by the ledger (I6).

``Submitted(acquire=...)`` asks the guard `wants_lora` which way to go; its unguarded
forms ``SubmittedAcquiring()`` and ``SubmittedNoAcquire()`` take the same transitions
without asking (what `effects.tokenizer` fires).

Children of a parallel-sampling group are requests too: they start with
``Submitted(acquire=False)`` (or ``SubmittedNoAcquire()``) and receive their reference
by transfer from the group (see `states.sampling`). A prefix warm-up request is a
request that owns nothing.

Who a request is, is a `RequestKey(group, role, index)`: the client's rid (`group`; a
child's or warm-up's group is its sampling group's rid), its role, and its index in the
group. The key is turned into a string only at the edge (`RequestKey.rid`, the id a
client's stream carries); nothing parses an id back into a key.
"""

from __future__ import annotations

from typing import Any

import msgspec

from terminus.fsm import ANY, ERROR, IGNORE, Event, Instance, Machine, Spec, State, go

__all__ = [
    "REQUEST",
    "REQUEST_PLANS",
    "ROLES",
    "AcquireFailed",
    "DispatchFailed",
    "Finished",
    "LoRAAcquired",
    "Output",
    "Request",
    "RequestAbort",
    "RequestKey",
    "SchedulerError",
    "Submitted",
    "SubmittedAcquiring",
    "SubmittedNoAcquire",
    "Validated",
    "ValidationFailed",
    "client_rid",
]


# -- events ------------------------------------------------------------------------------


class Submitted(Event):
    """The request entered the tokenizer; `acquire` says it must acquire its own LoRA."""

    acquire: bool = False


class SubmittedAcquiring(Event):
    """`Submitted(acquire=True)` as an event of its own: the same transition, with no
    guard to ask (what the tokenizer side fires: one step less for every request)."""


class SubmittedNoAcquire(Event):
    """`Submitted(acquire=False)` as an event of its own: the request acquires no LoRA
    reference itself (none used, or a child given one by transfer); the same transition,
    with no guard to ask."""


class LoRAAcquired(Event):
    """The registry counted the reference(s); `lora_ids` are the stable ids handed out."""

    lora_ids: tuple[int, ...] = ()


class AcquireFailed(Event):
    """The registry refused the acquire: nothing was acquired. `status` 4xx for an
    unknown adapter (the client named it), 5xx for a registry failure."""

    status: int = 400
    message: str = ""


class Validated(Event):
    """Validation and tokenization succeeded; the request goes to the scheduler."""


class ValidationFailed(Event):
    """Validation or tokenization failed; `status` 4xx is the client's fault, 5xx ours."""

    status: int = 400
    message: str = ""


class DispatchFailed(Event):
    """Sending the tokenized request to the scheduler failed."""

    message: str = ""


class Output(Event):
    """A non-final output (a streamed chunk) came back from the scheduler."""


class Finished(Event):
    """The scheduler finished the request; `reason` as it reported it (stop, length)."""

    reason: str = "stop"


class SchedulerError(Event):
    """The scheduler failed the request; `status` 4xx (bad input) or 5xx (503: overloaded)."""

    status: int = 500
    message: str = ""


class RequestAbort(Event):
    """The client (or the server) aborts the request."""

    message: str = ""


# -- identity --------------------------------------------------------------------------

ROLES = ("request", "group", "warmup", "child")
"""A client's own request, a sampling group (the parent of a batch), a group's prefix
warm-up (one per prompt), a group's child (n per prompt)."""


class RequestKey(msgspec.Struct, frozen=True, cache_hash=True):
    """The identity of a tokenizer-side request: `group`, `role` and `index`.

    `group` is the rid the client chose (or was given) for its request or its sampling
    group; `role` is one of `ROLES`; `index` numbers a group's warm-ups (per prompt) and
    children (prompt-major, then sample). Keys are hashable and compare by value, so
    drivers index by them; `rid` is the id the client sees.
    """

    group: Any
    role: str = "request"
    index: int = 0

    def __post_init__(self) -> None:
        # The valid keys in as few steps as the common ones allow (every key a driver
        # makes passes here): index 0 with any role, a positive index for a warm-up or
        # child. Anything else is refused with what was wrong.
        if self.index.__class__ is not int and not (
                isinstance(self.index, int) and not isinstance(self.index, bool)):
            raise TypeError(f"RequestKey index must be an int (0, or >= 0 for a warm-up "
                            f"or child), got {self.index!r}; pass int(index)")
        if self.index == 0:
            if self.role in ROLES:
                return
        elif self.index > 0 and self.role in ("child", "warmup"):
            return
        if self.role not in ROLES:
            raise ValueError(f"RequestKey role must be one of {ROLES}, got {self.role!r}")
        raise ValueError(f"RequestKey index {self.index} is not valid for role "
                         f"{self.role!r} (a warm-up or child index is >= 0; a request "
                         "or group has index 0)")

    @property
    def rid(self) -> Any:
        """The client-facing id: the rid itself for a request or group, ``<group>-<k>``
        for child k, ``<group>-warmup-<i>`` for the warm-up of prompt i."""
        if self.role == "child":
            return f"{self.group}-{self.index}"
        if self.role == "warmup":
            return f"{self.group}-warmup-{self.index}"
        return self.group

    def __str__(self) -> str:
        return str(self.rid)


def client_rid(key: Any) -> Any:
    """The id a client sees for an instance key: `RequestKey.rid`, or the key itself."""
    return key.rid if isinstance(key, RequestKey) else key


# -- instance data and guards ------------------------------------------------------------

_instance_init = Instance.__init__  # (the engine's: a global, not a class attribute read)


class Request(Instance):
    """A tokenizer-side request. `key` is its `RequestKey` (any hashable will do for a
    machine used on its own); `rid` the id its client sees.

    Fields for the driver: `prompt`, `lora` (adapter name or None), `tokens` (once
    tokenized), `stream` (False for internal requests such as a prefix warm-up, whose
    terminal output nobody reads), `parent` (the sampling group of a child or warm-up;
    `effects.tokenizer.TokenizerSide` sets it to None when it forgets the ended family),
    `role` ("request", "child" or "warmup"; by default the role of a `RequestKey` key),
    `lora_id` (the adapter id sent to the scheduler with the request; what is released
    is decided by the ledger's handles, never by this field).

    `_rid` caches the id its client sees (`RequestKey.rid` of its key): a driver that
    made the key and has the id at hand sets it (the tokenizer side does); None, the
    default, works it out from the key when asked. It is not a constructor argument: an
    id that is not its key's would stream the request's output under another id.
    """

    __slots__ = ("_rid", "_role", "lora", "lora_id", "parent", "prompt", "stream", "tokens")

    def __init__(self, machine: Machine, key: Any = None, prompt: Any = None,
                 lora: str | None = None, stream: bool = True, parent: Any = None, *,
                 role: str | None = None) -> None:
        # (`prompt`, `lora`, `stream` and `parent` may be passed by position, as the
        # tokenizer side does: a call with keywords builds a dict for them, per request.)
        _instance_init(self, machine, key)  # not super(): no lookup per request
        self.prompt = prompt
        self.lora = lora
        self.tokens: Any = None
        self.lora_id: int | None = None
        self._role = role  # None: its key's (read when asked, not per request made)
        self._rid: Any = None  # its key's `rid`, where a driver that made the key sets it
        self.stream = stream
        self.parent = parent

    @property
    def role(self) -> str:
        """"request", "child" or "warmup": as given, else the role of a `RequestKey` key
        ("request" for any other key)."""
        role = self._role
        if role is not None:
            return role
        key = self.key
        return key.role if isinstance(key, RequestKey) else "request"

    @role.setter
    def role(self, role: str) -> None:
        self._role = role

    @property
    def rid(self) -> Any:
        """The id the client sees (`RequestKey.rid` of the key, or the key itself)."""
        rid = self._rid
        return client_rid(self.key) if rid is None else rid


def wants_lora(inst: Any, ev: Any) -> bool:
    """The request must acquire its LoRA reference itself."""
    return ev.acquire  # a bool field (no bool() call: this runs for every request)


def client_error(inst: Any, ev: Any) -> bool:
    """The failure is the client's (HTTP 4xx): the request is rejected, not errored."""
    return 400 <= ev.status < 500


# -- the declaration ---------------------------------------------------------------------

_aborted = go("aborted", plan="release_aborted")
_failed = [go("rejected", plan="release_rejected", when="client_error"),
           go("errored", plan="release_errored")]
# Late arrivals a terminal request must absorb: the scheduler's echo of an abort, an abort
# after finish, an acquire an abort overtook, a tokenizer or dispatch result after an
# abort, a duplicate error. Submitted twice is a driver bug, so it stays an error.
_terminal_row: dict[Any, Any] = {ANY: IGNORE, Submitted: ERROR, SubmittedAcquiring: ERROR,
                                 SubmittedNoAcquire: ERROR}

SPEC = Spec(
    "request",
    states=(
        State("created", initial=True, doc="known to the tokenizer, nothing acquired"),
        State("acquiring_lora", doc="the registry acquire is in flight"),
        State("validating", doc="validating and tokenizing; owns its LoRA reference"),
        State("dispatched", doc="handed to the scheduler"),
        State("running", doc="the scheduler is producing outputs"),
        State("finished", terminal=True, doc="finished normally"),
        State("aborted", terminal=True, doc="aborted by the client or the server"),
        State("rejected", terminal=True, doc="4xx: unknown adapter, invalid input"),
        State("errored", terminal=True, doc="5xx: tokenizer or scheduler failure"),
        State("dispatch_failed", terminal=True, doc="the scheduler could not be reached"),
    ),
    events=(Submitted, SubmittedAcquiring, SubmittedNoAcquire,
            LoRAAcquired, AcquireFailed, Validated, ValidationFailed,
            DispatchFailed, Output, Finished, SchedulerError, RequestAbort),
    table={
        "created": {
            Submitted: [go("acquiring_lora", when="wants_lora"), go("validating")],
            SubmittedAcquiring: go("acquiring_lora"),
            SubmittedNoAcquire: go("validating"),
            RequestAbort: _aborted,
            ANY: ERROR,
        },
        "acquiring_lora": {
            LoRAAcquired: go("validating"),
            AcquireFailed: _failed,
            RequestAbort: _aborted,
            ANY: ERROR,
        },
        "validating": {
            Validated: go("dispatched"),
            ValidationFailed: _failed,
            RequestAbort: _aborted,
            ANY: ERROR,
        },
        "dispatched": {
            DispatchFailed: go("dispatch_failed", plan="release_dispatch_failed"),
            Output: go("running"),
            Finished: go("finished", plan="release_finished"),
            SchedulerError: _failed,
            RequestAbort: _aborted,
            ANY: ERROR,
        },
        "running": {
            Output: go("running"),
            Finished: go("finished", plan="release_finished"),
            SchedulerError: _failed,
            RequestAbort: _aborted,
            ANY: ERROR,
        },
        "finished": _terminal_row,
        "aborted": _terminal_row,
        "rejected": _terminal_row,
        "errored": _terminal_row,
        "dispatch_failed": _terminal_row,
    },
    guards={"wants_lora": wants_lora, "client_error": client_error},
    doc="Tokenizer-side request lifecycle; owns its LoRA reference until it is terminal.",
)

REQUEST: Machine = SPEC.build()
REQUEST_PLANS = REQUEST.plan_names
"""The release plans REQUEST's terminal edges name (sorted); `effects.request` implements
them."""
"""The built request machine (unbound: bind plans and a ledger with `effects.request`)."""
