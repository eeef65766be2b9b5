"""The compiled engine agrees with the `transitions` declaration it was built from, and
the batched step agrees with the scalar one."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from terminus.fsm import TransitionNotAllowed
from terminus.fsm.bench import bench_spec
from terminus.fsm.graph import shortest_routes
from terminus.fsm.oracle import Differential
from terminus.fsm.table import TRANSITION
from tests.lifecycle import EVENTS, LIFECYCLE, Abort, Chunk, Finish, Job, Start

# Declaration-only uses: the oracle counts plans but runs none, so their plans run empty.
BENCH = bench_spec().build().bind(partial=True)
LIFECYCLE = LIFECYCLE.bind(partial=True)

events = st.one_of(st.just(Start()), st.just(Finish()), st.just(Abort()),
                   st.builds(Chunk, last=st.booleans()))
steps = st.lists(st.tuples(events, st.integers(0, 2)), max_size=30)


@settings(max_examples=200, deadline=None)
@given(steps)
def test_random_event_sequences_agree_with_the_transitions_oracle(seq):
    job = Job(LIFECYCLE, "r")
    diff = Differential(job)
    for ev, in_flight in seq:
        job.in_flight = in_flight  # guards read it, in both engines
        diff.deliver(ev)
    assert diff.plans_match()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(BENCH.events), max_size=40))
def test_random_sequences_on_the_benchmark_machine_agree_with_the_oracle(seq):
    diff = Differential(BENCH.create())
    for cls in seq:
        diff.deliver(cls())
    assert diff.plans_match()


def shortest_paths(m):
    """For every (state, event, alt) transition, the shortest event path to take it,
    found by the engine's one graph traversal (`fsm.graph`) over the compiled cells."""

    def edges(s):
        for e, alts in enumerate(m.cells[s]):
            for k, a in enumerate(alts):
                if a.decision == TRANSITION:
                    yield (s, e, k), a.target

    routes = shortest_routes([m.initial], edges)
    return [[*routes[s], (s, e, k)] for s, row in enumerate(m.cells) if s in routes
            for e, alts in enumerate(row) for k, a in enumerate(alts)
            if a.decision == TRANSITION]


def arrange(job, m, s, e, k):
    """An event (and instance data) that takes alternative k of cell (s, e)."""
    cls = m.events[e]
    alt = m.cells[s][e][k]
    job.in_flight = 1 if alt.guard == "chunks_in_flight" else 0
    if cls is Chunk:
        return Chunk(last=alt.guard == "last_chunk")
    return cls()


def test_the_shortest_path_to_every_transition_agrees_with_the_oracle():
    paths = shortest_paths(LIFECYCLE)
    assert len(paths) == sum(1 for r in LIFECYCLE.cells for alts in r for a in alts
                             if a.decision == TRANSITION)
    for path in paths:
        job = Job(LIFECYCLE, "r")
        diff = Differential(job)
        for s, e, k in path:
            assert job.state_id == s
            diff.deliver(arrange(job, LIFECYCLE, s, e, k))
            assert job.state_id == LIFECYCLE.cells[s][e][k].target
        assert diff.plans_match()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40).flatmap(
    lambda n: st.lists(st.lists(st.integers(-1, len(BENCH.events) - 1), min_size=n,
                                max_size=n), max_size=12)))
def test_a_batched_step_agrees_with_scalar_instances(rounds):
    n = len(rounds[0]) if rounds else 1
    batch = BENCH.batch(n)
    scalars = [BENCH.create(i) for i in range(n)]
    for evs in rounds:
        ids = torch.tensor(evs, dtype=torch.int64)
        bad = [i for i, e in enumerate(evs)
               if e >= 0 and BENCH.tables.next[scalars[i].state_id][e] < 0]
        before = batch.states.clone()
        if bad:
            with pytest.raises(TransitionNotAllowed) as info:
                batch.step(ids)
            assert info.value.instance == bad[0]
            assert torch.equal(batch.states, before)
            continue
        was_terminal = [s.terminal for s in scalars]
        for s, e in zip(scalars, evs, strict=True):
            if e >= 0:
                s.fire(BENCH.events[e]())
        result = batch.step(ids)
        assert batch.states.tolist() == [s.state_id for s in scalars]
        newly = [i for i, s in enumerate(scalars) if s.terminal and not was_terminal[i]]
        assert result.terminal.tolist() == newly
        assert all(BENCH.plan_names[p] == "release" for p in result.plan_ids.tolist())


def test_a_batched_step_rejects_a_guarded_pair_and_names_the_instance():
    b = LIFECYCLE.batch(3)
    b.step(b.event_ids([Start, Start, None]))
    with pytest.raises(TransitionNotAllowed, match=r"\(instance 0\): event 'Chunk' is not "
                       r"allowed in state 'prefilling': the cell is guarded"):
        b.step(b.event_ids([Chunk, None, None]))
    with pytest.raises(IndexError, match="event id 9 at instance 2 is out of range"):
        b.step(torch.tensor([0, 0, 9]))
    assert b.states.tolist() == [1, 1, 0]


def test_a_sink_sees_a_batched_guarded_rejection_as_an_error_decision():
    records = []
    b = LIFECYCLE.batch(2)
    b.step(b.event_ids([Start, None]))
    LIFECYCLE.add_sink(records.append)
    try:
        with pytest.raises(TransitionNotAllowed, match="the cell is guarded"):
            b.step(b.event_ids([Chunk, None]))
    finally:
        LIFECYCLE.remove_sink(records.append)
    assert [(r.source, r.event, r.target, r.decision) for r in records] == [
        ("prefilling", "Chunk", "prefilling", "error")]


def test_a_batched_step_runs_one_batched_release_per_plan():
    from terminus.fsm import release_effect
    from terminus.kernels import TokenKVAllocator

    kv = TokenKVAllocator(64 * 8, strict=True)
    table = torch.stack([kv.alloc(64) for _ in range(8)])
    calls = []

    @release_effect
    def release_rows(ctx, idx):
        calls.append((ctx.plan, idx.tolist()))
        kv.free(table[idx].reshape(-1))

    from terminus.fsm.bench import Finish as Done
    from terminus.fsm.bench import Resume, Tick

    b = BENCH.batch(8, plans={"release": release_rows})
    b.step(b.event_ids([Resume] * 8))
    b.step(b.event_ids([Done if i % 2 else None for i in range(8)]))
    b.step(b.event_ids([Done if i % 2 == 0 else Tick for i in range(8)]))
    assert calls == [("release", [1, 3, 5, 7]), ("release", [0, 2, 4, 6])]
    assert b.count("finished") == 8
    assert BENCH.stats.plans_run["release"] >= 8
    kv.assert_full()


def test_batched_tables_have_one_column_per_event_plus_no_event_and_start_anew():
    b = LIFECYCLE.batch(2)
    assert b._packed.numel() == len(LIFECYCLE.states) * (len(EVENTS) + 2)
