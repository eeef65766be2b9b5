"""Batched release: free everything a step's terminal requests held, one op per pool.

Given the request slots that became terminal in one scheduler step::

    slots        [s0, s1, s2]                 lengths [3, 1, 2]   (from the table)
    req_to_token rows s0..s2, columns [0, max(lengths)):
                 s0: [a b c]
                 s1: [d . .]      mask = arange(max) < lengths[:, None]
                 s2: [e f .]
    KV free      [a b c d e f]    one free call
    Mamba free   mamba_slots[slots] that are not 0      one free call
    slot free    [s0 s1 s2]       one free call

Ownership is decided before this runs (by the effect layer); this only returns what the
given slots own, so a slot must appear here once, and only for a request that owns it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._stack import IdsLike, as_ids
from kernels.protocols import KVAllocator, MambaPool, ReqSlots
from kernels.req_table import ReqToTokenTable

__all__ = ["BatchRelease", "gather_kv", "release_batch"]


@dataclass(frozen=True)
class BatchRelease:
    """What one ``release_batch`` returned: counts of requests, KV tokens, Mamba slots."""

    requests: int
    kv_tokens: int
    mamba_slots: int


def gather_kv(
    table: ReqToTokenTable, slots: torch.Tensor, start: torch.Tensor | None = None
) -> torch.Tensor:
    """The KV token indices rows ``slots`` own: ``req_to_token[s, start:length]`` for each.

    One host sync (the output size); when every row owns all of ``[0, max(length))``
    the mask and compaction are skipped.
    """
    lengths = table.lengths.index_select(0, slots)
    if start is None:
        stats = torch.stack((lengths.max(), lengths.sum().to(lengths.dtype))).tolist()
        width, total = int(stats[0]), int(stats[1])
    else:
        start = start.to(lengths.device, lengths.dtype)
        stats = torch.stack((lengths.max(), (lengths - start).clamp(min=0).sum())).tolist()
        width, total = int(stats[0]), int(stats[1])
    if width <= 0 or total <= 0:
        return torch.empty(0, dtype=torch.int32, device=table.device)
    rows = table.req_to_token.narrow(1, 0, width).index_select(0, slots)
    if start is None and total == rows.numel():
        return rows.reshape(-1)
    cols = torch.arange(width, dtype=lengths.dtype, device=lengths.device)
    mask = cols < lengths.unsqueeze(1)
    if start is not None:
        mask &= cols >= start.unsqueeze(1)
    return torch.masked_select(rows, mask)


def release_batch(
    slots: IdsLike,
    table: ReqToTokenTable,
    kv: KVAllocator,
    mamba: MambaPool | None = None,
    *,
    kv_start: torch.Tensor | None = None,
    req_slots: ReqSlots | None = None,
) -> BatchRelease:
    """Free the KV tokens, Mamba slots and request slots of ``slots``, one call per pool.

    Args:
        slots: request slots that became terminal this step.
        table: the request-to-token table they live in (lengths and Mamba slots read
            from it; their lengths and Mamba slots are reset to 0).
        kv: KV allocator receiving ``req_to_token[s, kv_start:length]``.
        mamba: Mamba pool receiving ``table.mamba_slots[s]`` where not 0.
        kv_start: per-request first owned column (e.g. after a shared cached prefix);
            default 0.
        req_slots: where the request slots go back; default ``table`` itself.
    """
    ids = as_ids(slots, table.device).long()
    if ids.numel() == 0:
        return BatchRelease(0, 0, 0)
    tokens = gather_kv(table, ids, kv_start)
    kv.free(tokens)
    freed_mamba = 0
    if mamba is not None:
        m = table.mamba_slots.index_select(0, ids)
        m = m[m > 0]
        freed_mamba = m.numel()
        if freed_mamba:
            mamba.free(m)
        table.mamba_slots.index_fill_(0, ids, 0)
    table.lengths.index_fill_(0, ids, 0)
    (req_slots if req_slots is not None else table).free(ids)
    return BatchRelease(ids.numel(), tokens.numel(), freed_mamba)
