"""`RunningBatch.append_kv` of a few rows of a CPU table is written on the host; it
writes the same pages in the same places as the whole-tensor path, page sizes 1 and 4,
partial last pages included, and refuses the same way when the pool is short."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from terminus.effects import sequence
from terminus.effects.sequence import RunningBatch, SchedulerPools
from terminus.states.sequence import SequenceAbort


def five_rows(page_size: int) -> tuple[SchedulerPools, RunningBatch, torch.Tensor]:
    """Pools of 6 rows and 64 KV tokens, and a batch with 5 rows admitted (no Mamba)."""
    pools = SchedulerPools(rows=6, max_context_len=64, kv_tokens=64,
                           mamba_slots=2, page_size=page_size)
    rb = RunningBatch(pools)
    rows = rb.admit(5, mamba=False)
    assert rows is not None
    return pools, rb, rows


def grown(seed: int, page_size: int, host: bool, monkeypatch) -> tuple[list, RunningBatch]:
    monkeypatch.setattr(sequence, "_HOST_ROWS", 64 if host else 0)
    rng = random.Random(seed)
    pools, rb, rows = five_rows(page_size)
    seen = []
    for _ in range(6):
        pick = sorted(rng.sample(rows.tolist(), rng.randint(1, 5)))
        counts = [rng.choice([0, 1, 2, 3, 5, 7]) for _ in pick]
        ok = rb.append_kv(torch.tensor(pick), torch.tensor(counts))
        t = pools.table
        seen.append((ok, t.lengths.tolist(), [t.tokens(r).tolist() for r in range(6)],
                     pools.kv.available_size()))
    rb.fire(rows, SequenceAbort)
    pools.assert_full()
    return seen, rb


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(12))
def test_the_host_path_writes_what_the_tensor_path_writes(seed, page_size, monkeypatch):
    on_host, _ = grown(seed, page_size, True, monkeypatch)
    by_tensor, _ = grown(seed, page_size, False, monkeypatch)
    assert on_host == by_tensor


def grown_lists(seed: int, page_size: int, as_lists: bool) -> list:
    """`grown`'s appends, decode steps (one token each) among them, given as lists of
    ints or as tensors."""
    rng = random.Random(seed)
    pools, rb, rows = five_rows(page_size)
    seen = []
    for _ in range(8):
        pick = sorted(rng.sample(rows.tolist(), rng.randint(1, 5)))
        counts = ([1] * len(pick) if rng.random() < 0.5 else
                  [rng.choice([0, 1, 2, 3, 5, 7]) for _ in pick])
        ok = (rb.append_kv(pick, counts) if as_lists else
              rb.append_kv(torch.tensor(pick), torch.tensor(counts)))
        t = pools.table
        seen.append((ok, t.lengths.tolist(), [t.tokens(r).tolist() for r in range(6)],
                     pools.kv.available_size()))
    rb.fire(rows, SequenceAbort)
    pools.assert_full()
    return seen


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(8))
def test_lists_of_ints_append_what_tensors_append(seed, page_size):
    assert grown_lists(seed, page_size, True) == grown_lists(seed, page_size, False)


@pytest.mark.parametrize("picks, counts, error, why", [
    ([0, 1], [1], ValueError, r"2 rows but 1 counts"),
    ([0, 1], [3, -1], ValueError, r"negative token counts \[-1\] for rows \[{1}\]"),
    ([0, 0], [1, 1], ValueError, r"rows \[{0}, {0}\] name a row more than once"),
    ([0, None], [1, 1], IndexError, r"rows \[{0}, 9\] name a row outside 0\.\.5"),
    ([0], [70], ValueError, r"would hold \[70\] tokens, past the table's max_context_len"),
], ids=["count_missing", "negative", "twice", "foreign_row", "too_long"])
def test_lists_are_refused_as_tensors_are_taking_nothing(picks, counts, error, why):
    pools = SchedulerPools(rows=6, max_context_len=64, kv_tokens=64, mamba_slots=2,
                           page_size=4)
    rb = RunningBatch(pools)
    admitted = rb.admit(2, mamba=False)
    assert admitted is not None
    own = admitted.tolist()
    rows = [9 if p is None else own[p] for p in picks]  # 9: no row of this batch
    kv_free, lengths = pools.kv.available, pools.table.lengths.clone()
    for given, cs in ((rows, counts), (torch.tensor(rows), torch.tensor(counts))):
        with pytest.raises(error, match=why.format(*own)):
            rb.append_kv(given, cs)
        assert pools.kv.available == kv_free  # nothing taken
        assert torch.equal(pools.table.lengths, lengths)
    # Not plain ints (numpy scalars): read as a tensor of them would be.
    assert rb.append_kv([np.int64(r) for r in own], [np.int64(2), np.int64(1)])
    assert pools.table.lengths[own].tolist() == [2, 1]
    rb.fire(admitted, SequenceAbort)
    pools.assert_full()
