"""The prefetch machine's effects and its rank-collective abort, on real or simulated ranks.

One `PrefetchSite` per rank holds that rank's host page pool, ownership ledger and
prefetch instances. The abort protocol is written once, as a generator of collective
operations (`abort_steps`), and run by one of two drivers:

    site.abort(rid, RankCollectives(...))     torch.distributed (gloo on CPU, NCCL on GPU)
    SimulatedRanks(sites, groups).abort(rid)  N ranks in one process, stepped in lockstep,
                                              deterministically (unit tests, the simulator)

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
after the caller tore the group down (no peer can still be in it). A reduction that
times out leaves the request in `abort_requested` with nothing decided and nothing
touched (the I/O still runs); only `close_group(rid)` releases it, stopping the I/O first.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any, NamedTuple

import msgspec
import torch

from terminus.fsm import Ledger, Machine, Plan, PlanReport, Release, ReleaseContext, release_effect
from terminus.kernels.collective import CollectiveTimeout, RankCollectives, grid_partitions
from terminus.kernels.host import HostPagePool, Prefetch
from terminus.states.prefetch import (
    PREFETCH,
    BarrierPassed,
    BarrierTimedOut,
    Complete,
    Drained,
    GroupClosed,
    Join,
    Local,
    PrefetchReq,
    Queue,
    Revoked,
    Start,
)
from terminus.states.prefetch import Release as ReleaseNow

__all__ = [
    "PREFETCH_PLANS",
    "AbortOutcome",
    "BarrierOp",
    "CollectiveMismatch",
    "PrefetchAbortTimeout",
    "PrefetchSite",
    "ReduceOp",
    "SimulatedAbort",
    "SimulatedRanks",
    "drive",
    "simulate_abort",
]


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


class PrefetchAbortTimeout(TimeoutError):
    """A collective of a prefetch abort timed out; the rank kept what it owned.

    Fields: ``rid``, ``rank``, ``group``, ``state`` (the instance's state: ``stalled``
    after a barrier, ``abort_requested`` after the reduction), ``kept`` (what is still
    held), ``ticket`` (the outstanding barrier, for `PrefetchSite.retry`).
    """

    def __init__(self, rid: Any, rank: int, group: str, state: str, kept: str,
                 ticket: Any, cause: CollectiveTimeout) -> None:
        self.rid = rid
        self.rank = rank
        self.group = group
        self.state = state
        self.kept = kept
        self.ticket = ticket
        fix = ("retry(rid) once the peer arrives, or close_group(rid) after tearing the "
               "group down" if state == "stalled" else
               "the ranks did not all take part in the reduction; tear the group down")
        super().__init__(
            f"prefetch abort of request {rid!r} on rank {rank}: {cause.op} on attention "
            f"group {group!r} (ranks {cause.ranks}) timed out after {cause.timeout:g}s; "
            f"the request is {state!r} and keeps {kept}; {fix}"
        )


class CollectiveMismatch(RuntimeError):
    """Ranks of one group entered different collectives (with torch they would pair up)."""


_ABORTABLE = ("none", "pending", "active")


# -- one rank ------------------------------------------------------------------------------


class PrefetchSite:
    """One rank's storage prefetches: its host pool, ledger, bound machine and instances.

    ``insert(rid, pages)`` receives the completed prefix of a prefetch that completes
    (the host cache takes ownership); ``page_size`` converts pages to tokens.
    ``trace`` records, in order, every collective entered and every local action and
    release: ``("reduce", rid, group)``, ``("revoke", rid)``, ``("drain", rid,
    unwritten_pages)``, ``("barrier_enter", rid, group)``, ``("barrier_exit", rid,
    group)``, ``("free_tail", rid, pages)`` (pages the stopped I/O never wrote),
    ``("free_prefix", rid, pages)``, ``("unlock", rid, pages)``,
    ``("insert", rid, pages)``.
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
        self.requests: dict[Any, PrefetchReq] = {}
        self.trace: list[tuple[Any, ...]] = []
        self._stalled: dict[Any, tuple[int, Any]] = {}

    # -- the normal lifecycle --------------------------------------------------------------

    def _live(self, rid: Any, state: str) -> PrefetchReq:
        inst = self.requests.get(rid)
        if inst is None or inst.state != state:
            now = "none" if inst is None else inst.state
            raise ValueError(f"rank {self.rank}: request {rid!r} has no {state} prefetch "
                             f"(it is {now!r}); nothing was changed")
        return inst

    def queue(self, rid: Any, anchor: torch.Tensor | None = None) -> PrefetchReq:
        """Queue a prefetch for ``rid``; it locks ``anchor`` (cached pages it extends)."""
        old = self.requests.get(rid)
        if old is not None and not old.terminal:
            raise ValueError(f"rank {self.rank}: request {rid!r} already has a prefetch in "
                             f"state {old.state!r}; abort or complete it first")
        inst = PrefetchReq(self.machine, rid)
        inst.fire(Queue())
        self.requests[rid] = inst
        if anchor is not None and anchor.numel():
            self.host.lock(anchor)
            self.ledger.acquire(inst, "host_lock", anchor)
        return inst

    def start(self, rid: Any, n_pages: int) -> Prefetch | None:
        """Reserve ``n_pages`` host pages and start the I/O; None (still pending) when short."""
        inst = self._live(rid, "pending")
        p = self.host.prefetch(n_pages)
        if p is None:
            return None
        self.ledger.acquire(inst, "host_pages", p)
        inst.fire(Start())
        return p

    def prefetch_of(self, rid: Any) -> Prefetch | None:
        """The running transfer of ``rid``, if it has one that is not released."""
        inst = self.requests.get(rid)
        if inst is None:
            return None
        held = self.ledger.owned(inst, "host_pages")
        return held[0].value if held else None

    def transfer(self, rid: Any, pages: int) -> int:
        """The I/O wrote ``pages`` more pages of ``rid``; returns the completed count."""
        p = self.prefetch_of(rid)
        if p is None:
            raise ValueError(f"rank {self.rank}: request {rid!r} has no running transfer")
        return p.advance(pages)

    def complete(self, rid: Any) -> PlanReport | None:
        """The I/O finished: the host cache (``insert``) takes the completed prefix."""
        if self.insert is None:
            raise ValueError("PrefetchSite(insert=...) is needed to complete a prefetch: "
                             "something must own the pages the cache takes")
        return self._live(rid, "active").fire(Complete())

    @property
    def occupancy_tokens(self) -> int:
        """Tokens held by prefetches that are not released or taken yet."""
        return self.host.prefetch_occupied * self.page_size

    # -- the abort protocol ----------------------------------------------------------------

    def abort_steps(self, rid: Any, groups: Sequence[str], *,
                    naive: bool = False) -> Generator[Op, Any, AbortOutcome]:
        """The abort of ``rid`` on this rank, yielding the collectives a driver performs.

        ``groups``: names of the attention groups, in reduction order. ``naive=True``
        skips the reduction and decides on the local class alone: the bug this engine
        exists to prevent (ranks without active I/O leave before the barrier), kept so
        tests and the simulator can show it deadlocking.
        """
        inst = self.requests.get(rid)
        if inst is not None and not inst.terminal and inst.state not in _ABORTABLE:
            # Raised before any collective: every rank sees the same abort requests, so
            # a second abort of a request whose abort timed out is refused on all of them.
            raise ValueError(
                f"rank {self.rank}: request {rid!r} is already being aborted (state "
                f"{inst.state!r}); retry(rid) or close_group(rid) a timed-out abort")
        if inst is None or inst.terminal:
            # No prefetch here (or it already finished): this rank is the missing class,
            # and it still takes part in every collective.
            inst = PrefetchReq(self.machine, rid)
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
        inst.decide(value)
        if inst.state == "revoking":
            # A queued prefetch owns no host pages: revoking it only stops it starting.
            self.trace.append(("revoke", rid))
            inst.fire(Revoked())
        elif inst.state == "draining":
            p = self.prefetch_of(rid)
            assert p is not None  # an active prefetch owns its transfer
            unwritten = p.pages.numel() - p.completed
            p.stop()  # nothing is freed before the barrier: the terminal plan frees it
            self.trace.append(("drain", rid, unwritten))
            inst.fire(Drained())
        if inst.state in ("revoked", "drained"):
            inst.fire(Join() if value >= Local.ACTIVE else ReleaseNow())
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
            ticket = None
            self.trace.append(("barrier_exit", rid, g))
        inst.fire(BarrierPassed())

    def _timeout(self, inst: PrefetchReq, g: int, groups: Sequence[str], ticket: Any,
                 e: CollectiveTimeout) -> PrefetchAbortTimeout:
        if inst.state == "in_barrier":
            inst.timed_out_group = groups[g]
            inst.fire(BarrierTimedOut(groups[g]))
            self._stalled[inst.key] = (g, ticket)
        held = [f"{h.kind}" for h in self.ledger.owned(inst)]
        kept = ("its " + " and ".join(held) if held else "nothing") + (
            f" ({self.occupancy_tokens} prefetch tokens on this rank)")
        return PrefetchAbortTimeout(inst.key, self.rank, groups[g], inst.state, kept,
                                    ticket, e)

    def retry_steps(self, rid: Any, groups: Sequence[str]) -> Generator[Op, Any, AbortOutcome]:
        """Wait again on the barrier that timed out for ``rid`` (same collective), then release."""
        inst = self._live(rid, "stalled")
        g, ticket = self._stalled.pop(rid)
        inst.fire(Join())
        yield from self._barrier(inst, groups, g, ticket)
        return AbortOutcome(str(rid), self.rank, int(inst.local), inst.decision, True,
                            inst.state)

    def abort(self, rid: Any, collectives: RankCollectives, *,
              naive: bool = False) -> AbortOutcome:
        """Run the abort of ``rid`` on ``collectives`` (torch.distributed); see the module doc."""
        return drive(self.abort_steps(rid, collectives.names, naive=naive), collectives,
                     f"prefetch abort of request {rid!r} on rank {self.rank}")

    def retry(self, rid: Any, collectives: RankCollectives) -> AbortOutcome:
        """Retry the barrier of a stalled abort (after the late peer arrived)."""
        return drive(self.retry_steps(rid, collectives.names), collectives,
                     f"prefetch abort of request {rid!r} on rank {self.rank} (retry)")

    def close_group(self, rid: Any) -> PlanReport | None:
        """Release an abort whose collective timed out, once its group was torn down.

        The instance is ``stalled`` (barrier timed out) or ``abort_requested`` (the
        reduction timed out); either way no peer can still be in the collective.
        """
        inst = self.requests.get(rid)
        if inst is None or inst.state not in ("stalled", "abort_requested"):
            now = "none" if inst is None else inst.state
            raise ValueError(f"rank {self.rank}: request {rid!r} has no timed-out abort "
                             f"(it is {now!r}); nothing was changed")
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
    """Run a protocol generator on real collectives; a timeout is thrown into it."""
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
        except CollectiveTimeout as e:
            error = e


# -- simulated ranks -----------------------------------------------------------------------


class SimulatedRanks:
    """N ranks in one process, their collectives simulated in lockstep (no threads, no
    sleeps: the same inputs always give the same result).

    ``sites[r]`` is rank r's `PrefetchSite`; ``groups`` is ``[(name, [[ranks], ...]),
    ...]``: each attention group kind with its partition of the ranks, in reduction order
    (`kernels.collective.grid_partitions` builds tp/cp grids). A collective completes
    when every rank of its group waits at it; when no collective can complete while ranks
    still wait, the peers they wait for will never come, and each waiting rank gets the
    `CollectiveTimeout` that a real group would give after its timeout.
    ``reduces[r][g]`` / ``barriers[r][g]`` count the collectives rank r entered.
    """

    def __init__(self, sites: Sequence[PrefetchSite],
                 groups: Sequence[tuple[str, Sequence[Sequence[int]]]]) -> None:
        n = len(sites)
        for name, parts in groups:
            flat = sorted(r for p in parts for r in p)
            if flat != list(range(n)):
                raise ValueError(f"group kind {name!r} must partition ranks 0..{n - 1}, "
                                 f"got {[list(p) for p in parts]}")
        self.sites = list(sites)
        self.groups = [(name, [list(p) for p in parts]) for name, parts in groups]
        self.names = tuple(name for name, _ in self.groups)
        self.reduces = [[0] * len(self.groups) for _ in sites]
        self.barriers = [[0] * len(self.groups) for _ in sites]

    def abort(self, rid: Any, *, naive: bool | Sequence[bool] = False
              ) -> list[AbortOutcome | BaseException]:
        """Abort ``rid`` on every rank; per rank its outcome or the error it raised.

        ``naive``: one flag for all ranks, or one per rank.
        """
        flags = [naive] * len(self.sites) if isinstance(naive, bool) else list(naive)
        return self.run({r: s.abort_steps(rid, self.names, naive=flags[r])
                         for r, s in enumerate(self.sites)})

    def run(self, gens: dict[int, Generator[Op, Any, AbortOutcome]]
            ) -> list[AbortOutcome | BaseException]:
        """Step protocol generators (rank -> generator) until every one has finished."""
        waiting: dict[int, Op] = {}
        results: dict[int, AbortOutcome | BaseException] = {}

        def step(r: int, reply: Any = None, error: BaseException | None = None) -> None:
            g = gens[r]
            try:
                op = g.throw(error) if error is not None else g.send(reply)
            except StopIteration as stop:
                results[r] = stop.value
                waiting.pop(r, None)
                return
            except Exception as e:  # the rank's error is its result; peers go on
                results[r] = e
                waiting.pop(r, None)
                return
            waiting[r] = op
            if isinstance(op, ReduceOp):
                self.reduces[r][op.group] += 1
            elif op.ticket is None:
                self.barriers[r][op.group] += 1

        for r in sorted(gens):
            step(r)
        while waiting:
            progressed = False
            for gi, (name, parts) in enumerate(self.groups):
                for members in parts:
                    ops = [waiting.get(m) for m in members]
                    if not all(o is not None and o.group == gi for o in ops):
                        continue
                    if len({type(o) for o in ops}) > 1:
                        raise CollectiveMismatch(
                            f"ranks {members} of group {name!r} entered different "
                            f"collectives {ops}; with torch.distributed they would pair "
                            "up and exchange the wrong data")
                    if isinstance(ops[0], ReduceOp):
                        v = max(o.value for o in ops if isinstance(o, ReduceOp))
                        for m in members:
                            step(m, reply=v)
                    else:
                        for m in members:
                            step(m)
                    progressed = True
            if not progressed:
                for r in sorted(waiting):
                    op = waiting[r]
                    name, parts = self.groups[op.group]
                    members = next(p for p in parts if r in p)
                    kind = "reduce_max" if isinstance(op, ReduceOp) else "barrier"
                    step(r, error=CollectiveTimeout(
                        f"simulated rank {r}", kind, name, members, 0.0, ticket=None))
        return [results[r] for r in sorted(results)]


class SimulatedAbort(msgspec.Struct, frozen=True):
    """What `simulate_abort` saw, per rank (index = rank).

    ``states``: each rank's state right after the abort (``released``, or ``stalled`` /
    ``abort_requested`` when a collective timed out); ``barrier``: whether the rank
    entered the barrier; ``reduces``/``barriers``: collectives entered; ``errors``: the
    timeout message, or ""; ``traces``: each site's trace; ``released_after_barrier``:
    every release of a rank that entered the barrier came after its last barrier exit.
    """

    classes: tuple[int, ...]
    naive: bool
    states: tuple[str, ...]
    barrier: tuple[bool, ...]
    reduces: tuple[int, ...]
    barriers: tuple[int, ...]
    errors: tuple[str, ...]
    traces: tuple[tuple[tuple[Any, ...], ...], ...]
    released_after_barrier: bool

    @property
    def deadlocked(self) -> bool:
        """Some rank waited in a collective that a peer never entered."""
        return any(self.errors)

    @property
    def all_or_none(self) -> bool:
        """Every rank entered the barrier, or none did."""
        return len(set(self.barrier)) <= 1


def simulate_abort(classes: Sequence[int], *, tp: int | None = None, naive: bool = False,
                   pages: int = 5, completed: int = 3, anchor: int = 2) -> SimulatedAbort:
    """Abort one request on ``len(classes)`` simulated ranks whose local classes are given.

    ``classes[r]``: rank r's `Local` class (0 missing, 1 pending, 2 active); ``tp``:
    ranks per tp group (default: all of them; the rest form cp groups); ``naive``: run
    the pre-fix logic that decides on the local class alone. Each rank gets its own host
    pool: a pending prefetch locks ``anchor`` cached pages, an active one also reserves
    ``pages`` and has written ``completed`` of them. A timed-out abort is released with
    `PrefetchSite.close_group` afterwards, and every pool is checked full before this
    returns (raising `AssertionError` if anything leaked), so callers can run many.
    """
    n = len(classes)
    sites = [PrefetchSite(HostPagePool(pages + anchor + 1), rank=r) for r in range(n)]
    anchors: list[torch.Tensor] = []
    for site, c in zip(sites, classes, strict=True):
        local = Local(c)
        if local >= Local.PENDING:
            a = site.host.alloc(anchor)
            assert a is not None
            anchors.append(a)
            site.queue("rid", a)
        if local == Local.ACTIVE:
            site.start("rid", pages)
            site.transfer("rid", completed)
    sim = SimulatedRanks(sites, grid_partitions(n, tp or n) if n > 1 else [])
    out = sim.abort("rid", naive=naive)
    states = tuple(site.requests["rid"].state for site in sites)
    errors = tuple(str(o) if isinstance(o, BaseException) else "" for o in out)
    after = True
    for site in sites:
        kinds = [t[0] for t in site.trace]
        if "barrier_exit" in kinds:
            last = max(i for i, k in enumerate(kinds) if k == "barrier_exit")
            after &= all(i > last for i, k in enumerate(kinds)
                         if k in ("free_tail", "free_prefix", "unlock"))
        if site.requests["rid"].state in ("stalled", "abort_requested"):
            site.close_group("rid")
        site.assert_released()
    for site, c in zip(sites, classes, strict=True):
        if Local(c) >= Local.PENDING:
            site.host.free(anchors.pop(0))
        site.host.assert_full()
        site.ledger.assert_empty()
    return SimulatedAbort(
        tuple(int(c) for c in classes), naive, states,
        tuple(any(t[0] == "barrier_enter" for t in site.trace) for site in sites),
        tuple(sum(r) for r in sim.reduces), tuple(sum(b) for b in sim.barriers), errors,
        tuple(tuple(site.trace) for site in sites), after)
