"""Batched release: free everything a step's terminal requests held, one op per pool.

Given the request slots that became terminal in one scheduler step::

    slots        [s0, s1, s2]                 lengths [3, 1, 2]   (from the table)
    req_to_token rows s0..s2, columns [0, max(lengths)):
                 s0: [a b c]
                 s1: [d . .]
                 s2: [e f .]
    KV free      [a b c d e f]    one free call
    Mamba free   mamba_slots[slots] that are not 0      one free call
    slot free    [s0 s1 s2]       one free call

Ownership is decided before this runs (by the effect layer); this only returns what the
given slots own, so a slot must appear here once, and only for a request that owns it.

A pool that refuses its free (a strict pool naming a double free) changes nothing, and
what it refused stays findable: the rows keep their lengths (KV refused) or their Mamba
slots (Mamba refused), and the request slots go back only when every other pool took its
units. So a release that raised can be repaired and called again, and frees each unit
once.

No op here goes parallel on a small input with torch's default thread count: the
obvious way to expand per-row counts, ``repeat_interleave``, runs an OpenMP region with a
grain of one row, which on a busy machine costs milliseconds on a few hundred rows
(``gather_kv`` builds the same positions with ``index_add_`` and ``cumsum``, both serial).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import ExceptionGroup

from terminus.kernels._stack import IdsLike, as_ids
from terminus.kernels.protocols import KVAllocator, MambaPool, ReqSlots
from terminus.kernels.req_table import ReqToTokenTable

__all__ = ["BatchRelease", "gather_kv", "release_batch", "repeat_rows"]


@dataclass(frozen=True)
class BatchRelease:
    """What one ``release_batch`` returned: counts of requests, KV tokens, Mamba slots."""

    requests: int
    kv_tokens: int
    mamba_slots: int


# A release of at most this many rows of a CPU table is done through numpy views.
_HOST_ROWS = 64


def _empty(table: ReqToTokenTable) -> torch.Tensor:
    return table.req_to_token.new_empty(0)


def gather_kv(
    table: ReqToTokenTable, slots: torch.Tensor, start: torch.Tensor | None = None
) -> torch.Tensor:
    """The KV token indices rows ``slots`` own: ``req_to_token[s, start:length]`` for each.

    When every row owns all of ``[0, length)`` with one common length (and no ``start``),
    the rows are gathered whole and returned flat: one host sync. Otherwise each owned
    token's flat table position is built and gathered in one ``index_select``::

        counts  [3, 1, 2]       owned tokens per row; ends = cumsum: [3, 4, 6]
        pos[j] = j + c[row of j],  c = row * W + start - (tokens before the row)

    ``c`` is a step function of ``j``, so it is the cumsum of its jumps: ``c[r]`` added
    where row ``r`` starts and subtracted where it ends (an empty row adds and subtracts
    at one place). Both scatters are ``index_add_`` over the rows and the cumsum is one
    pass, all serial (no OpenMP region however small the batch); a second host sync on a
    device.
    """
    if slots.device != table.req_to_token.device:
        slots = slots.to(table.req_to_token.device)
    lengths = table.lengths.index_select(0, slots)
    width = table.max_context_len
    if start is None:
        lo, hi = _min_max(table, lengths)
        if hi <= 0:
            return _empty(table)
        if lo == hi:
            rows = table.req_to_token if hi == width else table.req_to_token.narrow(1, 0, hi)
            return rows.index_select(0, slots).view(-1)
        counts = lengths.long()
        base = slots * width
    else:
        start = start.to(lengths.device, torch.int64)
        counts = (lengths.long() - start).clamp_(min=0)
        base = slots * width + start
    ends = counts.cumsum(0)
    total = int(ends[-1])
    if total <= 0:
        return _empty(table)
    first = ends - counts
    # pos = cumsum(1 + jumps) - 1 + c, so the -1 goes into c and no arange is needed.
    c = base.sub_(first).sub_(1)
    steps = torch.ones(total + 1, dtype=torch.int64, device=c.device)
    steps.index_add_(0, first, c)
    steps.index_add_(0, ends, c.neg_())
    pos = steps[:total].cumsum_(0)
    return table.req_to_token.view(-1).index_select(0, pos)


def repeat_rows(counts: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """The row of each of ``sum(counts)`` items: ``torch.repeat_interleave(counts)``,
    without its OpenMP region.

    ``repeat_interleave`` parallelises over rows with a grain of one, so with torch's
    default thread count it opens a parallel region for any batch of two rows or more;
    on a busy machine each costs milliseconds. Here: the rows' ends are scattered with
    ``index_add_`` and summed with ``cumsum``, both serial, one pass over the output.
    ``total`` (the sum, when the caller knows it) saves a host sync on a device.
    """
    counts = counts.to(torch.int64)
    ends = counts.cumsum(0)
    if total is None:
        total = int(ends[-1]) if ends.numel() else 0
    steps = torch.zeros(total + 1, dtype=torch.int64, device=counts.device)
    steps.index_add_(0, ends, torch.ones_like(ends))
    return steps[:total].cumsum_(0)


def _min_max(table: ReqToTokenTable, lengths: torch.Tensor) -> list[int]:
    """``[min, max]`` of ``lengths`` on the host: one reduction written into a two-element
    buffer kept on the table, and one transfer."""
    torch.aminmax(lengths, out=table._min_max_out)
    return table._min_max.tolist()


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
            from it; their lengths and Mamba slots are reset to 0 once freed).
        kv: KV allocator receiving ``req_to_token[s, kv_start:length]``.
        mamba: Mamba pool receiving ``table.mamba_slots[s]`` where not 0.
        kv_start: per-request first owned column (e.g. after a shared cached prefix);
            default 0.
        req_slots: where the request slots go back; default ``table`` itself.

    A pool that raises leaves what it refused where its owner finds it (see the module
    docstring); every pool's free is tried, and the error (an ``ExceptionGroup`` when
    several pools raised) is raised at the end.
    """
    dev = table.req_to_token.device
    if (
        type(slots) is torch.Tensor
        and slots.dtype == torch.int64
        and slots.device == dev
        and slots.dim() == 1
    ):
        ids = slots
    else:
        ids = as_ids(slots, dev, "release_batch")
        if ids.dtype != torch.int64:
            ids = ids.long()  # index_fill_ takes int64 indices only
    if not ids.numel():
        return BatchRelease(0, 0, 0)
    host = table._np if ids.numel() <= _HOST_ROWS else None
    if host is not None:
        # A few rows of a CPU table: read and reset through numpy views of it, and the
        # KV they own gathered one slice a row (the same tokens, in the same order).
        rows = ids.tolist()
        if min(rows) < 0:  # numpy would count from the end; index_select refused these
            raise IndexError(f"release_batch: slots {[r for r in rows if r < 0]} are out "
                             f"of range 0..{table.capacity - 1}")
        lengths_np, _, r2t = host
        ends = lengths_np[rows].tolist()
        firsts = [0] * len(rows) if kv_start is None else kv_start.tolist()
        runs = [r2t[r, a:b] for r, a, b in zip(rows, firsts, ends, strict=True) if b > a]
        tokens = (torch.from_numpy(np.concatenate(runs)) if len(runs) > 1 else
                  torch.from_numpy(runs[0].copy()) if runs else _empty(table))
    else:
        tokens = gather_kv(table, ids, kv_start)
    errors: list[Exception] = []
    try:
        kv.free(tokens)
    except Exception as e:
        errors.append(e)
    else:
        if host is not None:
            host[0][rows] = 0
        else:
            table.lengths.index_fill_(0, ids, 0)
    m = None
    if mamba is not None:
        if host is not None:
            held = host[1][rows]
            m = torch.from_numpy(held[held > 0])
        else:
            m = table.mamba_slots.index_select(0, ids)
            m = m[m > 0]
        try:
            if m.numel():
                mamba.free(m)
        except Exception as e:
            errors.append(e)
        else:
            if host is not None:
                host[1][rows] = 0
            else:
                table.mamba_slots.index_fill_(0, ids, 0)
    if not errors:
        # Only now: a slot that went back with a refused unit in its row would lose it.
        try:
            if req_slots is None:
                table._free.push(ids)  # what table.free does, minus checking ids again
            else:
                req_slots.free(ids)
        except Exception as e:
            errors.append(e)
    if errors:
        if len(errors) == 1:
            raise errors[0]
        raise ExceptionGroup("release_batch: several pools refused their frees", errors)
    return BatchRelease(ids.numel(), tokens.numel(), 0 if m is None else m.numel())
