"""The prefetch machine and its rank-collective abort, in one process.

The abort runs on `SimulatedRanks`: the ranks' collectives are simulated in lockstep,
deterministically, over the real host pools and ledgers of each rank. The same protocol
runs on a real gloo group in test_prefetch_collective.py.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
import torch

from terminus.effects.prefetch import (
    AbortOutcome,
    BarrierOp,
    PrefetchAbortError,
    PrefetchAbortTimeout,
    PrefetchCollectiveFailed,
    PrefetchSite,
    ReduceOp,
)
from terminus.effects.sim.ranks import SimulatedRanks
from terminus.fsm import TransitionNotAllowed
from terminus.fsm.oracle import Differential
from terminus.fsm.paths import Step
from terminus.fsm.testing import drive_machine
from terminus.kernels.collective import CollectiveTimeout, RankCollectives, grid_partitions
from terminus.kernels.host import HostPagePool
from terminus.states.prefetch import (
    PREFETCH,
    BarrierPassed,
    BarrierTimedOut,
    Complete,
    Drained,
    GroupClosed,
    Join,
    Local,
    PrefetchAbort,
    PrefetchRelease,
    PrefetchReq,
    Queue,
    Reduced,
    Revoked,
    Start,
    classify,
)

PAGES = 5  # reserved per active prefetch
DONE = 3  # of which the I/O completed this many before the abort
ANCHOR = 2  # cached pages a prefetch extends (locked while it lives)


class Rank:
    """One rank's site, with the anchor pages its host cache holds (freed at the end)."""

    def __init__(self, rank: int, pages: int = 32) -> None:
        self.inserted: list[torch.Tensor] = []
        self.site = PrefetchSite(HostPagePool(pages), rank=rank,
                                 insert=lambda rid, p: self.inserted.append(p))
        self.anchors: list[torch.Tensor] = []

    def prepare(self, rid: str, local: Local) -> None:
        """Put this rank's prefetch of `rid` in the `local` class."""
        if local >= Local.PENDING:
            anchor = self.site.host.alloc(ANCHOR)
            assert anchor is not None
            self.anchors.append(anchor)
            self.site.queue(rid, anchor)
        if local == Local.ACTIVE:
            assert self.site.start(rid, PAGES) is not None
            self.site.transfer(rid, DONE)

    def finish(self) -> None:
        """What every test ends with: nothing owned, the pool full."""
        self.site.assert_released()
        for pages in self.inserted + self.anchors:
            self.site.host.free(pages)
        self.site.host.assert_full()
        self.site.ledger.assert_empty()


def ranks(n: int) -> list[Rank]:
    return [Rank(r) for r in range(n)]


def simulated(rs: list[Rank], tp: int) -> SimulatedRanks:
    return SimulatedRanks([r.site for r in rs], grid_partitions(len(rs), tp))


def events(site: PrefetchSite, kind: str) -> list[tuple[Any, ...]]:
    return [t for t in site.trace if t[0] == kind]


def check_order(site: PrefetchSite, barrier: bool, groups: int) -> None:
    """Reductions first; barrier entries all after local work; releases after the barrier."""
    kinds = [t[0] for t in site.trace]
    assert kinds[:groups] == ["reduce"] * groups
    releases = [i for i, k in enumerate(kinds) if k in ("free_prefix", "unlock")]
    local = [i for i, k in enumerate(kinds) if k in ("revoke", "drain")]
    exits = [i for i, k in enumerate(kinds) if k == "barrier_exit"]
    enters = [i for i, k in enumerate(kinds) if k == "barrier_enter"]
    if barrier:
        assert len(enters) == len(exits) == groups
        assert all(i < min(enters) for i in local)
        assert all(i > max(exits) for i in releases)
    else:
        assert not enters and not exits


# -- the declaration ---------------------------------------------------------------------


def test_every_pair_is_declared_and_only_released_and_completed_are_terminal() -> None:
    assert {s for s, t in zip(PREFETCH.states, PREFETCH.terminal, strict=True) if t} == {
        "released", "completed"}
    assert PREFETCH.plan_names == ("release_aborted", "release_completed")
    assert all(len(row) == len(PREFETCH.events) for row in PREFETCH.cells)


def test_local_class_follows_the_state_and_orders_for_max() -> None:
    assert [classify(s) for s in ("none", "pending", "active", "released", "completed")] == [
        Local.MISSING, Local.PENDING, Local.ACTIVE, Local.MISSING, Local.MISSING]
    assert max(Local.MISSING, Local.ACTIVE, Local.PENDING) is Local.ACTIVE


def _arrange(site: PrefetchSite) -> Any:
    """Build each path step's event over real pages: the guards it needs hold."""

    def arrange(inst: PrefetchReq, step: Step) -> Any:
        ev = step.event
        if ev is Queue and step.source == "none":
            anchor = site.host.alloc(ANCHOR)
            assert anchor is not None
            site.host.lock(anchor)
            site.ledger.acquire(inst, "host_lock", anchor)
            site.anchors.append(anchor)  # type: ignore[attr-defined]
        if ev is Start and step.source == "pending":
            p = site.host.prefetch(PAGES)
            assert p is not None
            p.advance(DONE)
            site.ledger.acquire(inst, "host_pages", p)
        if ev is PrefetchAbort and step.source in ("none", "pending", "active"):
            inst.local = classify(step.source)
        if ev is Reduced and step.source == "abort_requested":
            local = {"local_active": Local.ACTIVE, "local_pending": Local.PENDING}.get(
                step.guard or "", Local.MISSING)
            inst.local = local
            inst.decision = Local.ACTIVE if step.guard in ("local_active", "barrier_decided") \
                else max(int(local), 0)
            if local == Local.ACTIVE and not site.ledger.owned(inst, "host_pages"):
                p = site.host.prefetch(PAGES)
                assert p is not None
                site.ledger.acquire(inst, "host_pages", p)
            return Reduced(inst.decision)
        if ev is Drained:
            for h in site.ledger.owned(inst, "host_pages"):
                h.value.terminate()
        if step.guard == "barrier_decided":
            inst.decision = Local.ACTIVE
        if step.guard == "no_barrier":
            inst.decision = Local.PENDING
        if ev is BarrierTimedOut:
            return BarrierTimedOut("tp")
        return ev()

    return arrange


def test_paths_reach_every_transition_and_pair_and_release_what_they_owned() -> None:
    r = Rank(0, pages=256)
    site = r.site
    site.anchors = r.anchors  # type: ignore[attr-defined]
    n = itertools.count()
    summary = drive_machine(site.machine, lambda: PrefetchReq(site.machine, f"p{next(n)}"),
                            _arrange(site))
    assert summary.ok and summary.terminal_paths == summary.paths
    assert summary.released > 0
    assert r.inserted  # the success path handed a completed prefix to the cache
    r.finish()


def _random_event(rng: random.Random) -> Any:
    ev = rng.choice(PREFETCH.events)
    if ev is Reduced:
        return Reduced(rng.randrange(3))
    if ev is BarrierTimedOut:
        return BarrierTimedOut("tp")
    return ev()


def test_compiled_machine_agrees_with_the_transitions_oracle_on_random_walks() -> None:
    rng = random.Random(6)
    decisions: set[str] = set()
    for walk in range(300):
        inst = PrefetchReq(PREFETCH.bind(partial=True), f"w{walk}")
        diff = Differential(inst)
        for _ in range(rng.randrange(1, 25)):
            # The guards read the instance; vary what they read between events.
            inst.local = Local(rng.randrange(3))
            inst.decision = rng.randrange(-1, 3)
            decisions.add(diff.deliver(_random_event(rng)))
        assert diff.plans_match()
    assert decisions == {"transition", "ignore", "error"}


# -- the collective abort, simulated -------------------------------------------------------


@pytest.mark.parametrize(("world", "tp"), [(2, 2), (4, 2), (4, 4)])
def test_every_combination_of_local_classes_enters_the_barrier_all_or_none(
        world: int, tp: int) -> None:
    groups = len(grid_partitions(world, tp))
    for combo in itertools.product(list(Local), repeat=world):
        rs = ranks(world)
        for r, local in zip(rs, combo, strict=True):
            r.prepare("rid", local)
        sim = simulated(rs, tp)
        out = sim.abort("rid")
        barrier = max(combo) == Local.ACTIVE
        assert all(isinstance(o, AbortOutcome) for o in out), (combo, out)
        assert [o.barrier for o in out] == [barrier] * world  # type: ignore[union-attr]
        assert [o.decision for o in out] == [max(combo)] * world  # type: ignore[union-attr]
        assert sim.reduces == [[1] * groups] * world
        assert sim.barriers == [[int(barrier)] * groups] * world
        for r, local in zip(rs, combo, strict=True):
            site = r.site
            check_order(site, barrier, groups)
            # Only the owner releases, and only what it owns: the completed prefix.
            assert events(site, "free_prefix") == ([("free_prefix", "rid", DONE)]
                                                   if local == Local.ACTIVE else [])
            assert events(site, "unlock") == ([("unlock", "rid", ANCHOR)]
                                              if local >= Local.PENDING else [])
            assert bool(events(site, "revoke")) == (local == Local.PENDING)
            assert events(site, "drain") == ([("drain", "rid", PAGES - DONE)]
                                             if local == Local.ACTIVE else [])
            assert site.requests["rid"].state == "released"
            r.finish()


def test_active_rank_keeps_its_pages_and_locks_until_every_rank_arrived() -> None:
    rs = ranks(2)
    rs[0].prepare("rid", Local.ACTIVE)
    site = rs[0].site
    gens = {r.site.rank: r.site.abort_steps("rid", ("tp",)) for r in rs}
    # Step rank 0 alone up to the barrier: the reduction needs rank 1, so drive both
    # through it by hand, then hold rank 1 back.
    op0, op1 = gens[0].send(None), gens[1].send(None)
    assert op0 == ReduceOp(0, Local.ACTIVE) and op1 == ReduceOp(0, Local.MISSING)
    assert gens[0].send(2) == BarrierOp(0, None)
    assert site.requests["rid"].state == "in_barrier"
    assert site.host.locked_pages() == ANCHOR
    # Nothing goes back before the barrier, not even the tail the I/O never wrote.
    assert site.host.available == 32 - ANCHOR - PAGES
    assert site.occupancy_tokens == PAGES
    assert not events(site, "free_prefix")
    gens[1].send(2)  # rank 1 (missing) only joins
    for g in gens.values():
        with pytest.raises(StopIteration):
            g.send(None)
    assert events(site, "free_prefix") == [("free_prefix", "rid", DONE)]
    assert site.occupancy_tokens == 0
    for r in rs:
        r.finish()


def test_no_rank_with_active_io_means_no_rank_enters_the_barrier() -> None:
    rs = ranks(4)
    for r, local in zip(rs, (Local.PENDING, Local.MISSING, Local.PENDING, Local.MISSING),
                        strict=True):
        r.prepare("rid", local)
    sim = simulated(rs, 2)
    out = sim.abort("rid")
    assert sim.barriers == [[0, 0]] * 4
    assert {o.state for o in out if isinstance(o, AbortOutcome)} == {"released"}
    for r in rs:
        r.finish()


def test_a_completed_prefetch_takes_part_in_a_later_abort_as_missing() -> None:
    rs = ranks(2)
    rs[0].prepare("rid", Local.ACTIVE)
    rs[1].prepare("rid", Local.ACTIVE)
    rs[0].site.transfer("rid", PAGES)
    rs[0].site.complete("rid")
    assert rs[0].inserted and rs[0].inserted[0].numel() == PAGES
    out = simulated(rs, 2).abort("rid")
    assert [(o.local, o.barrier) for o in out if isinstance(o, AbortOutcome)] == [
        (Local.MISSING, True), (Local.ACTIVE, True)]
    assert rs[0].site.requests["rid"].state == "released"
    for r in rs:
        r.finish()


def test_a_peer_that_never_takes_part_times_out_naming_the_request_and_group() -> None:
    rs = ranks(2)
    rs[0].prepare("rid", Local.ACTIVE)
    sim = simulated(rs, 2)
    (err,) = sim.run({0: rs[0].site.abort_steps("rid", sim.names)})
    assert isinstance(err, PrefetchAbortTimeout)
    assert err.state == "abort_requested" and err.group == "tp"
    with pytest.raises(PrefetchAbortTimeout, match=r"request 'rid' on rank 0: reduce_max on "
                       r"attention group 'tp' \(ranks \[0, 1\]\).*keeps its host_lock"):
        raise err
    # Nothing was decided, so nothing was released and the I/O was not touched.
    assert rs[0].site.prefetch_of("rid") is not None
    assert rs[0].site.host.locked_pages() == ANCHOR
    with pytest.raises(ValueError, match=r"'rid' is already being aborted \(state "
                       r"'abort_requested'\); retry\(rid\) or close_group\(rid\)"):
        next(rs[0].site.abort_steps("rid", sim.names))
    # The group was torn down: the release stops the I/O and frees only what it wrote.
    rs[0].site.close_group("rid")
    assert rs[0].site.requests["rid"].state == "released"
    assert ("free_prefix", "rid", DONE) in rs[0].site.trace
    for r in rs:
        r.finish()


def test_a_reduced_class_below_the_local_one_is_refused_and_changes_nothing() -> None:
    r = Rank(0)
    r.prepare("rid", Local.ACTIVE)
    inst = r.site.requests["rid"]
    inst.abort()
    with pytest.raises(ValueError, match=r"reduced class 0 is below this rank's own class 2"):
        inst.decide(Local.MISSING)
    assert inst.state == "abort_requested" and inst.decision == -1
    inst.decide(Local.ACTIVE)
    assert inst.state == "draining"
    r.site.prefetch_of("rid").terminate()  # type: ignore[union-attr]
    for ev in (Drained(), Join(), BarrierPassed()):
        inst.fire(ev)
    r.finish()


def test_an_active_rank_can_never_skip_the_barrier() -> None:
    r = Rank(0)
    r.prepare("rid", Local.ACTIVE)
    inst = r.site.requests["rid"]
    inst.abort()
    inst.decide(Local.ACTIVE)
    r.site.prefetch_of("rid").terminate()  # type: ignore[union-attr]
    inst.fire(Drained())
    with pytest.raises(TransitionNotAllowed, match=r"'PrefetchRelease' is not allowed in state "
                       r"'drained'"):
        inst.fire(PrefetchRelease())
    assert inst.state == "drained" and r.site.host.locked_pages() == ANCHOR
    inst.fire(Join())
    inst.fire(BarrierPassed())
    r.finish()


def test_abort_echo_and_late_completion_after_release_release_nothing() -> None:
    rs = ranks(2)
    rs[0].prepare("rid", Local.ACTIVE)
    simulated(rs, 2).abort("rid")
    inst = rs[0].site.requests["rid"]
    runs = rs[0].site.machine.stats.plans_run["release_aborted"]
    inst.fire(PrefetchAbort())
    inst.fire(Complete())
    assert rs[0].site.machine.stats.plans_run["release_aborted"] == runs
    assert inst.state == "released"
    for r in rs:
        r.finish()


def test_a_stalled_abort_is_released_once_the_group_is_closed() -> None:
    rs = ranks(2)
    rs[0].prepare("rid", Local.ACTIVE)
    rs[1].prepare("rid", Local.PENDING)
    out = simulated(rs, 2).abort("rid", naive=True)
    assert isinstance(out[0], PrefetchAbortTimeout)
    assert rs[0].site.requests["rid"].state == "stalled"
    rs[0].site.close_group("rid")
    assert rs[0].site.requests["rid"].state == "released"
    for r in rs:
        r.finish()


# -- bad input -------------------------------------------------------------------------------


def test_queueing_a_second_prefetch_for_a_live_request_is_refused() -> None:
    r = Rank(0)
    r.prepare("rid", Local.PENDING)
    with pytest.raises(ValueError, match=r"already has a prefetch in state 'pending'"):
        r.site.queue("rid")
    simulated([r], 1).abort("rid")
    r.finish()


def test_a_start_short_of_host_pages_stays_pending_and_takes_nothing() -> None:
    r = Rank(0, pages=4)
    r.prepare("rid", Local.PENDING)
    assert r.site.start("rid", 10) is None
    assert r.site.requests["rid"].state == "pending" and r.site.occupancy_tokens == 0
    with pytest.raises(ValueError, match=r"has no pending prefetch \(it is 'none'\)"):
        r.site.start("other", 1)
    simulated([r], 1).abort("rid")
    r.finish()


def test_completing_without_a_cache_to_take_the_pages_is_refused_before_anything() -> None:
    site = PrefetchSite(HostPagePool(8))
    site.queue("rid")
    site.start("rid", 2)
    with pytest.raises(ValueError, match=r"PrefetchSite\(insert=...\) is needed"):
        site.complete("rid")
    assert site.requests["rid"].state == "active"
    SimulatedRanks([site], []).abort("rid")
    site.assert_released()
    site.host.assert_full()


def test_a_recorder_raising_at_queue_leaves_the_prefetch_findable_with_its_lock() -> None:
    """The anchor is locked into the ledger before the Queue fire; a trace recorder that
    raises out of that fire left an instance holding the lock that no rid reached (the
    ledger never empty again). Now it is known, queued, and its abort unlocks."""
    from terminus.fsm import observe

    class Raising:
        def record(self, machine, source, event, alt):
            if machine.event_names[event] == "Queue":
                raise RuntimeError("recorder broke")

        def record_counts(self, machine, counts):
            pass

    site = PrefetchSite(HostPagePool(8))
    anchor = site.host.alloc(2)
    prev = observe.set_recorder(Raising())
    try:
        with pytest.raises(RuntimeError, match="recorder broke"):
            site.queue("rid", anchor)
    finally:
        observe.set_recorder(prev)
    assert site.requests["rid"].state == "pending"
    assert site.host.locked_pages() == 2
    SimulatedRanks([site], []).abort("rid")
    assert site.host.locked_pages() == 0
    site.assert_released()
    site.host.free(anchor)
    site.host.assert_full()


def test_group_kinds_must_partition_the_ranks() -> None:
    with pytest.raises(ValueError, match=r"group kind 'tp' must partition ranks 0..1"):
        SimulatedRanks([PrefetchSite(HostPagePool(1)) for _ in range(2)], [("tp", [[0]])])
    with pytest.raises(ValueError, match=r"tp=3 must be >= 1 and divide world_size=4"):
        grid_partitions(4, 3)
    with pytest.raises(ValueError, match=r"timeout must be > 0 seconds"):
        RankCollectives([], timeout=0)


def test_grid_partitions_name_tp_and_cp_groups_of_more_than_one_rank() -> None:
    assert grid_partitions(4, 2) == [("tp", [[0, 1], [2, 3]]), ("cp", [[0, 2], [1, 3]])]
    assert grid_partitions(4, 4) == [("tp", [[0, 1, 2, 3]])]
    assert grid_partitions(2, 1) == [("cp", [[0, 1]])]
    assert grid_partitions(1, 1) == []


def test_a_barrier_timeout_leads_to_stalled_and_only_a_closed_group_releases() -> None:
    inst = PrefetchReq(PREFETCH.bind(partial=True), "rid")  # a table test
    inst.abort()
    inst.decide(Local.ACTIVE)  # a missing rank only joins
    assert inst.state == "in_barrier"
    inst.fire(BarrierTimedOut("cp"))
    assert inst.state == "stalled"
    with pytest.raises(TransitionNotAllowed, match=r"'BarrierPassed' is not allowed in "
                       r"state 'stalled'"):
        inst.fire(BarrierPassed())
    inst.fire(GroupClosed())
    assert inst.state == "released"


# -- errors of the collectives, late completions, duplicate aborts ----------------------------

AFTER_ABORT = ("abort_requested", "revoking", "draining", "revoked", "drained", "in_barrier",
               "stalled", "broken", "released")


def _abort_until(r: Rank, state: str) -> Any:
    """Start the abort of `rid` on rank 0 of a tp pair and stop in `state`; returns the
    suspended protocol generator, if the state is reached through it."""
    site = r.site
    r.prepare("rid", Local.PENDING if state in ("revoking", "revoked") else Local.ACTIVE)
    inst = site.requests["rid"]
    if state in ("revoking", "draining", "revoked", "drained"):
        inst.abort()
        inst.decide(int(inst.local))  # the peer was missing: the MAX is this rank's class
        if state == "revoked":
            inst.fire(Revoked())
        if state == "drained":
            site.prefetch_of("rid").stop()  # type: ignore[union-attr]
            inst.fire(Drained())
        return None
    gen = site.abort_steps("rid", ("tp",))
    assert next(gen) == ReduceOp(0, Local.ACTIVE)
    if state == "abort_requested":
        return gen
    assert gen.send(Local.ACTIVE) == BarrierOp(0, None)
    if state == "stalled":
        with pytest.raises(PrefetchAbortTimeout):
            gen.throw(CollectiveTimeout("peer", "barrier", "tp", [0, 1], 1.0, ticket=None))
    elif state == "broken":
        with pytest.raises(PrefetchCollectiveFailed):
            gen.throw(RuntimeError("Connection closed by peer"))
    elif state == "released":
        with pytest.raises(StopIteration):
            gen.send(None)
    return gen


def _finish_abort(r: Rank, state: str, gen: Any) -> None:
    """Take the abort from `state` to `released` the way its driver would."""
    site, inst = r.site, r.site.requests["rid"]
    if state in ("abort_requested", "stalled", "broken"):
        if gen is not None:
            gen.close()
        site.close_group("rid")
    elif state == "in_barrier":
        with pytest.raises(StopIteration):
            gen.send(None)
    elif state in ("revoking", "revoked"):
        if state == "revoking":
            inst.fire(Revoked())
        inst.fire(PrefetchRelease())
    elif state in ("draining", "drained"):
        if state == "draining":
            site.prefetch_of("rid").stop()  # type: ignore[union-attr]
            inst.fire(Drained())
        inst.fire(Join())
        inst.fire(BarrierPassed())
    assert inst.state == "released"


@pytest.mark.parametrize("state", AFTER_ABORT)
def test_a_late_completion_is_absorbed_in_every_state_after_the_abort_started(
        state: str) -> None:
    r = Rank(0)
    gen = _abort_until(r, state)
    site, inst = r.site, r.site.requests["rid"]
    assert inst.state == state
    held = [(h.kind, h.hid) for h in site.ledger.owned(inst)]
    assert site.complete("rid") is None  # the I/O side reports its end late
    assert inst.fire(Complete()) is None
    assert inst.state == state and [(h.kind, h.hid) for h in site.ledger.owned(inst)] == held
    assert site.machine.stats.plans_run["release_completed"] == 0 and not r.inserted
    if state != "released":
        _finish_abort(r, state, gen)
    assert site.machine.stats.plans_run["release_aborted"] == 1
    r.finish()


def test_a_duplicate_abort_of_a_released_prefetch_is_absorbed_without_a_collective() -> None:
    rs = ranks(2)
    rs[0].prepare("rid", Local.ACTIVE)
    sim = simulated(rs, 2)
    sim.abort("rid")
    reduces, runs = [list(x) for x in sim.reduces], rs[0].site.machine.stats.plans_run.copy()
    # Only rank 0 gets the duplicate: its peer never joins a collective for it.
    (out,) = sim.run({0: rs[0].site.abort_steps("rid", sim.names)})
    assert isinstance(out, AbortOutcome), out
    assert (out.state, out.barrier) == ("released", False)
    assert sim.reduces == reduces and sim.barriers == [[1], [1]]
    assert rs[0].site.machine.stats.plans_run == runs
    assert rs[0].site.trace[-1] == ("absorbed", "rid")
    # With real collectives too: a group object that must never be touched.
    untouchable = RankCollectives([("tp", object())], timeout=1.0)
    assert rs[1].site.abort("rid", untouchable).state == "released"
    assert untouchable.reduces == [0] and untouchable.barriers == [0]
    for r in rs:
        r.finish()


class PeerDiesAfterReduce:
    """Collectives of a rank whose only peer exits after the reduction, as gloo reports
    it: the barrier raises the backend's RuntimeError."""

    names = ("tp",)

    def __init__(self, fail: str = "barrier") -> None:
        self.fail = fail

    def reduce_max(self, i: int, value: int, what: str = "") -> int:
        if self.fail == "reduce":
            raise RuntimeError("[pair.cc:537] Read error: Connection reset by peer")
        return int(Local.ACTIVE)

    def barrier(self, i: int, what: str = "", ticket: Any = None) -> None:
        raise RuntimeError("[pair.cc:598] Connection closed by peer [127.0.0.1]:1234")


@pytest.mark.parametrize(("fail", "state"), [("barrier", "broken"),
                                             ("reduce", "abort_requested")])
def test_a_collective_error_names_request_rank_and_group_and_close_group_releases_once(
        fail: str, state: str) -> None:
    r = Rank(3)
    r.prepare("rid", Local.ACTIVE)
    site = r.site
    with pytest.raises(PrefetchCollectiveFailed) as info:
        site.abort("rid", PeerDiesAfterReduce(fail))  # type: ignore[arg-type]
    err = info.value
    assert isinstance(err, PrefetchAbortError) and isinstance(err.error, RuntimeError)
    assert (err.rid, err.rank, err.group, err.state) == ("rid", 3, "tp", state)
    assert str(err).startswith(f"prefetch abort of request 'rid' on rank 3: "
                               f"{'barrier' if fail == 'barrier' else 'reduce_max'} on "
                               "attention group 'tp' raised RuntimeError: ")
    assert "close_group(rid) releases it" in str(err) and "host_lock" in err.kept
    inst = site.requests["rid"]
    assert inst.state == state
    # Nothing was released: the pages, the anchor lock and the occupancy are all kept.
    assert site.host.locked_pages() == ANCHOR and site.occupancy_tokens == PAGES
    assert site.machine.stats.plans_run["release_aborted"] == 0
    # A retry or a second abort is refused without changing anything; no peer is left.
    with pytest.raises(ValueError, match=r"has no stalled prefetch"):
        next(site.retry_steps("rid", ("tp",)))
    with pytest.raises(ValueError, match=r"already being aborted"):
        next(site.abort_steps("rid", ("tp",)))
    assert inst.state == state
    # The documented recovery: the caller tears the group down, then close_group.
    report = site.close_group("rid")
    assert report is not None and report.ok
    assert sorted(h.kind for h in report.released) == ["host_lock", "host_pages"]
    assert site.machine.stats.plans_run["release_aborted"] == 1
    with pytest.raises(ValueError, match=r"has no timed-out or failed abort \(it is "
                       r"'released'\); nothing was changed"):
        site.close_group("rid")
    r.finish()


def test_forget_drops_an_ended_prefetch_and_refuses_a_live_one() -> None:
    taken: list[torch.Tensor] = []
    site = PrefetchSite(HostPagePool(8), insert=lambda rid, pages: taken.append(pages))
    site.queue("r")
    site.start("r", 2)
    with pytest.raises(ValueError, match="no ended prefetch to forget"):
        site.forget("r")
    assert site.requests["r"].state == "active"  # refused: nothing changed
    site.transfer("r", 2)
    site.complete("r")
    site.forget("r")
    assert "r" not in site.requests
    with pytest.raises(ValueError, match="it is 'none'"):
        site.forget("r")
    site.host.free(taken[0])  # the cache's pages back to the pool
    site.assert_released()
    site.host.assert_full()
