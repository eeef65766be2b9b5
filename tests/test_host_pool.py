"""Host page pool: lock references, prefetch prefix release, occupancy."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from terminus.kernels import (
    DoubleFree,
    ForeignIndex,
    HostPagePool,
    KernelError,
    LeakError,
    PageLocked,
)


def test_alloc_and_free_account_for_occupancy(device):
    h = HostPagePool(8, device)
    a = h.alloc(3)
    assert a is not None
    assert (h.occupied, h.available, h.capacity) == (3, 5, 8)
    assert a.device.type == h.device.type == h.lock_refs.device.type == device
    h.free(a)
    h.assert_full()


def test_alloc_when_short_returns_none(device):
    h = HostPagePool(2, device)
    assert h.alloc(3) is None
    assert h.prefetch(3) is None
    assert h.available == 2
    h.assert_full()  # no page, and no prefetch, was taken


def test_locked_pages_cannot_be_freed_until_every_lock_is_dropped(device):
    h = HostPagePool(4, device)
    a = h.alloc(2)
    assert a is not None
    h.lock(a[:1])
    h.lock(a[:1])
    assert h.locked_pages() == 1
    with pytest.raises(PageLocked, match=rf"cannot free locked pages \[{int(a[0])}\]"):
        h.free(a)
    assert h.occupied == 2  # nothing was freed
    h.unlock(a[:1])
    with pytest.raises(PageLocked):
        h.free(a)
    assert h.occupied == 2
    h.unlock(a[:1])
    h.free(a)
    h.assert_full()


@pytest.mark.parametrize("bad", [9, -1])
def test_a_lock_naming_a_page_outside_the_pool_locks_nothing(device, bad):
    h = HostPagePool(4, device)
    a = h.alloc(1)
    assert a is not None
    p = int(a)
    with pytest.raises(IndexError, match=rf"lock of pages \[{bad}\] outside the pool"):
        h.lock([p, bad])
    assert h.lock_refs.tolist() == [0, 0, 0, 0] and h.locked_pages() == 0
    h.lock([p])  # a real lock still keeps its page from being freed
    with pytest.raises(PageLocked):
        h.free(a)
    h.unlock([p])
    h.free(a)
    h.assert_full()


def test_unlock_below_zero_raises_and_changes_nothing(device):
    h = HostPagePool(4, device)
    a = h.alloc(1)
    assert a is not None
    with pytest.raises(KernelError, match=rf"unlock of pages \[{int(a)}\] that are not locked"):
        h.unlock(a)
    assert h.lock_refs.tolist() == [0, 0, 0, 0]  # no reference left at -1
    h.lock(a)
    with pytest.raises(KernelError, match="not locked that many times"):
        h.unlock(torch.cat((a, a)))  # one reference, two unlocks: refused whole
    assert h.lock_refs.tolist() == [1 if i == int(a) else 0 for i in range(4)]
    h.unlock(a)
    h.free(a)
    h.assert_full()


def test_double_and_foreign_frees_raise_at_the_free(device):
    h = HostPagePool(4, device)
    a = h.alloc(2)
    assert a is not None
    h.free(a[:1])
    with pytest.raises(DoubleFree, match=rf"HostPagePool: double free of \[{int(a[0])}\]"):
        h.free(a[:1])
    assert h.available == 3  # the refusal changed nothing
    with pytest.raises(
        ForeignIndex, match=r"foreign index \[4\]: this pool only hands out pages 0..3"
    ):
        h.free(4)
    assert h.available == 3
    h.free(a[1:])
    h.assert_full()


def test_released_prefetch_frees_only_its_completed_prefix(device):
    h = HostPagePool(8, device)
    p = h.prefetch(5)
    assert p is not None
    assert h.prefetch_occupied == 5
    p.advance(2)
    assert p.terminate() == 2  # the I/O side frees the 3 pages it never started
    assert h.available == 6
    assert p.release() == 2  # the request frees pages[:2] and nothing else
    assert h.prefetch_occupied == 0
    h.assert_full()


def test_taken_prefetch_hands_its_prefix_to_the_caller(device):
    h = HostPagePool(8, device)
    p = h.prefetch(4)
    assert p is not None
    p.advance(3)
    p.terminate()
    kept = p.take()
    assert kept.tolist() == p.pages[:3].tolist()
    assert h.occupied == 3 and h.prefetch_occupied == 0
    h.free(kept)
    h.assert_full()


def test_prefetch_cannot_be_released_while_its_io_is_active(device):
    h = HostPagePool(4, device)
    p = h.prefetch(2)
    assert p is not None
    with pytest.raises(KernelError, match=r"release\(\) while its I/O may still write"):
        p.release()
    assert h.available == 2 and h.prefetch_occupied == 2 and not p.retired  # nothing changed
    p.terminate()
    assert p.release() == 0
    h.assert_full()


def test_prefetch_released_twice_raises(device):
    h = HostPagePool(4, device)
    p = h.prefetch(2)
    assert p is not None
    p.advance(2)
    p.terminate()
    p.release()
    with pytest.raises(DoubleFree, match="Prefetch: double free"):
        p.release()
    assert h.available == 4 and h.prefetch_occupied == 0  # the refusal changed nothing
    h.assert_full()


def test_a_release_with_a_page_still_read_frees_it_at_the_readers_last_unlock(device):
    h = HostPagePool(8, device)
    anchor = h.alloc(1)
    assert anchor is not None
    p = h.prefetch(3, anchor=anchor)
    assert p is not None
    p.advance(2)
    p.terminate()
    reader = p.pages[1:2]
    h.lock(reader)
    h.lock(reader)  # two lock references
    assert p.release() == 2  # never fails on a reader's lock: nothing left to retry
    assert p.retired and h.prefetch_occupied == 0
    assert h.available == 8 - 1 - 1  # the anchor, and the page still being read
    with pytest.raises(DoubleFree):  # the owner released it; nobody frees it again
        h.free(reader)
    assert h.available == 6 and int(h.lock_refs[reader]) == 2  # the refusal changed nothing
    with pytest.raises(LeakError, match="still locked by a reader"):
        h.assert_full()
    h.unlock(reader)
    assert h.available == 6
    h.unlock(reader)  # the last reference: the page goes back
    assert h.available == 7
    h.free(anchor)
    h.assert_full()


def test_a_terminate_with_a_locked_tail_page_frees_it_at_its_unlock(device):
    h = HostPagePool(4, device)
    p = h.prefetch(3)
    assert p is not None
    p.advance(1)
    h.lock(p.pages[2:])
    assert p.terminate() == 1 and p.terminated and h.available == 2
    h.unlock(p.pages[2:])
    assert h.available == 3
    p.release()
    h.assert_full()


def test_prefetch_locks_its_anchor_until_released(device):
    h = HostPagePool(8, device)
    anchor = h.alloc(2)
    assert anchor is not None
    p = h.prefetch(2, anchor=anchor)
    assert p is not None
    with pytest.raises(PageLocked):
        h.free(anchor)
    assert h.available == 4 and h.lock_refs[anchor].tolist() == [1, 1]  # nothing changed
    p.terminate()
    p.release()
    h.free(anchor)
    h.assert_full()


def test_assert_full_reports_live_prefetches_and_locks(device):
    h = HostPagePool(4, device)
    p = h.prefetch(1)
    assert p is not None
    with pytest.raises(LeakError, match="1 pages still held"):
        h.assert_full()
    p.advance(1)
    p.terminate()
    pages = p.take()
    h.free(pages)
    h.assert_full()
    page = h.alloc(1)
    assert page is not None
    h.lock(page)  # a lock never dropped (a stale reader) keeps its page from the pool
    with pytest.raises(LeakError, match=rf"1 pages still held, e.g. \[{int(page)}\]"):
        h.assert_full()
    h.unlock(page)
    h.free(page)
    h.assert_full()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(st.sampled_from(["alloc", "free", "prefetch"]), st.integers(0, 4)), max_size=30
    )
)
def test_any_sequence_keeps_accounting_and_never_hands_out_twice(device, ops):
    h = HostPagePool(10, device)
    held: list[int] = []
    for op, k in ops:
        if op == "alloc":
            got = h.alloc(k)
            if got is not None:
                assert not set(got.tolist()) & set(held)
                held += got.tolist()
        elif op == "prefetch":
            p = h.prefetch(k)
            if p is not None:
                assert not set(p.pages.tolist()) & set(held)
                p.advance(k // 2)
                p.terminate()
                held += p.take().tolist()
        elif held:
            h.free(torch.tensor([held.pop(k % len(held))], device=device))
        assert h.available + len(held) == h.capacity
    h.free(held)
    h.assert_full()


def test_stopping_a_prefetch_frees_nothing_and_ends_its_io(device):
    pool = HostPagePool(8, device)
    p = pool.prefetch(5)
    p.advance(2)
    assert p.stop() == 2
    assert pool.available == 3  # the unwritten tail is still held
    with pytest.raises(KernelError, match="after stop"):
        p.advance(1)
    assert p.terminate() == 2 and pool.available == 6
    assert p.release() == 2
    pool.assert_full()


def test_a_release_refused_at_its_anchor_changes_nothing_and_can_be_retried(device):
    # Someone else dropped the anchor's lock reference, so the prefetch's own unlock would
    # underflow. The release must refuse before freeing the prefix or dropping occupancy:
    # once the lock is back, the same release frees everything exactly once.
    h = HostPagePool(8, device)
    anchor = h.alloc(2)
    assert anchor is not None
    p = h.prefetch(3, anchor=anchor)
    assert p is not None
    p.advance(2)
    p.terminate()
    h.unlock(anchor)  # a stray unlock (a bug elsewhere)
    before = (h.available, h.prefetch_occupied)
    with pytest.raises(KernelError, match="not locked that many times"):
        p.release()
    assert (h.available, h.prefetch_occupied) == before and not p.retired
    h.lock(anchor)  # the owner of the stray unlock puts its reference back
    assert p.release() == 2
    h.free(anchor)
    h.assert_full()


def test_a_take_refused_at_its_anchor_changes_nothing_and_can_be_retried(device):
    h = HostPagePool(8, device)
    anchor = h.alloc(1)
    assert anchor is not None
    p = h.prefetch(2, anchor=anchor)
    assert p is not None
    p.advance(2)
    p.terminate()
    h.unlock(anchor)
    with pytest.raises(KernelError, match="not locked that many times"):
        p.take()
    assert h.prefetch_occupied == 2 and not p.retired
    h.lock(anchor)
    h.free(p.take())
    h.free(anchor)
    h.assert_full()


def test_a_release_refused_as_a_double_free_changes_nothing(device):
    h = HostPagePool(6, device)
    anchor = h.alloc(1)
    assert anchor is not None
    p = h.prefetch(2, anchor=anchor)
    assert p is not None
    p.advance(2)
    p.terminate()
    h.free(p.pages[:1])  # a stray free of a page the prefetch still owns
    with pytest.raises(DoubleFree):
        p.release()
    assert h.prefetch_occupied == 2 and int(h.lock_refs[anchor]) == 1 and not p.retired
    page = h.alloc(1)  # the stray freer takes its page back (alloc pops the last freed)
    assert page is not None and int(page) == int(p.pages[0])
    assert p.release() == 2
    h.free(anchor)
    h.assert_full()


@pytest.mark.parametrize("done", [0, 2, 4])
def test_a_prefetch_written_whole_or_in_part_retires_the_same_pages(device, done):
    # terminate(), release() and take() of a prefetch whose I/O wrote every page (no
    # tail: no free; its pages whole, not a slice) and of one it wrote in part: the
    # tail goes back at terminate, the written prefix at release, or to the taker.
    for how in ("release", "take"):
        h = HostPagePool(6, device)
        p = h.prefetch(4)
        assert p is not None
        p.advance(done)
        assert p.terminate() == done and h.available == 2 + 4 - done
        if how == "release":
            assert p.release() == done and h.available == 6
        else:
            kept = p.take()
            assert kept.tolist() == p.pages[:done].tolist() and h.occupied == done
            h.free(kept)
        with pytest.raises(DoubleFree):
            p.release()
        assert h.prefetch_occupied == 0
        h.assert_full()
