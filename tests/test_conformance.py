"""Engines' own pools and registry behind the effects: SGLang-shaped stand-ins
(`tests.sglang_shapes`) always, and SGLang's real classes where they import here (else
those cases skip). Each run ends with every pool full (no page free twice) and every
LoRA counter zero."""

from __future__ import annotations

import asyncio

import pytest
import torch

from terminus.effects.disagg import DisaggPools, DisaggPrefill
from terminus.effects.lora_adapter import AdapterManager
from terminus.effects.sequence import RunningBatch, SchedulerPools
from terminus.effects.sim.transport import FakeTransport
from terminus.effects.tokenizer import TokenizerSide
from terminus.kernels import MambaStatePool, MetadataSlots, TokenKVAllocator, UnloadTimeout
from terminus.kernels.protocols import (
    AdapterRegistry,
    AuditedPool,
    KVAllocator,
    LoRARegistry,
    MambaPool,
    SlotAllocator,
)
from terminus.states.sequence import ChunkDone, ChunkLaunched, Fail, Finish, SequenceAbort, Token
from terminus.states.sequence import LastChunkDone as LastDone
from tests import sglang_shapes as sg
from tests.tokenizer_side import FakeScheduler, FakeTokenizer, RecordingSink, settle

KINDS = ["standin", "sglang"]


def kv_allocator(kind, size, ps):
    if kind == "sglang":
        return sg.real_allocator(size, ps)
    if kind == "ours":
        return TokenKVAllocator(size, ps, strict=True)
    return sg.TokenAllocator(size) if ps == 1 else sg.PagedAllocator(size, ps)


def mamba_pool(kind, n):
    if kind == "sglang":
        return sg.real_mamba(n)
    if kind == "ours":
        return MambaStatePool(n, 1, 4, 2, 1, 2, 2, strict=True)
    return sg.MambaSlots(n)


def assert_all_pages_back(kv):
    """Every page free exactly once: the check an unaudited pool cannot run itself."""
    pages = kv.get_all_free_pages()
    assert torch.unique(pages).numel() == pages.numel(), "a page was freed twice"
    assert kv.available_size() == kv.size


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("kind", KINDS)
def test_sglang_shaped_pools_satisfy_the_protocols_but_not_the_audited_one(kind, ps):
    kv, mamba = kv_allocator(kind, 256, ps), mamba_pool(kind, 4)
    assert isinstance(kv, KVAllocator) and isinstance(mamba, MambaPool)
    assert not isinstance(kv, AuditedPool) and not isinstance(mamba, AuditedPool)
    assert isinstance(sg.MetadataSlots(2), SlotAllocator)
    ours = TokenKVAllocator(256, ps)
    assert isinstance(ours, KVAllocator) and isinstance(ours, AuditedPool)
    assert isinstance(MetadataSlots(2), SlotAllocator) and isinstance(MetadataSlots(2),
                                                                      AuditedPool)


def test_a_pool_missing_members_is_refused_naming_them():
    with pytest.raises(TypeError, match=r"SchedulerPools\(kv=\): object is not a "
                       r"KVAllocator: it lacks alloc, available_size, free, page_size"):
        SchedulerPools(rows=2, max_context_len=8, mamba_slots=2, kv=object())
    with pytest.raises(ValueError, match="page_size 1 differs from the KV allocator's "
                       "page_size 16"):
        DisaggPools.make(kv=sg.PagedAllocator(64, 16), page_size=1)


def _last_loc(table, rows, lengths):
    """Location of each row's last token, -1 for an empty row (SGLang's last_loc)."""
    last = table.req_to_token[rows, (lengths - 1).clamp(min=0)].to(torch.int64)
    return torch.where(lengths > 0, last, torch.full_like(last, -1))


def _twin_extend(twin, ps, table, rows, before, after):
    """Where SGLang's allocator, fed the same lengths, would put the new tokens."""
    n = int((after - before).sum())
    if ps == 1:
        return twin.alloc(n)
    last = _last_loc(table, rows, before)
    return twin.alloc_extend(before, before, after, after, last, n)


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("kind", KINDS)
def test_the_running_batch_over_sglang_pools_places_tokens_as_alloc_extend_would(kind, ps):
    kv, twin = kv_allocator(kind, 1024, ps), kv_allocator(kind, 1024, ps)
    mamba = mamba_pool(kind, 4)
    pools = SchedulerPools(rows=4, max_context_len=128, kv=kv, mamba=mamba)
    assert pools.page_size == ps and pools.unchecked() == ["kv", "mamba"]
    retired = []
    rb = RunningBatch(pools, lambda rows, state: retired.extend([state] * rows.numel()))
    table = pools.table
    rows = rb.admit(3, mamba=True)

    def grow(counts, decode=False):
        before = table.lengths.index_select(0, rows).long()
        after = before + counts
        if decode and ps > 1:
            want = twin.alloc_decode(after, after, _last_loc(table, rows, before))
        else:
            want = _twin_extend(twin, ps, table, rows, before, after)
        assert rb.append_kv(rows, counts)
        got = torch.cat([table.req_to_token[r, b:a] for r, b, a in
                         zip(rows.tolist(), before.tolist(), after.tolist(), strict=True)])
        assert got.long().tolist() == want.tolist()

    for counts in ([5, 7, 9], [16, 3, 20]):  # two overlapped prefill chunks
        grow(torch.tensor(counts))
        rb.fire(rows, ChunkLaunched)
    rb.fire(rows, ChunkDone)
    rb.fire(rows, LastDone)
    for _ in range(19):  # decode: one token a step, crossing page boundaries
        grow(torch.ones(3, dtype=torch.int64), decode=True)
        rb.fire(rows, Token)
    pages = [set((table.tokens(int(r)) // ps).tolist()) for r in rows]
    assert not (pages[0] & pages[1] or pages[0] & pages[2] or pages[1] & pages[2])
    # Retire one row at a time: each frees its own pages only, none twice.
    rb.fire(rows[:1], Finish)
    assert kv.available_size() == 1024 - sum(len(p) for p in pages[1:]) * ps
    rb.fire(rows[1:2], SequenceAbort)
    rb.fire(rows[2:], Fail)
    assert retired == ["finished", "aborted", "failed"]
    assert_all_pages_back(kv)
    assert mamba.available_size() == 4
    assert pools.assert_full() == ["kv", "mamba"]  # only the table could say


def _run_disagg(e):
    """r0 succeeds over chunks of 24 and 16 tokens (a partial page with pages of 16),
    r3 over one chunk of 5 (less than a page: SGLang's alloc(5) would give nothing), r1
    is aborted with a chunk in flight, r2 fails at bootstrap."""
    e.transport.fail("bootstrap", "r2", times=1)
    for rid, prompt in (("r0", 40), ("r1", 40), ("r2", 40), ("r3", 5)):
        e.add(rid, prompt, chunk_size=24, host_pages=2)
        e.bootstrap(rid)
    assert e.requests["r2"].state == "bootstrap_failed"
    for rid in ("r0", "r1"):
        assert e.schedule(rid) is not None
        assert e.schedule(rid) is not None
    assert e.schedule("r3") is not None
    assert e.pools.table.tokens(int(e.ledger.owned(e.requests["r3"], "req_slot")[0]
                                    .value[0])).numel() == 5
    e.assert_accounted()
    e.abort("r1")
    for k in (0, 1):
        e.result("r0", k)
        e.result("r1", k)
    e.result("r3", 0)
    for rid in ("r0", "r3"):
        e.transport.complete(rid)
        e.poll_transfer(rid)
    assert [e.requests[r].state for r in ("r0", "r1", "r2", "r3")] == [
        "succeeded", "aborted", "bootstrap_failed", "succeeded"]
    assert e.transport.sent_tokens["r0"] == 40 and e.transport.sent_tokens["r3"] == 5
    assert e.cache.inserts["r0"] == 1 and e.cache.inserts["r1"] == 0
    e.assert_accounted()
    return e.finish()


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("kind", [*KINDS, "ours"])
def test_disaggregated_prefill_over_an_engines_pools(kind, ps):
    kv, mamba = kv_allocator(kind, 1024, ps), mamba_pool(kind, 8)
    meta = MetadataSlots(4) if kind == "ours" else sg.MetadataSlots(4)
    pools = DisaggPools.make(kv=kv, mamba=mamba, metadata=meta, requests=4,
                             max_context_len=256)
    assert pools.page_size == ps
    e = DisaggPrefill(pools, transport=FakeTransport())
    audited = {"hicache", "req_slot"} | ({"kv", "mamba", "metadata"} if kind == "ours"
                                         else set())
    assert set(e.accounting()) == audited
    assert pools.unchecked() == ([] if kind == "ours" else ["kv", "mamba", "metadata"])
    assert _run_disagg(e) == pools.unchecked()
    if kind != "ours":
        assert_all_pages_back(kv)
        assert mamba.available_size() == 8 and meta.available_size() == 4
    pools.assert_full()


def _registry(kind):
    return sg.LoRARegistry() if kind == "standin" else sg.real_lora()[0]


def _counters(registry):
    held = {i: c.value() if callable(c.value) else c.value
            for i, c in registry._counters.items()}
    return {i: n for i, n in held.items() if n}


@pytest.mark.parametrize("kind", KINDS)
def test_adapter_manager_and_tokenizer_over_an_sglang_shaped_registry(kind):
    async def main():
        registry = _registry(kind)
        assert isinstance(registry, AdapterRegistry) and isinstance(registry, LoRARegistry)
        manager = AdapterManager(registry)
        side = TokenizerSide(registry, FakeTokenizer(), FakeScheduler(), RecordingSink())
        a = await manager.load("a", "/w/a")
        assert isinstance(a, str) and manager.state("a") == "ready"
        await side.submit("one", "a", rid="r1")
        assert _counters(registry) == {a: 1}
        assert manager.count("a") is None  # the registry cannot count: no count(id)
        with pytest.raises(NotImplementedError, match="has no upsert"):
            await manager.upsert("a", "/w/a2")
        assert manager.state("a") == "ready"
        with pytest.raises(UnloadTimeout, match=f"LoRA id {a} .* cannot count them"):
            await manager.unload("a", timeout=0.05)
        assert manager.state("a") == "unloading"
        side.on_finish("r1")
        await settle()
        assert await manager.wait_unloaded("a", timeout=1) == a
        assert manager.state("a") == "unloaded"
        side.ledger.assert_empty()
        assert _counters(registry) == {} and a not in registry._counters
        with pytest.raises(ValueError, match="already exists"):
            await registry.register(sg.LoRARef(lora_name="b"))
            await manager.load("b")  # the name is taken: load fails, declared
        assert manager.state("b") == "load_failed"

    asyncio.run(main())
