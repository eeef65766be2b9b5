"""The disaggregated-prefill request over real pools: aborts racing chunk results,
bootstrap failures, a failing sender, success. Every test ends with every pool full and
the ledger empty (`engine.finish()`); these machines hold no LoRA references."""

from __future__ import annotations

import numpy as np
import pytest

from terminus.effects.disagg import DisaggPools, DisaggPrefill
from terminus.effects.output import TerminalOutput
from terminus.effects.sim.transport import FakeTransport
from terminus.effects.transport import Poll, TransportError
from terminus.fsm import TransitionNotAllowed
from terminus.fsm.oracle import Differential
from terminus.states.chunk import Abandon, Commit, Result
from terminus.states.disagg import (
    DISAGG_PREFILL,
    BootstrapFailed,
    Bootstrapped,
    BootstrapRetry,
    ChunkScheduled,
    ChunkSettled,
    ChunkSettledLast,
    ChunkSettledNotLast,
    DisaggAbort,
    SenderAborted,
    SenderDeadline,
    TransferDone,
    TransferFailed,
)


class Clock:
    """A clock the test moves by hand (no timed assertions)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def engine(**kw):
    t = FakeTransport()
    return DisaggPrefill(DisaggPools.make(), transport=t, **kw), t


def started(e, rid="r", prompt=12, chunk=4, host_pages=3, chunks=1):
    """A request bootstrapped (metadata slot taken) with `chunks` chunks launched."""
    req = e.add(rid, prompt, chunk_size=chunk, host_pages=host_pages)
    e.bootstrap(rid)
    for _ in range(chunks):
        assert e.schedule(rid) is not None
    return req


def plans(e, name):
    return e.requests_machine.stats.plans_run[name]


def test_abort_while_a_middle_chunk_runs_releases_once_when_its_result_arrives():
    e, t = engine()
    req = started(e, chunks=1)  # chunk 0 of 3 runs, nothing after it
    assert e.abort("r") is None
    assert req.state == "draining"
    e.assert_accounted()
    assert e.pools.kv.available < e.pools.kv.capacity  # nothing released yet
    report = e.result("r", 0)
    assert report is not None and report.plan == "release_aborted"
    assert req.state == "aborted"
    assert req.chunks[0].state == "abandoned"
    assert plans(e, "release_aborted") == 1
    assert t.aborts["r"] == 1
    assert e.sink.outputs == [TerminalOutput("r", "aborted", message="aborted")]
    assert e.cache.inserts["r"] == 0
    e.finish()


def test_abort_with_a_later_overlapped_chunk_waits_for_it_then_releases_once():
    e, t = engine()
    req = started(e, chunks=2)
    assert [c.state for c in req.chunks] == ["overlapped", "running"]
    e.abort("r")
    assert e.result("r", 0) is None  # the later chunk still writes: no release (I8)
    assert req.state == "draining"
    assert plans(e, "release_aborted") == 0
    assert e.sink.counts["r"] == 0
    e.assert_accounted()
    report = e.result("r", 1)
    assert report is not None and report.plan == "release_aborted"
    assert plans(e, "release_aborted") == 1
    assert e.chunks_machine.stats.plans_run["release_abandoned"] == 2
    assert e.sink.counts["r"] == 1 and t.aborts["r"] == 1
    e.finish()


def test_aborted_final_chunk_is_released_without_cache_insert_or_send():
    e, t = engine()
    req = started(e, chunks=3)
    for k in (0, 1):
        e.result("r", k)
    assert req.state == "prefilling"
    slot = e.ledger.owned(req, "metadata")[0].value
    assert slot.index >= 0
    e.abort("r", "client gone")
    report = e.result("r", 2)
    assert report is not None and report.plan == "release_aborted"
    assert req.state == "aborted"
    assert e.cache.inserts["r"] == 0
    assert t.sends["r"] == 0
    assert t.aborts["r"] == 1
    assert slot.index == -1
    assert e.pools.host.prefetch_occupied == 0  # hierarchical-cache state released
    assert [h.kind for h in report.released].count("hicache") == 1
    assert e.sink.outputs == [TerminalOutput("r", "aborted", message="client gone")]
    e.finish()


@pytest.mark.parametrize("cause", ["bootstrap_failed", "retired"])
def test_a_delayed_result_after_cleanup_releases_nothing_and_streams_nothing(cause):
    e, t = engine()
    req = started(e, prompt=8, chunks=1)
    e.result("r", 0)  # chunk 0 committed; no chunk in flight
    if cause == "bootstrap_failed":
        e.bootstrap_failed("r", "decode side gone")
        assert req.state == "bootstrap_failed"
    else:
        e.schedule("r")
        e.result("r", 1)
        t.complete("r")
        e.poll_transfer("r")
        assert req.state == "succeeded"
    released, streamed, aborts = e.ledger.released, len(e.sink.outputs), t.aborts["r"]
    ignored = sum(e.requests_machine.stats.ignored.values())
    for k in (0, 1, 5):  # duplicates of settled chunks, and a chunk never scheduled
        assert e.result("r", k) is None
    assert e.ledger.released == released
    assert len(e.sink.outputs) == streamed == 1
    assert t.aborts["r"] == aborts == 0
    stale = sum(1 for k in (0, 1, 5) if k >= len(req.chunks))
    assert sum(e.requests_machine.stats.ignored.values()) == ignored + stale
    e.finish()


def test_a_failing_sender_abort_skips_no_local_release_and_the_abort_streams_once():
    e, t = engine()
    t.fail("abort")
    req = started(e, chunks=2)
    e.result("r", 0)
    e.abort("r")
    report = e.result("r", 1)
    assert report is not None
    assert len(report.errors) == 1 and report.errors[0].best_effort
    assert isinstance(report.errors[0].error, TransportError)
    assert sorted({h.kind for h in report.released}) == ["hicache", "kv", "mamba", "metadata",
                                                        "req_slot"]
    assert req.state == "aborted"
    assert e.sink.outputs == [TerminalOutput("r", "aborted", message="aborted")]
    assert e.ledger.errors == report.errors
    e.finish()


def test_bootstrap_failure_before_the_metadata_slot_releases_the_host_state():
    e, t = engine()
    t.fail("bootstrap", "r")
    req = e.add("r", 8, chunk_size=4, host_pages=2)
    report = e.bootstrap("r")
    assert req.state == "bootstrap_failed"
    assert report is not None and [h.kind for h in report.released] == ["hicache"]
    assert e.pools.metadata.available == e.pools.metadata.capacity
    assert e.sink.counts["r"] == 1 and t.aborts["r"] == 0
    e.finish()


def test_bootstrap_failure_after_the_metadata_slot_frees_it_to_minus_one():
    e, t = engine()
    t.fail("init", "r")
    req = e.add("r", 8, chunk_size=4, host_pages=2)
    report = e.bootstrap("r")
    assert req.state == "bootstrap_failed"
    assert report is not None
    meta = [h.value for h in report.released if h.kind == "metadata"]
    assert len(meta) == 1 and meta[0].index == -1
    assert e.sink.outputs[0].outcome == "bootstrap_failed"
    e.finish()


def test_abort_is_terminal_before_an_optimistic_bootstrap_retry():
    e, t = engine()
    req = e.add("r", 8, chunk_size=4)
    assert e.retry_bootstrap("r")  # a transient failure: the retry is queued
    assert req.state == "bootstrapping"
    e.abort("r")
    assert req.state == "aborted"
    calls = list(t.calls)
    assert not e.retry_bootstrap("r")
    assert e.bootstrap("r") is None
    assert req.state == "aborted" and t.calls == calls  # no handshake after the abort
    assert e.pools.metadata.available == e.pools.metadata.capacity
    assert e.sink.counts["r"] == 1
    e.finish()


@pytest.mark.parametrize("event", [DisaggAbort("x"), BootstrapFailed("y")])
def test_the_same_terminal_event_twice_releases_once(event):
    e, _ = engine()
    req = started(e, chunks=1)
    e.result("r", 0)
    first = req.fire(event)
    assert first is not None
    assert req.fire(event) is None
    assert e.requests_machine.stats.ignored[(req.state, type(event).__name__)] == 1
    assert sum(e.requests_machine.stats.plans_run.values()) == 1
    assert e.sink.counts["r"] == 1
    e.finish()


def test_success_caches_the_kv_once_transfers_it_and_frees_the_metadata():
    e, t = engine()
    req = started(e, prompt=10, chunk=4, chunks=2)
    e.result("r", 0)
    e.schedule("r")
    e.result("r", 1)
    e.result("r", 2)
    assert req.state == "transferring"
    assert t.sends["r"] == 1 and t.sent_tokens["r"] == 10
    slot = e.ledger.owned(req, "metadata")[0].value
    assert e.poll_transfer("r") is None  # still transferring
    t.complete("r")
    report = e.poll_transfer("r")
    assert report is not None and report.plan == "release_succeeded"
    assert req.state == "succeeded"
    assert e.cache.inserts == {"r": 1} and e.cache.held_tokens == 10
    assert slot.index == -1
    assert t.aborts["r"] == 0
    assert e.sink.outputs == [TerminalOutput("r", "succeeded")]
    e.finish()


def test_a_failed_transfer_releases_everything_without_caching():
    e, t = engine()
    req = started(e, prompt=4, chunks=1)
    e.result("r", 0)
    t.break_transfer("r")
    report = e.poll_transfer("r")
    assert report is not None and report.plan == "release_failed"
    assert req.state == "failed" and e.cache.inserts["r"] == 0
    e.finish()


def test_a_send_that_cannot_start_fails_the_request():
    e, t = engine()
    t.fail("send")
    req = started(e, prompt=4, chunks=1)
    report = e.result("r", 0)
    assert report is not None and report.plan == "release_failed"
    assert req.state == "failed" and e.sink.counts["r"] == 1
    e.finish()


def kv_ids(e, owner):
    return {int(i) for h in e.ledger.owned(owner, "kv") for i in h.value.tolist()}


@pytest.mark.parametrize("confirm", ["aborted", "done", "failed", "deadline"])
def test_abort_during_the_transfer_keeps_the_kv_until_the_sender_confirms(confirm):
    clock = Clock()
    e, t = engine(clock=clock, sender_deadline_s=5.0)
    if confirm == "deadline":
        t.fail("abort", "r")  # the notice is lost: the sender may read until the deadline
    req = started(e, prompt=8, chunks=2)
    e.result("r", 0)
    e.result("r", 1)
    assert req.state == "transferring"
    sent = kv_ids(e, req)
    assert e.abort("r", "client gone") is None
    assert req.state == "awaiting_sender" and t.aborts["r"] == 1
    assert kv_ids(e, req) == sent  # the sender may still read these pages (I10)
    e.assert_accounted()
    # The next request is not handed a page the sender may still read.
    started(e, "n", prompt=8, chunks=1)
    assert not kv_ids(e, e.req("n").chunks[0]) & sent
    assert e.abort("r", "second cause") is None  # absorbed, and changes nothing
    assert e.bootstrap_failed("r", "late") is None
    if confirm == "deadline":
        assert len(e.errors) == 1 and isinstance(e.errors[0], TransportError)
        clock.now += 4.9
        assert e.poll_transfer("r") is None and req.state == "awaiting_sender"
        clock.now += 0.1
    elif confirm == "done":
        t.complete("r")
    elif confirm == "failed":
        t.break_transfer("r")
    else:
        assert t.poll("r") is Poll.ABORTED
    assert e.sink.counts["r"] == 0 and kv_ids(e, req) == sent
    report = e.poll_transfer("r")
    assert report is not None and report.plan == "release_aborted_transfer" and report.ok
    assert req.state == "aborted" and e.cache.inserts["r"] == 0
    assert t.aborts["r"] == 1  # told once, when the wait began
    assert e.sink.outputs == [TerminalOutput("r", "aborted", message="client gone")]
    assert e.poll_transfer("r") is None
    e.abort("n")
    e.result("n", 0)
    e.finish()


def test_an_abandoned_middle_chunk_keeps_its_pages_until_the_drain_ends():
    e, _ = engine()
    req = started(e, prompt=12, chunks=2)  # chunk 1 overlaps chunk 0 and attends over it
    first = kv_ids(e, req.chunks[0])
    e.abort("r", "client gone")
    assert e.result("r", 0) is None
    assert req.chunks[0].state == "abandoned" and req.chunks[1].state == "running"
    assert kv_ids(e, req) == first  # the request holds them now; nothing went back
    e.assert_accounted()
    # The next request is not handed a page chunk 1 still reads.
    started(e, "n", prompt=4, chunks=1)
    assert not kv_ids(e, e.req("n").chunks[0]) & first
    report = e.result("r", 1)
    assert report is not None and report.plan == "release_aborted"
    assert first <= {int(i) for h in report.released if h.kind == "kv"
                     for i in h.value.tolist()}
    assert e.chunks_machine.stats.plans_run["release_abandoned"] == 2
    e.abort("n")
    e.result("n", 0)
    e.finish()


def test_a_refused_bootstrap_failure_changes_nothing_not_even_the_reason():
    e, _ = engine()
    req = started(e, prompt=4, chunks=1)
    e.result("r", 0)
    assert req.state == "transferring"
    with pytest.raises(TransitionNotAllowed, match="'BootstrapFailed' is not allowed in "
                       "state 'transferring'"):
        e.bootstrap_failed("r", "a late handshake failure")
    assert req.state == "transferring" and req.reason == ""
    e.abort("r", "client gone")
    e.poll_transfer("r")
    assert e.sink.outputs == [TerminalOutput("r", "aborted", message="client gone")]
    e.finish()


def _succeed(e, t):
    started(e, prompt=4, chunks=1)
    e.result("r", 0)
    t.complete("r")
    return e.poll_transfer("r")


def _fail_transfer(e, t):
    started(e, prompt=4, chunks=1)
    e.result("r", 0)
    t.break_transfer("r")
    return e.poll_transfer("r")


def _abort_drain(e, t):
    started(e, chunks=1)
    e.abort("r")
    return e.result("r", 0)


def _abort_transfer(e, t):
    started(e, prompt=4, chunks=1)
    e.result("r", 0)
    e.abort("r")
    return e.poll_transfer("r")


TERMINAL_PATHS = {
    "release_succeeded": _succeed,
    "release_failed": _fail_transfer,
    "release_aborted": _abort_drain,
    "release_aborted_transfer": _abort_transfer,
    "release_bootstrap_failed": lambda e, t: (e.add("r", 8, chunk_size=4, host_pages=2),
                                              e.bootstrap("r"), e.bootstrap_failed("r"))[2],
}


@pytest.mark.parametrize("plan", list(TERMINAL_PATHS))
def test_a_failing_client_stream_is_recorded_and_skips_no_release(plan):
    e, t = engine()
    e.sink.failing.add("r")
    report = TERMINAL_PATHS[plan](e, t)
    assert report is not None and report.plan == plan
    assert [(er.step, er.best_effort, type(er.error)) for er in report.errors] == [
        ("stream_terminal", True, ConnectionError)]
    assert "client stream of 'r' is closed" in str(report.errors[0])
    assert e.sink.counts["r"] == 1  # tried once, never retried by a later event
    assert e.ledger.count() == 0  # every handle went back although the stream raised
    e.abort("r")
    assert e.sink.counts["r"] == 1
    if plan == "release_succeeded":
        assert e.cache.inserts["r"] == 1
    e.finish()


def test_bootstrap_failure_while_a_chunk_runs_drains_first():
    e, _ = engine()
    req = started(e, chunks=1)
    assert e.bootstrap_failed("r", "peer lost") is None
    assert req.state == "draining"
    assert e.abort("r") is None  # a second cause is absorbed
    e.result("r", 0)
    assert req.state == "aborted"
    assert e.sink.outputs == [TerminalOutput("r", "aborted", message="peer lost")]
    e.finish()


def test_a_short_pool_takes_nothing_and_the_request_waits():
    pools = DisaggPools.make(kv_tokens=6)
    e = DisaggPrefill(pools, transport=FakeTransport())
    started(e, "a", prompt=4, chunk=4, chunks=1)
    req = e.add("b", 8, chunk_size=4)
    e.bootstrap("b")
    def free():
        return {k: getattr(pools, k).available for k in ("kv", "mamba", "table", "host")}

    before = free()
    assert e.schedule("b") is None  # 2 KV slots left for a 4-token chunk
    assert free() == before  # nothing taken from any pool
    e.assert_accounted()
    assert req.state == "waiting"
    e.abort("a")
    e.result("a", 0)
    e.abort("b")
    e.finish()


def test_metadata_exhaustion_keeps_the_request_bootstrapping():
    e = DisaggPrefill(DisaggPools.make(metadata_slots=1), transport=FakeTransport())
    started(e, "a", chunks=0)
    req = e.add("b", 4, chunk_size=4)
    assert e.bootstrap("b") is None and req.state == "bootstrapping"
    e.abort("a")
    e.bootstrap("b")
    assert req.state == "waiting"
    e.abort("b")
    e.finish()


def test_bad_input_names_what_was_wrong():
    e, _ = engine()
    with pytest.raises(ValueError, match=r"prompt_len \(0\) and chunk_size \(4\) must be >= 1"):
        e.add("r", 0, chunk_size=4)
    e.add("r", 4, chunk_size=4)
    with pytest.raises(ValueError, match="request 'r' already exists"):
        e.add("r", 4, chunk_size=4)
    with pytest.raises(ValueError, match="request 'long': prompt_len 5000 exceeds the "
                       "request table's max_context_len 4096"):
        e.add("long", 5000, chunk_size=4)  # refused before anything is taken
    with pytest.raises(KeyError, match="no disaggregated-prefill request 'x'; add\\(\\) it"):
        e.abort("x")
    with pytest.raises(ValueError, match="request 'r' has no chunk 0 in flight"):
        e.result("r", 0)
    with pytest.raises(ValueError, match="unknown step 'nope'"):
        FakeTransport().fail("nope")
    with pytest.raises(TransitionNotAllowed, match="'TransferDone' is not allowed in state "
                       "'bootstrapping'"):
        e.req("r").fire(TransferDone())
    e.abort("r")
    e.finish()


# -- every declared (state, event) pair and transition, against the transitions oracle --


def _to_succeeded(e, t):
    started(e, prompt=4, chunks=1)
    e.result("r", 0)
    t.complete("r")
    e.poll_transfer("r")


def _to_failed(e, t):
    started(e, prompt=4, chunks=1)
    e.result("r", 0)
    t.break_transfer("r")
    e.poll_transfer("r")


# Each builder leaves request "r" in a state; variants make each guard hold or not.
BUILDERS = {
    "bootstrapping": lambda e, t: e.add("r", 12, chunk_size=4, host_pages=2),
    "waiting": lambda e, t: started(e, chunks=0),
    "prefilling_busy": lambda e, t: started(e, chunks=1),
    "prefilling_idle": lambda e, t: (started(e, chunks=1), e.result("r", 0)),
    "draining_one": lambda e, t: (started(e, chunks=1), e.abort("r")),
    "draining_two": lambda e, t: (started(e, chunks=2), e.abort("r")),
    "transferring": lambda e, t: (started(e, prompt=4, chunks=1), e.result("r", 0)),
    "awaiting_sender": lambda e, t: (started(e, prompt=4, chunks=1), e.result("r", 0),
                                     e.abort("r")),
    "succeeded": _to_succeeded,
    "failed": _to_failed,
    "aborted": lambda e, t: (started(e, chunks=0), e.abort("r")),
    "bootstrap_failed": lambda e, t: (e.add("r", 8, chunk_size=4), e.bootstrap_failed("r")),
}

EVENTS = {
    "Bootstrapped": lambda req: Bootstrapped(),
    "BootstrapRetry": lambda req: BootstrapRetry(),
    "BootstrapFailed": lambda req: BootstrapFailed("x"),
    "ChunkScheduled": lambda req: ChunkScheduled(len(req.chunks)),
    "ChunkSettled(last)": lambda req: ChunkSettled(0, last=True),
    "ChunkSettled": lambda req: ChunkSettled(0),
    "ChunkSettledLast": lambda req: ChunkSettledLast(0),
    "ChunkSettledNotLast": lambda req: ChunkSettledNotLast(0),
    "DisaggAbort": lambda req: DisaggAbort("x"),
    "TransferDone": lambda req: TransferDone(),
    "TransferFailed": lambda req: TransferFailed("x"),
    "SenderAborted": lambda req: SenderAborted(),
    "SenderDeadline": lambda req: SenderDeadline(),
}


def _settle_first_in_flight(e, req):
    """What the loop does before telling a request a chunk settled."""
    for c in req.chunks:
        if not c.terminal:
            c.fire(Result())
            if req.state == "prefilling":
                for h in e.ledger.owned(c, "kv"):
                    e.ledger.transfer(h, req)
                c.fire(Commit())
            else:
                c.fire(Abandon())
            return


def _cleanup(e, t):
    req = e.req("r")
    if not req.terminal:
        e.abort("r")
    if req.state == "awaiting_sender":
        e.poll_transfer("r")  # the sender confirms the abort it was told of
    for c in req.chunks:
        if not c.terminal:
            e.result("r", c.index)
    assert req.terminal
    e.finish()
    assert e.sink.counts["r"] == 1


@pytest.mark.parametrize("event", list(EVENTS))
@pytest.mark.parametrize("where", list(BUILDERS))
def test_every_pair_decides_as_the_transitions_oracle_and_ends_with_pools_full(where, event):
    e, t = engine()
    BUILDERS[where](e, t)
    req = e.req("r")
    assert req.state == _state_of(where)  # the builder really stands there
    ev = EVENTS[event](req)
    settled = (ChunkSettled, ChunkSettledLast, ChunkSettledNotLast)
    if isinstance(ev, settled) and req.state in ("prefilling", "draining"):
        _settle_first_in_flight(e, req)
    diff = Differential(req)
    diff.model.state = req.state  # start the oracle where the instance stands
    decision = diff.deliver(ev)
    if decision == "error":
        e.assert_accounted()
    _cleanup(e, t)


def _state_of(where):
    return where.split("_")[0] if where.startswith(("prefilling", "draining")) else where


def test_the_builders_stand_in_every_state_of_the_machine():
    reached = set()
    for where, build in BUILDERS.items():
        e, t = engine()
        build(e, t)
        reached.add(e.req("r").state)
        assert e.req("r").state == _state_of(where), where
        _cleanup(e, t)
    assert reached == set(DISAGG_PREFILL.states)


def test_an_abort_while_a_reader_holds_a_prefetched_page_frees_it_at_the_unlock():
    e, _ = engine()
    req = started(e, chunks=1)
    prefetch = e.ledger.owned(req, "hicache")[0].value
    prefetch.advance(2)
    reader = prefetch.pages[:1]
    e.pools.host.lock(reader)  # e.g. a cache lookup still copying the page
    e.abort("r", "client gone")
    report = e.result("r", 0)
    assert report is not None and report.ok and req.state == "aborted"
    assert e.pools.host.prefetch_occupied == 0 and e.pools.host.occupied == 1
    e.pools.host.unlock(reader)
    e.finish()


def test_a_final_result_before_an_earlier_ones_is_refused_and_changes_nothing():
    e, t = engine()
    req = started(e, prompt=8, chunks=2)  # both chunks of the prompt in flight
    with pytest.raises(ValueError, match=r"chunk 1 of request 'r' arrived before that of "
                                         r"chunk\(s\) \[0\]; deliver chunk results in"):
        e.result("r", 1)
    assert req.state == "prefilling" and not req.chunks[1].terminal and t.sends["r"] == 0
    e.result("r", 0)
    e.result("r", 1)
    assert req.state == "transferring" and t.sends["r"] == 1
    e.abort("r", "done with it")
    e.poll_transfer("r")  # the sender confirms it stopped reading the KV
    e.finish()


def test_an_early_result_names_every_earlier_chunk_still_in_flight():
    e, t = engine()
    req = started(e, prompt=12, chunks=3)  # chunks 0, 1 and 2 of the prompt launched
    for k, early in ((2, "0, 1"), (1, "0")):
        with pytest.raises(ValueError, match=rf"chunk {k} of request 'r' arrived before "
                                             rf"that of chunk\(s\) \[{early}\];"):
            e.result("r", k)
    e.result("r", 0)
    with pytest.raises(ValueError, match=r"arrived before that of chunk\(s\) \[1\];"):
        e.result("r", 2)  # chunk 0 settled: only chunk 1 is early now
    assert [c.terminal for c in req.chunks] == [True, False, False] and t.sends["r"] == 0
    e.result("r", 1)
    e.result("r", 2)
    assert req.state == "transferring" and t.sends["r"] == 1
    e.abort("r", "done with it")
    e.poll_transfer("r")  # the sender confirms it stopped reading the KV
    e.finish()


def test_forget_drops_an_ended_request_and_refuses_a_live_one():
    e, _ = engine()
    started(e, "r", prompt=8, chunk=4, chunks=1)
    with pytest.raises(ValueError, match=r"cannot be forgotten: it is prefilling with "
                                         r"chunk\(s\) \[0\] not settled"):
        e.forget("r")
    assert "r" in e.requests  # refused: nothing changed
    e.abort("r")  # drains: chunk 0 still runs
    with pytest.raises(ValueError, match="draining"):
        e.forget("r")
    e.result("r", 0)
    assert e.req("r").state == "aborted"
    e.forget("r")
    assert "r" not in e.requests
    with pytest.raises(KeyError, match="no disaggregated-prefill request 'r'"):
        e.abort("r")  # a late event for a forgotten id: an unknown id
    e.finish()


def cached_prompt() -> DisaggPrefill:
    """An engine whose request "a" (tokens 0..7, one chunk) succeeded: its KV is cached."""
    t = FakeTransport()
    e = DisaggPrefill(DisaggPools.make(kv_tokens=64), transport=t)
    e.add("a", 8, chunk_size=8, tokens=tuple(range(8)))
    e.bootstrap("a")
    e.schedule("a")
    e.result("a", 0)
    t.complete("a")
    e.poll_transfer("a")
    assert e.req("a").state == "succeeded"
    return e


def test_accounting_holds_while_a_request_locks_a_cached_prefix():
    e = cached_prompt()
    e.add("b", 8, chunk_size=8, tokens=tuple(range(8)))
    assert e.req("b").cached == 7  # b owns a lock of the cached prefix
    e.assert_accounted()  # the lock is not pool units (it raised AttributeError)
    e.abort("b")
    e.assert_accounted()
    e.cache.evict_all()
    e.pools.assert_full()
    e.ledger.assert_empty()


def test_a_schedule_refused_by_the_table_frees_its_chunks_pages_and_a_retry_sends_the_prompt():
    from terminus.effects.callsites import FaultPlan, call_sites, proxy
    from terminus.effects.prefix_cache import PrefixCache

    plan = FaultPlan(strict=False)
    real = DisaggPools.make(kv_tokens=64, requests=4, mamba_slots=4, metadata_slots=4,
                            host_pages=8, max_context_len=32)
    pools = DisaggPools(kv=real.kv, mamba=real.mamba, metadata=real.metadata,
                        host=real.host, table=proxy(real.table, "table", plan))
    t, sent = FakeTransport(), {}
    send = t.send

    def recording_send(rid, kv):
        send(rid, kv)
        sent[rid] = kv.tolist()

    t.send = recording_send
    cache = PrefixCache(real.kv)
    e = DisaggPrefill(pools, transport=t, cache=cache)
    e.add("a", 8, chunk_size=4, tokens=tuple(range(8)))
    e.bootstrap("a")
    plan.arm(next(s for s in call_sites() if (s.resource, s.method) == ("table", "write")))
    free_before = real.kv.available_size()
    with pytest.raises(RuntimeError):
        e.schedule("a")
    # The never-launched chunk's pages are free again, not the request's.
    assert e.ledger.owned(e.req("a"), "kv") == []
    assert real.kv.available_size() == free_before
    c0, c1 = e.schedule("a"), e.schedule("a")
    pages = [h.value.tolist() for c in (c0, c1) for h in e.ledger.owned(c, "kv")]
    e.result("a", 0)
    e.result("a", 1)
    assert sent["a"] == pages[0] + pages[1]  # the prompt's 8 tokens, nothing stale first
    t.complete("a")
    e.poll_transfer("a")
    assert e.req("a").state == "succeeded"
    assert cache.match(tuple(range(8))).indices.tolist() == sent["a"]
    cache.evict_all()
    real.assert_full()
    e.ledger.assert_empty()


def test_a_later_chunk_short_of_kv_takes_nothing_and_schedules_once_pages_are_back():
    # A later chunk takes only its KV: the allocator's None is its check.
    pools = DisaggPools.make(kv_tokens=12)
    e = DisaggPrefill(pools, transport=FakeTransport())
    req = started(e, "a", prompt=8, chunk=4, chunks=1)
    started(e, "b", prompt=4, chunk=4, chunks=1)
    started(e, "c", prompt=4, chunk=4, chunks=0)
    assert e.schedule("c") is not None  # the pool's last 4 slots
    before = {k: getattr(pools, k).available for k in ("kv", "mamba", "table", "host")}
    assert e.schedule("a") is None  # chunk 1 of "a": no KV left
    assert {k: getattr(pools, k).available for k in ("kv", "mamba", "table", "host")} == before
    assert len(req.chunks) == 1 and req.state == "prefilling"
    e.assert_accounted()
    e.abort("b")
    e.result("b", 0)  # b's pages go back
    assert e.schedule("a") is not None and len(req.chunks) == 2
    for rid, k in (("a", 0), ("a", 1), ("c", 0)):
        e.result(rid, k)
    for rid in ("a", "c"):
        e.transport.complete(rid)
        e.poll_transfer(rid)
    assert [e.req(r).state for r in "abc"] == ["succeeded", "aborted", "succeeded"]
    e.finish()


def _row(table, row):
    return table.tokens(row).tolist()


@pytest.mark.parametrize("cached", [None, 3], ids=["as-add-sets-it", "moved-by-hand"])
def test_the_first_chunk_writes_its_row_as_two_writes_of_prefix_and_chunk_would(cached):
    """The matched prefix and the first chunk's KV: one write of both where the prefix
    ends at the chunk's start (what `add` sets), else the two writes; either way the row
    and its length are those of writing the prefix at 0, then the chunk at its start."""
    from terminus.kernels.req_table import ReqToTokenTable

    e = cached_prompt()
    req = e.add("b", 8, chunk_size=4, tokens=tuple(range(8)))
    assert req.cached == 7 and req.matched is not None and req.matched.numel() == 7
    if cached is not None:
        req.set_cached(cached)  # the prefix no longer ends where the chunk starts
    e.bootstrap("b")
    chunk = e.schedule("b")
    assert chunk is not None
    (h,) = e.ledger.owned(chunk, "kv")
    ref = ReqToTokenTable(1, 32)
    ref.write(0, 0, req.matched)
    ref.write(0, req.cached, h.value)
    assert _row(e.pools.table, req.row) == _row(ref, 0)
    assert int(e.pools.table.lengths[req.row]) == req.cached + int(h.value.numel())
    e.abort("b")
    e.result("b", 0)
    e.finish()


def test_a_result_for_a_chunk_index_out_of_range_is_refused_and_changes_nothing():
    e, _ = engine()
    req = started(e, "r", prompt=8, chunk=4, chunks=1)
    for k in (-1, 1, 5):  # (an index from the end names no chunk either)
        with pytest.raises(ValueError, match=rf"request 'r' has no chunk {k} in flight "
                           r"\(1 scheduled\)"):
            e.result("r", k)
    assert req.state == "prefilling" and req.chunks[0].state == "running"
    e.abort("r")
    assert e.result("r", 0) is not None  # the drain ends
    assert e.result("r", -1) is None  # a stale result for a terminal request: ignored
    assert req.state == "aborted"
    e.finish()


def test_a_prompt_of_more_chunks_than_the_events_made_ahead_succeeds_with_each_chunks_own():
    """The chunk events are made once per index and shared; a chunk index past those made
    ahead makes its own, and every chunk's result settles it (the last starts the
    transfer)."""
    from terminus.effects import disagg

    n = len(disagg._SCHEDULED) + 6
    e = DisaggPrefill(DisaggPools.make(kv_tokens=4 * n), transport=FakeTransport())
    req = e.add("r", n, chunk_size=1)
    e.bootstrap("r")
    for k in range(n):
        chunk = e.schedule("r")
        assert chunk is not None and chunk.index == k and chunk.last == (k == n - 1)
        assert disagg._SCHEDULED[k] == ChunkScheduled(k)
        if k == n - 1:
            with pytest.raises(ValueError, match=f"has no chunk {n} in flight"):
                e.result("r", n)  # a live request's unknown index changes nothing
        e.result("r", k)
        assert req.state == ("transferring" if k == n - 1 else "prefilling")
    assert disagg._SETTLED_LAST[n - 1] == ChunkSettledLast(n - 1)
    assert disagg._SETTLED_NOT_LAST[n - 1] == ChunkSettledNotLast(n - 1)
    e.transport.complete("r")
    assert e.poll_transfer("r").plan == "release_succeeded"
    assert req.state == "succeeded" and e.transport.sent_tokens["r"] == n
    assert e.result("r", n + 30) is None  # stale, past every chunk made: ignored
    assert e.cache.inserts == {"r": 1} and e.cache.held_tokens == n
    e.finish()


def _first_mamba_alloc_raises(rid: str, requests: int):
    """An engine whose Mamba pool raises at its next alloc (a fault armed on the pool's
    call site), with `rid` (8 tokens, chunks of 4) bootstrapped; (engine, its real pools,
    the request)."""
    from terminus.effects.callsites import FaultPlan, call_sites, proxy

    plan = FaultPlan(strict=False)
    real = DisaggPools.make(kv_tokens=64, requests=requests, mamba_slots=4, metadata_slots=4,
                            host_pages=8, max_context_len=32)
    pools = DisaggPools(kv=real.kv, mamba=proxy(real.mamba, "mamba", plan),
                        metadata=real.metadata, host=real.host, table=real.table)
    e = DisaggPrefill(pools, transport=FakeTransport())
    req = e.add(rid, 8, chunk_size=4)
    e.bootstrap(rid)
    plan.arm(next(s for s in call_sites() if (s.resource, s.method) == ("mamba", "alloc")))
    return e, real, req


def test_a_first_chunk_whose_mamba_pool_raises_frees_its_pages_keeps_its_row_and_a_retry_runs():
    """A first chunk takes its KV first (the allocator's None is its check), then the
    request's row and Mamba state: a Mamba pool that raises leaves the row owned by the
    request (recorded the moment it was taken) and the never-launched chunk's pages
    free again; the retry takes only the Mamba state and writes the same row."""
    e, real, req = _first_mamba_alloc_raises("a", requests=4)
    kv_free, rows_free = real.kv.available_size(), real.table.available
    with pytest.raises(RuntimeError):
        e.schedule("a")
    assert real.kv.available_size() == kv_free and req.chunks == []
    assert [h.kind for h in e.ledger.owned(req)] == ["metadata", "req_slot"]
    assert real.table.available == rows_free - 1
    e.assert_accounted()
    row = req.row
    c0, c1 = e.schedule("a"), e.schedule("a")
    assert c0 is not None and c1 is not None and req.row == row
    assert real.table.available == rows_free - 1  # the same row, not a second
    assert [h.kind for h in e.ledger.owned(req)] == ["metadata", "req_slot", "mamba"]
    pages = [h.value.tolist() for c in (c0, c1) for h in e.ledger.owned(c, "kv")]
    assert _row(real.table, row) == pages[0] + pages[1]
    e.result("a", 0)
    e.result("a", 1)
    e.transport.complete("a")
    e.poll_transfer("a")
    assert req.state == "succeeded"
    e.finish()



def served(e, t, prompt):
    """Request "a" over `prompt` (chunks of 4) served to success: its KV is cached."""
    e.add("a", len(prompt), chunk_size=4, tokens=prompt)
    e.bootstrap("a")
    for k in range(-(-len(prompt) // 4)):
        e.schedule("a")
        e.result("a", k)
    t.complete("a")
    assert e.poll_transfer("a").plan == "release_succeeded"
    return prompt


def test_a_prefix_lock_that_raises_leaves_no_request_claiming_the_unlocked_pages():
    """`add` matches the prompt's cached prefix, then locks it: a lock that raises is a
    refused `add` (nothing made, nothing taken), not a request that claims pages nobody
    locked (evicted, they would be handed out again and sent as its prefix)."""
    e, t = engine()
    prompt = served(e, t, tuple(range(100, 112)))
    kv_free, locked = e.pools.kv.available_size(), e.cache.locked_tokens

    def refuse(match):
        raise RuntimeError("cache lock failed")

    real, e.cache.lock = e.cache.lock, refuse
    with pytest.raises(RuntimeError, match="cache lock failed"):
        e.add("b", 12, chunk_size=4, tokens=(*prompt[:8], 1, 2, 3, 4))
    e.cache.lock = real
    assert "b" not in e.requests and e.cache.locked_tokens == locked
    assert e.pools.kv.available_size() == kv_free
    e.assert_accounted()
    req = e.add("b", 12, chunk_size=4, tokens=(*prompt[:8], 1, 2, 3, 4))  # a retry
    assert req.cached == 8 and e.cache.locked_tokens == locked + 8
    e.abort("b")
    e.finish()


def test_a_host_prefetch_that_raises_is_recorded_and_the_request_runs_without_host_pages():
    """The host prefetch of `add` is best-effort (a full host pool gives None): one that
    raises took nothing, is recorded in `errors`, and the request is added with its prefix
    lock, ready to run. Raised out of `add`, it left a request registered behind the
    caller's back, holding the lock, that no driver would ever end."""
    e, t = engine()
    prompt = served(e, t, tuple(range(100, 112)))
    host_free, locked = e.pools.host.available, e.cache.locked_tokens

    def refuse(n, anchor=None):
        raise RuntimeError("host pool failed")

    e.pools.host.prefetch = refuse
    req = e.add("b", 12, chunk_size=4, host_pages=2, tokens=(*prompt[:8], 1, 2, 3, 4))
    del e.pools.host.prefetch
    assert [str(x) for x in e.errors] == ["host pool failed"]
    assert e.requests["b"] is req and req.state == "bootstrapping" and req.cached == 8
    assert [h.kind for h in e.ledger.owned(req)] == ["prefix_lock"]  # no host pages
    assert e.pools.host.available == host_free and e.cache.locked_tokens == locked + 8
    e.assert_accounted()
    e.bootstrap("b")
    e.schedule("b")
    e.result("b", 0)
    t.complete("b")
    assert e.poll_transfer("b").plan == "release_succeeded"
    assert e.cache.locked_tokens == locked
    e.finish()


@pytest.mark.parametrize(("kw", "error", "match"), [
    ({"host_pages": None}, TypeError, "host_pages must be an int, got NoneType None"),
    ({"host_pages": "2"}, TypeError, "host_pages must be an int, got str '2'"),
    ({"host_pages": 2.5}, TypeError, "host_pages must be an int, got float 2.5"),
    ({"host_pages": True}, TypeError, "host_pages must be an int, got True"),
    ({"host_pages": -1}, ValueError, r"host_pages \(-1\) must be >= 0"),
    ({"chunk_size": 4.0}, TypeError, "chunk_size must be an int, got float 4.0"),
])
def test_add_checks_its_counts_before_it_registers_or_locks_anything(kw, error, match):
    """A bad count is refused before the request is registered and its cached prefix
    locked: checked after them, it left a request the caller was told was refused,
    holding the lock, and its retry was "already exists"."""
    e, t = engine()
    prompt = served(e, t, tuple(range(100, 112)))
    locked = e.cache.locked_tokens
    with pytest.raises(error, match=match):
        e.add("b", 12, **{"chunk_size": 4, **kw}, tokens=prompt)
    assert "b" not in e.requests and e.cache.locked_tokens == locked
    e.assert_accounted()
    # A numpy integer is an int; the retry with good counts is a new request.
    req = e.add("b", 12, chunk_size=np.int64(4), host_pages=np.int64(2), tokens=prompt)
    assert req.cached == 11 and [h.kind for h in e.ledger.owned(req)] == [
        "prefix_lock", "hicache"]
    assert req.chunk_size.__class__ is int
    e.abort("b")
    e.finish()


def test_a_dead_peer_whose_every_poll_raises_does_not_stop_the_sender_deadline():
    """Aborted during its transfer, a request waits for the sender until its deadline: a
    poll that raises (a dead peer raises at every one) is recorded and the deadline still
    ends the wait, releasing everything. Raised before the deadline check, it left the
    request in `awaiting_sender` for good, owning its KV: abort is ignored there."""
    clock = Clock()
    e, t = engine(clock=clock, sender_deadline_s=5)
    req = started(e, prompt=8, chunk=4, host_pages=2, chunks=2)
    for k in (0, 1):
        e.result("r", k)
    assert req.state == "transferring"

    def dead(rid):
        raise TransportError("peer gone")

    t.poll = dead
    # During the transfer, a raising poll changes nothing and is raised as a
    # TransportError naming the request, the sender's error its cause.
    with pytest.raises(TransportError, match=r"request 'r'.*peer gone") as raised:
        e.poll_transfer("r")
    assert str(raised.value.__cause__) == "peer gone"
    assert req.state == "transferring" and not e.errors
    e.abort("r", "client gone")
    assert req.state == "awaiting_sender"
    assert e.poll_transfer("r") is None  # before the deadline: recorded, still waiting
    assert req.state == "awaiting_sender" and [str(x) for x in e.errors] == ["peer gone"]
    assert e.pools.kv.available < e.pools.kv.capacity  # the sender may still read the KV
    clock.now += 5
    report = e.poll_transfer("r")
    assert report is not None and report.plan == "release_aborted_transfer"
    assert req.state == "aborted" and len(e.errors) == 2
    assert e.sink.outputs == [TerminalOutput("r", "aborted", message="client gone")]
    assert e.poll_transfer("r") is None  # ended: not polled again
    assert len(e.errors) == 2
    e.finish()


@pytest.mark.parametrize("step", ["bootstrap", "init", "send"])
def test_a_sender_step_raising_something_else_fails_its_request_as_a_transport_error_does(
        step):
    """A real sender raises what its library raises (a `ConnectionError`), not always
    `TransportError`. Raised out of the driver, `init`'s left the request waiting with a
    metadata slot the decode side never heard of, and `send`'s left it transferring a
    transfer that never started: each ran on to a wait nobody would end. Now the step
    fails its request (everything released once) and the error is kept in `errors`."""
    e, t = engine()
    req = e.add("r", 8, chunk_size=4, host_pages=2)
    err = ConnectionError("connection reset by peer")

    def reset(*args):
        raise err

    setattr(t, step, reset)
    e.bootstrap("r")
    if step == "send":
        for k in (0, 1):
            e.schedule("r")
            e.result("r", k)
    outcome = "failed" if step == "send" else "bootstrap_failed"
    assert req.state == outcome and e.errors == [err]
    assert e.sink.outputs == [TerminalOutput("r", outcome, message=f"sender failed: {err!r}")]
    assert e.pools.metadata.available == e.pools.metadata.capacity
    e.finish()


def test_a_poll_raising_something_else_during_the_transfer_is_a_transport_error():
    e, t = engine()
    req = started(e, prompt=4, chunk=4, host_pages=0, chunks=1)
    e.result("r", 0)

    def reset(rid):
        raise ConnectionError("connection reset by peer")

    t.poll = reset
    with pytest.raises(TransportError, match="poll again, or abort it") as raised:
        e.poll_transfer("r")
    assert isinstance(raised.value.__cause__, ConnectionError)
    assert req.state == "transferring" and not e.errors
    del t.poll  # the sender's own poll again
    t.complete("r")
    assert e.poll_transfer("r").plan == "release_succeeded"
    e.finish()


def test_a_first_chunk_retried_after_a_pool_raised_needs_only_what_it_does_not_own():
    """A Mamba pool that raised left the request its row; with the request table full
    (its own row the last), the retry still schedules: it needs no second row."""
    e, real, req = _first_mamba_alloc_raises("r", requests=1)
    with pytest.raises(RuntimeError):
        e.schedule("r")
    assert [h.kind for h in e.ledger.owned(req)] == ["metadata", "req_slot"]
    assert real.table.available == 0  # its own row was the last one
    c0 = e.schedule("r")
    assert c0 is not None and [h.kind for h in e.ledger.owned(req)] == [
        "metadata", "req_slot", "mamba"]
    e.schedule("r")
    for k in (0, 1):
        e.result("r", k)
    e.transport.complete("r")
    assert e.poll_transfer("r").plan == "release_succeeded"
    e.finish()


@pytest.mark.parametrize("ending", ["succeeded", "aborted"])
def test_forget_detaches_the_chunks_so_no_reference_cycle_outlives_the_request(ending):
    """A chunk points at its request, which lists it: a cycle that kept every
    forgotten request and its chunks in memory until the cyclic collector ran (in a
    10k-request simulation, 5.4k such objects, most of them moved up a generation and
    walked again). Forgotten, a request and its chunks are freed by their counts."""
    from terminus.effects.disagg import PrefillChunk, PrefillRequest
    from tests.garbage import cyclic_garbage

    with cyclic_garbage() as found:
        e, t = engine()
        req = started(e, "r", prompt=12, chunk=4, chunks=2)
        if ending == "aborted":
            e.abort("r")  # drains: chunks 0 and 1 still run
        for k in range(2):
            e.result("r", k)
        if ending == "succeeded":
            e.schedule("r")
            e.result("r", 2)
            t.complete("r")
            e.poll_transfer("r")
        assert req.state == ending
        chunks = list(req.chunks)
        assert [c.parent for c in chunks] == [req] * len(chunks)
        e.forget("r")
        assert [c.parent for c in chunks] == [None] * len(chunks)
        assert req.chunks == chunks  # the request keeps its chunks
        e.finish()
        del req, chunks
    left = [o for o in found if isinstance(o, (PrefillRequest, PrefillChunk))]
    assert left == []
