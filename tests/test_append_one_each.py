"""A decode step (`append_kv` with one token a row) on a CPU table takes
`_append_one_each`'s numpy path; it writes the same pages in the same places as the
general host path (`_append_host`) would, for rows with no token yet (row 0 among them),
rows whose last page is full and rows with room on it, and refuses the same way when
the pool is short. Also: lists holding something other than plain ints (in the rows or
only in the counts) are read as tensors of them would be. Every test runs with the
rows checked as a numpy array and as Python lists (`_NP_CHECK_ROWS` 0 and large)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from terminus.effects import sequence
from terminus.effects.sequence import RunningBatch, SchedulerPools
from terminus.states.sequence import SequenceAbort


@pytest.fixture(params=[0, 10**6], ids=["np_check", "list_check"], autouse=True)
def check_path(request, monkeypatch):
    monkeypatch.setattr(sequence, "_NP_CHECK_ROWS", request.param)
    return request.param


def history(seed: int, page_size: int, one_each: bool) -> list:
    """Random appends to six rows (all admitted: row 0 is one), decode steps among them;
    `one_each=False` sends the decode steps through the general host path instead."""
    rng = random.Random(seed)
    pools = SchedulerPools(rows=6, max_context_len=64, kv_tokens=96, mamba_slots=2,
                           page_size=page_size)
    rb = RunningBatch(pools)
    rows = rb.admit(6, mamba=False)
    assert rows is not None and 0 in rows.tolist()
    if not one_each:
        def general(rows_t, counts_t, host, arrays=None):  # the same, by the general path
            return rb._append_host(host)
        rb._append_one_each = general  # type: ignore[method-assign]
    seen = []
    for _ in range(40):
        pick = sorted(rng.sample(rows.tolist(), rng.randint(1, 6)))
        counts = ([1] * len(pick) if rng.random() < 0.8 else
                  [rng.choice([0, 1, 2, 3, 5]) for _ in pick])
        ok = rb.append_kv(pick, counts)
        t = pools.table
        seen.append((ok, t.lengths.tolist(), [t.tokens(r).tolist() for r in range(6)],
                     pools.kv.available_size()))
    rb.fire(rows, SequenceAbort)
    pools.assert_full()
    return seen


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("seed", range(10))
def test_decode_steps_write_what_the_general_path_writes(seed, page_size):
    fast = history(seed, page_size, True)
    assert fast == history(seed, page_size, False)
    assert any(not ok for ok, *_ in fast) or page_size == 1  # the pool ran short too


@pytest.mark.parametrize("odd", ["rows", "counts"])
def test_a_non_int_in_one_list_reads_both_as_tensors(odd):
    pools = SchedulerPools(rows=4, max_context_len=32, kv_tokens=64, mamba_slots=2,
                           page_size=4)
    rb = RunningBatch(pools)
    rows = rb.admit(2, mamba=False)
    assert rows is not None
    own = rows.tolist()
    given = [np.int64(r) for r in own] if odd == "rows" else own
    counts = [3, np.int64(2)] if odd == "counts" else [3, 2]
    assert rb.append_kv(given, counts)
    assert pools.table.lengths[own].tolist() == [3, 2]
    assert rb.append_kv(own, [True, 1])  # a bool is not a plain int: as a tensor, 1
    assert pools.table.lengths[own].tolist() == [4, 3]
    rb.fire(rows, SequenceAbort)
    pools.assert_full()
    assert torch.equal(pools.table.lengths, torch.zeros_like(pools.table.lengths))


@pytest.mark.parametrize("row", [2**70, -(2**70), -1])
def test_a_row_past_int64_or_negative_is_refused_taking_nothing(row):
    pools = SchedulerPools(rows=4, max_context_len=32, kv_tokens=64, mamba_slots=2,
                           page_size=4)
    rb = RunningBatch(pools)
    rows = rb.admit(2, mamba=False)
    assert rows is not None
    own = rows.tolist()
    kv_free, lengths = pools.kv.available, pools.table.lengths.clone()
    with pytest.raises(IndexError, match=r"name a row outside 0\.\.3"):
        rb.append_kv([own[0], row], [1, 1])
    assert pools.kv.available == kv_free  # nothing taken
    assert torch.equal(pools.table.lengths, lengths)
    rb.fire(rows, SequenceAbort)
    pools.assert_full()


@pytest.mark.parametrize("as_tensors", [False, True])
def test_a_decode_step_past_max_context_len_is_refused_taking_nothing(as_tensors):
    pools = SchedulerPools(rows=4, max_context_len=8, kv_tokens=64, mamba_slots=2,
                           page_size=4)
    rb = RunningBatch(pools)
    rows = rb.admit(3, mamba=False)
    assert rows is not None
    own = rows.tolist()
    assert rb.append_kv(own, [8, 3, 7])  # full, room, one slot left
    kv_free, lengths = pools.kv.available, pools.table.lengths.clone()
    given = (torch.tensor(own), torch.ones(3, dtype=torch.int64)) if as_tensors else (
        own, [1, 1, 1])
    with pytest.raises(ValueError, match=rf"rows \[{own[0]}\] would hold \[9\] tokens"):
        rb.append_kv(*given)
    assert pools.kv.available == kv_free  # nothing taken
    assert torch.equal(pools.table.lengths, lengths)
    assert rb.append_kv(own[1:], [1, 1])  # the others still grow: 3 -> 4, 7 -> 8
    assert pools.table.lengths[own].tolist() == [8, 4, 8]
    rb.fire(rows, SequenceAbort)
    pools.assert_full()


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seed", range(4))
def test_both_checks_give_the_same_history(seed, page_size, monkeypatch):
    monkeypatch.setattr(sequence, "_NP_CHECK_ROWS", 0)
    by_np = history(seed, page_size, True)
    monkeypatch.setattr(sequence, "_NP_CHECK_ROWS", 10**6)
    assert by_np == history(seed, page_size, True)
