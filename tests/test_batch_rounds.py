"""`Batch.step` of a (rounds, n) tensor: several events per row in one call, in order,
exactly as the same rounds stepped one call each (states, terminal rows, plans run),
refused as a whole."""

from __future__ import annotations

import random

import pytest
import torch

from terminus.fsm import Plan, TransitionNotAllowed, release_effect
from terminus.fsm.bench import Finish, Resume, Tick, Yield, bench_spec
from terminus.fsm.plan import Action
from terminus.states.sequence import SEQUENCE, Admit, ChunkDone, ChunkLaunched, Token

N = 7


def built(log):
    @release_effect
    def release_rows(ctx):
        log.append(sorted(ctx.rows.tolist()))

    m = bench_spec().build()
    return m, m.batch(N, plans={"release": Plan(Action(release_rows))})


@pytest.mark.parametrize("seed", range(24))
def test_rounds_in_one_call_end_where_one_call_per_round_ends(seed):
    rng = random.Random(seed)
    choices = [None, Tick, Yield, Resume, Resume, Finish]
    for _ in range(3):  # a few steps in a row on the same two batches
        one_log, many_log = [], []
        m, one = built(one_log)
        _, many = built(many_log)
        k = rng.randint(1, 4)
        rows = [[rng.choice(choices) for _ in range(N)] for _ in range(k)]
        events = torch.stack([one.event_ids(r) for r in rows])
        step = one.step(events)
        singles = [many.step(many.event_ids(r)) for r in rows]
        assert torch.equal(one.states, many.states)
        assert sorted(step.terminal.tolist()) == sorted(
            i for s in singles for i in s.terminal.tolist())
        assert sorted(r for rows in one_log for r in rows) == sorted(
            r for rows in many_log for r in rows)
        assert len(one_log) <= 1  # one plan call for every row that turned terminal
        assert (step.plan_ids == m.plan_names.index("release")).all()


def test_an_empty_round_tensor_changes_nothing_and_retires_no_one():
    log = []
    _, b = built(log)
    step = b.step(torch.empty((0, N), dtype=torch.int64))
    assert step.terminal.numel() == 0 and b.count("waiting") == N and log == []


def sequence_batch():
    log = []

    @release_effect
    def release_rows(ctx):
        log.append(ctx.rows.tolist())

    m = SEQUENCE
    plans = dict.fromkeys(m.plan_names, Plan(Action(release_rows)))
    return m, m.batch(3, plans=plans), log


def test_an_error_in_a_later_round_refuses_every_round_and_names_the_row_and_its_state():
    _, b, log = sequence_batch()
    b.step(b.event_ids([Admit, Admit, Admit]))
    before = b.states.clone()
    # Row 1 takes a chunk launch (prefill_1), then a token, which prefill_1 declares an
    # error; rows 0 and 2 would have moved on.
    rounds = torch.stack((b.event_ids([ChunkLaunched, ChunkLaunched, None]),
                          b.event_ids([ChunkDone, Token, ChunkLaunched])))
    with pytest.raises(TransitionNotAllowed, match=r"prefill_1.*Token|Token.*prefill_1") as info:
        b.step(rounds)
    assert info.value.instance == 1
    assert torch.equal(b.states, before) and log == []


def test_an_out_of_range_id_in_a_later_round_names_its_instance():
    _, b, log = sequence_batch()
    rounds = torch.tensor([[-1, -1, -1], [-1, 99, -1]], dtype=torch.int64)
    with pytest.raises(IndexError, match="event id 99 at instance 1"):
        b.step(rounds)
    assert b.count("vacant") == 3 and log == []


@pytest.mark.parametrize("shape", [(2, 2, 3), (2, 4), (2,)])
def test_a_round_tensor_of_the_wrong_shape_is_refused_naming_the_shape(shape):
    _, b, _ = sequence_batch()
    with pytest.raises(ValueError, match="rounds, 3"):
        b.step(torch.full(shape, -1, dtype=torch.int64))


def test_sinks_hear_each_rounds_transition_from_the_state_that_round_left():
    m, b, log = sequence_batch()
    heard = []
    m.add_sink(heard.append)
    try:
        b.step(torch.stack((b.event_ids([Admit, None, Admit]),
                            b.event_ids([ChunkLaunched, Admit, None]))))
    finally:
        m.remove_sink(heard.append)
    assert [(r.instance, r.source, r.event, r.target) for r in heard] == [
        (0, "vacant", "Admit", "prefill"), (2, "vacant", "Admit", "prefill"),
        (0, "prefill", "ChunkLaunched", "prefill_1"), (1, "vacant", "Admit", "prefill")]
    assert log == []
