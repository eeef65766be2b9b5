"""The prefix cache's host paths against its general (tensor) paths: `RadixTree.insert_host`
and `evict_host`, `RadixMatch.host`, `PrefixCache.evict` through `free_host`, a CPU
RunningBatch's retirement into the cache and its admission through
`ReqToTokenTable.alloc_host`. Each fast path is run beside the general one on the same
operations and must decide, hold and free exactly the same; every test ends with the
pools full."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from terminus.effects.prefix_cache import PrefixCache
from terminus.effects.sequence import RunningBatch, SchedulerPools
from terminus.fsm import ReleaseFailed
from terminus.kernels import DoubleFree, ReqToTokenTable, TokenKVAllocator
from terminus.kernels.radix import RadixTree
from terminus.states.sequence import ChunkLaunched, Fail, Finish, LastChunkDone, Token
from tests.test_radix_tree import _shape  # every node, in a canonical order


def _host_nodes_share_their_values(tree: RadixTree) -> None:
    for n in tree._nodes():
        assert n.host is not None, f"{n!r}: inserted from the host but has no host array"
        assert n.host.dtype == np.int64
        assert np.shares_memory(n.host, n.value.numpy())
        assert n.host.tolist() == n.value.tolist()


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("seed", range(3))
def test_insert_host_decides_holds_and_evicts_as_insert_does(page_size, dtype, seed):
    # Two trees fed the same operations: one inserts tensors (the general path), the
    # other numpy rows (insert_host) and evicts as numpy every other time.
    rng = random.Random(seed)
    gen, host = RadixTree(page_size), RadixTree(page_size)
    seqs: list[list[int]] = []
    locked: list[tuple] = []
    nxt = 0
    for step in range(150):
        op = rng.random()
        if op < 0.45 or not seqs:
            base = list(rng.choice(seqs)) if seqs and rng.random() < 0.7 else []
            seq = base[: rng.randrange(len(base) + 1)] + [
                rng.randrange(5) for _ in range(rng.randrange(1, 14))]
            seqs.append(seq)
            kv = np.arange(nxt, nxt + len(seq), dtype=dtype)
            nxt += len(seq)
            owned = rng.choice([0, rng.randrange(len(seq) + 1)])
            outs = []
            for use_host in (False, True):
                try:
                    r = (host.insert_host(seq, kv.copy(), owned_from=owned) if use_host else
                         gen.insert(seq, torch.from_numpy(kv.astype(np.int64)),
                                    owned_from=owned))
                except ValueError as e:
                    outs.append(("refused", str(e)))
                else:
                    outs.append((r.prefix_len, r.taken.tolist(), r.taken_count,
                                 r.duplicate_count, r.duplicates.tolist(), r.leftover.tolist(),
                                 r.node.key))
                    assert r.taken.dtype == torch.int64
            assert outs[0] == outs[1]
        elif op < 0.75:
            seq = rng.choice(seqs)
            limit = rng.choice([None, rng.randrange(len(seq) + 2)])
            mg, mh = gen.match_prefix(seq, limit=limit), host.match_prefix(seq, limit=limit)
            assert (mg.length, mg.indices.tolist(), mg.node.key) == \
                   (mh.length, mh.indices.tolist(), mh.node.key)
            assert mg.host is None  # inserted as tensors: no host array
            if mh.length:
                assert mh.host is not None and mh.host.tolist() == mh.indices.tolist()
                assert np.shares_memory(mh.host, mh.indices.numpy())
            if rng.random() < 0.5 and mg.length:
                gen.inc_lock_ref(mg.node)
                host.inc_lock_ref(mh.node)
                locked.append((mg.node, mh.node))
        elif op < 0.87 and locked:
            a, b = locked.pop(rng.randrange(len(locked)))
            gen.dec_lock_ref(a)
            host.dec_lock_ref(b)
        else:
            k = rng.randrange(0, 12)
            want = gen.evict(k).tolist()
            got = host.evict_host(k) if step % 2 else host.evict(k).numpy()
            assert isinstance(got, np.ndarray) and got.tolist() == want
        assert _shape(gen) == _shape(host)
        gen.check()
        host.check()
        _host_nodes_share_their_values(host)
    for a, b in locked:
        gen.dec_lock_ref(a)
        host.dec_lock_ref(b)
    assert gen.evict(gen.total_size()).tolist() == \
        host.evict_host(host.total_size()).tolist()
    assert gen.total_size() == host.total_size() == 0


def test_a_tree_mixing_tensor_and_host_inserts_matches_and_evicts_the_same_indices():
    # A node inserted as a tensor has no host array: a match across it is a torch.cat
    # (no host), evict_host reads its values as numpy.
    tree = RadixTree(2)
    tree.insert([1, 2, 3, 4], torch.tensor([10, 11, 12, 13]))
    tree.insert_host([1, 2, 3, 4, 5, 6], np.array([10, 11, 12, 13, 20, 21], np.int32))
    m = tree.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert m.length == 6 and m.indices.tolist() == [10, 11, 12, 13, 20, 21]
    assert m.host is None
    tree.check()
    got = tree.evict_host(tree.total_size())
    assert got.dtype == np.int64 and sorted(got.tolist()) == [10, 11, 12, 13, 20, 21]
    assert tree.total_size() == 0


@pytest.mark.parametrize("bad, why", [
    ([0, 1, 2, 3], "1-D numpy array"),
    (np.zeros((2, 2), np.int64), "1-D numpy array"),
    (np.arange(3), "1-D numpy array"),
    (np.zeros(4, np.float64), "integer array"),
    (np.zeros(4, np.bool_), "integer array"),
    (np.zeros(4, np.uint64), "integer array"),
])
def test_insert_host_refuses_what_is_not_one_integer_index_per_token_and_changes_nothing(
        bad, why):
    tree = RadixTree(1)
    tree.insert_host([5, 6], np.array([0, 1]))
    before = _shape(tree)
    with pytest.raises(ValueError, match=why):
        tree.insert_host([1, 2, 3, 4], bad)
    assert _shape(tree) == before
    tree.check()
    assert tree.evict_host(2).tolist() == [0, 1]


def test_insert_host_refuses_a_prefix_no_longer_cached_and_a_tree_off_the_cpu():
    tree = RadixTree(1)
    before = _shape(tree)
    with pytest.raises(ValueError, match="no longer cached"):
        tree.insert_host([1, 2, 3], np.array([4, 5, 6]), owned_from=2)
    with pytest.raises(ValueError, match="owned_from"):
        tree.insert_host([1, 2, 3], np.array([4, 5, 6]), owned_from=4)
    assert _shape(tree) == before and tree.total_size() == 0
    meta = RadixTree(1, device="meta")
    with pytest.raises(ValueError, match="tree is on meta"):
        meta.insert_host([1], np.array([0]))
    with pytest.raises(ValueError, match="tree is on meta"):
        meta.evict_host(1)


class _PlainPool(TokenKVAllocator):
    """Not exactly TokenKVAllocator: PrefixCache.evict frees through free(), the general
    path (as it does for a fault plan's proxy)."""


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("strict", [False, True])
def test_cache_eviction_frees_the_same_pages_in_the_same_order_through_free_host(
        page_size, strict):
    rng = random.Random(page_size)
    pools = [cls(256, page_size, strict=strict) for cls in (TokenKVAllocator, _PlainPool)]
    caches = [PrefixCache(kv) for kv in pools]
    seqs: list[list[int]] = []
    for _ in range(60):
        if rng.random() < 0.6 or not seqs:
            base = list(rng.choice(seqs)) if seqs and rng.random() < 0.6 else []
            seq = base[: rng.randrange(len(base) + 1)] + [
                rng.randrange(4) for _ in range(rng.randrange(1, 20))]
            if pools[0].available < len(seq):
                continue
            seqs.append(seq)
            for c in caches:
                kv = c.kv.alloc(len(seq))
                r = c.insert(0, seq, kv)
                if r.duplicate_count:
                    c.kv.free(r.duplicates[::page_size] if page_size > 1 else r.duplicates)
                left = r.leftover
                if left.numel():
                    c.kv.free(left[:1] if page_size > 1 else left)
        else:
            k = rng.randrange(1, 40)
            assert caches[0].evict(k) == caches[1].evict(k)
        a, b = (kv._free for kv in pools)
        assert a._stack[:a._top].tolist() == b._stack[:b._top].tolist()
        assert caches[0].evicted_tokens == caches[1].evicted_tokens
        assert _shape(caches[0].tree) == _shape(caches[1].tree)
    for c in caches:
        c.evict_all()
        c.kv.assert_full()


def test_a_double_free_through_the_host_eviction_is_still_refused_by_a_strict_pool():
    kv = TokenKVAllocator(64, 4, strict=True)
    cache = PrefixCache(kv)
    idx = kv.alloc(8)
    cache.insert(0, list(range(8)), idx)
    kv.free(idx[:1])  # the tree's first page, freed behind its back
    with pytest.raises(DoubleFree):
        cache.evict(8)
    kv.clear()


def _run(rb: RunningBatch, cache: PrefixCache, seed: int) -> list:
    """A random run of admissions with prompts (matching and locking), prefill, decode,
    finishes (inserting into the cache) and failures; the trace of what it saw."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(6) for _ in range(rng.randrange(2, 24))] for _ in range(6)]
    live: dict[int, list[int]] = {}
    trace: list = []
    for _ in range(80):
        op = rng.random()
        if op < 0.35 and len(live) < 6:
            base = rng.choice(prompts)
            prompt = [*base[: rng.randrange(1, len(base) + 1)], rng.randrange(6)]
            n = rng.choice([1, 1, 2])
            ps = [list(prompt) for _ in range(n)]
            rows = rb.admit(n, mamba=rng.random() < 0.5, prompts=ps)
            if rows is None:
                trace.append("full")
                continue
            for r, p in zip(rows.tolist(), ps, strict=True):
                rest = len(p) - rb.matched(r)
                if not rb.append_kv([r], [rest]):
                    rb.fire(torch.tensor([r]), Fail)
                    trace.append(("no kv", r))
                    continue
                rb.fire(torch.tensor([r]), ChunkLaunched)
                rb.fire(torch.tensor([r]), LastChunkDone)
                live[r] = p
                trace.append(("admit", r, rb.matched(r)))
        elif op < 0.7 and live:
            rows = sorted(live)
            if rb.append_kv(rows, [1] * len(rows)):
                for r in rows:
                    live[r].append(rng.randrange(6))
                rb.fire(torch.tensor(rows), Token)
                trace.append(("token", rows))
        elif live:
            r = rng.choice(sorted(live))
            del live[r]
            rb.fire(torch.tensor([r]), Finish if rng.random() < 0.8 else Fail)
            trace.append(("end", r))
        trace.append((cache.held_tokens, cache.locked_tokens, cache.evicted_tokens))
    if live:
        rb.fire(torch.tensor(sorted(live)), Fail)
    return trace


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(3))
def test_a_cpu_batch_retires_into_the_cache_as_the_general_path_does(page_size, seed):
    # The same run twice: once with the CPU table's host paths (insert_host, admission
    # through alloc_host, rows rewritten through numpy), once with the table's numpy
    # views taken away (every path the tensor one, as on a device).
    outs = []
    for host in (True, False):
        pools = SchedulerPools(rows=8, max_context_len=64, kv_tokens=96, mamba_slots=8,
                               strict=True, page_size=page_size)
        if not host:
            pools.table._np = None
        cache = PrefixCache(pools.kv)
        rb = RunningBatch(pools, cache=cache)
        trace = _run(rb, cache, seed)
        rb.audit()
        cache.tree.check()
        free = pools.kv._free
        outs.append((trace, _shape(cache.tree), free._stack[:free._top].tolist(),
                     pools.table.req_to_token.tolist()))
        cache.evict_all()
        pools.assert_full()
    assert outs[0] == outs[1]


def test_alloc_host_takes_and_resets_the_rows_alloc_would():
    tables = [ReqToTokenTable(6, 8) for _ in range(2)]
    for t in tables:
        t.lengths.fill_(5)
        t.mamba_slots.fill_(3)
    a = tables[0].alloc_host(4)
    b = tables[1].alloc(4)
    assert isinstance(a, np.ndarray) and a.dtype == np.int64
    assert b is not None and a.tolist() == b.tolist()
    assert tables[0].lengths.tolist() == tables[1].lengths.tolist()
    assert tables[0].mamba_slots.tolist() == tables[1].mamba_slots.tolist()
    assert tables[0].alloc_host(3) is None  # short: nothing taken
    assert tables[0].available == 2
    with pytest.raises(ValueError, match="negative"):
        tables[0].alloc_host(-1)
    assert tables[0].available == 2
    tables[0].free(torch.from_numpy(a))
    tables[1].free(b)
    for t in tables:
        t.assert_full()


def test_a_free_or_alloc_wrapped_on_the_instance_is_called_not_bypassed():
    # bench e2e's pool clock (and any caller) wraps a pool's methods on the instance:
    # the host paths are for a pool whose methods are its class's own, so a wrapped
    # free (eviction) and a wrapped alloc (admission) are called as before.
    pools = SchedulerPools(rows=4, max_context_len=32, kv_tokens=64, mamba_slots=4,
                           page_size=4)
    calls: list[str] = []
    for obj, name in ((pools.kv, "free"), (pools.table, "alloc")):
        fn = getattr(obj, name)

        def wrapped(*a, _fn=fn, _name=name, **k):
            calls.append(_name)
            return _fn(*a, **k)

        setattr(obj, name, wrapped)
    cache = PrefixCache(pools.kv)
    rb = RunningBatch(pools, cache=cache)
    prompt = list(range(9))
    rows = rb.admit(1, mamba=False, prompts=[prompt])
    assert calls == ["alloc"]
    assert rb.append_kv(rows, [len(prompt)])
    rb.fire(rows, ChunkLaunched)
    rb.fire(rows, LastChunkDone)
    rb.fire(rows, Finish)
    assert cache.held_tokens == 8
    calls.clear()
    assert cache.evict_all() == 8
    assert calls == ["free"]
    pools.assert_full()


class _RefusingInserts(PrefixCache):
    """The simulator's idiom for a cache_insert fault: a subclass whose insert refuses."""

    def insert(self, rid, tokens, kv_indices, *, owned_from=0):
        raise RuntimeError(f"refused insert of {rid!r}")


@pytest.mark.parametrize("kind", ["subclass", "wrapped"])
def test_a_replaced_cache_insert_is_called_when_rows_retire(kind):
    # The host insert is our own cache's: a subclass that refuses inserts, or an insert
    # wrapped on the instance (a counter, a timer), sees the retiring row's insert.
    pools = SchedulerPools(rows=4, max_context_len=32, kv_tokens=64, mamba_slots=4,
                           page_size=4)
    calls: list[int] = []
    if kind == "subclass":
        cache: PrefixCache = _RefusingInserts(pools.kv)
    else:
        cache = PrefixCache(pools.kv)
        fn = cache.insert

        def wrapped(rid, *a, **k):
            calls.append(rid)
            return fn(rid, *a, **k)

        cache.insert = wrapped  # type: ignore[method-assign]
    rb = RunningBatch(pools, cache=cache)
    prompt = list(range(9))
    rows = rb.admit(1, mamba=False, prompts=[prompt])
    rb.append_kv(rows, [len(prompt)])
    rb.fire(rows, ChunkLaunched)
    rb.fire(rows, LastChunkDone)
    if kind == "subclass":
        with pytest.raises(ReleaseFailed) as failed:
            rb.fire(rows, Finish)
        assert "refused insert of" in repr(failed.value.exceptions)
        assert cache.held_tokens == 0  # the row freed everything it held
    else:
        rb.fire(rows, Finish)
        assert calls == [int(rows[0])] and cache.held_tokens == 8
    cache.evict_all()
    pools.assert_full()
