"""Model-based paths (fsm.paths) and driving instances along them (fsm.testing)."""

from __future__ import annotations

from typing import Any

import pytest
from machines import JOB, Abort, Job, Poke, Progress

from terminus.fsm import Ledger, Plan, Release, release_effect
from terminus.fsm import observe as obs
from terminus.fsm.coverage import CoverageRecorder
from terminus.fsm.paths import complete, covering_paths, pair_paths, to_terminal, transition_paths
from terminus.fsm.spec import TRANSITION
from terminus.fsm.testing import drive_machine, drive_paths
from terminus.kernels.kv import TokenKVAllocator


def _edges(m: Any) -> set[tuple[str, str, int]]:
    return {(m.states[s], m.event_names[e], k) for s, row in enumerate(m.cells)
            for e, alts in enumerate(row) for k, a in enumerate(alts)
            if a.decision == TRANSITION}


def _assert_connected(m: Any, steps: Any) -> None:
    state = m.states[m.initial]
    for st in steps:
        assert st.source == state
        state = st.target


def test_transition_paths_reach_every_declared_transition_by_its_shortest_route() -> None:
    paths = transition_paths(JOB)
    assert {p.goal for p in paths} == _edges(JOB)
    assert len(paths) == len(_edges(JOB)) == 8
    for p in paths:
        _assert_connected(JOB, p.steps)
        last = p.steps[-1]
        assert (last.source, last.event.__name__, last.alt) == p.goal
    by_goal = {p.goal: p for p in paths}
    assert len(by_goal[("queued", "Abort", 0)].steps) == 1
    deep = by_goal[("draining", "Progress", 0)]
    assert [str(s) for s in deep.steps] == [
        "queued --Start--> running",
        "running --Abort [in_flight]--> draining",
        "draining --Progress [last] / release_aborted--> aborted",
    ]


def test_pair_paths_end_with_the_declared_decision_of_every_cell() -> None:
    paths = pair_paths(JOB)
    assert len(paths) == len(JOB.states) * len(JOB.events)
    decisions = {(p.goal[0], p.goal[1]): p.steps[-1].decision for p in paths}
    assert decisions[("queued", "Progress")] == "error"
    assert decisions[("queued", "Poke")] == "ignore"
    assert decisions[("draining", "Progress")] == "ignore"  # its IGNORE fallback
    assert decisions[("running", "Poke")] == "transition"  # all-guarded: first alt
    assert decisions[("aborted", "Start")] == "error"
    for p in paths:
        _assert_connected(JOB, p.steps[:-1])


def test_covering_paths_cover_everything_and_none_is_a_prefix_of_another() -> None:
    paths = covering_paths(JOB)
    taken = {(s.source, s.event.__name__, s.alt) for p in paths for s in p.steps
             if s.decision == "transition"}
    pairs = {(s.source, s.event.__name__) for p in paths for s in p.steps}
    assert taken == _edges(JOB)
    assert pairs == {(st, ev) for st in JOB.states for ev in JOB.event_names}
    for p in paths:
        for q in paths:
            if p is not q:
                assert q.steps[:len(p.steps)] != p.steps


def test_complete_extends_a_path_to_the_nearest_terminal_state() -> None:
    p = next(p for p in transition_paths(JOB) if p.goal == ("running", "Abort", 0))
    assert p.final == "draining"
    done = complete(JOB, p)
    assert done.steps[:len(p.steps)] == p.steps
    assert JOB.terminal[JOB.state_id(done.final)]
    assert [str(s) for s in to_terminal(JOB, "draining")] == [
        "draining --Progress [last] / release_aborted--> aborted"]
    assert to_terminal(JOB, "done") == ()


class _Rig:
    """JOB bound to a real KV pool through a ledger; each instance owns 4 slots."""

    def __init__(self) -> None:
        self.pool = TokenKVAllocator(64)

        @release_effect
        def free_kv(ctx: Any, handle: Any) -> None:
            self.pool.free(handle.value)

        self.ledger = Ledger({"kv": free_kv})
        self.bound = JOB.bind({"release_done": Plan(Release("kv")),
                               "release_aborted": Plan(Release("kv"))}, self.ledger)

    def make(self) -> Job:
        job = Job(self.bound, key="j")
        slots = self.pool.alloc(4)
        assert slots is not None
        self.ledger.acquire(job, "kv", slots)
        return job


def arrange_job(job: Any, step: Any) -> Any:
    """Make step.alt the alternative taken: `last` and `in_flight` follow step.guard."""
    if step.event is Progress:
        return Progress(last=step.guard == "last")
    if step.event in (Abort, Poke):
        job.in_flight = 1 if step.guard == "in_flight" else 0
    return step.event()


def test_driving_every_covering_path_releases_everything_each_instance_owned() -> None:
    rig = _Rig()
    summary = drive_machine(rig.bound, rig.make, arrange_job)
    assert summary.ok
    assert summary.paths == len(covering_paths(JOB)) == summary.terminal_paths
    assert summary.released == summary.paths  # one KV handle per instance
    rig.pool.assert_full()
    rig.ledger.assert_empty()


def test_a_wrong_arrange_is_reported_with_the_alternative_taken_and_the_fix() -> None:
    rig = _Rig()

    def careless(job: Any, step: Any) -> Any:
        return Progress(last=True) if step.event is Progress else step.event()

    with pytest.raises(AssertionError, match=r"took alternative 1, not alternative 0; make "
                                             r"arrange\(\) make guard 'in_flight' hold"):
        drive_machine(rig.bound, rig.make, careless)
    summary = drive_machine(rig.bound, rig.make, careless, check=False)
    assert not summary.ok
    assert any("raised machine 'job'" in f and "no guard held" in f for f in summary.failures)
    # A failed path leaves its instance where it stopped: finish those by hand.
    for job in list(rig.ledger.outstanding()):
        job.in_flight = 0
        job.fire(Abort())
        if not job.terminal:
            job.fire(Progress(last=True))
    rig.pool.assert_full()
    rig.ledger.assert_empty()


def test_arrange_must_return_the_steps_event_class() -> None:
    rig = _Rig()
    summary = drive_paths(transition_paths(JOB)[:1], rig.make, lambda j, s: Abort(),
                          check=False)
    assert summary.failures and "it must return a Start event" in summary.failures[0]
    for job in list(rig.ledger.outstanding()):
        job.fire(Abort())
    rig.pool.assert_full()
    rig.ledger.assert_empty()


def test_driving_passes_every_decision_on_to_the_attached_recorder() -> None:
    rec = CoverageRecorder()
    prev = obs.set_recorder(rec)
    try:
        rig = _Rig()
        drive_machine(rig.bound, rig.make, arrange_job)
        assert obs.recorder() is rec
    finally:
        obs.set_recorder(prev)
    report = rec.report(fail_under=100)
    job = report.machines["job"]
    assert (job.transitions.covered, job.transitions.declared) == (8, 8)
    assert (job.pairs.covered, job.pairs.declared) == (20, 20)
    assert job.terminals.reached == ["done", "aborted"]
    assert report.passed
    rig.pool.assert_full()
    rig.ledger.assert_empty()
