"""Batched release: one free call per pool for all of a step's terminal requests."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import DoubleFree, MambaStatePool, ReqToTokenTable, TokenKVAllocator, release_batch


class Counting:
    """Wraps a pool and counts its free calls."""

    def __init__(self, inner):
        self.inner = inner
        self.frees = 0

    def free(self, ids):
        self.frees += 1
        self.inner.free(ids)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def setup(lengths, page_size=1, strict=True):
    kv = TokenKVAllocator(256, page_size=page_size, strict=strict)
    table = ReqToTokenTable(8, 64, strict=strict)
    mamba = MambaStatePool(8, 1, 4, 2, 1, 2, 2, strict=strict)
    slots = table.alloc(len(lengths))
    assert slots is not None
    for s, n in zip(slots.tolist(), lengths, strict=True):
        got = kv.alloc(n)
        assert got is not None
        table.write(s, 0, got)
        m = mamba.alloc(1)
        assert m is not None
        table.mamba_slots[s] = m[0]
    return kv, table, mamba, slots


def test_releases_every_pool_with_one_free_call_each():
    kv, table, mamba, slots = setup([3, 1, 5])
    ckv, cmamba, ctab = Counting(kv), Counting(mamba), Counting(table)
    out = release_batch(slots, table, ckv, cmamba, req_slots=ctab)
    assert (ckv.frees, cmamba.frees, ctab.frees) == (1, 1, 1)
    assert (out.requests, out.kv_tokens, out.mamba_slots) == (3, 9, 3)
    for pool in (kv, table, mamba):
        pool.assert_full()


def test_releases_only_the_given_requests():
    kv, table, mamba, slots = setup([2, 4, 6])
    keep = int(slots[1])
    release_batch(slots[[0, 2]], table, kv, mamba)
    assert kv.available == kv.capacity - 4
    assert table.available == table.capacity - 1
    assert mamba.available == mamba.capacity - 1
    assert int(table.lengths[keep]) == 4
    release_batch([keep], table, kv, mamba)
    kv.assert_full()


def test_uniform_and_mixed_lengths_free_exactly_the_owned_tokens():
    for lengths in ([4, 4, 4], [1, 7, 0, 3]):
        kv, table, mamba, slots = setup(lengths)
        release_batch(slots, table, kv, mamba)
        kv.assert_full()
        mamba.assert_full()


def test_kv_start_leaves_a_shared_prefix_to_its_owner():
    kv, table, mamba, slots = setup([5, 3])
    prefix = [table.tokens(int(s))[:2].clone() for s in slots]
    release_batch(slots, table, kv, mamba, kv_start=torch.tensor([2, 2]))
    assert kv.available == kv.capacity - 4
    kv.free(torch.cat(prefix))
    kv.assert_full()


def test_paged_pool_frees_each_page_once_even_when_lengths_end_mid_page():
    kv, table, mamba, slots = setup([5, 3, 8], page_size=4)
    release_batch(slots, table, kv, mamba)
    kv.assert_full()


def test_releasing_a_request_twice_is_a_double_free():
    kv, table, mamba, slots = setup([2])
    release_batch(slots, table, kv, mamba)
    with pytest.raises(DoubleFree):
        release_batch(slots, table, kv, mamba)


def test_empty_batch_releases_nothing():
    kv, table, mamba, _ = setup([2])
    out = release_batch(torch.empty(0, dtype=torch.int64), table, kv, mamba)
    assert out.requests == 0
    assert kv.available == kv.capacity - 2


@pytest.mark.gpu
def test_batched_release_runs_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    kv = TokenKVAllocator(256, device="cuda")
    table = ReqToTokenTable(4, 32, device="cuda")
    slots = table.alloc(3)
    assert slots is not None
    for s, n in zip(slots.tolist(), [3, 5, 7], strict=True):
        got = kv.alloc(n)
        assert got is not None
        table.write(s, 0, got)
    release_batch(slots, table, kv)
    kv.assert_full()
    table.assert_full()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=8), st.sampled_from([1, 4]), st.data())
def test_any_batch_returns_everything_and_leaves_the_rest(lengths, page_size, data):
    kv, table, mamba, slots = setup(lengths, page_size=page_size)
    pick = data.draw(st.lists(st.booleans(), min_size=len(lengths), max_size=len(lengths)))
    first = slots[torch.tensor(pick, dtype=torch.bool)]
    rest = slots[~torch.tensor(pick, dtype=torch.bool)]
    release_batch(first, table, kv, mamba)
    held = sum(-(-n // page_size) * page_size for n, p in zip(lengths, pick, strict=True) if not p)
    assert kv.available + held == kv.capacity
    assert table.available + rest.numel() == table.capacity
    release_batch(rest, table, kv, mamba)
    for pool in (kv, table, mamba):
        pool.assert_full()
