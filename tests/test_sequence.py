"""The scheduler's running batch: SEQUENCE rows stepped together, chunked overlapped
prefill, decode, and one batched release per plan per step over real pools."""

from __future__ import annotations

import re

import pytest
import torch

from terminus.effects.sequence import RunningBatch, SchedulerPools
from terminus.fsm import TransitionNotAllowed
from terminus.fsm.paths import complete, covering_paths
from terminus.kernels import release_batch
from terminus.states.sequence import (
    SEQUENCE,
    Admit,
    ChunkDone,
    ChunkLaunched,
    Fail,
    Finish,
    LastChunkDone,
    SequenceAbort,
    Token,
)


@pytest.fixture(params=[1, 16], ids=["page1", "page16"])
def pools(request):
    p = SchedulerPools(rows=8, max_context_len=64, kv_tokens=256, mamba_slots=8, strict=True,
                       page_size=request.param)
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
    rb.fire(rows, SequenceAbort)  # the abort echo after finish releases nothing
    assert len(log) == 2 and rb.retired == {"finished": 2, "aborted": 0, "failed": 0}


def test_an_abort_with_two_chunks_in_flight_releases_only_after_the_last_result(pools):
    log = []
    rb = RunningBatch(pools, retire_log(log))
    rows = rb.admit(1, mamba=True)
    prefill_chunk(rb, rows, 16)
    prefill_chunk(rb, rows, 16)
    rb.fire(rows, SequenceAbort)
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
    rb.fire(rows, SequenceAbort)


def test_a_live_row_cannot_be_recycled(pools):
    rb = RunningBatch(pools)
    rows = rb.admit(1, mamba=False)
    with pytest.raises(TransitionNotAllowed, match="only a terminal"):
        rb.batch.recycle(rows)
    rb.fire(rows, SequenceAbort)


def test_admission_is_all_or_nothing(pools):
    rb = RunningBatch(pools)
    assert rb.admit(9, mamba=False) is None
    assert pools.table.available == 8
    rows = rb.admit(8, mamba=True)
    assert rb.admit(1, mamba=False) is None
    assert not rb.append_kv(rows, torch.full((8,), 64))  # 512 > 256 tokens: nothing taken
    assert pools.kv.available == pools.kv.capacity
    rb.fire(rows, SequenceAbort)


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
    ev[rows[0]] = rb.event[SequenceAbort]
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
        rb.fire(vacant, SequenceAbort)
    assert pools.table.available == free_before
    rb.fire(rows, SequenceAbort)


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
    rb.fire(rows, SequenceAbort)
    assert sorted(log) == sorted((int(r), "aborted") for r in rows)


@pytest.mark.terminus_no_sanitize(
    "a deliberate stray free makes the strict pool refuse the batch's KV free; the rows "
    "keep their slots and lengths (findable, released again below), and the sanitizer "
    "rightly reports them at this fire as held by retired rows")
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
    # The strict pool refused the whole KV free, so the rows keep their slots and
    # lengths: the tokens they legitimately own are still listed there, not leaked with a
    # freed slot. Their owner releases them again past what the bug freed (with pages,
    # every token of row 0 on the page the bad free returned).
    assert pools.table.lengths[rows].tolist() == [4, 4]
    ps = pools.page_size
    skip = int((tokens[0] // ps == tokens[0][0] // ps).sum())
    release_batch(rows, pools.table, pools.kv, pools.mamba, kv_start=torch.tensor([skip, 0]))


def test_one_echo_that_raises_does_not_keep_the_other_retired_rows_silent(pools):
    from terminus.effects.sim.serving import SimConfig, SimScheduler
    from terminus.effects.sim.workload import RequestSpec
    from terminus.states.request import RequestKey

    heard = []

    class Tokenizer:  # stands in for TokenizerSide: only its two echo entry points
        def on_finish(self, rid, reason):
            heard.append((rid.rid, reason))
            if rid.rid == "r0":
                raise RuntimeError("r0's LoRA release underflowed")

        def on_error(self, rid, status, message):
            heard.append((rid.rid, status))

        def on_output(self, rid):
            pass

    def spec_of(key):
        return RequestSpec(key.group, "plain", 0, 4, 1, None, 1, None, None, mamba=False)

    sched = SimScheduler(RunningBatch(pools), SimConfig(chunk_size=64), spec_of)
    sched.tokenizer = Tokenizer()
    for rid in ("r0", "r1", "r2"):
        sched.send(RequestKey(rid), 4, None)
    with pytest.raises(Exception) as info:
        for _ in range(10):
            sched.step()
    assert "r0's LoRA release underflowed" in repr(info.value)
    assert sorted(heard) == [("r0", "length"), ("r1", "length"), ("r2", "length")]
    assert sched.idle


def pages_of(pools, row):
    return set((pools.table.tokens(int(row)) // pools.page_size).tolist())


@pytest.mark.parametrize("rows_counts, why", [
    ([30, -5], "negative token counts \\[-5\\] for rows"),
    ([70, 3], "would hold \\[72\\] tokens, past the table's max_context_len 64"),
], ids=["negative", "past_max_context_len"])
def test_append_kv_refuses_bad_counts_before_taking_any_kv(pools, rows_counts, why):
    rb = RunningBatch(pools)
    rows = rb.admit(2, mamba=False)
    assert rb.append_kv(rows, torch.tensor([2, 2]))
    kv_free, lengths = pools.kv.available, pools.table.lengths.clone()
    with pytest.raises(ValueError, match=why):
        rb.append_kv(rows, torch.tensor(rows_counts))
    assert pools.kv.available == kv_free  # nothing taken, nothing without an owner
    assert torch.equal(pools.table.lengths, lengths)
    with pytest.raises(ValueError, match="name a row more than once"):
        rb.append_kv(torch.cat((rows, rows[:1])), torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="2 rows but 1 counts"):
        rb.append_kv(rows, torch.tensor([1]))
    assert pools.kv.available == kv_free
    rb.fire(rows, SequenceAbort)


@pytest.mark.parametrize("rows", [2, 30], ids=["few_rows", "many_rows"])
@pytest.mark.parametrize("as_", ["lists", "tensors"])
def test_append_kv_refuses_a_row_that_holds_no_live_sequence(rows, as_):
    """A late append for a row whose sequence ended (its slot back in the table's free
    list), or for a row never admitted, is refused before anything is taken. Accepted,
    its KV went into a free slot, and the slot's next admission reset its length: the
    pages were lost for good. A row admitted queued (vacant in the batch until the next
    flush) already owns its resources and takes KV."""
    pools = SchedulerPools(rows=40, max_context_len=64, kv_tokens=4096, mamba_slots=4,
                           strict=True, page_size=4)
    rb = RunningBatch(pools)
    live = rb.admit(rows, mamba=False)
    queued = rb.admit(1, mamba=False, queued=True)
    assert int(rb.batch.states[queued[0]]) == SEQUENCE.state_id("vacant")  # not flushed
    assert rb.append_kv(queued.tolist(), [2])
    ended = rb.admit(1, mamba=False)
    rb.fire(ended, SequenceAbort)  # retired: its slot is free (flushing the queued one)
    taken = live.tolist() + queued.tolist() + ended.tolist()
    vacant = next(r for r in range(40) if r not in taken)

    def call(rs: list[int], counts: list[int]) -> bool:
        if as_ == "tensors":
            return rb.append_kv(torch.tensor(rs), torch.tensor(counts))
        return rb.append_kv(rs, counts)

    kv_free = pools.kv.available
    for bad in (int(ended[0]), vacant):
        for counts in (1, 3):  # a decode step (one each) and a prefill chunk
            rs = [*live.tolist(), bad]
            with pytest.raises(ValueError, match=rf"rows \[{bad}\] hold no live sequence"):
                call(rs, [counts] * len(rs))
            assert pools.kv.available == kv_free  # nothing taken
            assert int(pools.table.lengths[bad]) == 0
    assert call([*live.tolist(), int(queued[0])], [3] * (rows + 1))
    again = rb.admit(1, mamba=False)  # the ended row's slot, admitted anew
    assert call(again.tolist(), [2])
    rb.fire(torch.cat((live, queued, again)), SequenceAbort)
    pools.assert_full()


def test_each_request_has_pages_of_its_own_and_the_first_retirement_frees_only_its_own():
    pools = SchedulerPools(rows=4, max_context_len=64, kv_tokens=256, mamba_slots=4,
                           strict=True, page_size=16)
    log = []
    rb = RunningBatch(pools, retire_log(log))
    rows = rb.admit(3, mamba=False)
    prefill_chunk(rb, rows, 0)  # one launch for all three rows, of different sizes:
    assert rb.append_kv(rows, torch.tensor([5, 7, 9]))
    owned = [pages_of(pools, r) for r in rows]
    assert all(len(p) == 1 for p in owned) and len(set.union(*owned)) == 3
    rb.fire(rows, LastChunkDone)
    rb.fire(rows[:1], Finish)  # the first retirement frees row 0's page only
    assert pools.kv.available == pools.kv.capacity - 2 * 16
    assert all(pages_of(pools, r) == p for r, p in zip(rows[1:], owned[1:], strict=True))
    rb.fire(rows[1:], Finish)  # strict: a page freed twice would raise DoubleFree here
    assert [s for _, s in log] == ["finished"] * 3
    pools.assert_full()


def test_a_rows_partial_last_page_is_filled_before_a_new_page_is_taken():
    pools = SchedulerPools(rows=4, max_context_len=64, kv_tokens=256, mamba_slots=4,
                           strict=True, page_size=16)
    rb = RunningBatch(pools)
    rows = rb.admit(2, mamba=False)
    assert rb.append_kv(rows, torch.tensor([5, 16]))
    assert rb.append_kv(rows, torch.tensor([7, 1]))  # row 0 fits its page; row 1 does not
    assert [len(pages_of(pools, r)) for r in rows] == [1, 2]
    assert rb.append_kv(rows, torch.tensor([6, 0]))  # 12 + 6: 4 on its page, 2 on a new one
    t0 = pools.table.tokens(int(rows[0]))
    assert t0.numel() == 18 and torch.unique(t0).numel() == 18
    assert (t0[:16] // 16).unique().numel() == 1  # the first page is full
    assert t0[16] % 16 == 0 and t0[17] == t0[16] + 1  # then a new page, from its start
    for _ in range(14):  # decode one token a step: row 0 fills its second page first
        assert rb.append_kv(rows[:1], torch.ones(1, dtype=torch.int64))
    assert len(pages_of(pools, rows[0])) == 2
    assert pools.kv.available == pools.kv.capacity - 4 * 16
    rb.fire(rows, SequenceAbort)
    pools.assert_full()


def test_scheduler_pools_check_runs_each_audited_pools_own_check():
    from terminus.kernels import DoubleFree
    from tests import sglang_shapes as sg

    pools = SchedulerPools(rows=2, max_context_len=8, kv_tokens=16, mamba_slots=2)
    t = pools.kv.alloc(4)
    pools.kv.free(t[:2])
    pools.kv.free(t[:2])  # not strict: recorded on the device, not raised here
    with pytest.raises(DoubleFree, match=re.escape(f"double free of {sorted(t[:2].tolist())}")):
        pools.check()
    pools.kv.clear()
    pools.check()
    pools.assert_full()
    theirs = SchedulerPools(rows=2, max_context_len=8, mamba_slots=2,
                            kv=sg.TokenAllocator(16))
    assert theirs.unchecked() == ["kv"] and "kv_tokens" not in theirs.leaks()
    theirs.check()  # nothing it can check on an engine's pool
    theirs.assert_full()


def test_a_queued_admission_is_delivered_even_when_its_step_is_refused(pools):
    rb = RunningBatch(pools)
    old = rb.admit(1, mamba=False)
    new = rb.admit(2, mamba=True, queued=True)
    assert rb.rows_in("vacant").numel() == pools.table.capacity - 1  # not delivered yet
    vacant = [r for r in range(pools.table.capacity) if r not in old.tolist() + new.tolist()]
    rb.queue(vacant[:1], SequenceAbort)  # an error, read back at once (it could end a row)
    rb.queue(new.tolist(), ChunkLaunched)
    with pytest.raises(TransitionNotAllowed, match="'SequenceAbort' is not allowed in state "
                       "'vacant'"):
        rb.flush()
    # The step changed nothing but the admissions, delivered alone after the refusal:
    # the new rows own a slot and a Mamba state, and an abort can release them.
    assert sorted(rb.rows_in("prefill").tolist()) == sorted(old.tolist() + new.tolist())
    assert rb.admitting.numel() == 0
    rb.fire(torch.cat((old, new)), SequenceAbort)
    assert rb.retired["aborted"] == 3


@pytest.mark.parametrize("bad", [-1, 8])
def test_a_row_outside_the_batch_is_refused_when_queued_and_queues_nothing(pools, bad):
    rb = RunningBatch(pools)
    new = rb.admit(2, mamba=True, queued=True)
    with pytest.raises(IndexError, match=rf"queue: rows \[{bad}\] are outside the batch; "
                       r"rows are 0\.\.7"):
        rb.queue([new.tolist()[0], bad], SequenceAbort)
    # Nothing of the refused call was queued, and the admission queued before it is
    # still delivered: the rows own their slots and an abort releases them.
    rb.flush()
    rb.check()
    assert sorted(rb.rows_in("prefill").tolist()) == sorted(new.tolist())
    assert rb.admitting.numel() == 0
    rb.fire(new, SequenceAbort)
    assert rb.retired["aborted"] == 2


def test_numpy_rows_are_queued_as_ints_and_rows_that_are_not_ints_are_refused(pools):
    rb = RunningBatch(pools)
    new = rb.admit(2, mamba=True, queued=True)
    rows = new.numpy().copy()  # numpy ints: a recorder's step refused them at flush
    rb.queue(list(rows), SequenceAbort)
    rows[:] = 7  # the queue kept its own copy
    with pytest.raises(TypeError, match=r"queue: rows are row ints, as admit\(\) returns; "
                       r"got \['a'\]"):
        rb.queue(["a"], SequenceAbort)
    rb.flush()
    rb.check()
    assert rb.retired["aborted"] == 2


def test_the_rows_admit_returns_are_the_callers_the_batch_keeps_its_own(pools):
    rb = RunningBatch(pools)
    new = rb.admit(2, mamba=True, queued=True)
    rows = new.tolist()
    new.fill_(7)  # a caller reusing the tensor admit() returned, before the flush
    assert sorted(rb.admitting.tolist()) == sorted(rows)
    rb.flush()
    rb.check()
    assert sorted(rb.rows_in("prefill").tolist()) == sorted(rows)
    rb.fire(torch.tensor(rows), SequenceAbort)
    assert rb.retired["aborted"] == 2


def test_a_quiet_step_refused_on_the_device_still_admits_its_rows(pools, unobserved):
    rb = RunningBatch(pools)
    old = rb.admit(1, mamba=False)
    new = rb.admit(1, mamba=True, queued=True)
    rb.queue(old.tolist(), Token)  # quiet ids: the error is found at the next read
    rb.flush()
    assert rb.batch.unchecked == 1
    with pytest.raises(TransitionNotAllowed, match=r"'Token'.*'prefill'.*quiet step"):
        rb.check()
    assert sorted(rb.rows_in("prefill").tolist()) == sorted(old.tolist() + new.tolist())
    rb.fire(torch.cat((old, new)), SequenceAbort)
    assert rb.retired["aborted"] == 2
