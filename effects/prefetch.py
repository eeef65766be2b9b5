"""The prefetch machine's effects and its rank-collective abort, on real or simulated ranks.

One `PrefetchSite` per rank holds that rank's host page pool, ownership ledger and
prefetch instances. The abort protocol is written once, as a generator of collective
operations (`abort_steps`), and run by one of two drivers:

    site.abort(rid, RankCollectives(...))     torch.distributed (gloo on CPU, NCCL on GPU)
    SimulatedRanks(sites, groups).abort(rid)  N ranks in one process, stepped in lockstep,
                                              deterministically (unit tests, the simulator;
                                              in `terminus.effects.sim.ranks`)

The protocol on every rank, for one aborted request (I7)::

    classify local state: missing < pending < active      (PrefetchReq.abort)
    for each attention group (tp, then cp):               every rank, unconditionally
        v = all_reduce(v, MAX, group)
    decide(v)                                             same v on every rank
      pending  -> revoke the queued prefetch (it never starts)
      active   -> drain the transfer: stop the I/O, which gives back the pages it never wrote
    if v == ACTIVE: barrier over each group in turn       all ranks, or none
    release (terminal edge): the completed host pages, the anchor lock reference,
    the prefetch occupancy -- only now, after the barrier

A barrier that times out raises `PrefetchAbortTimeout` naming the request, the rank and
the group; the instance is then `stalled` and keeps, for a retry, everything the
request owned: its reserved host pages (the I/O is stopped; the pages it never wrote are
freed with the completed ones, after the barrier), the lock reference on its anchor
pages and its prefetch occupancy; the outstanding barrier is kept as a
ticket. `retry(rid, ...)` waits on that same barrier again; `close_group(rid)` releases
after the caller tore the group down (no peer can still be in it). A collective that
raises anything else (gloo's "Connection closed by peer" when a peer process died)
raises `PrefetchCollectiveFailed`, naming the same; after a barrier the instance is
`broken` (it keeps everything; the group is unusable, so there is no retry). A reduction
that times out or raises leaves the request in `abort_requested` with nothing decided
and nothing touched (the I/O still runs). Either way the recovery is the same: tear the
group down, then `close_group(rid)` releases everything, exactly once (stopping the I/O
first). Both errors derive from `PrefetchAbortError`.

An abort of a request whose prefetch this rank already released (a duplicate abort) is
absorbed locally: no collective, since the peers that did not get the duplicate would
never join one. A `complete(rid)` that arrives after the abort started is absorbed too.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any, NamedTuple

import msgspec
import torch

from terminus.fsm import (
    Handle,
    Ledger,
    Machine,
    Plan,
    PlanReport,
    Release,
    ReleaseContext,
    release_effect,
)
from terminus.kernels.collective import CollectiveError, CollectiveTimeout, RankCollectives
from terminus.kernels.host import HostPagePool, Prefetch
from terminus.states.prefetch import (
    PREFETCH,
    BarrierPassed,
    BarrierTimedOut,
    CollectiveFailed,
    Complete,
    Drained,
    GroupClosed,
    Join,
    Local,
    PrefetchRelease,
    PrefetchReq,
    Queue,
    Revoked,
    Start,
)

from .sanitize import sanitized

__all__ = [
    "PREFETCH_PLANS",
    "AbortOutcome",
    "BarrierOp",
    "CollectiveMismatch",
    "PrefetchAbortError",
    "PrefetchAbortTimeout",
    "PrefetchCollectiveFailed",
    "PrefetchSite",
    "PrefetchStopFailed",
    "ReduceOp",
    "drive",
]


# Payload-free events, made once (events are frozen).
_QUEUE = Queue()
_START = Start()
_COMPLETE = Complete()


# -- release effects -----------------------------------------------------------------------


@release_effect
def free_completed_pages(ctx: ReleaseContext, handle: Any) -> None:
    """Abort, after the barrier: free the pages the stopped I/O never wrote, then the
    completed prefix."""
    site: PrefetchSite = ctx.resources
    p: Prefetch = handle.value
    if not p.terminated:  # the pages the stopped I/O never wrote go back first
        tail = p.pages.numel() - p.completed
        p.terminate()
        site.trace.append(("free_tail", ctx.instance.key, tail))
    n = p.release()
    site.trace.append(("free_prefix", ctx.instance.key, n))


@release_effect
def hand_to_cache(ctx: ReleaseContext, handle: Any) -> None:
    """Success: the host cache takes the completed prefix (and owns it from now on)."""
    site: PrefetchSite = ctx.resources
    p: Prefetch = handle.value
    if site.insert is None:  # complete() checks it before firing; never take pages then
        raise ValueError("PrefetchSite(insert=...) is needed to complete a prefetch")
    p.terminate()
    pages = p.take()
    site.trace.append(("insert", ctx.instance.key, pages.numel()))
    try:
        site.insert(ctx.instance.key, pages)
    except BaseException:
        site.host.free(pages)  # the cache did not take them: nobody else owns them
        raise


@release_effect
def unlock_anchor(ctx: ReleaseContext, handle: Any) -> None:
    """Drop the lock reference the prefetch held on the cached pages it extends."""
    site: PrefetchSite = ctx.resources
    site.host.unlock(handle.value)
    site.trace.append(("unlock", ctx.instance.key, handle.value.numel()))


PREFETCH_PLANS: dict[str, Plan] = {
    "release_aborted": Plan(Release("host_pages"), Release("host_lock")),
    "release_completed": Plan(Release("host_pages", hand_to_cache), Release("host_lock")),
}
"""The plans of `states.prefetch.PREFETCH`: pages first, then the anchor lock."""


# -- the protocol: collective operations a driver performs -----------------------------------


class ReduceOp(NamedTuple):
    """All-reduce ``value`` with MAX over attention group ``group`` (an index)."""

    group: int
    value: int


class BarrierOp(NamedTuple):
    """Barrier over attention group ``group``; ``ticket``: wait again on a timed-out one."""

    group: int
    ticket: Any = None


Op = ReduceOp | BarrierOp


class AbortOutcome(msgspec.Struct, frozen=True):
    """What one rank did for one aborted request (picklable: tests ship it between processes)."""

    rid: str
    rank: int
    local: int
    decision: int
    barrier: bool
    state: str


class PrefetchAbortError(Exception):
    """A collective of a prefetch abort failed; the rank kept what it owned.

    Fields: ``rid``, ``rank``, ``group``, ``state`` (the instance's state after the
    error), ``kept`` (what is still held). Subclasses say how it failed.
    """

    rid: Any
    rank: int
    group: str
    state: str
    kept: str

    def _fields(self, rid: Any, rank: int, group: str, state: str, kept: str) -> None:
        self.rid = rid
        self.rank = rank
        self.group = group
        self.state = state
        self.kept = kept


class PrefetchAbortTimeout(PrefetchAbortError, TimeoutError):
    """A collective of a prefetch abort timed out; the rank kept what it owned.

    Fields as `PrefetchAbortError` (``state``: ``stalled`` after a barrier,
    ``abort_requested`` after the reduction), plus ``ticket`` (the outstanding barrier,
    for `PrefetchSite.retry`).
    """

    def __init__(self, rid: Any, rank: int, group: str, state: str, kept: str,
                 ticket: Any, cause: CollectiveTimeout) -> None:
        self._fields(rid, rank, group, state, kept)
        self.ticket = ticket
        fix = ("retry(rid) once the peer arrives, or close_group(rid) after tearing the "
               "group down" if state == "stalled" else
               "the ranks did not all take part in the reduction; tear the group down")
        super().__init__(
            f"prefetch abort of request {rid!r} on rank {rank}: {cause.op} on attention "
            f"group {group!r} (ranks {cause.ranks}) timed out after {cause.timeout:g}s; "
            f"the request is {state!r} and keeps {kept}; {fix}"
        )


class PrefetchCollectiveFailed(PrefetchAbortError, RuntimeError):
    """A collective of a prefetch abort raised (a peer process died, the link broke).

    Fields as `PrefetchAbortError` (``state``: ``broken`` after a barrier,
    ``abort_requested`` after the reduction), plus ``op`` and ``error`` (what the
    collective raised; also ``__cause__``). The group is unusable: tear it down, then
    `PrefetchSite.close_group` releases everything.
    """

    def __init__(self, rid: Any, rank: int, group: str, state: str, kept: str, op: str,
                 error: BaseException) -> None:
        self._fields(rid, rank, group, state, kept)
        self.op = op
        self.error = error
        inner = error.error if isinstance(error, CollectiveError) else error
        text = str(inner).strip()
        first = text.splitlines()[0][:300] if text else ""
        super().__init__(
            f"prefetch abort of request {rid!r} on rank {rank}: {op} on attention group "
            f"{group!r} raised {type(inner).__name__}: {first}; the request is {state!r} "
            f"and keeps {kept}; tear the group down, then close_group(rid) releases it"
        )



class PrefetchStopFailed(PrefetchCollectiveFailed):
    """The drain could not stop the transfer (its ``stop`` raised): the I/O may still
    write the pages, so the rank keeps everything (state ``draining``) and does not join
    the barrier, where its peers time out. Tear the group down, then
    `PrefetchSite.close_group` stops the I/O again and releases everything once."""

class CollectiveMismatch(RuntimeError):
    """Ranks of one group entered different collectives (with torch they would pair up)."""


_ABORTABLE = ("none", "pending", "active")
# What close_group releases.
_TIMED_OUT = ("stalled", "abort_requested", "broken", "draining")


# -- one rank ------------------------------------------------------------------------------


class _SitePrefetch(PrefetchReq):
    """A prefetch a site made, and the ledger handle of the host pages its I/O writes
    (`handle`: None until `start` acquired them; the ledger still says who owns it)."""

    __slots__ = ("handle",)

    def __init__(self, machine: Machine, key: object = None) -> None:
        PrefetchReq.__init__(self, machine, key)
        self.handle: Handle | None = None


class PrefetchSite:
    """One rank's storage prefetches: its host pool, ledger, bound machine and instances.

    ``insert(rid, pages)`` receives the completed prefix of a prefetch that completes
    (the host cache takes ownership); ``page_size`` converts pages to tokens.
    ``trace`` records, in order, every collective entered and every local action and
    release: ``("reduce", rid, group)``, ``("revoke", rid)``, ``("drain", rid,
    unwritten_pages)``, ``("barrier_enter", rid, group)``, ``("barrier_exit", rid,
    group)``, ``("free_tail", rid, pages)`` (pages the stopped I/O never wrote),
    ``("free_prefix", rid, pages)``, ``("unlock", rid, pages)``,
    ``("insert", rid, pages)``, ``("absorbed", rid)`` (a duplicate abort, no collective).
    """

    def __init__(self, host: HostPagePool, *, rank: int = 0, page_size: int = 1,
                 insert: Callable[[Any, torch.Tensor], None] | None = None) -> None:
        self.host = host
        self.rank = rank
        self.page_size = page_size
        self.insert = insert
        self.ledger = Ledger({"host_pages": free_completed_pages, "host_lock": unlock_anchor},
                             resources=self)
        self.machine: Machine = PREFETCH.bind(PREFETCH_PLANS, self.ledger)
        self.requests: dict[Any, _SitePrefetch] = {}
        # State ids the hot paths compare (`inst._s`) instead of reading the `state`
        # and `terminal` properties (as effects.tokenizer and effects.disagg do).
        self._ids = {name: i for i, name in enumerate(self.machine.states)}
        self._abortable = frozenset(self._ids[s] for s in _ABORTABLE)
        self._terminal = self.machine.terminal
        self.trace: list[tuple[Any, ...]] = []
        self._stalled: dict[Any, tuple[int, Any]] = {}

    # -- the normal lifecycle --------------------------------------------------------------

    def _live(self, rid: Any, state: str) -> _SitePrefetch:
        inst = self.requests.get(rid)
        if inst is None or inst._s != self._ids[state]:  # (`inst.state != state`)
            now = "none" if inst is None else inst.state
            raise ValueError(f"rank {self.rank}: request {rid!r} has no {state} prefetch "
                             f"(it is {now!r}); nothing was changed")
        return inst

    @sanitized
    def forget(self, rid: Any) -> None:
        """Drop the ended prefetch of ``rid`` (a later call for it then finds none, as
        for one never queued); raises ValueError, changing nothing, unless it is
        terminal."""
        inst = self.requests.get(rid)
        if inst is None or not self._terminal[inst._s]:  # (`inst.terminal`)
            now = "none" if inst is None else inst.state
            raise ValueError(f"rank {self.rank}: request {rid!r} has no ended prefetch to "
                             f"forget (it is {now!r}); nothing was changed")
        del self.requests[rid]

    @sanitized
    def queue(self, rid: Any, anchor: torch.Tensor | None = None) -> PrefetchReq:
        """Queue a prefetch for ``rid``; it locks ``anchor`` (cached pages it extends)."""
        old = self.requests.get(rid)
        if old is not None and not old.terminal:
            raise ValueError(f"rank {self.rank}: request {rid!r} already has a prefetch in "
                             f"state {old.state!r}; abort or complete it first")
        inst = _SitePrefetch(self.machine, rid)
        if anchor is not None and anchor.numel():
            # Locked before the prefetch is known: a lock that raises (a bad anchor, a
            # failing pool) is a refused queue, leaving no prefetch registered without
            # the lock it asked for.
            self.host.lock(anchor)
            self.ledger.acquire(inst, "host_lock", anchor)
        # Known before it fires: a trace recorder that raises out of the fire leaves it
        # queued, holding its lock, where an abort finds it (not lost with the lock).
        self.requests[rid] = inst
        inst.fire(_QUEUE)
        return inst

    @sanitized
    def start(self, rid: Any, n_pages: int) -> Prefetch | None:
        """Reserve ``n_pages`` host pages and start the I/O; None (still pending) when short."""
        inst = self._live(rid, "pending")
        p = self.host.prefetch(n_pages)
        if p is None:
            return None
        inst.handle = self.ledger.acquire(inst, "host_pages", p)  # (read by transfer)
        inst.fire(_START)
        return p

    def prefetch_of(self, rid: Any) -> Prefetch | None:
        """The running transfer of ``rid``, if it has one that is not released."""
        inst = self.requests.get(rid)
        if inst is None:
            return None
        held = self.ledger.owned(inst, "host_pages")
        return held[0].value if held else None

    @sanitized
    def transfer(self, rid: Any, pages: int) -> int:
        """The I/O wrote ``pages`` more pages of ``rid``; returns the completed count."""
        inst = self.requests.get(rid)  # (`prefetch_of`, inline: a call a step)
        h = inst.handle if inst is not None else None
        if h is not None and h.owner is inst and not h.released:
            return h.value.advance(pages)  # the host pages `start` acquired, still owned
        held = self.ledger.owned(inst, "host_pages") if inst is not None else None
        if not held:
            raise ValueError(f"rank {self.rank}: request {rid!r} has no running transfer")
        return held[0].value.advance(pages)

    @sanitized
    def complete(self, rid: Any) -> PlanReport | None:
        """The I/O finished: the host cache (``insert``) takes the completed prefix.

        Once the abort of ``rid`` started (or the prefetch already ended) the completion
        is late: it is absorbed (None), and the abort releases what the I/O completed.
        """
        inst = self.requests.get(rid)
        if inst is not None and inst._s not in self._abortable:  # (`inst.state`)
            return inst.fire(_COMPLETE)  # declared ignore in every such state
        if self.insert is None:
            raise ValueError("PrefetchSite(insert=...) is needed to complete a prefetch: "
                             "something must own the pages the cache takes")
        return self._live(rid, "active").fire(_COMPLETE)

    @property
    def occupancy_tokens(self) -> int:
        """Tokens held by prefetches that are not released or taken yet."""
        return self.host.prefetch_occupied * self.page_size

    # -- the abort protocol ----------------------------------------------------------------

    @sanitized
    def abort_steps(self, rid: Any, groups: Sequence[str], *,
                    naive: bool = False) -> Generator[Op, Any, AbortOutcome]:
        """The abort of ``rid`` on this rank, yielding the collectives a driver performs.

        ``groups``: names of the attention groups, in reduction order. ``naive=True``
        skips the reduction and decides on the local class alone: the bug this engine
        exists to prevent (ranks without active I/O leave before the barrier), kept so
        tests and the simulator can show it deadlocking.
        """
        inst = self.requests.get(rid)
        if inst is not None and inst.state == "released":
            # A duplicate abort: this rank's abort already ran its collectives and
            # released. Absorb it here: a peer that did not get the duplicate would
            # never join a new collective, and this rank would wait for it in vain.
            inst.abort()  # an echo, declared ignored
            self.trace.append(("absorbed", rid))
            return AbortOutcome(str(rid), self.rank, int(Local.MISSING), inst.decision,
                                False, inst.state)
        if inst is not None and not inst.terminal and inst.state not in _ABORTABLE:
            # Raised before any collective: every rank sees the same abort requests, so
            # a second abort of a request whose abort timed out is refused on all of them.
            raise ValueError(
                f"rank {self.rank}: request {rid!r} is already being aborted (state "
                f"{inst.state!r}); retry(rid) or close_group(rid) a timed-out or failed abort")
        if inst is None or inst.terminal:
            # No prefetch here (or it already finished): this rank is the missing class,
            # and it still takes part in every collective.
            inst = _SitePrefetch(self.machine, rid)
            self.requests[rid] = inst
        inst.abort()
        value = int(inst.local)
        if not naive:
            for g in range(len(groups)):
                self.trace.append(("reduce", rid, g))
                try:
                    value = yield ReduceOp(g, value)
                except CollectiveTimeout as e:
                    raise self._timeout(inst, g, groups, None, e) from e
                except Exception as e:  # a backend error: nothing decided, nothing touched
                    raise self._failed(inst, g, groups, "reduce_max", e) from e
        inst.decide(value)
        if inst.state == "revoking":
            # A queued prefetch owns no host pages: revoking it only stops it starting.
            self.trace.append(("revoke", rid))
            inst.fire(Revoked())
        elif inst.state == "draining":
            p = self.prefetch_of(rid)
            assert p is not None  # an active prefetch owns its transfer
            unwritten = p.pages.numel() - p.completed
            try:
                p.stop()  # nothing is freed before the barrier: the terminal plan frees it
            except Exception as e:  # the I/O may still write: keep everything (I10)
                raise PrefetchStopFailed(inst.key, self.rank, groups[0] if groups else "",
                                         inst.state, self._kept(inst), "stop", e) from e
            self.trace.append(("drain", rid, unwritten))
            inst.fire(Drained())
        if inst.state in ("revoked", "drained"):
            inst.fire(Join() if value >= Local.ACTIVE else PrefetchRelease())
        entered = inst.state == "in_barrier"
        if entered:
            yield from self._barrier(inst, groups, 0, None)
        return AbortOutcome(str(rid), self.rank, int(inst.local), value, entered, inst.state)

    def _barrier(self, inst: PrefetchReq, groups: Sequence[str], first: int,
                 ticket: Any) -> Generator[Op, Any, None]:
        rid = inst.key
        for g in range(first, len(groups)):
            if ticket is None:
                self.trace.append(("barrier_enter", rid, g))
            try:
                yield BarrierOp(g, ticket)
            except CollectiveTimeout as e:
                raise self._timeout(inst, g, groups, e.ticket, e) from e
            except Exception as e:  # a peer process died: the group is unusable
                raise self._failed(inst, g, groups, "barrier", e) from e
            ticket = None
            self.trace.append(("barrier_exit", rid, g))
        inst.fire(BarrierPassed())

    def _timeout(self, inst: PrefetchReq, g: int, groups: Sequence[str], ticket: Any,
                 e: CollectiveTimeout) -> PrefetchAbortTimeout:
        if inst.state == "in_barrier":
            inst.timed_out_group = groups[g]
            inst.fire(BarrierTimedOut(groups[g]))
            self._stalled[inst.key] = (g, ticket)
        return PrefetchAbortTimeout(inst.key, self.rank, groups[g], inst.state,
                                    self._kept(inst), ticket, e)

    def _failed(self, inst: PrefetchReq, g: int, groups: Sequence[str], op: str,
                e: Exception) -> PrefetchCollectiveFailed:
        if inst.state == "in_barrier":
            inst.fire(CollectiveFailed(groups[g]))
        return PrefetchCollectiveFailed(inst.key, self.rank, groups[g], inst.state,
                                        self._kept(inst), op, e)

    def _kept(self, inst: PrefetchReq) -> str:
        held = [f"{h.kind}" for h in self.ledger.owned(inst)]
        return ("its " + " and ".join(held) if held else "nothing") + (
            f" ({self.occupancy_tokens} prefetch tokens on this rank)")

    @sanitized
    def retry_steps(self, rid: Any, groups: Sequence[str]) -> Generator[Op, Any, AbortOutcome]:
        """Wait again on the barrier that timed out for ``rid`` (same collective), then release."""
        inst = self._live(rid, "stalled")
        g, ticket = self._stalled.pop(rid)
        inst.fire(Join())
        yield from self._barrier(inst, groups, g, ticket)
        return AbortOutcome(str(rid), self.rank, int(inst.local), inst.decision, True,
                            inst.state)

    @sanitized
    def abort(self, rid: Any, collectives: RankCollectives, *,
              naive: bool = False) -> AbortOutcome:
        """Run the abort of ``rid`` on ``collectives`` (torch.distributed); see the module doc."""
        return drive(self.abort_steps(rid, collectives.names, naive=naive), collectives,
                     f"prefetch abort of request {rid!r} on rank {self.rank}")

    @sanitized
    def retry(self, rid: Any, collectives: RankCollectives) -> AbortOutcome:
        """Retry the barrier of a stalled abort (after the late peer arrived)."""
        return drive(self.retry_steps(rid, collectives.names), collectives,
                     f"prefetch abort of request {rid!r} on rank {self.rank} (retry)")

    @sanitized
    def close_group(self, rid: Any) -> PlanReport | None:
        """Release an abort whose collective timed out or raised, once its group was
        torn down.

        The instance is ``stalled`` (barrier timed out), ``broken`` (barrier raised),
        ``abort_requested`` (the reduction timed out or raised) or ``draining`` (the
        transfer would not stop); either way no peer can still be in the collective.
        """
        inst = self.requests.get(rid)
        if inst is None or inst.state not in _TIMED_OUT:
            now = "none" if inst is None else inst.state
            raise ValueError(f"rank {self.rank}: request {rid!r} has no timed-out or "
                             f"failed abort (it is {now!r}); nothing was changed")
        self._stalled.pop(rid, None)
        return inst.fire(GroupClosed())

    def assert_released(self) -> None:
        """Raise unless the ledger is empty and no prefetch occupies tokens."""
        self.ledger.assert_empty()
        if self.host.prefetch_occupied:
            raise AssertionError(f"rank {self.rank}: {self.occupancy_tokens} prefetch "
                                 "tokens still occupied")


def drive(steps: Generator[Op, Any, AbortOutcome], collectives: RankCollectives,
          what: str) -> AbortOutcome:
    """Run a protocol generator on real collectives; whatever a collective raises (a
    timeout, a backend error) is thrown into it, which turns it into a
    `PrefetchAbortError` once the instance is in a state `close_group` releases."""
    reply: Any = None
    error: BaseException | None = None
    while True:
        try:
            op = steps.throw(error) if error is not None else steps.send(reply)
        except StopIteration as stop:
            return stop.value
        reply, error = None, None
        try:
            if isinstance(op, ReduceOp):
                reply = collectives.reduce_max(op.group, op.value, what)
            else:
                collectives.barrier(op.group, what, op.ticket)
        except Exception as e:
            error = e
