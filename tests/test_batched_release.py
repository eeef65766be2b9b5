"""Batched release: one free call per pool for all of a step's terminal requests."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from terminus.kernels import (
    DoubleFree,
    MambaStatePool,
    ReqToTokenTable,
    TokenKVAllocator,
    batched,
    release_batch,
)
from terminus.kernels.batched import gather_kv, repeat_rows

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import ExceptionGroup


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


@pytest.fixture(autouse=True, params=["rows", "vector", "tensor"])
def release_path(request, monkeypatch):
    """Each test runs on each way a release reads the table: a CPU table's few rows one
    at a time (``rows``) or vectorized in numpy (``vector``), or tensor ops (``tensor``:
    what a device table takes, run here on the CPU)."""
    if request.param == "vector":
        monkeypatch.setattr(batched, "_HOST_ROWS", 0)
    elif request.param == "tensor":
        monkeypatch.setattr(batched, "_HOST_RELEASE", False)
    return request.param


def setup(lengths, device, page_size=1, strict=True):
    kv = TokenKVAllocator(256, page_size=page_size, device=device, strict=strict)
    table = ReqToTokenTable(8, 64, device, strict=strict)
    mamba = MambaStatePool(8, 1, 4, 2, 1, 2, 2, device, strict=strict)
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


def test_releases_every_pool_with_one_free_call_each(device):
    kv, table, mamba, slots = setup([3, 1, 5], device)
    ckv, cmamba, ctab = Counting(kv), Counting(mamba), Counting(table)
    out = release_batch(slots, table, ckv, cmamba, req_slots=ctab)
    assert (ckv.frees, cmamba.frees, ctab.frees) == (1, 1, 1)
    assert (out.requests, out.kv_tokens, out.mamba_slots) == (3, 9, 3)
    for pool in (kv, table, mamba):
        pool.assert_full()


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_free_replaced_on_the_pool_itself_is_called(device, page_size):
    # A wrapper set on the instance (`terminus bench e2e`'s pool clock, a user's
    # counter) sees the release: our own pools' direct pushes would go around it.
    kv, table, mamba, slots = setup([3, 1, 5], device, page_size=page_size)
    seen: dict[str, list[list[int]]] = {"kv": [], "mamba": [], "table": []}
    for name, pool in (("kv", kv), ("mamba", mamba), ("table", table)):
        def free(ids, _inner=pool.free, _name=name):
            seen[_name].append(sorted(torch.as_tensor(ids).tolist()))
            return _inner(ids)
        pool.free = free
    out = release_batch(slots, table, kv, mamba)
    assert (out.requests, out.kv_tokens, out.mamba_slots) == (3, 9, 3)
    assert len(seen["kv"]) == len(seen["mamba"]) == len(seen["table"]) == 1
    assert len(seen["kv"][0]) == 9 and len(seen["mamba"][0]) == 3
    assert seen["table"][0] == sorted(slots.tolist())
    for pool in (kv, table, mamba):
        pool.assert_full()


def test_a_table_subclass_free_gets_the_released_slots(device):
    kv, table, mamba, slots = setup([2, 3], device)
    freed: list[list[int]] = []

    class Table(ReqToTokenTable):
        def free(self, ids):
            freed.append(sorted(torch.as_tensor(ids).tolist()))
            return super().free(ids)

    table.__class__ = Table
    release_batch(slots, table, kv, mamba)
    assert freed == [sorted(slots.tolist())]
    for pool in (kv, table, mamba):
        pool.assert_full()


def test_releases_only_the_given_requests(device):
    kv, table, mamba, slots = setup([2, 4, 6], device)
    keep = int(slots[1])
    release_batch(slots[[0, 2]], table, kv, mamba)
    assert kv.available == kv.capacity - 4
    assert table.available == table.capacity - 1
    assert mamba.available == mamba.capacity - 1
    assert int(table.lengths[keep]) == 4
    release_batch([keep], table, kv, mamba)
    for pool in (kv, table, mamba):
        pool.assert_full()


def test_uniform_and_mixed_lengths_free_exactly_the_owned_tokens(device):
    for lengths in ([4, 4, 4], [1, 7, 0, 3]):
        kv, table, mamba, slots = setup(lengths, device)
        release_batch(slots, table, kv, mamba)
        for pool in (kv, table, mamba):
            pool.assert_full()


def test_kv_start_leaves_a_shared_prefix_to_its_owner(device):
    kv, table, mamba, slots = setup([5, 3], device)
    prefix = [table.tokens(int(s))[:2].clone() for s in slots]
    release_batch(slots, table, kv, mamba, kv_start=torch.tensor([2, 2], device=device))
    assert kv.available == kv.capacity - 4
    kv.free(torch.cat(prefix))
    for pool in (kv, table, mamba):
        pool.assert_full()


def test_paged_pool_frees_each_page_once_even_when_lengths_end_mid_page(device):
    kv, table, mamba, slots = setup([5, 3, 8], device, page_size=4)
    release_batch(slots, table, kv, mamba)
    for pool in (kv, table, mamba):
        pool.assert_full()


def test_releasing_a_request_twice_is_a_double_free(device):
    kv, table, mamba, slots = setup([2], device)
    release_batch(slots, table, kv, mamba)
    with pytest.raises(DoubleFree):
        release_batch(slots, table, kv, mamba)
    for pool in (kv, table, mamba):  # the refused second release changed nothing
        pool.assert_full()


def test_a_token_shared_by_two_released_rows_is_named_by_check(device):
    kv, table, mamba, slots = setup([3, 3], device, strict=False)
    shared = int(table.req_to_token[slots[0], 1])
    table.req_to_token[slots[1], 2] = shared  # a second owner of one token (a bug upstream)
    release_batch(slots, table, kv, mamba)  # one free call, the token in it twice
    with pytest.raises(DoubleFree, match=rf"double free of \[{shared}\]"):
        kv.check()
    table.assert_full()  # the other pools got everything back
    mamba.assert_full()
    kv.clear()  # a lazy double free cannot be undone by a free: start the KV pool over
    kv.assert_full()


def test_strict_batch_with_a_shared_token_raises_before_freeing_anything(device):
    kv, table, mamba, slots = setup([4, 2], device)
    real = int(table.req_to_token[slots[1], 1])
    shared = int(table.req_to_token[slots[0], 0])
    table.req_to_token[slots[1], 1] = shared
    before = kv.available
    with pytest.raises(DoubleFree, match=rf"double free of \[{shared}\]"):
        release_batch(slots, table, kv, mamba)
    assert kv.available == before
    table.req_to_token[slots[1], 1] = real  # the owner repairs its row and releases again
    release_batch(slots, table, kv, mamba)
    for pool in (kv, table, mamba):
        pool.assert_full()


def test_releasing_a_request_twice_lazily_is_named_by_both_checks(device):
    kv, table, mamba, slots = setup([2, 3], device, strict=False)
    tokens = table.tokens(int(slots[0])).clone()
    release_batch(slots[:1], table, kv, mamba)
    table.lengths[slots[0]] = 2  # a stale row released again
    table.req_to_token[slots[0], :2] = tokens
    release_batch(slots[:1], table, kv)
    with pytest.raises(DoubleFree, match=rf"double free of \[{int(tokens[0])}, {int(tokens[1])}\]"):
        kv.check()
    with pytest.raises(DoubleFree, match=rf"double free of \[{int(slots[0])}\]"):
        table.check()
    mamba.free(table.mamba_slots[slots[1]])  # the one pool the second release left intact
    mamba.assert_full()
    # Lazy double frees cannot be undone by a free (and slots[1]'s KV tokens and slot
    # would overflow the corrupted free lists): start both pools over.
    kv.clear()
    kv.assert_full()
    table.clear()
    table.assert_full()


def test_a_release_inside_a_kv_free_group_keeps_its_tokens_not_the_table_row(device):
    kv, table, mamba, slots = setup([3], device, strict=False)
    tokens = table.tokens(int(slots[0])).tolist()
    kv.free_group_begin()
    release_batch(slots, table, kv, mamba)
    assert kv.available == kv.capacity - 3  # held by the open group
    again = table.alloc(1)  # the slot is reused and its row overwritten before group end
    assert again is not None and int(again[0]) == int(slots[0])
    table.write(int(again[0]), 0, torch.tensor([7, 8, 9], device=device))
    kv.free_group_end()
    assert sorted(kv._free._stack[kv.available - 3 : kv.available].tolist()) == sorted(tokens)
    table.free(again)
    for pool in (kv, table, mamba):
        pool.assert_full()


def test_a_lazy_release_after_a_backup_is_undone_by_restore(device):
    kv, table, mamba, slots = setup([4, 2], device, strict=False)
    held = sorted(table.tokens(int(slots[0])).tolist() + table.tokens(int(slots[1])).tolist())
    snap = kv.backup_state()
    release_batch(slots, table, kv, mamba)
    kv.assert_full()
    kv.restore_state(snap)  # the released tokens are allocated again, as at the backup
    assert kv.available == kv.capacity - 6
    assert sorted(kv.held(limit=16)) == held
    kv.free(torch.tensor(held, device=device))
    for pool in (kv, table, mamba):
        pool.assert_full()


def test_empty_batch_releases_nothing(device):
    kv, table, mamba, slots = setup([2], device)
    out = release_batch(torch.empty(0, dtype=torch.int64, device=device), table, kv, mamba)
    assert out.requests == 0
    assert kv.available == kv.capacity - 2
    assert table.available == table.capacity - 1
    assert mamba.available == mamba.capacity - 1
    release_batch(slots, table, kv, mamba)
    for pool in (kv, table, mamba):
        pool.assert_full()


def test_lazy_pools_without_a_mamba_pool_release_mixed_lengths(device):
    kv = TokenKVAllocator(256, device=device)
    table = ReqToTokenTable(4, 32, device)
    slots = table.alloc(3)
    assert slots is not None
    for s, n in zip(slots.tolist(), [3, 5, 7], strict=True):
        got = kv.alloc(n)
        assert got is not None
        table.write(s, 0, got)
    out = release_batch(slots, table, kv)
    assert (out.requests, out.kv_tokens, out.mamba_slots) == (3, 15, 0)
    kv.assert_full()
    table.assert_full()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=8), st.sampled_from([1, 4]), st.data())
def test_any_batch_returns_everything_and_leaves_the_rest(device, lengths, page_size, data):
    kv, table, mamba, slots = setup(lengths, device, page_size=page_size)
    pick = data.draw(st.lists(st.booleans(), min_size=len(lengths), max_size=len(lengths)))
    mask = torch.tensor(pick, dtype=torch.bool, device=device)
    first, rest = slots[mask], slots[~mask]
    release_batch(first, table, kv, mamba)
    held = sum(-(-n // page_size) * page_size for n, p in zip(lengths, pick, strict=True) if not p)
    assert kv.available + held == kv.capacity
    assert table.available + rest.numel() == table.capacity
    release_batch(rest, table, kv, mamba)
    for pool in (kv, table, mamba):
        pool.assert_full()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.data())
def test_gather_kv_returns_each_rows_owned_columns_in_order(device, data):
    rows, width = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 9))
    table = ReqToTokenTable(rows, width, device)
    table.req_to_token.copy_(torch.arange(rows * width, dtype=torch.int32).view(rows, width))
    lengths = data.draw(st.lists(st.integers(0, width), min_size=rows, max_size=rows))
    table.lengths.copy_(torch.tensor(lengths, dtype=torch.int32))
    slots = data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=rows, unique=True))
    starts = data.draw(
        st.none() | st.lists(st.integers(0, width), min_size=len(slots), max_size=len(slots))
    )
    got = gather_kv(
        table,
        torch.tensor(slots, device=device),
        None if starts is None else torch.tensor(starts, dtype=torch.int32, device=device),
    )
    want = [
        s * width + c
        for i, s in enumerate(slots)
        for c in range(0 if starts is None else starts[i], lengths[s])
    ]
    assert got.dtype == torch.int32
    assert got.device.type == device
    assert got.tolist() == want
    table.assert_full()  # reading rows takes no slot


def test_gather_kv_takes_slots_and_starts_from_the_host(device):
    table = ReqToTokenTable(3, 4, device)
    table.req_to_token.copy_(torch.arange(12, dtype=torch.int32).view(3, 4))
    table.lengths.copy_(torch.tensor([4, 2, 3], dtype=torch.int32))
    assert gather_kv(table, torch.tensor([2, 0])).tolist() == [8, 9, 10, 0, 1, 2, 3]
    got = gather_kv(table, torch.tensor([0, 1]), torch.tensor([1, 0]))
    assert got.device.type == device and got.tolist() == [1, 2, 3, 4, 5]
    table.assert_full()  # reading rows takes no slot


def test_a_refused_kv_free_keeps_the_rows_so_their_tokens_stay_findable(device):
    # A strict KV pool refuses the batch's free (one row names a token another row owns).
    # The Mamba states still go back, but the request slots and lengths stay: the tokens
    # the rows legitimately own are still listed there, not leaked with a freed slot.
    kv, table, mamba, slots = setup([4, 2], device)
    real = int(table.req_to_token[slots[1], 1])
    shared = int(table.req_to_token[slots[0], 0])
    table.req_to_token[slots[1], 1] = shared  # strict KV will refuse the whole free
    before = kv.available
    with pytest.raises(DoubleFree, match=rf"double free of \[{shared}\]"):
        release_batch(slots, table, kv, mamba)
    assert kv.available == before  # the refused KV free changed nothing
    mamba.assert_full()  # the Mamba states went back, and their table entries with them
    assert table.mamba_slots.index_select(0, slots).tolist() == [0, 0]
    assert table.available == table.capacity - 2  # the rows are still held...
    assert table.lengths.index_select(0, slots).tolist() == [4, 2]  # ...with their tokens
    table.req_to_token[slots[1], 1] = real  # repaired, the same release frees each unit once
    out = release_batch(slots, table, kv, mamba)
    assert (out.requests, out.kv_tokens, out.mamba_slots) == (2, 6, 0)
    for pool in (kv, table, mamba):
        pool.assert_full()


class Refusing:
    """A pool whose free raises (changing nothing) until told to accept."""

    def __init__(self, inner):
        self.inner = inner
        self.refuse = True

    def free(self, ids):
        if self.refuse:
            raise RuntimeError("refused")
        self.inner.free(ids)


def test_a_refused_mamba_free_keeps_the_rows_so_their_mamba_slots_stay_findable(device):
    kv, table, mamba, slots = setup([3, 5], device)
    held = table.mamba_slots.index_select(0, slots).tolist()
    refusing = Refusing(mamba)
    with pytest.raises(RuntimeError, match="refused"):
        release_batch(slots, table, kv, refusing)
    kv.assert_full()  # the KV tokens went back (and the rows' lengths with them)
    assert table.lengths.index_select(0, slots).tolist() == [0, 0]
    assert table.mamba_slots.index_select(0, slots).tolist() == held  # still findable
    assert table.available == table.capacity - 2
    refusing.refuse = False
    out = release_batch(slots, table, kv, refusing)
    assert (out.requests, out.kv_tokens, out.mamba_slots) == (2, 0, 2)
    for pool in (kv, table, mamba):
        pool.assert_full()


def test_two_refusing_pools_raise_both_errors_and_free_no_slot(device):
    kv, table, mamba, slots = setup([2, 2], device)
    bad_kv, bad_mamba = Refusing(kv), Refusing(mamba)
    with pytest.raises(ExceptionGroup, match="several pools refused") as info:
        release_batch(slots, table, bad_kv, bad_mamba)
    assert len(info.value.exceptions) == 2
    assert table.available == table.capacity - 2
    assert table.lengths.index_select(0, slots).tolist() == [2, 2]
    bad_kv.refuse = bad_mamba.refuse = False
    release_batch(slots, table, bad_kv, bad_mamba)
    for pool in (kv, table, mamba):
        pool.assert_full()


def test_a_float_slot_tensor_is_refused_naming_it(device):
    kv, table, mamba, slots = setup([2], device)
    with pytest.raises(TypeError, match=r"release_batch: indices must be integers, got torch"):
        release_batch(slots.double(), table, kv, mamba)
    release_batch(slots, table, kv, mamba)
    for pool in (kv, table, mamba):
        pool.assert_full()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.integers(0, 6), max_size=10), st.booleans())
def test_repeat_rows_is_repeat_interleave(device, counts, pass_total):
    c = torch.tensor(counts, dtype=torch.int64, device=device)
    got = repeat_rows(c, sum(counts) if pass_total else None)
    assert got.device.type == device and got.dtype == torch.int64
    assert got.tolist() == torch.repeat_interleave(c).tolist()


@pytest.mark.parametrize("bad", [-1, 8, 100])
def test_a_slot_out_of_range_is_refused_changing_nothing(device, bad):
    kv, table, mamba, slots = setup([3, 2], device)
    before = (kv.available, table.available, mamba.available, table.lengths.tolist())
    with pytest.raises(IndexError):
        release_batch(torch.cat((slots, torch.tensor([bad], device=device))), table, kv, mamba)
    assert (kv.available, table.available, mamba.available, table.lengths.tolist()) == before
    release_batch(slots, table, kv, mamba)
    for pool in (kv, table, mamba):
        pool.assert_full()


@pytest.mark.parametrize(
    ("starts", "match"),
    [([0, -1], r"kv_start \[-1\] is negative"), ([0], "kv_start has 1 entries for 2 slots")],
)
def test_bad_kv_starts_are_refused_changing_nothing(device, starts, match):
    kv, table, mamba, slots = setup([3, 2], device)
    before = (kv.available, table.available, mamba.available, table.lengths.tolist())
    with pytest.raises(ValueError, match=match):
        release_batch(slots, table, kv, mamba, kv_start=torch.tensor(starts, device=device))
    assert (kv.available, table.available, mamba.available, table.lengths.tolist()) == before
    release_batch(slots, table, kv, mamba)
    for pool in (kv, table, mamba):
        pool.assert_full()


@pytest.mark.parametrize("starts", [[0.0, 1.5], [True, False]])
def test_kv_starts_that_are_not_integers_are_refused_changing_nothing(device, starts):
    kv, table, mamba, slots = setup([3, 2], device)
    before = (kv.available, table.available, mamba.available, table.lengths.tolist())
    with pytest.raises(TypeError, match="kv_start: indices must be integers"):
        release_batch(slots, table, kv, mamba, kv_start=torch.tensor(starts, device=device))
    assert (kv.available, table.available, mamba.available, table.lengths.tolist()) == before
    release_batch(slots, table, kv, mamba)
    for pool in (kv, table, mamba):
        pool.assert_full()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.data())
def test_any_batch_with_starts_frees_exactly_the_owned_columns(device, data):
    lengths = data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=8))
    kv = TokenKVAllocator(256, device=device, strict=True)
    table = ReqToTokenTable(8, 9, device, strict=True)
    slots = table.alloc(len(lengths))
    assert slots is not None
    owned = []
    for s, n in zip(slots.tolist(), lengths, strict=True):
        got = kv.alloc(n)
        assert got is not None
        table.write(s, 0, got)
        owned.append(got.tolist())
    starts = [data.draw(st.integers(0, 10)) for _ in lengths]
    pick = data.draw(st.permutations(range(len(lengths))))
    # The columns before each start stay with their owner (a cached prefix): freed here.
    kv.free(torch.tensor([t for i in pick for t in owned[i][: starts[i]]], dtype=torch.int64,
                         device=device))
    firsts = [starts[i] for i in pick]  # as a list of ints or as a tensor
    out = release_batch(slots[list(pick)], table, kv, kv_start=firsts if data.draw(
        st.booleans()) else torch.tensor(firsts, device=device))
    assert out.kv_tokens == sum(max(0, n - s) for n, s in zip(lengths, starts, strict=True))
    kv.assert_full()
    table.assert_full()


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_cpu_table_over_a_kv_pool_whose_free_list_is_on_a_device_frees_through_free(
        page_size):
    # A CPU request table may sit over a KV pool on a GPU (`SchedulerPools` accepts it):
    # that pool's free list has no host view (`FreeStack` leaves `_stack_host` None off
    # the CPU), so the release frees through `free()`, which moves the ids to it. Here
    # a CPU pool without its host view stands in for the device one.
    kv, table, mamba, slots = setup([6, 5], "cpu", page_size=page_size)
    kv._free._stack_host = None  # as on a device
    res = release_batch(slots[:1], table, kv, mamba, req_slots=table)
    assert (res.kv_tokens, res.requests) == (6, 1)
    assert kv.available == 256 - (8 if page_size == 4 else 5)  # the second row's alone
    release_batch(slots[1:], table, kv, mamba, req_slots=table)
    for pool in (kv, table, mamba):
        pool.assert_full()


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("lengths", [[5], [3, 0, 7], [9, 4, 4, 1, 6]])
def test_kv_start_as_a_list_releases_what_the_tensor_releases(device, lengths, page_size):
    # A scheduler's host-computed first columns, as a list of ints: the same tokens,
    # pages and slots go back in the same order as for the same starts as a tensor.
    def run(as_list):
        kv, table, mamba, slots = setup(lengths, device, page_size)
        firsts = [min(n, 2 * page_size) if i % 2 else 0 for i, n in enumerate(lengths)]
        out = release_batch(slots, table, kv, mamba, kv_start=firsts if as_list else
                            torch.tensor(firsts, device=device))
        # What stays held (the columns before each start) and the free lists' order.
        left = [table.req_to_token[s, :f].tolist()
                for s, f in zip(slots.tolist(), firsts, strict=True)]
        got_kv, got_rows = kv.alloc(kv.available), table.alloc(table.available)
        assert got_kv is not None and got_rows is not None
        seen = (out, left, got_kv.tolist(), got_rows.tolist(), table.lengths.tolist(),
                mamba.available)
        kv.free(got_kv)  # all back: what was taken, and the prefixes the starts kept
        table.free(got_rows)
        kv.free(torch.tensor([t for run in left for t in run], dtype=torch.int64,
                             device=device))
        for pool in (kv, table, mamba):
            pool.assert_full()
        return seen
    assert run(True) == run(False)


@pytest.mark.parametrize(("starts", "error", "match"), [
    ([0, -1], ValueError, r"kv_start \[-1\] is negative"),
    ([0], ValueError, "kv_start has 1 entries for 2 slots"),
    ([0, 1.5], TypeError, r"kv_start \[0, 1.5\] holds something other than Python ints"),
    ([True, 0], TypeError, r"kv_start \[True, 0\] holds something other than Python ints"),
    ((0, 1), TypeError, "kv_start is a tuple; pass an int tensor or a list"),
])
def test_bad_kv_start_lists_are_refused_changing_nothing(device, starts, error, match):
    kv, table, mamba, slots = setup([3, 2], device)
    before = (kv.available, table.available, mamba.available, table.lengths.tolist())
    with pytest.raises(error, match=match):
        release_batch(slots, table, kv, mamba, kv_start=starts)
    assert (kv.available, table.available, mamba.available, table.lengths.tolist()) == before
    release_batch(slots, table, kv, mamba)
    for pool in (kv, table, mamba):
        pool.assert_full()
