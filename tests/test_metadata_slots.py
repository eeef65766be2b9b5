"""Metadata slots: int or None, -1 after release through the owner, idempotent."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from terminus.kernels import DoubleFree, ForeignIndex, LeakError, MetadataSlots
from terminus.kernels.protocols import SlotAllocator


def test_alloc_returns_ints_then_none_when_exhausted():
    m = MetadataSlots(2)
    assert {m.alloc(), m.alloc()} == {0, 1}
    assert m.alloc() is None
    for i in (0, 1):
        m.free(i)
    m.assert_full()


def test_free_makes_a_slot_available_again():
    m = MetadataSlots(1)
    i = m.alloc()
    assert i is not None
    m.free(i)
    assert m.alloc() == i
    m.free(i)
    m.assert_full()


def test_double_free_and_foreign_slot_raise():
    m = MetadataSlots(2)
    i = m.alloc()
    assert i is not None
    m.free(i)
    with pytest.raises(DoubleFree, match=rf"MetadataSlots: double free of \[{i}\]"):
        m.free(i)
    assert m.available == 2  # the refusal changed nothing
    with pytest.raises(
        ForeignIndex, match=r"foreign index \[-1\]: this pool only hands out slots 0..1"
    ):
        m.free(-1)
    assert m.available == 2
    m.assert_full()


def test_release_through_the_owner_sets_minus_one_and_is_idempotent():
    m = MetadataSlots(2)
    owner = m.acquire()
    assert owner is not None and owner.index >= 0
    assert owner.release() is True
    assert owner.index == -1
    assert owner.release() is False
    m.assert_full()


def test_acquire_when_exhausted_returns_none():
    m = MetadataSlots(1)
    owner = m.acquire()
    assert owner is not None
    assert m.acquire() is None
    assert m.available == 0
    assert owner.release() is True
    m.assert_full()


def test_assert_full_names_held_slots():
    m = MetadataSlots(3)
    i = m.alloc()
    assert i is not None
    with pytest.raises(LeakError, match=rf"1 slots still held, e.g. \[{i}\]"):
        m.assert_full()
    m.free(i)
    m.assert_full()


def test_slots_satisfy_the_protocol():
    assert isinstance(MetadataSlots(1), SlotAllocator)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 7)), max_size=40))
def test_any_sequence_keeps_accounting_and_never_hands_out_twice(ops):
    m = MetadataSlots(4)
    held: list[int] = []
    for is_alloc, k in ops:
        if is_alloc:
            i = m.alloc()
            if i is None:
                assert m.available == 0
            else:
                assert i not in held
                held.append(i)
        elif held:
            m.free(held.pop(k % len(held)))
        assert m.available + len(held) == m.capacity
    for i in held:
        m.free(i)
    m.assert_full()
