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

import sys
from dataclasses import dataclass

import torch

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import ExceptionGroup

from terminus.kernels._stack import IdsLike, as_ids
from terminus.kernels.protocols import KVAllocator, MambaPool, ReqSlots
from terminus.kernels.req_table import ReqToTokenTable

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

    When every row owns all of ``[0, length)`` with one common length (and no ``start``),
    the rows are gathered whole and returned flat: one host sync. Otherwise each owned
    token's flat table position is built and gathered in one ``index_select``::

        counts  [3, 1, 2]            owned tokens per row
        which   [0 0 0 1 2 2]        repeat_interleave(counts): the row of each token
        idx     base[which] + arange(total),  base = row * W + start - tokens before it

    (two host syncs on a device; ``masked_select`` over the padded rows costs ~1.6x this
    on CPU).
    """
    if slots.device != table.device:
        slots = slots.to(table.device)
    lengths = table.lengths.index_select(0, slots)
    if start is None:
        lo, hi = _host_ints(torch.aminmax(lengths))
        if hi <= 0:
            return torch.empty(0, dtype=torch.int32, device=table.device)
        if lo == hi:
            return table.req_to_token.narrow(1, 0, hi).index_select(0, slots).reshape(-1)
        counts = lengths.long()
        base = slots.long() * table.max_context_len
    else:
        start = start.to(lengths.device, torch.int64)
        counts = (lengths.long() - start).clamp_(min=0)
        base = slots.long() * table.max_context_len + start
    total = int(counts.sum())
    if total <= 0:
        return torch.empty(0, dtype=torch.int32, device=table.device)
    which = torch.repeat_interleave(counts, output_size=total)
    base -= counts.cumsum(0) - counts
    idx = base.index_select(0, which)
    idx += torch.arange(total, device=idx.device)
    return table.req_to_token.reshape(-1).index_select(0, idx)


def _host_ints(values: tuple[torch.Tensor, ...]) -> list[int]:
    """0-d tensors as ints: one ``item`` each on CPU (cheap), one stacked transfer elsewhere."""
    if values[0].device.type == "cpu":
        return [int(v) for v in values]
    return [int(v) for v in torch.stack(values).tolist()]


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
    ids = as_ids(slots, table.device)
    if ids.dtype != torch.int64:
        ids = ids.long()  # index_fill_ takes int64 indices only
    if ids.numel() == 0:
        return BatchRelease(0, 0, 0)
    tokens = gather_kv(table, ids, kv_start)
    m = table.mamba_slots.index_select(0, ids) if mamba is not None else None
    if m is not None:
        m = m[m > 0]
    # Each pool's free runs even when an earlier one raised (a strict pool naming a
    # double free): one refusal must not leak what the other pools hold.
    errors: list[Exception] = []
    try:
        kv.free(tokens)
    except Exception as e:
        errors.append(e)
    if mamba is not None and m is not None:
        if m.numel():
            try:
                mamba.free(m)
            except Exception as e:
                errors.append(e)
        table.mamba_slots.index_fill_(0, ids, 0)
    table.lengths.index_fill_(0, ids, 0)
    try:
        (req_slots if req_slots is not None else table).free(ids)
    except Exception as e:
        errors.append(e)
    if errors:
        if len(errors) == 1:
            raise errors[0]
        raise ExceptionGroup("release_batch: several pools refused their frees", errors)
    return BatchRelease(ids.numel(), tokens.numel(), 0 if m is None else m.numel())
