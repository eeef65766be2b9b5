"""One scheduler step delivers its rows' events in one `Batch.step`.

The reference scheduler (`effects.sim.serving.SimScheduler`) queues every event of a
step (aborts, chunk results, launches, tokens, finishes, failures) on its running batch
and delivers them together at the end of the step, several per row where a row takes
several (its last chunk's result, its first token and its finish). Admission is queued
too (`admit(queued=True)`: the rows' reset and `Admit` are the first round of the same
step), so a scheduler step is exactly one `Batch.step`. The counts here are of calls
into `Batch.step`, whatever the tensors' sizes.
"""

from __future__ import annotations

import pytest
import torch

from terminus.effects.sequence import RunningBatch, SchedulerPools
from terminus.effects.sim.serving import SimConfig, SimScheduler
from terminus.effects.sim.workload import RequestSpec
from terminus.states.request import RequestKey
from terminus.states.sequence import SequenceAbort


class Tokenizer:
    """The scheduler's echoes, by request id (stands in for TokenizerSide)."""

    def __init__(self):
        self.outputs: list[str] = []
        self.ends: dict[str, object] = {}

    def on_output(self, rid):
        self.outputs.append(rid.rid)

    def on_finish(self, rid, reason):
        assert rid.rid not in self.ends, f"{rid.rid} ended twice"
        self.ends[rid.rid] = reason

    def on_error(self, rid, status, message):
        assert rid.rid not in self.ends, f"{rid.rid} ended twice"
        self.ends[rid.rid] = status


# rid -> (prompt tokens, new tokens, fault, mamba)
WORK = {
    "short": (4, 1, None, False),        # last chunk, first token and finish in one step
    "long": (150, 3, None, True),        # three chunks, two in flight
    "fails": (10, 6, "scheduler_500", False),
    "aborted_early": (200, 4, None, True),
    "aborted_decoding": (8, 50, None, False),
    "queued": (8, 2, None, True),
}


def run(pools, *, aborts):
    """Drive WORK to the end; per step, the `Batch.step` calls made inside `admit()`
    and outside it, and the admissions."""
    specs = {rid: RequestSpec(rid, "plain", 0, p, n, None, 1, None, fault, mamba=mamba)
             for rid, (p, n, fault, mamba) in WORK.items()}
    rb = RunningBatch(pools)
    sched = SimScheduler(rb, SimConfig(chunk_size=64), lambda key: specs[key.group])
    tok = sched.tokenizer = Tokenizer()
    per_step: list[dict[str, int]] = []
    step, admit = rb.batch.step, rb.admit
    inside = [False]

    def counted_step(events, **kwargs):
        per_step[-1]["admit_steps" if inside[0] else "event_steps"] += 1
        return step(events, **kwargs)

    def counted_admit(n, mamba, prompts=None, **kwargs):
        inside[0] = True
        try:
            rows = admit(n, mamba, prompts, **kwargs)
        finally:
            inside[0] = False
        per_step[-1]["admissions"] += rows is not None
        return rows

    rb.batch.step, rb.admit = counted_step, counted_admit
    for rid in WORK:
        sched.send(RequestKey(rid), WORK[rid][0], None)
    now = 0
    while not sched.idle:
        for rid in aborts.get(now, ()):
            sched.abort(RequestKey(rid))
        per_step.append({"admit_steps": 0, "event_steps": 0, "admissions": 0})
        sched.step()
        now += 1
        assert now < 100, "the scheduler did not drain"
    return per_step, tok


@pytest.fixture
def pools():
    # Two rows: admission waits for retirements, so rows are reused.
    p = SchedulerPools(rows=3, max_context_len=256, kv_tokens=1024, mamba_slots=2,
                       strict=True, page_size=16)
    yield p
    p.assert_full()


def test_each_scheduler_step_delivers_its_events_in_one_batch_step(pools):
    per_step, tok = run(pools, aborts={2: ["aborted_early"], 8: ["aborted_decoding"]})
    assert sum(s["admissions"] for s in per_step) >= 4  # rows are reused
    assert max(s["admissions"] for s in per_step) >= 2  # Mamba and no-Mamba runs
    for s in per_step:
        # Every event, Admit included, in one call; admit() itself steps nothing.
        assert s["event_steps"] == 1
        assert s["admit_steps"] == 0
    assert tok.ends == {"short": "length", "long": "length", "fails": 500,
                        "aborted_early": "abort", "aborted_decoding": "abort",
                        "queued": "length"}
    assert sorted(tok.outputs) == ["aborted_decoding", "fails", "long", "queued", "short"]


def test_rows_taking_several_events_in_a_step_end_as_one_call_per_event_would(pools):
    # "short" takes its last chunk's result, its only token and its finish in one
    # step; "long" is aborted with two chunks in flight and drains them first.
    per_step, tok = run(pools, aborts={1: ["long"]})
    assert all(s["event_steps"] == 1 for s in per_step)
    assert tok.ends["long"] == "abort" and tok.ends["short"] == "length"
    assert "long" not in tok.outputs


def test_append_kv_with_empty_rows_between_full_ones_writes_each_rows_own_tokens(pools):
    rb = RunningBatch(pools)
    rows = rb.admit(3, False)
    assert rows is not None
    assert rb.append_kv(rows, torch.tensor([0, 5, 0]))
    assert rb.append_kv(rows, torch.tensor([3, 0, 2]))
    lengths = [int(pools.table.lengths[int(r)]) for r in rows]
    assert lengths == [3, 5, 2]
    held = [pools.table.tokens(int(r)) for r in rows]
    everything = torch.cat(held)
    assert everything.unique().numel() == everything.numel()  # no token given twice
    assert pools.in_use()["kv"] >= 10
    rb.fire(rows, SequenceAbort)
    assert rb.retired["aborted"] == 3
