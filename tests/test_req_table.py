"""Request-to-token table: slots, lengths, double-free detection."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from terminus.kernels import DoubleFree, ForeignIndex, LeakError, ReqToTokenTable


def test_table_is_int32_size_by_max_context_len(device):
    t = ReqToTokenTable(4, 16, device)
    assert t.req_to_token.shape == (4, 16)
    assert t.req_to_token.dtype == torch.int32
    assert t.device.type == device
    assert {x.device.type for x in (t.req_to_token, t.lengths, t.mamba_slots)} == {device}
    assert t.capacity == t.available == 4


def test_write_sets_tokens_and_length(device):
    t = ReqToTokenTable(2, 8, device)
    slot = t.alloc()
    assert slot is not None
    t.write(int(slot), 0, torch.tensor([5, 6, 7], device=device))
    t.write(int(slot), 3, torch.tensor([9], device=device))
    assert t.tokens(int(slot)).tolist() == [5, 6, 7, 9]
    assert int(t.lengths[slot]) == 4
    t.free(slot)
    t.assert_full()


def test_write_past_max_context_len_says_what_to_do(device):
    t = ReqToTokenTable(1, 4, device)
    with pytest.raises(ValueError, match="5 tokens do not fit max_context_len 4"):
        t.write(0, 2, torch.arange(3, device=device))
    assert int(t.lengths[0]) == 0  # the refused write changed nothing
    t.assert_full()


@pytest.mark.parametrize(("slot", "start", "shape"), [(0, -1, (2,)), (-1, 0, (2,)),
                                                      (2, 0, (2,)), (0, 0, (2, 1))])
def test_a_bad_slot_start_or_shape_is_refused_alike_on_every_path(device, slot, start, shape):
    t = ReqToTokenTable(2, 8, device)
    s = t.alloc(2)
    assert s is not None
    for dtype in (torch.int32, torch.int64, torch.int16):  # numpy views; torch's setitem
        tokens = torch.ones(shape, dtype=dtype, device=device)
        with pytest.raises(ValueError, match=r"ReqToTokenTable.write: slot .* 1-D tensor"):
            t.write(slot, start, tokens)
    assert t.lengths.tolist() == [0, 0] and not t.req_to_token.any()  # nothing written
    t.free(s)
    t.assert_full()


def test_alloc_when_short_returns_none(device):
    t = ReqToTokenTable(2, 4, device)
    assert t.alloc(3) is None
    assert t.available == 2
    t.assert_full()


def test_alloc_resets_the_length_of_a_reused_slot(device):
    t = ReqToTokenTable(1, 4, device)
    s = t.alloc()
    assert s is not None
    t.write(0, 0, torch.arange(3, device=device))
    t.free(s)
    again = t.alloc()
    assert again is not None
    assert int(t.lengths[0]) == 0
    t.free(again)
    t.assert_full()


def test_slot_double_free_is_detected(device):
    t = ReqToTokenTable(4, 4, device, strict=True)
    s = t.alloc(2)
    assert s is not None
    t.free(s[:1])
    with pytest.raises(DoubleFree, match=rf"ReqToTokenTable: double free of \[{int(s[0])}\]"):
        t.free(s[:1])
    assert t.available == 3
    t.free(s[1:])
    t.assert_full()


def test_lazy_slot_double_free_is_named_by_check(device):
    t = ReqToTokenTable(4, 4, device)
    s = t.alloc(3)
    assert s is not None
    t.free(s[:1])
    t.free(s[:1])
    with pytest.raises(DoubleFree, match=rf"\[{int(s[0])}\]"):
        t.check()
    # A lazy double free cannot be undone by a free: start the free list over
    # (ReqToTokenTable has no public clear()).
    t.clear()
    t.assert_full()


def test_foreign_slot_is_detected(device):
    t = ReqToTokenTable(4, 4, device, strict=True)
    held = t.alloc(1)
    with pytest.raises(
        ForeignIndex, match=r"foreign index \[4\]: this pool only hands out slots 0..3"
    ):
        t.free(4)
    assert t.available == 3
    t.free(held)
    t.assert_full()


def test_assert_full_names_held_slots(device):
    t = ReqToTokenTable(3, 4, device)
    s = t.alloc()
    assert s is not None
    with pytest.raises(LeakError, match=rf"1 slots still held, e.g. \[{int(s)}\]"):
        t.assert_full()
    t.free(s)
    t.assert_full()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=40))
def test_any_sequence_keeps_accounting_and_never_hands_out_twice(device, ops):
    t = ReqToTokenTable(8, 4, device, strict=True)
    held: list[int] = []
    for is_alloc, k in ops:
        if is_alloc:
            got = t.alloc(k)
            if got is None:
                assert t.available < k
                continue
            assert not set(got.tolist()) & set(held)
            held += got.tolist()
        elif held:
            t.free(held.pop(k % len(held)))
        assert t.available + len(held) == t.capacity
    t.free(held)
    t.assert_full()
