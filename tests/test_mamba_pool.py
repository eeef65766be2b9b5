"""Mamba state pool: shapes, zeroing on alloc, copy/fork, detection."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from terminus.kernels import DoubleFree, ForeignIndex, LeakError, MambaStatePool, mamba
from terminus.kernels.protocols import MambaPool


def pool(size: int = 4, **kw) -> MambaStatePool:
    return MambaStatePool(
        size, layers=2, conv_dims=[6, 3], conv_kernel=4, heads=2, head_dim=3, state_size=5, **kw
    )


def test_state_shapes_have_one_padding_slot_and_configurable_dtypes(device):
    p = pool(device=device, conv_dtype=torch.float16, ssm_dtype=torch.float64)
    assert [c.shape for c in p.conv] == [(2, 5, 6, 3), (2, 5, 3, 3)]
    assert p.temporal.shape == (2, 5, 2, 3, 5)
    assert p.conv[0].dtype == torch.float16 and p.temporal.dtype == torch.float64
    assert p.device.type == device
    assert {t.device.type for t in [*p.conv, p.temporal]} == {device}


@pytest.mark.parametrize("host_zero", [4, 0])
def test_alloc_zeroes_reused_slots_in_every_layer_and_leaves_others(
    device, monkeypatch, host_zero
):
    monkeypatch.setattr(mamba, "_HOST_ZERO", host_zero)  # 0: index_fill_ on a CPU too
    p = pool(device=device, conv_dtype=torch.bfloat16)
    a = p.alloc(4)
    assert a is not None and 0 not in a.tolist()
    for t in [*p.conv, p.temporal]:
        t.fill_(7)
    p.free(a[:2])
    b = p.alloc(2)
    assert b is not None
    for t in [*p.conv, p.temporal]:
        assert bool((t[:, b] == 0).all())
        assert bool((t[:, a[2:]] == 7).all())
    p.free(torch.cat((a[2:], b)))
    p.assert_full()


def test_alloc_zeroes_with_one_op_per_tensor(monkeypatch, device):
    monkeypatch.setattr(mamba, "_HOST_ZERO", 0)  # a CPU's few slots take byte views
    p = pool(device=device)
    calls = []
    orig = torch.Tensor.index_fill_

    def spy(self, *args):
        calls.append(self.shape)
        return orig(self, *args)

    monkeypatch.setattr(torch.Tensor, "index_fill_", spy)
    got = p.alloc(3)
    assert len(calls) == 3  # two conv tensors + the temporal state, all slots and layers
    assert got is not None
    p.free(got)
    p.assert_full()


def test_a_replaced_state_tensor_is_zeroed_on_alloc(device):
    p = pool(device=device)
    got = p.alloc(1)
    assert got is not None
    p.temporal = torch.full_like(p.temporal, 3.0)
    p.conv[1] = torch.full_like(p.conv[1], 2.0)
    p.free(got)
    again = p.alloc(1)
    assert again is not None
    assert bool((p.temporal[:, again] == 0).all()) and bool((p.conv[1][:, again] == 0).all())
    assert bool((p.temporal[:, 0] == 3).all())  # other slots untouched
    p.free(again)
    p.assert_full()


def test_alloc_when_short_returns_none(device):
    p = pool(2, device=device)
    assert p.alloc(3) is None
    assert p.available == 2
    p.assert_full()


def test_copy_from_and_fork_copy_every_state(device):
    p = pool(device=device)
    a = p.alloc(1)
    assert a is not None
    for i, t in enumerate(p._tensors()):
        t[:, a] = float(i + 2)
    b = p.fork(a)
    assert b is not None and int(b) != int(a)
    c = p.alloc(1)  # zeroed; then filled by an explicit copy_from
    assert c is not None
    p.copy_from(a, c)
    for i, t in enumerate(p._tensors()):
        assert bool((t[:, b] == i + 2).all()) and bool((t[:, c] == i + 2).all()), i
    p.free(torch.cat((a, b, c)))
    p.assert_full()


def test_copy_from_needs_one_source_per_destination(device):
    p = pool(device=device)
    with pytest.raises(ValueError, match="2 sources for 1 destinations"):
        p.copy_from([1, 2], [3])
    p.assert_full()


def test_double_free_and_padding_slot_are_detected(device):
    p = pool(device=device, strict=True)
    a = p.alloc(2)
    assert a is not None
    p.free(a[:1])
    with pytest.raises(DoubleFree, match=rf"MambaStatePool: double free of \[{int(a[0])}\]"):
        p.free(a[:1])
    with pytest.raises(ForeignIndex, match=r"foreign index \[0\]"):
        p.free(0)
    assert p.available == 3  # both refusals changed nothing
    p.free(a[1:])
    p.assert_full()


def test_assert_full_names_held_slots(device):
    p = pool(device=device)
    a = p.alloc(1)
    assert a is not None
    with pytest.raises(LeakError, match=rf"e\.g\. \[{int(a)}\]"):
        p.assert_full()
    p.free(a)
    p.assert_full()


def test_our_pool_satisfies_the_protocol():
    assert isinstance(pool(), MambaPool)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(st.tuples(st.sampled_from(["alloc", "free", "fork"]), st.integers(0, 3)), max_size=30)
)
def test_any_sequence_keeps_accounting_and_never_hands_out_twice(device, ops):
    p = pool(6, device=device, strict=True)
    held: list[int] = []
    for op, k in ops:
        if op == "alloc" or (op == "fork" and not held):
            got = p.alloc(k)
        elif op == "fork":
            got = p.fork([held[k % len(held)]])
        else:
            if held:
                p.free(held.pop(k % len(held)))
            got = None
        if got is not None:
            assert not set(got.tolist()) & set(held)
            held += got.tolist()
        assert p.available + len(held) == p.capacity
    p.free(held)
    p.assert_full()


@pytest.mark.parametrize("seed", range(3))
def test_a_host_alloc_takes_the_ids_and_zeroes_what_index_fill_does(monkeypatch, seed):
    # Two CPU pools under the same random allocs and frees: one pops a few slots as numpy
    # and zeroes them through byte views, the other (_HOST_ZERO 0) pops a tensor and
    # zeroes with index_fill_. Same ids, same states, same free lists; a short pool
    # hands out nothing on either path.
    import numpy as np

    rng = np.random.default_rng(seed)
    a, b = pool(), pool()
    held: list[torch.Tensor] = []
    for _ in range(40):
        if rng.random() < 0.6 or not held:
            n = int(rng.integers(0, 4))
            monkeypatch.setattr(mamba, "_HOST_ZERO", 4)
            ga = a.alloc(n)
            monkeypatch.setattr(mamba, "_HOST_ZERO", 0)
            gb = b.alloc(n)
            assert (ga is None) == (gb is None)
            if ga is not None:
                assert gb is not None and torch.equal(ga, gb)
                held.append(ga)
        else:
            ids = held.pop(int(rng.integers(len(held))))
            a.free(ids)
            b.free(ids)
        for ta, tb in zip([*a.conv, a.temporal], [*b.conv, b.temporal], strict=True):
            assert torch.equal(ta, tb)
            ta.fill_(3)  # stale state, for the next alloc to zero
            tb.fill_(3)
        assert a.available == b.available
        assert torch.equal(a._free._count, b._free._count)
    for ids in held:
        a.free(ids)
        b.free(ids)
    a.assert_full()
    b.assert_full()
