"""Many disaggregated-prefill requests under random interleavings of chunk launches and
results, aborts, bootstrap failures and transport faults: after every step the ledger
owns exactly what the pools handed out; at the end every pool is full and every request
streamed exactly one terminal output."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from terminus.effects.disagg import DisaggPools, DisaggPrefill
from terminus.effects.sim.transport import STEPS, FakeTransport
from terminus.fsm import TransitionNotAllowed

RIDS = [f"r{i}" for i in range(6)]
STATS: Counter[str] = Counter()  # what the walks reached, for the summary test below


class DisaggWorld(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.t = FakeTransport()
        self.now = 0.0  # the clock of the sender deadline, moved by the `wait` rule
        # Small pools so that shortages happen too.
        self.e = DisaggPrefill(DisaggPools.make(kv_tokens=40, requests=4, mamba_slots=6,
                                                metadata_slots=3, host_pages=6),
                               transport=self.t, mamba_per_request=1,
                               sender_deadline_s=10.0, clock=lambda: self.now)
        self.in_flight: dict[str, list[int]] = {}

    def live(self):
        return [r for r in self.e.requests.values() if not r.terminal]

    @precondition(lambda self: len(self.e.requests) < len(RIDS))
    @rule(prompt=st.integers(1, 12), chunk=st.integers(2, 5), host=st.integers(0, 2))
    def add(self, prompt, chunk, host):
        rid = RIDS[len(self.e.requests)]
        self.e.add(rid, prompt, chunk_size=chunk, host_pages=host)
        self.in_flight[rid] = []

    @precondition(lambda self: self.e.requests)
    @rule(i=st.integers(0, 5))
    def bootstrap(self, i):
        self.e.bootstrap(self._rid(i))

    @precondition(lambda self: self.e.requests)
    @rule(i=st.integers(0, 5))
    def retry(self, i):
        self.e.retry_bootstrap(self._rid(i))

    @precondition(lambda self: self.e.requests)
    @rule(i=st.integers(0, 5))
    def schedule(self, i):
        rid = self._rid(i)
        c = self.e.schedule(rid)
        if c is not None:
            self.in_flight[rid].append(c.index)

    @precondition(lambda self: any(self.in_flight.values()))
    @rule(i=st.integers(0, 5))
    def result(self, i):
        rids = [r for r, ks in self.in_flight.items() if ks]
        rid = rids[i % len(rids)]
        self.e.result(rid, self.in_flight[rid].pop(0))

    @precondition(lambda self: self.e.requests)
    @rule(i=st.integers(0, 5), k=st.integers(0, 3))
    def stale_result(self, i, k):
        rid = self._rid(i)
        req = self.e.req(rid)
        if req.terminal or (k < len(req.chunks) and req.chunks[k].terminal):
            self.e.result(rid, k)  # delayed or duplicate: must reach no effect

    @precondition(lambda self: self.e.requests)
    @rule(i=st.integers(0, 5), roll=st.integers(0, 2))
    def abort(self, i, roll):
        if roll == 0:  # rarer than progress, so requests also get far before they end
            self.e.abort(self._rid(i))

    @precondition(lambda self: self.e.requests)
    @rule(i=st.integers(0, 5), roll=st.integers(0, 3))
    def bootstrap_failed(self, i, roll):
        rid = self._rid(i)
        req = self.e.req(rid)
        if roll == 0 and (req.terminal or req.state != "transferring"):
            self.e.bootstrap_failed(rid)
        elif roll == 0:  # declared an error there: refused, and it changes nothing
            with pytest.raises(TransitionNotAllowed):
                self.e.bootstrap_failed(rid)
            assert req.state == "transferring" and req.reason == ""

    @rule(seconds=st.sampled_from([1.0, 6.0, 12.0]))
    def wait(self, seconds):
        """Time passes (sender deadlines may expire at the next poll)."""
        self.now += seconds

    @precondition(lambda self: self.e.requests)
    @rule(i=st.integers(0, 5), outcome=st.sampled_from(["complete", "break", "poll"]))
    def transfer(self, i, outcome):
        rid = self._rid(i)
        if outcome == "complete":
            self.t.complete(rid)
        elif outcome == "break":
            self.t.break_transfer(rid)
        self.e.poll_transfer(rid)

    @precondition(lambda self: self.e.requests)
    @rule(i=st.integers(0, 5), data=st.data())
    def progress(self, i, data):
        """The natural next happening of one request (weights the walk toward progress)."""
        rid = self._rid(i)
        req = self.e.req(rid)
        if req.state == "bootstrapping":
            self.e.bootstrap(rid)
        elif req.state == "transferring":  # the transfer ends, either way, or is aborted
            how = data.draw(st.sampled_from(["complete", "break", "abort"]))
            if how == "complete":
                self.t.complete(rid)
            elif how == "break":
                self.t.break_transfer(rid)
            else:
                self.e.abort(rid)  # aborted while the sender reads the KV
            self.e.poll_transfer(rid)
        elif req.state == "awaiting_sender":
            self.e.poll_transfer(rid)
        elif self.in_flight[rid] and data.draw(st.booleans()):
            self.e.result(rid, self.in_flight[rid].pop(0))
        else:
            self.schedule(i)

    progress_more = progress

    @rule(step=st.sampled_from(STEPS), i=st.integers(0, 5), times=st.sampled_from([1, None]))
    def fault(self, step, i, times):
        self.t.fail(step, RIDS[i], times)

    @rule(roll=st.integers(0, 3))
    def every_sender_abort_fails(self, roll):
        if roll == 0:
            self.t.fail("abort")

    @rule()
    def heal(self):
        self.t.heal()

    def _rid(self, i):
        rids = list(self.e.requests)
        return rids[i % len(rids)]

    @invariant()
    def ledger_matches_pools(self):
        self.e.assert_accounted()

    @invariant()
    def terminal_requests_streamed_once_others_never(self):
        for rid, req in self.e.requests.items():
            assert self.e.sink.counts[rid] == (1 if req.terminal else 0)
            if req.terminal:
                assert self.e.cache.inserts[rid] == (1 if req.state == "succeeded" else 0)

    def teardown(self):
        STATS.update(self.e.requests_machine.stats.plans_run)
        STATS["abandoned"] += self.e.chunks_machine.stats.plans_run["release_abandoned"]
        self.t.heal()
        for rid in self.e.requests:
            self.e.abort(rid)
        self.now += 1e6  # a sender that never confirms: its deadline passes
        for rid in self.e.requests:
            self.e.poll_transfer(rid)
        for rid, ks in self.in_flight.items():
            for k in ks:
                self.e.result(rid, k)
        for rid, req in self.e.requests.items():
            assert req.terminal, (rid, req.state)
            assert self.e.sink.counts[rid] == 1
        self.e.finish()


DisaggWorld.TestCase.settings = settings(max_examples=150, stateful_step_count=50, derandomize=True,
                                         deadline=None)
TestDisaggWorld = DisaggWorld.TestCase


def test_the_walks_reach_drains_successes_and_every_terminal_plan():
    # Runs after TestDisaggWorld in file order; alone, it runs the walks itself.
    if not STATS:
        TestDisaggWorld("runTest").runTest()
    for plan in ("release_aborted", "release_aborted_transfer", "release_bootstrap_failed",
                 "release_failed", "release_succeeded", "abandoned"):
        assert STATS[plan] > 0, (plan, dict(STATS))
