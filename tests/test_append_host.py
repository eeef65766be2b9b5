"""`RunningBatch.append_kv` of a few rows of a CPU table is written on the host; it
writes the same pages in the same places as the whole-tensor path, page sizes 1 and 4,
partial last pages included, and refuses the same way when the pool is short."""

from __future__ import annotations

import random

import pytest
import torch

from terminus.effects import sequence
from terminus.effects.sequence import RunningBatch, SchedulerPools
from terminus.states.sequence import SequenceAbort


def grown(seed: int, page_size: int, host: bool, monkeypatch) -> tuple[list, RunningBatch]:
    monkeypatch.setattr(sequence, "_HOST_ROWS", 64 if host else 0)
    rng = random.Random(seed)
    pools = SchedulerPools(rows=6, max_context_len=64, kv_tokens=64,
                           mamba_slots=2, page_size=page_size)
    rb = RunningBatch(pools)
    rows = rb.admit(5, mamba=False)
    assert rows is not None
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
