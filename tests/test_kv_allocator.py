"""KV allocator: exhaustion, padding, double free, foreign index, groups, snapshots."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from terminus.kernels import (
    DoubleFree,
    ForeignIndex,
    KernelError,
    LeakError,
    StaleSnapshot,
    TokenKVAllocator,
)
from terminus.kernels import kv as kv_module
from terminus.kernels.protocols import KVAllocator


def test_alloc_returns_distinct_indices_and_never_the_padding_slot(device):
    kv = TokenKVAllocator(8, device=device, strict=True)
    got = kv.alloc(8)
    assert got is not None
    assert got.device.type == device
    assert sorted(got.tolist()) == list(range(1, 9))
    assert kv.available == 0
    kv.free(got)
    kv.assert_full()


def test_alloc_when_short_returns_none_and_takes_nothing(device):
    kv = TokenKVAllocator(8, device=device)
    a = kv.alloc(5)
    assert a is not None
    assert kv.alloc(4) is None
    assert kv.available_size() == 3
    b = kv.alloc(3)
    assert b is not None
    kv.free(a)
    kv.free(b)
    kv.assert_full()


def test_free_returns_slots_and_assert_full_passes(device):
    kv = TokenKVAllocator(16, device=device, strict=True)
    a, b = kv.alloc(5), kv.alloc(7)
    kv.free(a)
    kv.free(b)
    assert kv.available == kv.capacity == 16
    kv.assert_full()


def test_assert_full_names_leaked_slots(device):
    kv = TokenKVAllocator(4, device=device)
    got = kv.alloc(1)
    assert got is not None
    with pytest.raises(LeakError, match=rf"1 token slots still held, e.g. \[{int(got)}\]"):
        kv.assert_full()
    kv.free(got)
    kv.assert_full()


def test_strict_double_free_raises_at_the_free_and_changes_nothing(device):
    kv = TokenKVAllocator(8, device=device, strict=True)
    got = kv.alloc(3)
    assert got is not None
    kv.free(got[:1])
    with pytest.raises(DoubleFree, match=rf"double free of \[{int(got[0])}\]"):
        kv.free(got[:2])
    assert kv.available == 6
    kv.free(got[1:])
    kv.assert_full()


def test_strict_duplicate_inside_one_free_is_a_double_free(device):
    kv = TokenKVAllocator(8, device=device, strict=True)
    got = kv.alloc(2)
    assert got is not None
    with pytest.raises(DoubleFree, match=rf"double free of \[{int(got[0])}\]"):
        kv.free(torch.stack((got[0], got[0])))
    assert kv.available == 6  # the refusal changed nothing
    kv.free(got)
    kv.assert_full()


def test_padding_slot_is_never_accepted_back(device):
    kv = TokenKVAllocator(8, device=device, strict=True)
    held = kv.alloc(1)
    assert held is not None
    with pytest.raises(ForeignIndex, match=r"foreign index \[0\]: this pool only hands out"):
        kv.free(torch.tensor([0], device=device))
    assert kv.available == 7  # the refusal changed nothing
    kv.free(held)
    kv.assert_full()


def test_out_of_range_and_negative_indices_are_foreign(device):
    kv = TokenKVAllocator(8, device=device, strict=True)
    held = kv.alloc(4)
    assert held is not None
    with pytest.raises(ForeignIndex, match=r"foreign index \[-3, 9\]"):
        kv.free(torch.tensor([-3, 9], device=device))
    assert kv.available == 4  # the refusal changed nothing
    kv.free(held)
    kv.assert_full()


def test_lazy_double_free_is_recorded_without_raising_and_check_names_it(device):
    kv = TokenKVAllocator(8, device=device)
    got = kv.alloc(4)
    assert got is not None
    kv.free(got[:2])
    kv.free(got[1:3])  # got[1] twice: recorded on the device, no host sync here
    with pytest.raises(DoubleFree, match=rf"double free of \[{int(got[1])}\]"):
        kv.check()
    kv.clear()  # a lazy double free cannot be undone by a free: start the pool over
    kv.assert_full()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_lazy_duplicate_inside_one_free_is_named_by_check(dtype, device):
    kv = TokenKVAllocator(8, device=device)
    got = kv.alloc(3)
    assert got is not None
    kv.free(torch.stack((got[0], got[1], got[0])).to(dtype))  # no host sync here
    with pytest.raises(DoubleFree, match=rf"double free of \[{int(got[0])}\]"):
        kv.check()
    kv.clear()  # a lazy double free cannot be undone by a free: start the pool over
    kv.assert_full()


def test_lazy_duplicate_inside_one_large_free_is_named_by_check(device):
    kv = TokenKVAllocator(1 << 12, device=device)
    got = kv.alloc(1 << 11)
    assert got is not None
    twice = got.clone()
    twice[-1] = got[5]  # one batched free of 2,048 indices, one of them twice
    kv.free(twice.to(torch.int32))
    with pytest.raises(DoubleFree, match=rf"double free of \[{int(got[5])}\]"):
        kv.check()
    kv.clear()  # a lazy double free cannot be undone by a free: start the pool over
    kv.assert_full()


def test_duplicate_inside_one_free_handed_out_again_is_still_reported(device):
    kv = TokenKVAllocator(4, device=device)
    got = kv.alloc(4)
    assert got is not None
    kv.free(torch.stack((got[2], got[2])))
    assert kv.alloc(2) is not None  # both copies of the one slot handed out
    with pytest.raises(DoubleFree, match=rf"double free of \[{int(got[2])}\]"):
        kv.check()
    kv.clear()  # a lazy double free cannot be undone by a free: start the pool over
    kv.assert_full()


@pytest.mark.parametrize(
    ("foreign", "dtype"), [(-5, torch.int32), (0, torch.int64), (100, torch.int64)]
)
def test_lazy_foreign_free_is_named_by_check(device, foreign, dtype):
    # Negative, the padding slot, and past the end. Lazy, so nothing validates it at the
    # free: on a device the id is clamped onto a sentinel count (no device-side assert), on
    # the CPU the scatter raises out of bounds and the counts are rebuilt.
    kv = TokenKVAllocator(8, device=device)
    held = kv.alloc(4)
    assert held is not None
    kv.free(torch.tensor([foreign], dtype=dtype, device=device))
    with pytest.raises(ForeignIndex, match=rf"foreign index \[{foreign}\]"):
        kv.check()
    kv.clear()
    kv.assert_full()


def test_double_freed_slot_handed_out_again_is_still_reported(device):
    kv = TokenKVAllocator(4, device=device)
    got = kv.alloc(4)
    assert got is not None
    kv.free(got[:1])
    kv.free(got[:1])
    kv.alloc(2)  # both copies of the same slot handed out: the evidence must survive
    with pytest.raises(DoubleFree, match=rf"double free of \[{int(got[0])}\]"):
        kv.check()
    kv.clear()  # a lazy double free cannot be undone by a free: start the pool over
    kv.assert_full()


def test_more_frees_than_allocated_raise_even_when_lazy(device):
    kv = TokenKVAllocator(4, device=device)
    got = kv.alloc(1)
    assert got is not None
    kv.free(got)
    with pytest.raises(DoubleFree):
        kv.free(got)
    assert kv.available == 4  # refused before it changed anything, even lazily
    kv.assert_full()


def test_free_group_defers_frees_until_the_end(device):
    kv = TokenKVAllocator(16, device=device, strict=True)
    reqs = [kv.alloc(4) for _ in range(4)]
    kv.free_group_begin()
    for r in reqs:
        kv.free(r)
    assert kv.available == 0
    kv.free_group_end()
    assert kv.available == 16
    kv.assert_full()


def test_the_pool_reports_the_exact_device_its_tensors_are_on(device):
    # "cuda" must come back as "cuda:N": the pool compares its own tensors' device with
    # its own on every grouped free, and a mismatch would move (copy) each one.
    kv = TokenKVAllocator(8, device=device)
    got = kv.alloc(4)
    assert got is not None and got.device == kv.device
    kv.free(got)
    kv.assert_full()


@pytest.mark.parametrize("strict", [False, True])
def test_a_free_group_takes_ids_from_the_host_and_the_device_alike(device, strict):
    kv = TokenKVAllocator(16, device=device, strict=strict)
    a, b, c = kv.alloc(4), kv.alloc(4), kv.alloc(2)
    assert a is not None and b is not None and c is not None
    kv.free_group_begin()
    kv.free(a)  # on the pool's device
    kv.free(b.cpu().to(torch.int32))  # a host copy, as a scheduler's list often is
    kv.free(c.view(1, 2))  # a 2-D row
    kv.free_group_end()
    kv.check()
    kv.assert_full()


def test_strict_free_group_checks_each_free_with_the_group_before_it(device):
    kv = TokenKVAllocator(8, device=device, strict=True)
    got = kv.alloc(2)
    assert got is not None
    kv.free_group_begin()
    kv.free(got)
    with pytest.raises(DoubleFree, match=rf"\[{int(got[0])}\]"):
        kv.free(got[:1])  # refused at the free that is wrong, joining nothing
    assert kv.available == 6  # nothing goes back before the group ends
    kv.free_group_end()  # the valid frees land
    kv.assert_full()


def test_free_group_cannot_nest_or_end_twice(device):
    kv = TokenKVAllocator(4, device=device)
    kv.free_group_begin()
    with pytest.raises(KernelError, match="while a free group is open"):
        kv.free_group_begin()
    kv.free_group_end()
    with pytest.raises(KernelError, match="without free_group_begin"):
        kv.free_group_end()
    kv.assert_full()  # no group left open, nothing held


def test_restore_after_allocations_only_returns_them(device):
    kv = TokenKVAllocator(16, device=device, strict=True)
    kept = kv.alloc(3)
    snap = kv.backup_state()
    assert kv.alloc(5) is not None and kv.alloc(2) is not None
    kv.restore_state(snap)
    assert kv.available == 13
    kv.free(kept)
    kv.assert_full()


def test_restore_after_frees_returns_exactly_the_backed_up_free_set(device):
    kv = TokenKVAllocator(16, device=device, strict=True)
    a = kv.alloc(4)
    assert a is not None
    free_before = set(range(1, 17)) - set(a.tolist())
    snap = kv.backup_state()
    b = kv.alloc(6)
    assert b is not None
    kv.free(a)  # overwrites the stack positions b came from
    c = kv.alloc(8)
    assert c is not None
    kv.free(b[:2])
    kv.restore_state(snap)
    assert kv.available == 12
    got = kv.alloc(12)
    assert got is not None
    assert set(got.tolist()) == free_before
    kv.free(got)
    kv.free(a)  # freed after the backup, so allocated again after the restore
    kv.assert_full()


def test_a_snapshot_can_be_restored_twice_but_not_after_a_newer_backup(device):
    kv = TokenKVAllocator(8, device=device, strict=True)
    snap = kv.backup_state()
    kv.alloc(3)
    kv.restore_state(snap)
    kv.alloc(2)
    kv.restore_state(snap)
    assert kv.available == 8
    kv.backup_state()
    with pytest.raises(StaleSnapshot, match="restore only the latest snapshot"):
        kv.restore_state(snap)
    assert kv.available == 8  # the refused restore changed nothing
    kv.assert_full()


def test_clear_frees_everything_and_forgets_violations(device):
    kv = TokenKVAllocator(8, device=device)
    got = kv.alloc(4)
    assert got is not None
    kv.free(got[:2])
    kv.free(got[:1])
    kv.clear()
    kv.check()
    kv.assert_full()


def test_paged_alloc_rounds_to_pages_and_returns_n_token_indices(device):
    kv = TokenKVAllocator(16, page_size=4, device=device, strict=True)
    got = kv.alloc(6)
    assert got is not None
    assert got.numel() == 6
    pages = (got // 4).tolist()
    assert pages[:4] == [pages[0]] * 4 and pages[4:] == [pages[4]] * 2
    assert (got % 4).tolist() == [0, 1, 2, 3, 0, 1]
    assert 0 not in pages
    assert kv.available == 8
    kv.free(got)
    kv.assert_full()


def test_paged_free_of_token_indices_frees_their_pages_once(device):
    kv = TokenKVAllocator(16, page_size=4, device=device, strict=True)
    got = kv.alloc(6)
    assert got is not None
    kv.free(got)
    kv.assert_full()


def test_paged_padding_page_is_foreign(device):
    kv = TokenKVAllocator(16, page_size=4, device=device, strict=True)
    held = kv.alloc(4)
    assert held is not None
    with pytest.raises(
        ForeignIndex, match=r"foreign index \[0\]: this pool only hands out pages 1..4"
    ):
        kv.free(torch.tensor([2], device=device))
    assert kv.available == 12  # the refusal changed nothing
    kv.free(held)
    kv.assert_full()


def test_size_must_be_a_multiple_of_the_page_size():
    with pytest.raises(ValueError, match="not a multiple of page_size 4; use 8"):
        TokenKVAllocator(10, page_size=4)


def test_int32_rows_from_the_request_table_are_accepted(device):
    kv = TokenKVAllocator(8, device=device, strict=True)
    got = kv.alloc(3)
    assert got is not None
    kv.free(got.to(torch.int32))
    kv.assert_full()


def test_our_allocator_satisfies_the_protocol():
    assert isinstance(TokenKVAllocator(4), KVAllocator)


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "free", "backup", "restore"]), st.integers(0, 9)),
    max_size=40,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=ops, page_size=st.sampled_from([1, 2, 4]), strict=st.booleans())
def test_any_sequence_keeps_accounting_and_never_hands_out_twice(ops, page_size, strict, device):
    kv = TokenKVAllocator(32, page_size=page_size, device=device, strict=strict)
    held: list[torch.Tensor] = []
    snap = None
    snap_held: list[torch.Tensor] = []
    for op, k in ops:
        if op == "alloc":
            got = kv.alloc(k)
            in_use = {t // page_size for h in held for t in h.tolist()}
            if got is None:
                assert kv.available < k
                continue
            pages = {t // page_size for t in got.tolist()}
            assert not pages & in_use
            assert 0 not in pages
            held.append(got)
        elif op == "free" and held:
            kv.free(held.pop(k % len(held)))
        elif op == "backup":
            snap, snap_held = kv.backup_state(), list(held)
        elif op == "restore" and snap is not None:
            kv.restore_state(snap)
            held = list(snap_held)
        allocated = sum(-(-h.numel() // page_size) * page_size for h in held)
        assert kv.available + allocated == kv.capacity
    kv.check()
    for h in held:
        kv.free(h)
    kv.assert_full()


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_a_float_free_is_refused_naming_its_values_never_truncated(device, strict, page_size):
    kv = TokenKVAllocator(16, page_size=page_size, device=device, strict=strict)
    got = kv.alloc(3)
    assert got is not None
    before = kv.available
    with pytest.raises(TypeError, match=r"indices must be integers, got torch.float32 \[.*\]"):
        kv.free(got.float() + 0.5)
    with pytest.raises(TypeError, match=r"indices must be integers, got values \[1.5\]"):
        kv.free([1.5])
    with pytest.raises(TypeError, match=r"got torch.bool"):
        kv.free(torch.ones(2, dtype=torch.bool, device=device))
    assert kv.available == before  # nothing was freed
    kv.free(got)
    kv.assert_full()


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("n", [-1, -3, -5])
def test_a_negative_alloc_is_refused_naming_the_value(device, page_size, n):
    kv = TokenKVAllocator(16, page_size=page_size, device=device)
    with pytest.raises(ValueError, match=rf"cannot allocate a negative number .*\({n}\)"):
        kv.alloc(n)
    assert kv.available == kv.capacity
    kv.assert_full()


def test_a_float_free_inside_a_free_group_is_refused_at_the_free(device):
    kv = TokenKVAllocator(16, device=device)
    got = kv.alloc(2)
    assert got is not None
    kv.free_group_begin()
    with pytest.raises(TypeError, match="indices must be integers"):
        kv.free(got.double())
    kv.free(got)
    kv.free_group_end()
    kv.assert_full()


@pytest.fixture(params=["host", "numpy", "tensor"])
def pages_path(request, monkeypatch):
    """A paged free finds its pages in Python (a few tokens on a CPU), with numpy (many
    tokens on a CPU) or with tensor ops (a device's way, run here on the CPU too)."""
    if request.param != "host":
        monkeypatch.setattr(kv_module, "_HOST_PAGES", 0)
    if request.param == "tensor":
        monkeypatch.setattr(kv_module, "_NP_PAGES", False)
    return request.param


@pytest.mark.parametrize("strict", [False, True])
def test_a_paged_free_pushes_each_page_once_in_page_order(device, pages_path, strict):
    kv = TokenKVAllocator(32, page_size=4, device=device, strict=strict)
    a, b = kv.alloc(10), kv.alloc(5)  # pages of 3 and 2
    assert a is not None and b is not None
    kv.free(torch.cat((b, a, a[:3])).to(torch.int32))  # a's first page named twice
    top = kv._free.available
    pushed = kv._free._stack[top - 5 : top].tolist()
    assert pushed == sorted({t // 4 for t in a.tolist() + b.tolist()})
    kv.assert_full()


def test_a_paged_free_of_a_negative_token_is_named_as_foreign(device, pages_path):
    kv = TokenKVAllocator(32, page_size=4, device=device, strict=True)
    with pytest.raises(ForeignIndex, match=r"\[-1\]"):
        kv.free(torch.tensor([-3, 5], device=device))
    kv.assert_full()
    lazy = TokenKVAllocator(32, page_size=4, device=device)
    got = lazy.alloc(8)  # two pages: the free below (two pages) fits the stack
    assert got is not None
    lazy.free(torch.cat((got[:4], torch.tensor([-3], device=device))))
    with pytest.raises(ForeignIndex, match=r"\[-1\]"):
        lazy.check()


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("seed", range(4))
def test_free_host_pushes_what_free_of_the_same_tensor_pushes(page_size, seed, monkeypatch):
    # Two pools under the same random allocs and frees; one frees numpy arrays (int32
    # or int64, views of a table row included) with free_host, the other the same ids
    # as tensors with free: the free lists and counts stay equal, on each pages path.
    import numpy as np

    from terminus.kernels import kv as kv_mod

    rng = np.random.default_rng(seed)
    a = TokenKVAllocator(1024, page_size=page_size)
    b = TokenKVAllocator(1024, page_size=page_size)
    held: list[np.ndarray] = []
    for step in range(40):
        monkeypatch.setattr(kv_mod, "_HOST_PAGES", 192 if step % 2 else 0)
        if rng.random() < 0.6 or not held:
            n = int(rng.integers(1, 300))
            ga, gb = a.alloc(n), b.alloc(n)
            assert (ga is None) == (gb is None)
            if ga is not None:
                assert gb is not None and torch.equal(ga, gb)
                held.append(ga.numpy().copy())
        else:
            ids = held.pop(int(rng.integers(len(held))))
            arr = ids.astype(np.int32) if rng.random() < 0.5 else ids
            if rng.random() < 0.3:
                arr = arr[::-1]  # a view with a negative stride
            a.free_host(arr)
            b.free(torch.from_numpy(arr.copy()))
        top = a._free._top
        assert top == b._free._top
        assert torch.equal(a._free._stack[:top], b._free._stack[:top])
        assert torch.equal(a._free._count, b._free._count)
    for ids in held:
        a.free_host(ids)
        b.free(torch.from_numpy(ids))
    assert torch.equal(a._free._stack, b._free._stack)
    a.assert_full()
    b.assert_full()


def test_free_host_refuses_what_is_not_a_1d_integer_array():
    kv = TokenKVAllocator(16, page_size=4)
    with pytest.raises(TypeError, match="free_host takes a 1-D numpy array of integer"):
        kv.free_host(torch.tensor([1]))  # type: ignore[arg-type]
    import numpy as np
    with pytest.raises(TypeError, match="free_host takes a 1-D numpy array of integer"):
        kv.free_host(np.array([4.0]))
    kv.free_host(np.array([], dtype=np.int64))  # nothing to free
    kv.assert_full()


@pytest.mark.parametrize("page_size", [2, 4, 16])
@pytest.mark.parametrize("seed", range(3))
def test_a_paged_alloc_gathers_from_its_token_table_what_the_broadcast_builds(
        page_size, seed, monkeypatch):
    # Two pools under the same random allocs and frees: one builds an alloc's tokens by
    # gathering its pages' rows from the token table, the other (_TOKEN_TABLE_SLOTS 0:
    # no table) by the broadcast multiply-add. Same tokens, same free lists and counts;
    # a caller that writes into what alloc returned never touches the pool's table.
    import numpy as np

    from terminus.kernels import kv as kv_mod

    rng = np.random.default_rng(seed)
    a = TokenKVAllocator(512, page_size=page_size)
    monkeypatch.setattr(kv_mod, "_TOKEN_TABLE_SLOTS", 0)
    b = TokenKVAllocator(512, page_size=page_size)
    assert a._page_tokens is not None and b._page_tokens is None
    table = a._page_tokens.copy()
    held: list[torch.Tensor] = []
    for _ in range(60):
        if rng.random() < 0.6 or not held:
            n = int(rng.integers(0, 200))
            ga, gb = a.alloc(n), b.alloc(n)
            assert (ga is None) == (gb is None)
            if ga is not None:
                assert gb is not None and torch.equal(ga, gb) and ga.numel() == n
                held.append(ga)
                ga.fill_(-1)  # the caller's own memory: the pool's table is untouched
                held[-1] = gb.clone()
        else:
            ids = held.pop(int(rng.integers(len(held))))
            a.free(ids)
            b.free(ids)
        top = a._free._top
        assert top == b._free._top
        assert torch.equal(a._free._stack[:top], b._free._stack[:top])
        assert torch.equal(a._free._count, b._free._count)
    assert np.array_equal(a._page_tokens, table)
    for ids in held:
        a.free(ids)
        b.free(ids)
    a.assert_full()
    b.assert_full()


def test_pop_view_takes_the_same_ids_as_pop_host():
    from terminus.kernels._stack import FreeStack

    a, b = FreeStack("a", 1, 64), FreeStack("b", 1, 64)
    for n in (1, 3, 8, 9, 30, 0):
        va, gb = a.pop_view(n), b.pop_host(n)
        assert va is not None and gb is not None and va[0].tolist() == gb.tolist()
        assert va[1] == (n > 0)  # checked on the host (none to check for n = 0)
        assert torch.equal(a._count, b._count) and a.available == b.available
    assert a.pop_view(64) is None  # short: nothing taken
    assert a.available == b.available


@pytest.mark.parametrize("foreign", [10_000, -8, 0])
def test_a_paged_alloc_after_a_foreign_free_computes_its_tokens_never_indexes_them(foreign):
    # Non-strict: a foreign free is recorded and named by check(). The alloc that pops it
    # must not index the pool's page-token table with it (an id above range raised a bare
    # numpy IndexError after popping; a negative one wrapped onto a live page's tokens):
    # the tokens are computed from the page, as the pool without the table does.
    out = []
    for table in (True, False):
        a = TokenKVAllocator(64, page_size=4, strict=False)
        if not table:
            a._page_tokens = None  # the broadcast path: the reference
        held = a.alloc(60)
        a.free(torch.tensor([foreign]))
        got = a.alloc(4)
        again = a.alloc(4)
        with pytest.raises(ForeignIndex, match=r"foreign index"):
            a.check()
        out.append((got.tolist(), again.tolist(), a.available))
        assert not set(got.tolist()) & set(held.tolist())
    assert out[0] == out[1]
    assert out[0][0] == [foreign // 4 * 4 + i for i in range(4)] or foreign == 0
