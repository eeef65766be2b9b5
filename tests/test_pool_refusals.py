"""A pool call that is refused changes nothing: bad input is refused before any unit is
taken, any count changed or any state written, with an error naming what was wrong.

Each case here was a refusal that came after a change: pages taken by a prefetch whose
anchor was then refused, Mamba slots popped by a fork whose source was then refused, a
copy half written, a count kept as a 0-d tensor that moved the free list's top, a
metadata slot marked released by a free the pool refused, a radix insert that lost an
index. Every test ends with the pool full.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from terminus.kernels import (
    DoubleFree,
    ForeignIndex,
    HostPagePool,
    KernelError,
    MambaStatePool,
    MetadataSlots,
    RadixTree,
    ReleaseUnderflow,
    TokenKVAllocator,
    UnknownAdapter,
)
from terminus.kernels.lora import LoRARegistry
from terminus.kernels.metadata import MetadataSlot
from terminus.kernels.req_table import ReqToTokenTable


def mamba(size: int = 4) -> MambaStatePool:
    return MambaStatePool(size, layers=1, conv_dims=2, conv_kernel=2, heads=1, head_dim=2,
                          state_size=2, strict=True)


@pytest.mark.parametrize("anchor", [[99], [0.5], torch.tensor([1.0]), [-1]],
                         ids=["outside", "float", "float_tensor", "negative"])
def test_a_prefetch_whose_anchor_is_refused_takes_no_page(anchor):
    h = HostPagePool(8)
    held = h.alloc(1)
    assert held is not None
    free = h.available
    with pytest.raises((IndexError, TypeError), match="HostPagePool"):
        h.prefetch(3, anchor=anchor)
    assert h.available == free and h.prefetch_occupied == 0 and h.locked_pages() == 0
    h.free(held)
    h.assert_full()


def test_a_prefetch_short_of_pages_locks_no_anchor():
    h = HostPagePool(4)
    anchor = h.alloc(2)
    assert anchor is not None
    assert h.prefetch(3, anchor=anchor) is None  # two free pages: short
    assert h.locked_pages() == 0
    h.free(anchor)  # not locked: freed at once
    h.assert_full()


@pytest.mark.parametrize(("k", "error"), [(-2, ValueError), (1.5, TypeError),
                                          (True, TypeError), ("1", TypeError)])
def test_a_prefetch_advance_by_a_count_that_is_not_one_is_refused(k, error):
    """A negative count made pages the I/O never wrote look completed (the cache would
    take them); a float made every later terminate raise, so the pages never came back."""
    h = HostPagePool(8)
    p = h.prefetch(4)
    assert p is not None
    p.advance(1)
    with pytest.raises(error, match=r"Prefetch\.advance"):
        p.advance(k)
    assert p.completed == 1
    assert p.advance(np.int64(1)) == 2  # a numpy integer is a count
    assert p.terminate() == 2
    p.release()
    h.assert_full()


@pytest.mark.parametrize("pages", [[99], [-1], [3, 99]], ids=["outside", "negative", "mixed"])
def test_an_unlock_outside_the_pool_names_the_pages_and_changes_nothing(pages):
    h = HostPagePool(4)
    p = h.alloc(1)
    assert p is not None
    h.lock(p)
    with pytest.raises(IndexError, match=r"HostPagePool: unlock of pages \[(99|-1)\] outside "
                                         r"the pool \(0..3\)"):
        h.unlock(pages)
    assert h.locked_pages() == 1
    h.unlock(p)
    h.free(p)
    h.assert_full()


@pytest.mark.parametrize("src", [[99], [-1], [0], [1, 99]],
                         ids=["outside", "negative", "padding", "mixed"])
def test_a_fork_of_a_slot_outside_the_pool_takes_no_slot(src):
    m = mamba()
    held = m.alloc(1)
    assert held is not None
    with pytest.raises(IndexError, match=r"MambaStatePool.fork: slots \[.*\] outside slots 1..4"):
        m.fork(src)
    assert m.available_size() == 3
    m.free(held)
    m.assert_full()


def test_a_copy_to_a_slot_outside_the_pool_writes_no_state():
    m = mamba()
    slots = m.alloc(2)
    assert slots is not None
    for t in m._tensors():
        t[:, int(slots[0])] = 7  # the source's state
    with pytest.raises(IndexError, match=r"MambaStatePool.copy_from: slots \[99\] outside"):
        m.copy_from(slots[:1].repeat(2), [int(slots[1]), 99])
    assert all(float(t[:, int(slots[1])].abs().sum()) == 0 for t in m._tensors())
    m.free(slots)
    m.assert_full()


@pytest.mark.parametrize("make", [
    lambda: TokenKVAllocator(16, strict=True),
    lambda: TokenKVAllocator(16, page_size=2, strict=True),
    lambda: ReqToTokenTable(8, 16, strict=True),
    lambda: mamba(8),
    lambda: HostPagePool(8),
], ids=["kv", "kv_paged", "table", "mamba", "host"])
def test_an_alloc_count_is_an_int_a_0d_tensor_is_one_and_a_float_is_refused(make):
    """A 0-d tensor count (`kv.alloc(lengths.sum())`) was kept as the free list's top: a
    later in-place add moved it, and the frees after it were never counted."""
    pool = make()
    free = pool.available
    got = pool.alloc(torch.tensor(2))
    assert got is not None and pool.available.__class__ is int
    more = pool.alloc(np.int64(2))
    assert more is not None
    for bad in (2.0, True, "2"):
        with pytest.raises(TypeError, match="must be an int"):
            pool.alloc(bad)
    pool.free(got)
    pool.free(more)
    assert pool.available == free
    pool.assert_full()


@pytest.mark.parametrize("bad", [True, torch.tensor(1), 1.0, "1"],
                         ids=["bool", "tensor", "float", "str"])
def test_a_metadata_free_of_a_slot_that_is_not_an_int_is_refused(bad):
    """A bool or a tensor kept in the free list was what the next alloc handed out."""
    s = MetadataSlots(2)
    i, j = s.alloc(), s.alloc()
    assert i is not None and j is not None
    if isinstance(bad, torch.Tensor):  # an integer tensor is an int: freed as slot 1
        s.free(bad)
        assert s.alloc() == 1 and s.alloc() is None
    else:
        with pytest.raises(TypeError, match=r"MetadataSlots.free\(.*\): a slot is an int"):
            s.free(bad)
        assert s.available == 0
    s.free(i)
    s.free(j)
    s.assert_full()


def test_a_metadata_slot_whose_free_is_refused_keeps_its_index_for_the_retry():
    s = MetadataSlots(2)
    slot = MetadataSlot.take(s)
    assert slot is not None
    other = MetadataSlots(8)
    foreign = MetadataSlot(other, 5)  # a slot of another pool: this one refuses it
    foreign.pool = s
    with pytest.raises(ForeignIndex):
        foreign.release()
    assert foreign.index == 5  # not marked released: the refusal changed nothing
    assert slot.release() and slot.index == -1 and not slot.release()
    s.assert_full()


def test_a_lora_release_of_what_is_not_an_id_is_refused_and_releases_nothing():
    async def main() -> None:
        r = LoRARegistry()
        a = await r.register("a")
        await r.acquire(["a", "a"])
        for bad in (True, "a", 1.5, [a, "a"]):
            with pytest.raises(TypeError, match="is not a LoRA id"):
                r.release_nowait(bad)
        assert r.counts() == {a: 2}
        with pytest.raises(ReleaseUnderflow):
            r.release_nowait([a, a, a])  # all or nothing
        r.release_nowait(np.int64(a))  # a numpy integer is an id
        r.release_nowait(torch.tensor([a]))  # so is a 1-D integer tensor of them
        assert r.counts() == {a: 0}
        r.assert_full()

    asyncio.run(main())


def test_a_radix_insert_with_an_owned_from_that_is_not_an_int_or_past_the_tree_is_refused():
    t = RadixTree(page_size=1)
    t.insert([1, 2], torch.tensor([10, 11]))
    with pytest.raises(TypeError, match=r"owned_from=1\.5 is not an int"):
        t.insert([1, 2, 3, 4], torch.tensor([10, 11, 12, 13]), owned_from=1.5)
    assert t.total_size() == 2
    # Pages of 4: the tree holds 8 tokens; a caller claiming its own indices start at 9
    # would leave index 8 in none of taken, duplicates and leftover.
    t4 = RadixTree(page_size=4)
    t4.insert(list(range(8)), torch.arange(100, 108))
    kv = torch.arange(200, 210)
    kv[:8] = torch.arange(100, 108)
    with pytest.raises(ValueError, match=r"matched prefix \(9 tokens\) is no longer cached"):
        t4.insert(list(range(10)), kv, owned_from=9)
    assert t4.total_size() == 8
    r = t4.insert(list(range(10)), kv, owned_from=8)
    assert r.taken.numel() == 0 and r.leftover.tolist() == [208, 209]


def test_a_double_free_inside_a_free_group_is_refused_at_that_free_and_the_rest_still_lands():
    """A strict pool refused the whole group at `free_group_end`, having closed it: the
    valid frees collected before were dropped, held by nobody."""
    kv = TokenKVAllocator(8, strict=True)
    a = kv.alloc(3)
    assert a is not None
    kv.free_group_begin()
    kv.free(a)
    with pytest.raises(DoubleFree, match=r"double free of \[\d\]"):
        kv.free(a[:1])  # already freed in this group
    kv.free_group_end()
    kv.assert_full()


def test_a_grouped_free_of_a_table_row_frees_what_the_row_held_then():
    """A grouped free of a view of the request table (a row's columns) is read when it
    is made: the row given to a new request before the group ends no longer frees the
    new request's pages and leaks the old ones."""
    kv = TokenKVAllocator(8, strict=True)
    table = ReqToTokenTable(2, 4)
    row = table.alloc(1)
    old = kv.alloc(2)
    assert row is not None and old is not None
    r = int(row[0])
    table.req_to_token[r, :2] = old.to(table.req_to_token.dtype)
    kv.free_group_begin()
    kv.free(table.req_to_token[r, :2])  # a view of the row
    new = kv.alloc(2)  # the next request's pages, written over the same columns
    assert new is not None
    table.req_to_token[r, :2] = new.to(table.req_to_token.dtype)
    kv.free_group_end()
    kv.free(new)
    kv.assert_full()
    table.free(row)
    table.assert_full()


@pytest.mark.parametrize("case", ["never_handed_out", "freed", "one_of_two", "tail", "many"])
def test_a_lock_of_a_free_page_names_it_and_locks_nothing(device, case):
    """A free page took the lock: the next alloc handed it out locked, and its new
    owner's free raised PageLocked."""
    h = HostPagePool(80, device)
    held = h.alloc(70)
    assert held is not None
    gone = h.alloc(1)  # handed out, then freed
    assert gone is not None
    h.free(gone)
    if case == "tail":  # the pages a prefetch's I/O never wrote, freed by terminate
        p = h.prefetch(3)
        assert p is not None
        p.advance(1)
        p.terminate()
        free, pages = p.pages[1:].tolist(), p.pages[1:]
    elif case == "freed":
        free, pages = gone.tolist(), gone
    elif case == "never_handed_out":  # alloc pops from the top: page 0 is the last one
        free, pages = [0], [0]
    elif case == "one_of_two":
        free, pages = [0], [int(held[0]), 0]
    else:  # more pages than a CPU pool checks in Python: the tensor path
        free, pages = [0], torch.cat((held, torch.tensor([0], device=held.device)))
    before = h.available
    with pytest.raises(KernelError, match=rf"HostPagePool: lock of pages "
                                          rf"\[{', '.join(map(str, sorted(free)))}\] that are "
                                          r"free .*nothing was locked"):
        h.lock(pages)
    assert h.locked_pages() == 0 and h._refs == 0 and h.available == before
    if case == "tail":
        p.release()
    h.lock(held)  # pages someone holds still lock
    h.unlock(held)
    rest = h.alloc(h.available)  # every free page, the refused ones among them, unlocked
    assert rest is not None and set(free) <= set(rest.tolist())
    h.free(rest)
    h.free(held)
    h.assert_full()


def test_a_prefetch_whose_anchor_is_a_free_page_takes_no_page(device):
    h = HostPagePool(8, device)
    anchor = h.alloc(1)
    assert anchor is not None
    h.free(anchor)
    with pytest.raises(KernelError, match=rf"lock of pages \[{int(anchor)}\] that are free"):
        h.prefetch(3, anchor=anchor)
    assert h.available == 8 and h.prefetch_occupied == 0 and h.locked_pages() == 0
    h.assert_full()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bool])
def test_a_table_write_of_tokens_that_are_not_integers_is_refused_and_writes_nothing(device,
                                                                                      dtype):
    """Float token slots were truncated into the row (1.7 became slot 1), silently."""
    t = ReqToTokenTable(2, 8, device)
    s = t.alloc(2)
    assert s is not None
    with pytest.raises(TypeError, match=rf"ReqToTokenTable.write: tokens are {dtype}, not "
                                        r"integers.*nothing was written"):
        t.write(0, 0, torch.tensor([1.7, 2.2], device=device).to(dtype))
    assert t.lengths.tolist() == [0, 0] and not t.req_to_token.any()
    t.write(0, 0, torch.tensor([1, 2], dtype=torch.int16, device=device))  # integers: kept
    assert t.tokens(0).tolist() == [1, 2]
    t.free(s)
    t.assert_full()


@pytest.mark.parametrize("tokens", [[1, 2], (1, 2), np.array([1, 2])],
                         ids=["list", "tuple", "ndarray"])
def test_a_table_write_of_tokens_that_are_not_a_tensor_is_refused_and_writes_nothing(device,
                                                                                     tokens):
    """A list of ids raised AttributeError ('list' object has no attribute 'ndim')."""
    t = ReqToTokenTable(2, 8, device)
    s = t.alloc(2)
    assert s is not None
    name = type(tokens).__name__
    with pytest.raises(TypeError, match=rf"ReqToTokenTable.write: tokens are a {name}, not a "
                                        r"tensor.*torch.tensor\(ids, dtype=torch.int64\).*"
                                        "nothing was written"):
        t.write(0, 0, tokens)
    assert t.lengths.tolist() == [0, 0] and not t.req_to_token.any()
    t.write(0, 0, torch.tensor(list(tokens), dtype=torch.int64, device=device))  # as told
    assert t.tokens(0).tolist() == [1, 2]
    t.free(s)
    t.assert_full()


@pytest.mark.parametrize(("slot", "start", "bad"), [
    (1.0, 0, r"slot 1\.0 \(float\)"), (True, 0, r"slot True \(bool\)"),
    (0, True, r"start True \(bool\)"), (0, 0.0, r"start 0\.0 \(float\)"),
    ("1", 0, r"slot '1' \(str\)"),
], ids=["float_slot", "bool_slot", "bool_start", "float_start", "str_slot"])
def test_a_table_write_at_a_slot_or_start_that_is_not_an_int_is_refused(device, slot, start,
                                                                         bad):
    """A bool slot was a numpy mask on a CPU table: `write(True, 0, tokens)` filled every
    column of row 0 and set both rows' lengths."""
    t = ReqToTokenTable(2, 8, device)
    s = t.alloc(2)
    assert s is not None
    for dtype in (torch.int32, torch.int64, torch.int16):  # numpy views; torch's setitem
        with pytest.raises(TypeError, match=rf"ReqToTokenTable.write: {bad} is not an int"):
            t.write(slot, start, torch.tensor([9], dtype=dtype, device=device))
    assert t.lengths.tolist() == [0, 0] and not t.req_to_token.any()  # nothing written
    with pytest.raises(TypeError, match=r"ReqToTokenTable.tokens: slot .* is not an int"):
        t.tokens(slot if type(start) is int else start)  # the value that is not an int
    t.write(np.int64(1), torch.tensor(0), torch.tensor([9], device=device))  # ints, both
    assert t.tokens(np.int64(1)).tolist() == [9]
    t.free(s)
    t.assert_full()


@pytest.mark.parametrize("slot", [-1, -2, 2])
def test_a_table_read_of_a_slot_outside_the_table_is_refused(device, slot):
    """A negative slot read another request's row (-1 is the last one)."""
    t = ReqToTokenTable(2, 8, device)
    s = t.alloc(2)
    assert s is not None
    t.write(1, 0, torch.tensor([5, 6], device=device))
    with pytest.raises(ValueError, match=rf"ReqToTokenTable.tokens: slot {slot} is outside "
                                         r"the table \(0..1\)"):
        t.tokens(slot)
    t.free(s)
    t.assert_full()


@pytest.mark.parametrize("again", ["release", "take"])
def test_a_prefetch_retired_again_after_take_says_its_pages_were_taken(device, again):
    """It said the pages were "already free": they were the taker's, still held by it."""
    h = HostPagePool(8, device)
    p = h.prefetch(3)
    assert p is not None
    p.advance(2)
    p.terminate()
    kept = p.take()
    a, b = kept.tolist()
    with pytest.raises(DoubleFree, match=rf"Prefetch: {again}\(\) after take\(\): take\(\) "
                                         rf"handed pages \[{a}, {b}\] to its caller") as err:
        getattr(p, again)()
    assert "already free" not in str(err.value) and err.value.indices == [a, b]
    assert h.occupied == 2 and h.prefetch_occupied == 0  # the refusal changed nothing
    h.free(kept)
    h.assert_full()


def test_an_unregister_of_an_unknown_lora_name_names_it_and_the_registered_ones():
    """It said "register() or upsert() them first; nothing was acquired": no word of the
    names registered, nor of a name being unloaded already (a second unregister)."""
    async def main() -> None:
        r = LoRARegistry()
        a, b = await r.register("a"), await r.register("b")
        await r.acquire("a")
        with pytest.raises(UnknownAdapter, match=r"unregister of unknown LoRA adapter 'zz': it "
                                                 r"was never registered.*Registered: \['a', "
                                                 r"'b'\]\. Nothing was changed"):
            await r.unregister("zz")
        assert await r.unregister("a") == a  # one reference still out: unloading
        with pytest.raises(UnknownAdapter, match=rf"'a': it is unregistered already \(id {a}, "
                                                 r"unloading with 1 reference\(s\) still out: "
                                                 rf"wait_for_unload\({a}\).*\['b'\]"):
            await r.unload("a")
        assert r.counts() == {a: 1, b: 0}  # the refusals changed nothing
        r.release_nowait(a)
        await r.unload("b")
        r.assert_full()

    asyncio.run(main())
