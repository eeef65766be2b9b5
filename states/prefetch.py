"""A storage → host prefetch on one attention rank, and its rank-collective abort.

    none ──Queue──► pending ──Start──► active ──Complete──► completed ▸ release_completed
      │                │                  │
      └─ PrefetchAbort ┴── PrefetchAbort ─┘   (local class recorded: missing / pending / active)
                       ▼
               abort_requested ──Reduced(MAX over the attention groups)──► collective decision
                 [local active]  ► draining ──Drained──► drained ──Join──► in_barrier
                 [local pending] ► revoking ──Revoked──► revoked ──Join [barrier]──► in_barrier
                                                   └────PrefetchRelease [no barrier]──► released
                 [barrier]       ► in_barrier          (a missing rank only joins)
                 else            ► released ▸ release_aborted
               abort_requested ──GroupClosed (reduction timed out or raised)──► released ▸
               in_barrier ──BarrierPassed──► released ▸ release_aborted
                          ──BarrierTimedOut──► stalled ──Join (retry)──► in_barrier
                                                       ──GroupClosed──► released ▸ release_aborted
                          ──CollectiveFailed──► broken ──GroupClosed──► released ▸ release_aborted

Every rank of the attention groups runs one instance per aborted request (a rank with
no prefetch for it starts one in `none`: it is the "missing" rank). The order is fixed
by I7: each rank records its local class, then every rank takes part in the MAX
reduction, and only the reduced value decides whether anyone enters the barrier
(`decision >= ACTIVE`: all ranks do; below: none does). Local work (revoke a pending
prefetch, drain an active transfer) happens after the reduction and before the
barrier; the request's own resources (the completed host pages, the lock reference on
the cached prefix the prefetch extends, its prefetch occupancy) are released only by the
terminal edge, i.e. after the barrier when there is one.

A barrier that times out leaves the instance in `stalled` holding everything it owned:
`Join` retries (waits on the same outstanding barrier), `GroupClosed` says the group was
torn down so no peer can still be in it, and releases. A barrier that raises instead (a
peer process died: gloo's "Connection closed by peer") leaves it in `broken`, holding
everything too; the group is unusable, so there is no retry, only `GroupClosed`. A
reduction that times out or raises leaves it in `abort_requested`, nothing decided and
nothing touched; `GroupClosed` releases it too (the release stops a still-running
transfer before freeing anything).

Once the abort started, a late `Complete` from the I/O side (the transfer finished while
the ranks agreed) and an abort echo (`PrefetchAbort`) are absorbed in every state; the
abort path releases whatever the I/O completed.

Resource kinds the plans release (the effects in `effects.prefetch` implement them):
``"host_pages"`` (the reserved host pages; the abort frees only the completed prefix,
the success path hands it to the host cache) and ``"host_lock"`` (the lock reference on
the anchor pages, taken when the prefetch was queued).
"""

from __future__ import annotations

from enum import IntEnum

from terminus.fsm import ANY, ERROR, IGNORE, Event, Instance, Machine, Spec, State, go

__all__ = [
    "PREFETCH",
    "PREFETCH_PLANS",
    "BarrierPassed",
    "BarrierTimedOut",
    "CollectiveFailed",
    "Complete",
    "Drained",
    "GroupClosed",
    "Join",
    "Local",
    "PrefetchRelease",
    "PrefetchReq",
    "Queue",
    "Reduced",
    "Revoked",
    "Start",
    "classify",
]


class Local(IntEnum):
    """What one rank holds for a request when its abort is requested; ordered for MAX."""

    MISSING = 0
    """No prefetch for this request on this rank (never queued, or already finished)."""
    PENDING = 1
    """Queued, no host pages reserved, no I/O started: revocable at once."""
    ACTIVE = 2
    """Host pages reserved and storage I/O running: must be drained before release."""


# -- events ------------------------------------------------------------------------------


class Queue(Event):
    """The prefetch was queued; it holds a lock reference on its anchor pages."""


class Start(Event):
    """Host pages were reserved and the storage I/O started."""


class Complete(Event):
    """The I/O finished (or was stopped by policy); the cache takes the completed prefix."""


class PrefetchAbort(Event):
    """The request was aborted; fire it through `PrefetchReq.abort()` to record the class."""


class Reduced(Event):
    """The MAX of the local classes over every attention group came back (`result`).

    Fire it through `PrefetchReq.decide(result)`, which records the decision the guards read.
    """

    result: int = 0


class Revoked(Event):
    """The pending prefetch was revoked: it will never start."""


class Drained(Event):
    """The transfer was drained: the I/O stopped and gave back the pages it never wrote."""


class Join(Event):
    """This rank enters the barrier (again, from `stalled`: a retry)."""


class PrefetchRelease(Event):
    """No barrier was decided: a revoked rank releases at once."""


class BarrierPassed(Event):
    """Every rank of every attention group arrived at the barrier."""


class BarrierTimedOut(Event):
    """A peer did not arrive in time; `group` names the group the barrier waited on."""

    group: str = ""


class CollectiveFailed(Event):
    """The barrier raised (a backend error: a peer process died, the link broke); `group`
    names the group, which is unusable from now on."""

    group: str = ""


class GroupClosed(Event):
    """After a timeout or a backend error, the group was torn down: no peer can still be
    in the collective."""


# -- instance data and guards ------------------------------------------------------------


class PrefetchReq(Instance):
    """One rank's prefetch for one request. `key` is the request id.

    `local` is the class recorded at abort (a `Local` value), `decision` the reduced
    MAX (-1 before the reduction), `timed_out_group` the group named by the last
    barrier timeout.
    """

    __slots__ = ("decision", "local", "timed_out_group")

    def __init__(self, machine: Machine, key: object = None) -> None:
        Instance.__init__(self, machine, key)  # not super(): one lookup less per prefetch
        self.local = Local.MISSING
        self.decision = -1
        self.timed_out_group = ""

    def abort(self) -> None:
        """Record the local class (from the current state) and fire `PrefetchAbort`."""
        if self.state in _CLASS:
            self.local = _CLASS[self.state]
        self.fire(PrefetchAbort())

    def decide(self, result: int) -> None:
        """Record the reduced MAX and fire `Reduced(result)`.

        A result below this rank's own class cannot come out of a MAX that this rank
        took part in, so it is refused before anything changes.
        """
        if self.state == "abort_requested" and result < self.local:
            raise ValueError(
                f"prefetch {self.key!r}: reduced class {result} is below this rank's own "
                f"class {int(self.local)} ({self.local.name}); the value must be the MAX "
                "over every rank of the attention groups, this one included"
            )
        if self.state == "abort_requested":
            self.decision = int(result)
        self.fire(Reduced(int(result)))


_CLASS = {"none": Local.MISSING, "pending": Local.PENDING, "active": Local.ACTIVE}


def classify(state: str) -> Local:
    """The local class of a rank whose prefetch is in `state` (terminal/unknown: missing)."""
    return _CLASS.get(state, Local.MISSING)


def local_active(inst: PrefetchReq, ev: object) -> bool:
    """This rank had storage I/O running when the abort was requested."""
    return inst.local == Local.ACTIVE


def local_pending(inst: PrefetchReq, ev: object) -> bool:
    """This rank had a queued prefetch that had not started."""
    return inst.local == Local.PENDING


def barrier_decided(inst: PrefetchReq, ev: object) -> bool:
    """Some rank of the attention groups has active I/O: every rank enters the barrier."""
    return inst.decision >= Local.ACTIVE


def no_barrier(inst: PrefetchReq, ev: object) -> bool:
    """No rank has active I/O: no rank enters the barrier."""
    return 0 <= inst.decision < Local.ACTIVE


# -- the machine -------------------------------------------------------------------------

# Once the abort started, an abort echo and a late completion of the I/O are absorbed:
# the abort path releases whatever the I/O completed.
_LATE = {PrefetchAbort: IGNORE, Complete: IGNORE, ANY: ERROR}

SPEC = Spec(
    "prefetch",
    states=(
        State("none", initial=True, doc="no prefetch on this rank (the missing class)"),
        State("pending", doc="queued; anchor locked; no pages, no I/O"),
        State("active", doc="host pages reserved; storage I/O running"),
        State("abort_requested", doc="local class recorded; in the MAX reduction"),
        State("revoking", doc="decision taken; revoking the pending prefetch"),
        State("draining", doc="decision taken; draining the transfer"),
        State("revoked", doc="the pending prefetch will never start"),
        State("drained", doc="the I/O stopped; its pages are kept until the barrier"),
        State("in_barrier", doc="waiting for every rank of every attention group"),
        State("stalled", doc="barrier timed out; everything owned is kept for a retry"),
        State("broken", doc="the barrier raised; everything owned is kept until the group "
                            "is torn down"),
        State("released", terminal=True, doc="aborted: completed prefix and locks released"),
        State("completed", terminal=True, doc="the cache took the completed prefix"),
    ),
    events=(Queue, Start, Complete, PrefetchAbort, Reduced, Revoked, Drained, Join,
            PrefetchRelease, BarrierPassed, BarrierTimedOut, CollectiveFailed, GroupClosed),
    table={
        "none": {Queue: go("pending"), PrefetchAbort: go("abort_requested"), ANY: ERROR},
        "pending": {Start: go("active"), PrefetchAbort: go("abort_requested"), ANY: ERROR},
        "active": {
            Complete: go("completed", plan="release_completed"),
            PrefetchAbort: go("abort_requested"),
            ANY: ERROR,
        },
        "abort_requested": {
            Reduced: [
                go("draining", when="local_active"),
                go("revoking", when="local_pending"),
                go("in_barrier", when="barrier_decided"),
                go("released", plan="release_aborted"),
            ],
            # The reduction timed out or raised and the group was torn down: nothing was
            # decided, and no peer is left to disagree; the release stops the I/O first.
            GroupClosed: go("released", plan="release_aborted"),
            **_LATE,
        },
        "revoking": {Revoked: go("revoked"), **_LATE},
        # The transfer would not stop (its stop raised): this rank never joins the
        # barrier, so its peers time out; once the group is torn down the release stops
        # the I/O again, then frees.
        "draining": {Drained: go("drained"),
                     GroupClosed: go("released", plan="release_aborted"), **_LATE},
        "revoked": {
            Join: go("in_barrier", when="barrier_decided"),
            PrefetchRelease: go("released", plan="release_aborted", when="no_barrier"),
            **_LATE,
        },
        # An active rank's own class makes the MAX active: it never skips the barrier.
        "drained": {Join: go("in_barrier"), **_LATE},
        "in_barrier": {
            BarrierPassed: go("released", plan="release_aborted"),
            BarrierTimedOut: go("stalled"),
            # A peer process died (or the link broke): the group is unusable, no retry.
            CollectiveFailed: go("broken"),
            **_LATE,
        },
        "stalled": {
            Join: go("in_barrier"),
            GroupClosed: go("released", plan="release_aborted"),
            **_LATE,
        },
        "broken": {GroupClosed: go("released", plan="release_aborted"), **_LATE},
        "released": {PrefetchAbort: IGNORE, Complete: IGNORE, ANY: ERROR},
        "completed": {PrefetchAbort: IGNORE, Complete: IGNORE, ANY: ERROR},
    },
    guards={
        "local_active": local_active,
        "local_pending": local_pending,
        "barrier_decided": barrier_decided,
        "no_barrier": no_barrier,
    },
    doc="storage -> host prefetch on one rank, with the rank-collective abort (I7)",
)

PREFETCH: Machine = SPEC.build()
"""The built prefetch machine (unbound: bind `effects.prefetch` plans to run it)."""

PREFETCH_PLANS: tuple[str, ...] = PREFETCH.plan_names
"""The release plans the declaration names: release_aborted, release_completed."""
