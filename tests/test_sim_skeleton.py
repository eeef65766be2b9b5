"""The simulator's skeleton keeps what it computes instead of re-reading it every step:
the scheduler counts a decoding row's tokens as the decode tick minus its start (its
first output and finish booked under their tick, its token ids appended when it
finishes), a chunk's size is a whole chunk or the sequence's `tail` (set once, when
seated), and the prefetch driver keeps which ranks run I/O. Each is checked here
against the per-row reference it replaced (kept in this file), also on runs whose
decode steps and prefetch starts are refused now and then (a short pool): the same
transitions, in the same order, the same outputs, the same prefix-cache figures and
no leak."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from terminus.effects.sim import naive as naive_mod
from terminus.effects.sim import serving
from terminus.effects.sim.naive import naive_parts
from terminus.effects.sim.serving import ServingLoop, SimConfig, SimPrefetch, SimScheduler
from terminus.effects.sim.workload import WorkloadConfig, _draw, _segment, generate
from terminus.states.sequence import ChunkDone, ChunkLaunched, Fail, Finish, LastChunkDone, Token


class ReferenceScheduler(SimScheduler):
    """The decode stage as it was: every step walks every decoding row, counts its
    token and appends its token id."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counts: dict[int, tuple[Any, int]] = {}  # id(seq) -> (seq: kept, tokens)

    def step(self) -> None:
        rb = self.running
        self._apply_aborts()
        self._admit()
        done, last, prefilled = [], [], []
        for seq in self.prefilling.values():
            if seq.in_flight:
                if seq.in_flight.popleft():
                    last.append(seq.row)
                    seq.decoding = not seq.aborted
                else:
                    done.append(seq.row)
                if not seq.in_flight and not seq.chunks_left:
                    prefilled.append(seq.row)
        for r in prefilled:
            del self.prefilling[r]
        rb.queue(done, ChunkDone)
        rb.queue(last, LastChunkDone)
        for _ in range(2):
            seqs = [seq for seq in self.prefilling.values()
                    if seq.chunks_left and not seq.aborted and len(seq.in_flight) < 2]
            if not seqs:
                break
            rows = [seq.row for seq in seqs]
            c = self.cfg.chunk_size
            sizes = [max(1, min(c, seq.prompt - (-(-seq.prompt // c) - seq.chunks_left) * c))
                     for seq in seqs]
            if not rb.append_kv(rows, sizes):
                break
            for seq in seqs:
                seq.chunks_left -= 1
                seq.in_flight.append(seq.chunks_left == 0)
            rb.queue(rows, ChunkLaunched)
        counts = self.counts
        decoding = sorted((seq for seq in self.by_row.values()
                           if seq.decoding and not seq.aborted), key=lambda s: s.row)
        if decoding:
            failing = [seq for seq in decoding
                       if seq.fail_status and counts.get(id(seq), (seq, 0))[1] >= seq.max_new // 2]
            if failing:
                for seq in failing:
                    seq.status = seq.fail_status
                    seq.decoding = False
                rb.queue([seq.row for seq in failing], Fail)
                decoding = [seq for seq in decoding if seq.decoding]
            rows = [seq.row for seq in decoding]
            if rows and rb.append_kv(rows, [1] * len(rows)):
                rb.queue(rows, Token)
                finished = []
                for seq in decoding:
                    g = counts.get(id(seq), (seq, 0))[1]
                    if seq.tokens is not None:
                        reply = seq.reply
                        if reply is None:
                            reply = seq.reply = self._reply(seq)
                        seq.tokens.append(reply[g] if g < len(reply) else 1)
                    g += 1
                    counts[id(seq)] = (seq, g)
                    if g == 1 and self.tokenizer is not None:
                        self.tokenizer.on_output(seq.rid)
                    if g >= seq.max_new:
                        finished.append(seq.row)
                        seq.decoding = False
                rb.queue(finished, Finish)
        rb.flush()


class ReferencePrefetch(SimPrefetch):
    """The prefetch driver as it was: every rank's state read every step."""

    def step(self, now: int) -> None:
        done = []
        for rid, (t0, pages) in self.live.items():
            finished = 0
            for s in self.sites:
                inst = s.requests[rid]
                if inst.state == "pending" and now >= t0 + s.rank:
                    s.start(rid, pages)
                elif inst.state == "active" and s.transfer(rid, 1) >= pages:
                    s.complete(rid)
                finished += inst.terminal
            if finished == len(self.sites):
                done.append(rid)
        for rid in done:
            del self.live[rid]
            self._waiting.pop(rid, None)
            for s in self.sites:
                s.forget(rid)
        if any(s.host.available < s.host.capacity // 4 for s in self.sites):
            self.evict()


class ReferenceNaiveScheduler(naive_mod.NaiveScheduler, ReferenceScheduler):
    """The naive baseline's scheduler over the reference decode stage."""


class ReferenceNaivePrefetch(naive_mod.NaivePrefetch, ReferencePrefetch):
    """The naive baseline's prefetch abort over the reference driver."""


def drive(monkeypatch: pytest.MonkeyPatch, workload: list[Any], *, reference: bool,
          naive: bool, refuse: bool) -> dict[str, Any]:
    """One run; what it did, in order, and its audit. With `refuse`, every third decode
    step's KV and every other prefetch start are refused as a short pool refuses them
    (nothing taken): the row takes no token that step, the rank stays pending."""
    calls = {"decode": 0, "start": 0, "refused": 0}
    append_kv, start = serving.RunningBatch.append_kv, serving.PrefetchSite.start

    def short_append(self: Any, rows: Any, counts: Any) -> bool:
        if list(counts) == [1] * len(counts):  # a decode step
            calls["decode"] += 1
            if calls["decode"] % 3 == 0:
                calls["refused"] += 1
                return False
        return append_kv(self, rows, counts)

    def short_start(self: Any, rid: Any, n: int) -> Any:
        calls["start"] += 1
        if calls["start"] % 2 == 0:
            calls["refused"] += 1
            return None
        return start(self, rid, n)

    with monkeypatch.context() as m:
        if reference:
            m.setattr(serving, "SimScheduler", ReferenceScheduler)
            m.setattr(serving, "SimPrefetch", ReferencePrefetch)
            m.setattr(naive_mod, "NaiveScheduler", ReferenceNaiveScheduler)
            m.setattr(naive_mod, "NaivePrefetch", ReferenceNaivePrefetch)
        if refuse:
            m.setattr(serving.RunningBatch, "append_kv", short_append)
            m.setattr(serving.PrefetchSite, "start", short_start)
        records: list[tuple[Any, ...]] = []

        def trace(r: Any) -> None:
            records.append((r.machine, r.instance, r.source, r.event, r.target,
                            r.decision, r.plan))

        loop = ServingLoop(workload, SimConfig(page_size=16),
                           parts=naive_parts if naive else serving.machine_parts,
                           trace=None if naive else trace)
        assert isinstance(loop.scheduler, ReferenceScheduler) == reference
        asyncio.run(loop.run())
    assert (calls["refused"] > 0) == refuse
    return {
        "records": records,
        "outputs": [(o.rid, o.outcome) for o in loop.sink.outputs],
        "steps": loop.steps,
        "peaks": loop.peaks(),
        "prefix_cache": loop.prefix_cache(),
        "retired": dict(loop.running.retired),
        "leaks": loop.leaks(),
    }


@pytest.mark.parametrize("naive", [False, True], ids=["machines", "naive"])
@pytest.mark.parametrize("refuse", [False, True], ids=["roomy", "short"])
def test_the_skeleton_does_what_the_per_row_reference_did(monkeypatch, refuse, naive):
    workload = generate(WorkloadConfig(requests=160, seed=4, abort_rate=0.3,
                                       fault_rate=0.25, n=3, prefetch_fraction=0.3))
    new = drive(monkeypatch, workload, reference=False, naive=naive, refuse=refuse)
    ref = drive(monkeypatch, workload, reference=True, naive=naive, refuse=refuse)
    assert new == ref
    assert new["outputs"] and new["retired"].get("finished", 0) > 0
    assert new["retired"].get("failed", 0) > 0  # the halfway failures happened
    if not naive:
        assert new["records"]
        assert new["leaks"] == dict.fromkeys(new["leaks"], 0)


def test_a_requests_own_segments_are_drawn_uncached_and_recurring_ones_kept():
    _segment.cache_clear()
    assert _segment("0/system/1", 9) == tuple(_draw("0/system/1", 9))
    assert _segment("0/system/1", 9) is _segment("0/system/1", 9)  # kept
    assert _segment.cache_info().hits == 2
    a, b = _draw("0/r5", 7), _draw("0/r5", 7)
    assert a == b and a is not b and len(a) == 7  # a new list each time
    assert all(1 <= t <= 32000 for t in a)
    assert _draw("0/r5", 0) == [] and _segment("0/r5", 0) == ()
