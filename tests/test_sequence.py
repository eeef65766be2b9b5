"""The scheduler's running batch: SEQUENCE rows stepped together, chunked overlapped
prefill, decode, and one batched release per plan per step over real pools."""

from __future__ import annotations

import pytest
import torch

from terminus.effects.sequence import RunningBatch, SchedulerPools
from terminus.fsm import TransitionNotAllowed
from terminus.fsm.paths import complete, covering_paths
from terminus.states.sequence import (
    SEQUENCE,
    Abort,
    Admit,
    ChunkDone,
    ChunkLaunched,
    Fail,
    Finish,
    LastChunkDone,
    Token,
)


@pytest.fixture
def pools():
    p = SchedulerPools(rows=8, max_context_len=64, kv_tokens=256, mamba_slots=8, strict=True)
    yield p
    p.assert_full()


def retire_log(log):
    def on_retired(rows, state):
        log.extend((int(r), state) for r in rows)

    return on_retired


def prefill_chunk(rb, rows, tokens):
    """Launch one chunk of `tokens` for each row: its KV is taken at launch."""
    assert rb.append_kv(rows, torch.full((rows.numel(),), tokens))
    rb.fire(rows, ChunkLaunched)


def test_a_sequence_prefills_in_overlapped_chunks_decodes_and_releases_once(pools):
    log = []
    rb = RunningBatch(pools, retire_log(log))
    rows = rb.admit(2, mamba=True)
    prefill_chunk(rb, rows, 8)
    prefill_chunk(rb, rows, 8)  # overlapped with the first
    assert rb.rows_in("prefill_2").tolist() == rows.tolist()
    rb.fire(rows, ChunkDone)
    rb.fire(rows, LastChunkDone)
    for _ in range(3):
        assert rb.append_kv(rows, torch.ones(2, dtype=torch.int64))
        rb.fire(rows, Token)
    assert pools.table.lengths[rows].tolist() == [19, 19]
    step = rb.fire(rows, Finish)
    assert step.terminal.tolist() == rows.tolist()
    assert sorted(log) == sorted((int(r), "finished") for r in rows)
    assert rb.released_tokens == 38
    rb.fire(rows, Abort)  # the abort echo after finish releases nothing
    assert len(log) == 2 and rb.retired == {"finished": 2, "aborted": 0, "failed": 0}


def test_an_abort_with_two_chunks_in_flight_releases_only_after_the_last_result(pools):
    log = []
    rb = RunningBatch(pools, retire_log(log))
    rows = rb.admit(1, mamba=True)
    prefill_chunk(rb, rows, 16)
    prefill_chunk(rb, rows, 16)
    rb.fire(rows, Abort)
    assert rb.rows_in("draining_2").tolist() == rows.tolist()
    rb.fire(rows, ChunkDone)
    assert log == [] and pools.kv.available == pools.kv.capacity - 32  # I8: still waits
    rb.fire(rows, LastChunkDone)  # the abandoned final chunk: released, never cached
    assert log == [(int(rows[0]), "aborted")]
    rb.fire(rows, ChunkDone)  # a late duplicate result is absorbed
    assert len(log) == 1


def test_a_failure_with_nothing_in_flight_ends_failed(pools):
    log = []
    rb = RunningBatch(pools, retire_log(log))
    rows = rb.admit(3, mamba=False)
    rb.fire(rows[:1], Fail)
    prefill_chunk(rb, rows[1:], 4)
    rb.fire(rows[1:], Fail)  # chunks in flight: drain first
    assert log == [(int(rows[0]), "failed")]
    rb.fire(rows[1:], LastChunkDone)
    assert sorted(s for _, s in log) == ["aborted", "aborted", "failed"]


def test_a_declared_error_rejects_the_whole_step_and_changes_nothing(pools):
    rb = RunningBatch(pools)
    rows = rb.admit(2, mamba=False)
    before = rb.batch.states.clone()
    with pytest.raises(TransitionNotAllowed, match="event 'Token' is not allowed in state "
                       "'prefill'"):
        rb.fire(rows, Token)
    assert torch.equal(rb.batch.states, before)
    rb.fire(rows, Abort)


def test_a_live_row_cannot_be_recycled(pools):
    rb = RunningBatch(pools)
    rows = rb.admit(1, mamba=False)
    with pytest.raises(TransitionNotAllowed, match="only a terminal"):
        rb.batch.recycle(rows)
    rb.fire(rows, Abort)


def test_admission_is_all_or_nothing(pools):
    rb = RunningBatch(pools)
    assert rb.admit(9, mamba=False) is None
    assert pools.table.available == 8
    rows = rb.admit(8, mamba=True)
    assert rb.admit(1, mamba=False) is None
    assert not rb.append_kv(rows, torch.full((8,), 64))  # 512 > 256 tokens: nothing taken
    assert pools.kv.available == pools.kv.capacity
    rb.fire(rows, Abort)


def test_every_transition_and_pair_of_the_sequence_machine_on_a_real_batch(pools):
    """Drive each covering path (extended to a terminal state) on a one-row batch."""
    paths = [complete(SEQUENCE, p) for p in covering_paths(SEQUENCE)]
    for path in paths:
        log = []
        rb = RunningBatch(pools, retire_log(log))
        rows = None
        for step in path.steps:
            if step.source == "vacant":  # a row nobody admitted; admit() fires Admit
                if step.event is Admit:
                    rows = rb.admit(1, mamba=True)
                    assert rows is not None
                else:
                    with pytest.raises(TransitionNotAllowed, match="state 'vacant'"):
                        rb.fire(rb.rows_in("vacant")[:1], step.event)
                continue
            assert rows is not None
            assert rb.batch.states.tolist()[int(rows[0])] == SEQUENCE.state_id(step.source)
            if step.event is ChunkLaunched and step.decision == "transition":
                assert rb.append_kv(rows, torch.tensor([2]))
            if step.decision == "error":
                with pytest.raises(TransitionNotAllowed):
                    rb.fire(rows, step.event)
                continue
            rb.fire(rows, step.event)
        assert [s for _, s in log] == [path.final], str(path)
        pools.assert_full()


def test_a_failing_batched_plan_does_not_skip_the_other_plans_rows(pools):
    from terminus.fsm import ReleaseFailed

    def on_retired(rows, state):
        if state == "aborted":
            raise ConnectionError("client stream closed")

    rb = RunningBatch(pools, on_retired)
    rows = rb.admit(2, mamba=True)
    assert rb.append_kv(rows, torch.tensor([3, 3]))
    ev = torch.full((rb.batch.n,), -1, dtype=torch.int64)
    ev[rows[0]] = rb.event[Abort]
    ev[rows[1]] = rb.event[Fail]
    with pytest.raises(ReleaseFailed) as info:
        rb.step(ev)
    assert [type(e.error) for e in info.value.exceptions] == [ConnectionError]
    # Both rows went back: the aborted row's release ran before its stream failed,
    # and the failed row's plan still ran.
    assert rb.retired == {"finished": 0, "aborted": 1, "failed": 1}


def test_an_abort_aimed_at_a_vacant_row_is_an_error_and_frees_nothing(pools):
    rb = RunningBatch(pools)
    rows = rb.admit(1, mamba=False)
    vacant = torch.tensor([int(r) for r in range(pools.table.capacity)
                           if r != int(rows[0])][:1])
    free_before = pools.table.available
    with pytest.raises(TransitionNotAllowed, match="state 'vacant'"):
        rb.fire(vacant, Abort)
    assert pools.table.available == free_before
    rb.fire(rows, Abort)


def test_a_batch_given_some_plans_must_be_given_all_of_them():
    from terminus.fsm import release_effect

    @release_effect
    def noop(ctx, rows):
        pass

    with pytest.raises(KeyError, match="not for release_failed, release_finished"):
        SEQUENCE.batch(2, plans={"release_aborted": noop})


def test_admitted_rows_are_admitted_at_once_so_an_immediate_abort_releases_them(pools):
    log = []
    rb = RunningBatch(pools, retire_log(log))
    rows = rb.admit(2, mamba=True)
    assert rb.rows_in("prefill").tolist() == rows.tolist()
    assert rb.rows_in("vacant").numel() == 6
    rb.fire(rows, Abort)
    assert sorted(log) == sorted((int(r), "aborted") for r in rows)


@pytest.mark.terminus_no_sanitize(
    "a deliberate stray free; the sanitizer reports (at this fire) the 7 tokens the "
    "refused release_batch leaves with no owner: issue 13's release_batch item")
def test_a_refused_batched_release_still_tells_the_owner_which_rows_retired(pools):
    from terminus.fsm import ReleaseFailed
    from terminus.kernels import DoubleFree

    log = []
    rb = RunningBatch(pools, retire_log(log))
    rows = rb.admit(2, mamba=False)
    prefill_chunk(rb, rows, 4)
    rb.fire(rows, LastChunkDone)
    tokens = [pools.table.tokens(int(r)).clone() for r in rows]
    pools.kv.free(tokens[0][:1])  # a bug elsewhere freed one of row 0's tokens
    with pytest.raises(ReleaseFailed) as info:
        rb.fire(rows, Finish)
    assert isinstance(info.value.exceptions[0].error, DoubleFree)
    assert sorted(log) == sorted((int(r), "finished") for r in rows)
    assert rb.retired["finished"] == 2
    # The strict pool refused the whole KV free; the slots went back all the same.
    pools.kv.free(torch.cat((tokens[0][1:], tokens[1])))


def test_one_echo_that_raises_does_not_keep_the_other_retired_rows_silent(pools):
    from terminus.effects.sim.serving import SimConfig, SimScheduler
    from terminus.effects.sim.workload import RequestSpec

    heard = []

    class Tokenizer:  # stands in for TokenizerSide: only its two echo entry points
        def on_finish(self, rid, reason):
            heard.append((rid, reason))
            if rid == "r0":
                raise RuntimeError("r0's LoRA release underflowed")

        def on_error(self, rid, status, message):
            heard.append((rid, status))

        def on_output(self, rid):
            pass

    def spec_of(rid):
        return RequestSpec(rid, "plain", 0, 4, 1, None, 1, None, None, mamba=False)

    sched = SimScheduler(RunningBatch(pools), SimConfig(chunk_size=64), spec_of)
    sched.tokenizer = Tokenizer()
    for rid in ("r0", "r1", "r2"):
        sched.send(rid, 4, None)
    with pytest.raises(Exception) as info:
        for _ in range(10):
            sched.step()
    assert "r0's LoRA release underflowed" in repr(info.value)
    assert sorted(heard) == [("r0", "length"), ("r1", "length"), ("r2", "length")]
    assert sched.idle
