"""Host synchronisations of a batched step, counted.

On CUDA every read of a tensor back to the host (and every op whose output size the
host must learn, such as `nonzero`) waits for the device. Every such call on a tensor is
counted here by wrapping torch's reading methods, so a read added anywhere in the step
shows up in the count, whichever module makes it.
"""

from __future__ import annotations

import pytest
import torch

from terminus.fsm import Plan, observe, release_effect
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


def test_a_quiet_step_reads_the_device_once_and_dispatches_no_plan(batch, syncs):
    m, b, released = batch
    quiet = ids(m, [Tick, Yield, None, Tick, Tick, None])
    syncs.clear()
    step = b.step(quiet)
    assert syncs == ["tolist"]  # the step's one min/max pair; no plan dispatch
    assert step.terminal.numel() == 0 and released == []


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
