"""Host synchronisations of a batched step, counted.

A quiet step (its event ids, told by `known=`, can neither end a row nor meet a guard)
reads nothing back; a step that can reads once, and each row that ended costs the reads
of its release, however many rows ended.

On CUDA every read of a tensor back to the host (and every op whose output size the
host must learn, such as `nonzero`) waits for the device. Every such call on a tensor is
counted here by wrapping torch's reading methods, so a read added anywhere in the step
shows up in the count, whichever module makes it.
"""

from __future__ import annotations

import pytest
import torch

from terminus.fsm import Plan, TransitionNotAllowed, observe, release_effect
from terminus.fsm.bench import Finish, Resume, Tick, Yield, bench_spec
from terminus.fsm.plan import Action

# Tensor methods that return host values or need the host to learn an output size.
READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero",
         "cpu", "numpy", "unique")


@pytest.fixture
def syncs(monkeypatch):
    """The reads made while the fixture is active, by method name. The coverage
    recorder (on in this suite) is detached: it counts decisions per cell, which costs
    reads of its own, and a serving loop runs without it."""
    previous = observe.set_recorder(None)
    counted: list[str] = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, _name=name, _original=original, **kwargs):
            counted.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapper)
    original_unique = torch.unique

    def unique(*args, **kwargs):
        counted.append("torch.unique")
        return original_unique(*args, **kwargs)

    monkeypatch.setattr(torch, "unique", unique)
    yield counted
    observe.set_recorder(previous)


@pytest.fixture
def batch():
    released: list[list[int]] = []

    @release_effect
    def release_rows(ctx):
        released.append(ctx.rows.tolist())

    m = bench_spec().build()
    b = m.batch(6, plans={"release": Plan(Action(release_rows))})
    running = torch.full((6,), m.event_id(Resume), dtype=torch.int64)
    b.step(running)
    return m, b, released


def ids(m, events):
    return torch.tensor([-1 if e is None else m.event_id(e) for e in events],
                        dtype=torch.int64)


def test_a_step_without_known_ids_reads_the_device_once_and_dispatches_no_plan(batch, syncs):
    m, b, released = batch
    quiet = ids(m, [Tick, Yield, None, Tick, Tick, None])
    syncs.clear()
    step = b.step(quiet)
    assert syncs == ["tolist"]  # the step's one min/max pair; no plan dispatch
    assert step.terminal.numel() == 0 and released == []


def known(m, *events):
    return {m.event_id(e) for e in events}


def test_a_quiet_step_told_its_event_ids_reads_nothing_back(batch, syncs):
    m, b, released = batch
    assert b.quiet_ids == known(m, Tick, Yield, Resume)  # Finish enters a terminal state
    syncs.clear()
    step = b.step(ids(m, [Tick, Yield, None, Tick, Tick, None]), known=known(m, Tick, Yield))
    step2 = b.step(torch.stack((ids(m, [Yield, Resume, None, None, None, None]),
                                ids(m, [Resume, Tick, None, None, None, None]))),
                   known=known(m, Yield, Resume, Tick))
    assert syncs == []  # two quiet steps, one of two rounds: no read at all
    assert step.terminal.numel() == 0 and step2.terminal.numel() == 0 and released == []
    assert b.unchecked == 2
    b.check()
    assert syncs == ["tolist"]  # check(): the sticky flag, once for both steps
    assert b.unchecked == 0
    assert [m.states[s] for s in b.states.tolist()] == [
        "running", "running", "running", "running", "running", "running"]


def test_a_step_with_terminal_rows_reads_as_many_times_with_known_ids_as_without(batch, syncs):
    m, b, released = batch
    b.step(ids(m, [Tick] * 6), known=known(m, Tick))  # quiet: its flag rides on the next read
    syncs.clear()
    step = b.step(ids(m, [Finish, Tick, None, None, Finish, None]), known=known(m, Finish, Tick))
    # min/max (and the quiet step's flag, in the same read); the terminal rows' indices;
    # the rows' plan ids; the plan's own effect reads ctx.rows.tolist().
    assert syncs == ["tolist", "nonzero", "tolist", "tolist"]
    assert step.terminal.tolist() == [0, 4] and released == [[0, 4]]
    assert b.unchecked == 0


def test_a_guarded_cell_is_read_back_at_once_and_refused(syncs):
    from tests.lifecycle import LIFECYCLE, Chunk, Start

    b = LIFECYCLE.batch(3)
    start, chunk = LIFECYCLE.event_id(Start), LIFECYCLE.event_id(Chunk)
    assert chunk not in b.quiet_ids and start in b.quiet_ids
    syncs.clear()
    b.step(torch.tensor([start, start, -1]), known={start})
    assert syncs == []
    with pytest.raises(TransitionNotAllowed, match="guarded"):
        b.step(torch.tensor([-1, chunk, -1]), known={chunk})
    # min/max; then the refused row (nonzero) and its state, event and cell (tolist).
    assert syncs == ["tolist", "nonzero", "tolist", "tolist"]
    assert [LIFECYCLE.states[s] for s in b.states.tolist()] == ["prefilling", "prefilling",
                                                                "queued"]


def test_an_error_in_a_quiet_step_refuses_it_on_the_device_and_raises_at_the_next_read(syncs):
    from tests.lifecycle import LIFECYCLE, Abort, Start

    b = LIFECYCLE.batch(3)
    start, abort = LIFECYCLE.event_id(Start), LIFECYCLE.event_id(Abort)
    b.step(torch.tensor([-1, -1, abort]))  # row 2 aborted: Start is an error there
    before = b.states.clone()
    syncs.clear()
    b.step(torch.tensor([start, -1, start]), known={start})  # refused, not read yet
    b.step(torch.tensor([-1, start, -1]), known={start})  # after a refusal: refused too
    assert syncs == []
    assert torch.equal(b.states, before)  # nothing changed, on the device
    with pytest.raises(TransitionNotAllowed, match=r"instance 2.*'Start'.*'aborted'.*"
                       r"quiet step.*1 quiet step\(s\) after it"):
        b.check()
    assert b.unchecked == 0
    b.step(torch.tensor([start, start, -1]), known={start})  # usable again
    b.check()
    assert [LIFECYCLE.states[s] for s in b.states.tolist()] == ["prefilling", "prefilling",
                                                                "aborted"]


def test_a_deferred_refusal_is_raised_by_the_next_step_that_reads_before_it_changes_anything(
        syncs):  # (detaches the coverage recorder: an observed step always reads)
    from tests.lifecycle import LIFECYCLE, Abort, Start

    b = LIFECYCLE.batch(2)
    start, abort = LIFECYCLE.event_id(Start), LIFECYCLE.event_id(Abort)
    b.step(torch.tensor([-1, abort]))
    b.step(torch.tensor([start, start]), known={start})  # row 1: an error, deferred
    with pytest.raises(TransitionNotAllowed, match="quiet step"):
        b.step(torch.tensor([abort, -1]))  # would release row 0: refused first
    assert [LIFECYCLE.states[s] for s in b.states.tolist()] == ["queued", "aborted"]


@pytest.mark.parametrize("bad", [99, -7])
def test_an_event_id_out_of_range_in_a_quiet_step_is_refused_as_a_loud_step_refuses_it(
        syncs, bad):
    from tests.lifecycle import LIFECYCLE, Start

    b = LIFECYCLE.batch(3)
    start = LIFECYCLE.event_id(Start)
    before = b.states.clone()
    syncs.clear()
    b.step(torch.tensor([start, bad, -1]), known={start})  # no read: refused on the device
    assert syncs == [] and b.unchecked == 1
    assert torch.equal(b.states, before)  # not clamped into some other event
    with pytest.raises(IndexError, match=rf"event id {bad} at instance 1 is out of range.*"
                       r"quiet step.*0 quiet step\(s\) after it"):
        b.check()
    with pytest.raises(IndexError, match=rf"event id {bad} at instance 1 is out of range"):
        b.step(torch.tensor([start, bad, -1]))  # the loud step's own refusal, the same
    assert torch.equal(b.states, before)


def test_recycle_after_a_refused_quiet_step_raises_that_refusal_and_recycles_nothing(syncs):
    from tests.lifecycle import LIFECYCLE, Abort, Start

    b = LIFECYCLE.batch(2)
    start, abort = LIFECYCLE.event_id(Start), LIFECYCLE.event_id(Abort)
    b.step(torch.tensor([abort, abort]))
    b.step(torch.tensor([start, -1]), known={start})  # row 0 aborted: refused, deferred
    with pytest.raises(TransitionNotAllowed, match="quiet step"):
        b.recycle(torch.tensor([0]))
    assert [LIFECYCLE.states[s] for s in b.states.tolist()] == ["aborted", "aborted"]
    b.recycle(torch.tensor([0]))  # the refusal reported: usable again
    assert [LIFECYCLE.states[s] for s in b.states.tolist()] == ["queued", "aborted"]


def test_a_step_with_terminal_rows_adds_their_indices_and_one_grouping_read(batch, syncs):
    m, b, released = batch
    loud = ids(m, [Finish, Tick, Finish, None, Finish, Tick])
    syncs.clear()
    step = b.step(loud)
    # min/max; the terminal rows' indices (nonzero); the group sizes by plan (tolist).
    # The plan's own effect reads ctx.rows.tolist() here, which is the caller's read.
    assert syncs == ["tolist", "nonzero", "tolist", "tolist"]
    assert step.terminal.tolist() == [0, 2, 4] and released == [[0, 2, 4]]


def test_a_batch_without_plans_reads_no_more_than_the_terminal_indices(syncs):
    m = bench_spec().build()
    b = m.batch(3)
    b.step(ids(m, [Resume, Resume, None]))
    syncs.clear()
    step = b.step(ids(m, [Finish, Tick, None]))
    assert syncs == ["tolist", "nonzero"]
    assert step.terminal.tolist() == [0]


def test_a_quiet_step_of_several_rounds_still_reads_the_device_once(batch, syncs):
    m, b, released = batch
    rounds = torch.stack((ids(m, [Tick, Yield, None, Tick, Tick, None]),
                          ids(m, [Yield, Resume, Tick, None, Tick, Yield])))
    syncs.clear()
    step = b.step(rounds)
    assert syncs == ["tolist"]  # one min/max read for every round together
    assert step.terminal.numel() == 0 and released == []
    assert [m.states[s] for s in b.states.tolist()] == [
        "waiting", "running", "running", "running", "running", "waiting"]


def test_rows_that_turn_terminal_in_different_rounds_cost_one_dispatch(batch, syncs):
    m, b, released = batch
    rounds = torch.stack((ids(m, [Finish, Tick, None, None, None, None]),
                          ids(m, [None, Finish, Tick, None, Finish, None])))
    syncs.clear()
    step = b.step(rounds)
    assert syncs == ["tolist", "nonzero", "tolist", "tolist"]
    assert step.terminal.tolist() == [0, 1, 4] and released == [[0, 1, 4]]


def test_a_scheduler_step_that_ends_no_row_reads_nothing_back_admission_included(syncs):
    from terminus.effects.sanitize import sanitizing
    from terminus.effects.sequence import RunningBatch, SchedulerPools
    from terminus.states.sequence import ChunkLaunched, Finish, LastChunkDone, Token

    pools = SchedulerPools(rows=4, max_context_len=64, kv_tokens=256, mamba_slots=4)
    rb = RunningBatch(pools)
    with sanitizing(False):  # the audit reads the pools after every call, by design
        rows = rb.admit(2, mamba=False, queued=True)
        assert rows is not None and rb.admitting.tolist() == rows.tolist()
        r = rows.tolist()
        assert rb.append_kv(rows, torch.tensor([4, 4]))
        rb.queue(r, ChunkLaunched)
        syncs.clear()
        rb.flush()  # reset + Admit, then ChunkLaunched: one quiet step
        assert syncs == [] and rb.batch.unchecked == 1
        rb.queue(r, LastChunkDone)  # could end a draining row: read back, once
        rb.flush()
        assert syncs == ["tolist"] and rb.batch.unchecked == 0
        assert rb.rows_in("decoding").tolist() == sorted(r)
        assert rb.append_kv(rows, torch.ones(2, dtype=torch.int64))
        rb.queue(r, Token)
        syncs.clear()
        rb.flush()
        assert syncs == []
        rb.queue(r[:1], Token)
        rb.queue(r[:1], Finish)
        rb.flush()
        # min/max; the terminal rows (nonzero); their plan ids; then the release plan's
        # own read (release_batch reading the few rows' slots, `ids.tolist()`).
        assert syncs == ["tolist", "nonzero", "tolist", "tolist"]
        assert rb.retired["finished"] == 1
        from terminus.states.sequence import SequenceAbort

        rb.fire(rows[1:], SequenceAbort)
    pools.assert_full()
