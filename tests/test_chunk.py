"""The chunk machine: every pair over real KV pages, and both disaggregated-prefill
machines against the `transitions` oracle on random event sequences. Every test that
drives a machine ends with the pools full and the ledger empty."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from terminus.effects.disagg import (
    CHUNK_PLANS,
    DisaggPools,
    DisaggResources,
    make_ledger,
)
from terminus.effects.output import OutputLog
from terminus.effects.prefix_cache import PrefixCache
from terminus.effects.sim.transport import FakeTransport
from terminus.fsm import TransitionNotAllowed
from terminus.fsm.oracle import Differential
from terminus.states.chunk import CHUNK, Abandon, Chunk, Commit, Launch, NextLaunched, Result
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
    DisaggReq,
    SenderAborted,
    SenderDeadline,
    TransferDone,
    TransferFailed,
)

PATHS = {  # events that bring a fresh chunk to each state
    "scheduled": (),
    "running": (Launch(),),
    "overlapped": (Launch(), NextLaunched()),
    "result_ready": (Launch(), Result()),
    "committed": (Launch(), Result(), Commit()),
    "abandoned": (Launch(), Result(), Abandon()),
}
CHUNK_EVENTS = (Launch(), NextLaunched(), Result(), Commit(), Abandon())


def chunk_world():
    pools = DisaggPools.make()
    res = DisaggResources(pools, FakeTransport(), PrefixCache(pools.kv),
                          OutputLog())
    ledger = make_ledger(res)
    return pools, ledger, CHUNK.bind(CHUNK_PLANS, ledger)




@pytest.mark.parametrize("event", CHUNK_EVENTS, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("state", list(PATHS))
def test_every_chunk_pair_decides_as_the_oracle_and_frees_its_pages_once(state, event):
    pools, ledger, machine = chunk_world()
    c = Chunk(machine, ("r", 0), index=0)
    ledger.acquire(c, "kv", pools.kv.alloc(4))
    for ev in PATHS[state]:
        c.fire(ev)
    assert c.state == state  # the path really leads there
    diff = Differential(c)
    diff.model.state = c.state
    before = ledger.released
    decision = diff.deliver(event)
    if decision != "transition":
        assert ledger.released == before  # an ignore or an error releases nothing
    if not c.terminal:
        if c.state in ("running", "overlapped"):
            c.fire(Result())
        c.fire(Abandon())
    assert ledger.released == 1  # the chunk's pages, exactly once, whichever way it ended
    pools.assert_full()
    ledger.assert_empty()


def test_abandoning_a_running_chunk_is_an_error_that_frees_nothing():
    pools, ledger, machine = chunk_world()
    c = Chunk(machine, "c")
    ledger.acquire(c, "kv", pools.kv.alloc(8))
    c.fire(Launch())
    with pytest.raises(TransitionNotAllowed, match="'Abandon' is not allowed in state "
                       "'running'"):
        c.fire(Abandon())
    assert pools.kv.available == pools.kv.capacity - 8
    c.fire(Result())
    report = c.fire(Abandon())
    assert report is not None and report.plan == "release_abandoned"
    assert c.fire(Result()) is None  # a duplicate result after the chunk settled
    assert machine.stats.ignored[("abandoned", "Result")] == 1
    pools.assert_full()
    ledger.assert_empty()


def test_a_commit_that_still_owns_pages_releases_them_rather_than_leak():
    pools, ledger, machine = chunk_world()
    c = Chunk(machine, "c")
    ledger.acquire(c, "kv", pools.kv.alloc(3))
    for ev in (Launch(), Result()):
        c.fire(ev)
    report = c.fire(Commit())
    assert report is not None and [h.kind for h in report.released] == ["kv"]
    pools.assert_full()
    ledger.assert_empty()


# -- differential: random event sequences against the transitions oracle ---------------

chunk_events = st.lists(st.sampled_from(CHUNK_EVENTS), max_size=12)


@settings(max_examples=150, deadline=None)
@given(chunk_events)
def test_random_chunk_sequences_agree_with_the_oracle(seq):
    pools, ledger, machine = chunk_world()
    c = Chunk(machine, "c")
    ledger.acquire(c, "kv", pools.kv.alloc(2))
    diff = Differential(c)
    for ev in seq:
        diff.deliver(ev)
    assert diff.plans_match()
    if not c.terminal:
        if c.state in ("scheduled", "result_ready"):
            c.fire(Abandon())
        else:
            c.fire(Result())
            c.fire(Abandon())
    pools.assert_full()
    ledger.assert_empty()


REQUEST_EVENTS = st.one_of(
    st.sampled_from([Bootstrapped(), BootstrapRetry(), BootstrapFailed("b"), DisaggAbort("a"),
                     TransferDone(), TransferFailed("t"), SenderAborted(), SenderDeadline()]),
    st.builds(ChunkScheduled, chunk=st.integers(0, 3)),
    st.builds(ChunkSettled, chunk=st.integers(0, 3), last=st.booleans()),
    st.builds(ChunkSettledLast, chunk=st.integers(0, 3)),
    st.builds(ChunkSettledNotLast, chunk=st.integers(0, 3)),
)
# Between events the chunks the guards read change: launch one, or settle the oldest.
CHUNK_OPS = st.sampled_from(["none", "launch", "settle"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(REQUEST_EVENTS, CHUNK_OPS), max_size=25))
def test_random_request_sequences_agree_with_the_oracle(seq):
    from terminus.fsm import Plan

    plans = {p: Plan() for p in DISAGG_PREFILL.plan_names}
    pools, ledger, chunk_machine = chunk_world()
    machine = DISAGG_PREFILL.bind(plans, ledger)
    req = DisaggReq(machine, "r")
    diff = Differential(req)
    for ev, op in seq:
        if op == "launch":
            c = Chunk(chunk_machine, ("r", len(req.chunks)))
            ledger.acquire(c, "kv", pools.kv.alloc(1))
            c.fire(Launch())
            req.chunks.append(c)
        elif op == "settle":
            live = [c for c in req.chunks if not c.terminal]
            if live:
                live[0].fire(Result())
                live[0].fire(Abandon())
        diff.deliver(ev)
    assert diff.plans_match()
    for c in req.chunks:
        if not c.terminal:
            c.fire(Result())
            c.fire(Abandon())
    pools.assert_full()
    ledger.assert_empty()
