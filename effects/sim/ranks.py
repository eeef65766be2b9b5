"""The prefetch abort protocol on N simulated ranks in one process.

`SimulatedRanks(sites, groups).abort(rid)` steps every rank's protocol generator
(`terminus.effects.prefetch.PrefetchSite.abort_steps`) in lockstep, deterministically:
the unit tests and the simulator run it where `PrefetchSite.abort` runs on
torch.distributed. `simulate_abort(classes, tp=..., naive=...)` builds the sites, runs
one abort and checks every pool is full afterwards.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import msgspec
import torch

from terminus.effects.prefetch import (
    AbortOutcome,
    CollectiveMismatch,
    Op,
    PrefetchSite,
    ReduceOp,
)
from terminus.kernels.collective import CollectiveError, CollectiveTimeout, grid_partitions
from terminus.kernels.host import HostPagePool
from terminus.states.prefetch import Local

__all__ = ["SimulatedAbort", "SimulatedRanks", "simulate_abort"]


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

    def abort(self, rid: Any, *, naive: bool | Sequence[bool] = False,
              fail: bool = False) -> list[AbortOutcome | BaseException]:
        """Abort ``rid`` on every rank; per rank its outcome or the error it raised.

        ``naive``: one flag for all ranks, or one per rank. ``fail``: the first
        collective that every member of a group entered raises a backend error on each
        of them (a peer process died), as gloo's "Connection closed by peer" does.
        """
        flags = [naive] * len(self.sites) if isinstance(naive, bool) else list(naive)
        return self.run({r: s.abort_steps(rid, self.names, naive=flags[r])
                         for r, s in enumerate(self.sites)}, fail=fail)

    def run(self, gens: dict[int, Generator[Op, Any, AbortOutcome]], *,
            fail: bool = False) -> list[AbortOutcome | BaseException]:
        """Step protocol generators (rank -> generator) until every one has finished;
        ``fail`` as in `abort`."""
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
                    if fail:
                        kind = "reduce_max" if isinstance(ops[0], ReduceOp) else "barrier"
                        for m in members:
                            step(m, error=CollectiveError(
                                f"simulated rank {m}", kind, name, members,
                                RuntimeError("Connection closed by peer (injected)")))
                    elif isinstance(ops[0], ReduceOp):
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
