"""The naive baseline's disaggregated-prefill server (`naive.NaiveDisagg`) does the
serving work the machines do (a prefix match and lock of the real prompt, table rows
per chunk, all of the KV sent, an insert under the prompt's token ids) and keeps the
seed's pre-fix bugs (an abort with chunks in flight only marks the request, aborted
middle results are dropped without release, the final result is not checked, a raising
sender abort skips the local releases)."""

from __future__ import annotations

import asyncio

import torch

from terminus.effects.output import OutputLog
from terminus.effects.sim.naive import NaiveDisagg, naive_parts
from terminus.effects.sim.serving import ServingLoop, SimConfig, machine_parts
from terminus.effects.sim.workload import RequestSpec, WorkloadConfig, generate, prompt_tokens


def _turn(rid: str, history: tuple[int, ...], **kw) -> RequestSpec:
    """A disaggregated request of conversation 0 whose prompt is its turns so far."""
    return RequestSpec(rid, "disagg", 0, sum(history), 1, None, 1, None, kw.pop("fault", None),
                       conv=0, history=history, **kw)


FIRST = _turn("c-0", (100,))  # the first turn: 100 tokens, cached once it succeeds
SECOND = _turn("c-1", (100, 40, 90))  # extends it: 100 cached + 130 (3 chunks of 64)


def _server(*later: RequestSpec) -> tuple[NaiveDisagg, OutputLog]:
    """A naive server that already served FIRST (its prompt is in the prefix cache)."""
    sink = OutputLog()
    d = NaiveDisagg(SimConfig(), [FIRST, *later], sink)
    d.add(FIRST)
    _drain(d)
    assert [(o.rid, o.outcome) for o in sink.outputs] == [("c-0", "succeeded")]
    return d, sink


def _drain(d: NaiveDisagg) -> None:
    for _ in range(100):
        if d.idle:
            return
        d.step()
    raise AssertionError(f"did not drain: {d.stuck()}")


def _outcomes(sink: OutputLog, rid: str) -> list[str]:
    return [o.outcome for o in sink.outputs if o.rid == rid]


def test_a_later_turn_matches_locks_writes_sends_and_caches_its_real_prompt():
    d, sink = _server(SECOND)
    cache, table = d.cache, d.pools.table
    assert (cache.lookups, cache.hit_tokens, cache.inserted_tokens) == (1, 0, 100)
    d.add(SECOND)
    r = d.loop.reqs["c-1"]
    # The first turn's 100 tokens matched (the limit is all but the last token) and locked.
    assert (r.cached, r.n_chunks) == (100, 3)
    assert (cache.lookups, cache.hit_tokens, cache.locked_tokens) == (2, 100, 100)
    d.step()  # chunks 0 and 1 launched (overlap): the row is the prefix, then each chunk
    assert sorted(r.in_flight) == [0, 1]
    row = table.tokens(r.row)
    assert r.prefix is not None
    assert torch.equal(row, torch.cat((r.prefix, r.in_flight[0], r.in_flight[1])))
    _drain(d)
    assert _outcomes(sink, "c-1") == ["succeeded"]
    # All of its KV went to the decode side: the matched prefix and every chunk.
    assert d.transport.sent_tokens["c-1"] == 230
    # Cached under its real token ids, only the new 130 taken, the prefix unlocked.
    tokens = tuple(prompt_tokens(SECOND))
    assert cache.match(tokens).length == 230
    assert (cache.inserted_tokens, cache.duplicate_tokens) == (230, 0)
    assert cache.locked_tokens == 0
    assert d.leaks() == dict.fromkeys(d.leaks(), 0)


def test_an_abort_while_chunks_are_in_flight_still_leaks_the_request_and_its_lock():
    d, sink = _server(SECOND)
    d.add(SECOND)
    d.step()  # chunks 0 and 1 in flight
    d.abort("c-1")  # marked only
    _drain(d)  # both middle results dropped without release; nothing more comes
    assert _outcomes(sink, "c-1") == []
    leaks = d.leaks()  # (evicts every unlocked page first)
    # Its two chunks' KV (never released) and the 100 cached tokens it still locks.
    assert d.cache.locked_tokens == 100
    assert leaks == {"kv_tokens": 128 + 100, "mamba_slots": 1, "request_slots": 1,
                     "metadata_slots": 1, "host_pages": 0}


def test_a_raising_sender_abort_skips_the_local_releases_lock_included():
    second = _turn("c-1", (100, 40, 90), fault="sender_abort", prefetch_pages=2)
    d, sink = _server(second)
    d.add(second)  # bootstrapped, prefix matched and locked, no chunk yet
    d.abort("c-1")  # the sender's abort raises before anything is released
    assert d.transport.aborts["c-1"] == 1
    _drain(d)
    assert _outcomes(sink, "c-1") == []
    leaks = d.leaks()
    assert d.cache.locked_tokens == 100
    assert leaks == {"kv_tokens": 100, "mamba_slots": 0, "request_slots": 0,
                     "metadata_slots": 1, "host_pages": 2}


def test_the_final_result_of_an_aborted_request_is_not_checked():
    second = _turn("c-1", (100, 40))  # 100 cached + 40: one chunk, the final one
    d, sink = _server(second)
    d.add(second)
    d.step()  # its only chunk in flight
    d.abort("c-1")  # marked only
    _drain(d)
    # Sent, cached and reported as succeeded although the client aborted it.
    assert _outcomes(sink, "c-1") == ["succeeded"]
    assert d.transport.sends["c-1"] == 1 and d.cache.inserts["c-1"] == 1
    assert d.leaks() == dict.fromkeys(d.leaks(), 0)


def test_on_the_workload_the_naive_server_looks_up_and_hits_as_the_machines_do():
    # Disaggregated requests only, sharing system prompts and conversations: every
    # bootstrapped request looks its prompt up, and both servers hit the cache.
    workload = generate(WorkloadConfig(requests=400, seed=5, disagg_fraction=1.0,
                                       prefetch_fraction=0.0))
    caches = {}
    for parts in (machine_parts, naive_parts):
        loop = ServingLoop(workload, SimConfig(), parts=parts)
        asyncio.run(loop.run())
        disagg = loop.disagg
        caches[loop.parts.loop] = disagg.cache if parts is naive_parts else disagg.engine.cache
        if parts is naive_parts:
            leaks = loop.leaks()
            naive = disagg
        else:
            assert loop.leaks() == dict.fromkeys(loop.leaks(), 0)
    bootstrapped = sum(1 for s in workload if s.fault != "bootstrap")
    assert caches["naive"].lookups == bootstrapped > 0
    assert caches["machines"].lookups == len(workload)
    assert caches["naive"].hit_tokens > 0 and caches["machines"].hit_tokens > 0
    # A request neither aborted nor faulted sends its whole prompt's KV.
    clean = [s for s in workload if s.fault is None and s.abort_at is None]
    assert clean and all(naive.transport.sent_tokens[s.rid] == s.prompt_len for s in clean)
    assert leaks["kv_tokens"] > 0 and leaks["metadata_slots"] > 0  # the seed's leak


def test_without_aborts_or_faults_the_naive_server_leaks_nothing_of_its_own():
    """The seed's bugs need an abort or a failing sender; without either, what the naive
    server's own bookkeeping frees (pages past an unaligned chunk, a duplicate insert's
    pages, a cache evicted under memory pressure, pages of 16 tokens) must all come
    back, or its "seed leak" figures would count leaks of its own. (Chunks of 24 tokens
    in pages of 16: a chunk that ends inside a page is not the last.)"""
    workload = generate(WorkloadConfig(requests=300, seed=9, disagg_fraction=1.0,
                                       prefetch_fraction=0.0, abort_rate=0.0,
                                       fault_rate=0.0))
    loop = ServingLoop(workload, SimConfig(page_size=16, chunk_size=24, disagg_kv_tokens=1 << 12),
                       parts=naive_parts)
    asyncio.run(loop.run())
    cache = loop.disagg.cache
    assert cache.evicted_tokens > 0 and cache.duplicate_tokens > 0  # both paths ran
    assert loop.leaks() == dict.fromkeys(loop.leaks(), 0)
