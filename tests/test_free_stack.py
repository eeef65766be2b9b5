"""Edge cases of the free list every id pool shares (kernels/_stack.py): the sentinel slots
that foreign ids land on, and counts kept modulo 256."""

from __future__ import annotations

import pytest
import torch

from terminus.kernels import DoubleFree, ForeignIndex, ReqToTokenTable, TokenKVAllocator, _stack


@pytest.fixture(autouse=True, params=["loop", "scatter", "bytes"])
def fold_path(request, monkeypatch):
    """Each test runs with a CPU's few-id folds and pop checks done id by id through a
    memoryview (``loop``), with the scatter and numpy ops that larger ones take
    (``scatter``), and with every pop checked as many ids are (``bytes``: one gather of
    their counts and a bytes comparison)."""
    if request.param in ("scatter", "bytes"):
        monkeypatch.setattr(_stack, "_HOST_FOLD", 0)
        monkeypatch.setattr(_stack, "_HOST_TAKE", 0)
    if request.param == "scatter":  # pops of more than _HOST_POP ids: torch ops
        monkeypatch.setattr(_stack, "_HOST_POP_BYTES", 0)
    if request.param == "bytes":
        monkeypatch.setattr(_stack, "_HOST_POP", 0)
    return request.param

@pytest.mark.parametrize("foreign", [[100], [9], [0], [100, 101]])
def test_a_single_foreign_id_handed_out_again_is_still_reported(device, foreign):
    # Freed lazily, then popped by the next alloc before any check(): the only evidence
    # left is the sentinel it was counted on.
    kv = TokenKVAllocator(8, device=device)
    held = kv.alloc(8)
    assert held is not None
    kv.free(torch.tensor(foreign, device=device))
    got = kv.alloc(len(foreign))
    assert got is not None and sorted(got.tolist()) == sorted(foreign)
    with pytest.raises(ForeignIndex, match="foreign index"):
        kv.check()
    kv.clear()
    kv.assert_full()


def test_a_foreign_slot_below_a_zero_based_range_is_reported_after_reuse(device):
    # Request slots start at 0, so -1 maps onto sentinel slot 0 without any bounds error.
    table = ReqToTokenTable(4, 4, device)
    held = table.alloc(4)
    assert held is not None
    table.free([-1])
    assert table.alloc(1) is not None
    with pytest.raises(ForeignIndex, match=r"foreign index \[-1\]"):
        table.check()
    table.clear()
    table.assert_full()


@pytest.mark.parametrize("copies", [2, 255, 256, 257, 512, 513])
def test_many_copies_of_one_id_are_named_even_when_its_count_wraps(device, copies):
    kv = TokenKVAllocator(1024, device=device)
    held = kv.alloc(1024)
    assert held is not None
    kv.free(torch.full((copies,), 5, device=device))
    with pytest.raises(DoubleFree, match=r"double free of \[5\]"):
        kv.check()
    kv.clear()
    kv.assert_full()


def test_wrapped_copies_popped_back_out_are_still_reported(device):
    # 257 copies: the count reads 1 (mod 256), so popping one copy looks clean; the 256
    # left in the free list make the counts' sum disagree with the free list's length.
    kv = TokenKVAllocator(1024, device=device)
    held = kv.alloc(1024)
    assert held is not None
    kv.free(torch.full((257,), 7, device=device))
    assert kv.alloc(1) is not None
    with pytest.raises(DoubleFree, match=r"double free of \[7\]"):
        kv.check()
    kv.clear()
    kv.assert_full()


def test_a_clean_pool_passes_check_after_many_cycles(device):
    kv = TokenKVAllocator(300, device=device)
    for _ in range(3):
        parts = [kv.alloc(100) for _ in range(3)]
        for p in parts:
            assert p is not None
            kv.free(p)
        kv.check()
    kv.assert_full()


def test_a_correct_free_after_an_unchecked_lazy_double_free_names_the_double_free(device):
    # The free list is full with one id twice, so the correct free of the last held id
    # has no room: it is refused naming the earlier double free, not itself.
    kv = TokenKVAllocator(4, device=device)
    held = kv.alloc(2)
    assert held is not None
    kv.free(held[:1])
    kv.free(held[:1])
    with pytest.raises(DoubleFree, match=rf"double free of \[{int(held[0])}\]"):
        kv.free(held[1:])
    kv.clear()
    kv.assert_full()


def test_clear_frees_every_slot_of_the_table_and_the_mamba_pool(device):
    from terminus.kernels import MambaStatePool

    table = ReqToTokenTable(4, 4, device)
    mamba = MambaStatePool(4, 1, 4, 2, 1, 2, 2, device)
    slots, states = table.alloc(3), mamba.alloc(2)
    assert slots is not None and states is not None
    table.write(int(slots[0]), 0, torch.tensor([1, 2], device=device))
    table.clear()
    mamba.clear()
    assert table.lengths.tolist() == [0, 0, 0, 0]
    table.assert_full()
    mamba.assert_full()


@pytest.mark.parametrize("ids", [[3, 3], [5, 0], [5, 9], [-2, 4], [4, 40]])
def test_a_few_lazy_frees_are_counted_as_a_scatter_counts_them(ids, monkeypatch):
    # The id-by-id fold of a few ids (a CPU's) leaves the same counts as the scatter,
    # foreign ids on their sentinels included.
    got = []
    for loop in (32, 0):
        monkeypatch.setattr(_stack, "_HOST_FOLD", loop)
        kv = TokenKVAllocator(8, strict=False)
        held = kv.alloc(8)
        assert held is not None
        kv.free(torch.tensor(ids))
        kv._free._sync()
        got.append(kv._free._count.tolist())
    assert got[0] == got[1]


@pytest.mark.parametrize("strict", [False, True])
def test_push_host_takes_any_1d_array_and_names_what_it_refuses(strict):
    import numpy as np

    s = _stack.FreeStack("ids", 0, 8, strict=strict)
    got = s.pop(8)
    assert got is not None
    table = np.array(got.tolist(), dtype=np.int64)
    s.push_host(table[::-2])  # a view with a negative stride: on every path
    with pytest.raises(TypeError, match=r"ids: push_host takes a 1-D numpy array of ids; "
                       r"got ndarray of shape \(\); pass a tensor to push\(\)"):
        s.push_host(np.array(3))
    with pytest.raises(TypeError, match="got list"):
        s.push_host([1, 2])  # type: ignore[arg-type]
    s.push_host(table[-2::-2])
    table[:] = 0  # the stack kept ids, not views of the caller's array
    s.assert_full()
    assert sorted(s.pop(8).tolist()) == sorted(got.tolist())
    s.push(got)
    s.assert_full()


@pytest.mark.parametrize("seed", range(6))
def test_pop_host_takes_the_same_ids_and_flags_as_pop(seed):
    # Two stacks driven by the same random frees (double and foreign ones included) and
    # pops: one pops tensors, the other numpy arrays; every pop, the counts, the sticky
    # flags and check()'s verdict agree (each fold path of the fixture).
    import numpy as np

    rng = np.random.default_rng(seed)
    a = _stack.FreeStack("ids", 1, 64)
    b = _stack.FreeStack("ids", 1, 64)
    held: list[int] = []
    for _ in range(60):
        if rng.random() < 0.5 or not held:
            n = int(rng.integers(0, 20))
            ta, tb = a.pop(n), b.pop_host(n)
            assert (ta is None) == (tb is None)
            if ta is not None:
                assert tb is not None and tb.dtype == np.int64
                assert ta.tolist() == tb.tolist()
                held += ta.tolist()
        else:
            k = int(rng.integers(1, len(held) + 1))
            ids = [held.pop(int(rng.integers(len(held)))) for _ in range(k)]
            if rng.random() < 0.1:
                ids.append(ids[0] if rng.random() < 0.5 else 70)  # a double / foreign free
            got = []
            for s in (a, b):
                try:
                    s.push(torch.tensor(ids))
                    got.append(None)
                except (DoubleFree, ForeignIndex) as e:  # refused: nothing changed
                    got.append(str(e))
            assert got[0] == got[1]
        assert torch.equal(a._count, b._count) and torch.equal(a._bad, b._bad)
        assert a._top == b._top
    errs = []
    for s in (a, b):
        try:
            s.check()
            errs.append(None)
        except (DoubleFree, ForeignIndex) as e:
            errs.append((type(e), str(e)))
    assert errs[0] == errs[1]


def test_pop_host_refuses_a_negative_count_and_a_device_stack():
    s = _stack.FreeStack("ids", 1, 8)
    with pytest.raises(ValueError, match="cannot allocate a negative number"):
        s.pop_host(-1)
    assert s.pop_host(9) is None and s.available == 8
    got = s.pop_host(0)
    assert got is not None and got.shape == (0,)
    s._stack_host = None  # as on a device
    with pytest.raises(ValueError, match="pop_host needs a CPU free list"):
        s.pop_host(1)


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")], ids=["str", "device"])
@pytest.mark.parametrize("values", [[], [5], [3, -1, 2**40]])
def test_host_ints_reads_a_device_or_its_name_alike(device, values):
    # A torch.device is read as it is (no torch.device() built), a name is parsed: the
    # same int64 CPU tensor of the values either way.
    got = _stack.host_ints(values, device)
    assert got.dtype == torch.int64 and got.device.type == "cpu"
    assert got.tolist() == values
    assert torch.equal(got, torch.tensor(values, dtype=torch.int64))
