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

from terminus.kernels._stack import IdsLike, as_ids, host_ints, not_ids
from terminus.kernels.kv import TokenKVAllocator
from terminus.kernels.mamba import MambaStatePool
from terminus.kernels.protocols import KVAllocator, MambaPool, ReqSlots
from terminus.kernels.req_table import ReqToTokenTable

__all__ = ["BatchRelease", "gather_kv", "release_batch", "repeat_rows"]


@dataclass(frozen=True)
class BatchRelease:
    """What one ``release_batch`` returned: counts of requests, KV tokens, Mamba slots."""

    requests: int
    kv_tokens: int
    mamba_slots: int


# A release from a CPU table is done through numpy views of it (tests turn this off to
# run the tensor path, the one a device takes, on a CPU); up to this many rows a row at
# a time, more rows vectorized.
_HOST_RELEASE = True
_HOST_ROWS = 64
_LITTLE_ENDIAN = sys.byteorder == "little"


def _non_negative(a: np.ndarray) -> bool:
    """Whether int64 array ``a`` holds no negative value: on a little-endian host, whether
    every value's top byte is below 0x80, which ``bytes.isascii`` tests in one C pass.

    After a scheduler's Python-heavy step, the first numpy reduction (``a.min()``) of a
    release costs 30-40 us of cold code (cache misses in numpy's reduction machinery);
    this costs ~4 us, as does the ``bytes`` comparison that tests the lengths for one
    common value.
    """
    if _LITTLE_ENDIAN and a.dtype == np.int64:
        return a.tobytes()[7::8].isascii()
    return bool((a >= 0).all())  # pragma: no cover - big-endian hosts


def _out_of_range(rows: list[int], capacity: int) -> IndexError:
    bad = [r for r in rows if not 0 <= r < capacity]
    return IndexError(f"release_batch: slots {bad} are out of range 0..{capacity - 1}; "
                      "pass request slots the table's alloc() returned")


def _starts(kv_start: torch.Tensor | list[int], n: int) -> list[int]:
    """``kv_start`` as a list of ``n`` ints >= 0 (ValueError naming what is wrong); a
    list (of exact ints: `_int_starts`) is taken as it is."""
    # (a 1-D tensor, what a driver passes, is read as it is: a reshape is a torch call)
    starts = kv_start if isinstance(kv_start, list) else (
        kv_start if kv_start.dim() == 1 else kv_start.reshape(-1)).tolist()
    if len(starts) != n or (starts and min(starts) < 0):
        raise _bad_starts(starts, n)
    return starts


def _starts_np(kv_start: torch.Tensor, n: int) -> np.ndarray:
    """``kv_start`` as a numpy array of ``n`` ints >= 0 (ValueError naming what is wrong)."""
    starts = kv_start.detach().reshape(-1).cpu().numpy()
    if starts.shape[0] != n or (n and int(starts.min()) < 0):
        raise _bad_starts(starts.tolist(), n)
    return starts


def _int_starts(kv_start: torch.Tensor | list[int] | None) -> None:
    """Refuse a ``kv_start`` that is not integers (``TypeError``): a float would be
    truncated on the tensor path and compared as it is on the host's. A list must hold
    exact ints (a bool, a float or a numpy int is refused, naming the values)."""
    if kv_start is None:
        return
    if kv_start.__class__ is list:
        if list(map(type, kv_start)).count(int) != len(kv_start):
            raise TypeError(f"release_batch: kv_start {kv_start!r} holds something other "
                            "than Python ints; pass a list of ints or an int tensor")
        return
    if not isinstance(kv_start, torch.Tensor):
        raise TypeError(f"release_batch: kv_start is a {type(kv_start).__name__}; pass an "
                        "int tensor or a list of Python ints, one per slot")
    if kv_start.dtype.is_floating_point or kv_start.is_complex() or kv_start.dtype == torch.bool:
        raise not_ids("release_batch: kv_start", kv_start, kv_start.dtype)


def _bad_starts(starts: list[int], n: int) -> ValueError:
    """The error for per-row first columns (``kv_start``) that are not one int >= 0 a row."""
    if len(starts) != n:
        return ValueError(f"release_batch: kv_start has {len(starts)} entries for {n} slots; "
                          "pass one first owned column per slot")
    return ValueError(f"release_batch: kv_start {[s for s in starts if s < 0]} is negative; "
                      "pass first owned columns >= 0")


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
    _int_starts(start)
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
        start = start.to(lengths.device, torch.int64).reshape(-1)
        if start.numel() != slots.numel():
            raise _bad_starts(start.tolist(), slots.numel())
        counts = (lengths.long() - start).clamp_(min=0)
        base = slots * width + start
    ends = counts.cumsum(0)
    if start is None:
        total = int(ends[-1])
    else:  # the check of the starts rides on the same host sync
        total, lowest = torch.stack((ends[-1], start.min())).tolist()
        if lowest < 0:
            raise _bad_starts(start.tolist(), slots.numel())
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
    kv_start: torch.Tensor | list[int] | None = None,
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
            default 0. An int tensor, or a list of Python ints (what a scheduler that
            computed them on the host has: no tensor built for a few rows).
        req_slots: where the request slots go back; default ``table`` itself.

    A pool that raises leaves what it refused where its owner finds it (see the module
    docstring); every pool's free is tried, and the error (an ``ExceptionGroup`` when
    several pools raised) is raised at the end.
    """
    _int_starts(kv_start)
    host = table._np if _HOST_RELEASE else None
    if (
        type(slots) is torch.Tensor
        and slots.dtype == torch.int64
        and slots.dim() == 1
        # (a CPU table's numpy views: the table is on the CPU, so is_cpu says it all)
        and (slots.is_cpu if table._np is not None
             else slots.device == table.req_to_token.device)
    ):
        ids = slots
    else:
        ids = as_ids(slots, table.req_to_token.device, "release_batch")
        if ids.dtype != torch.int64:
            ids = ids.long()  # index_fill_ takes int64 indices only
    if not ids.shape[0]:
        return BatchRelease(0, 0, 0)
    # The first columns as a tensor, for the paths below that read one (the few rows of
    # a CPU table's read a list as it is: none is built for them).
    start_t = kv_start if not isinstance(kv_start, list) else (
        host_ints(kv_start, table.req_to_token.device)
        if host is None or ids.shape[0] > _HOST_ROWS else None)
    if host is not None:
        # A CPU table: read and reset through numpy views of it (the same memory), with
        # as few distinct ops as it takes: after a scheduler's Python-heavy step the
        # first call of each op pays tens of us of cold code (README, "terminus bench
        # kernels"), more for a torch op than for numpy's take or slice assignment.
        lengths_np, _, r2t = host
        cap = table._rows
        n_rows = ids.shape[0]
        if n_rows <= _HOST_ROWS:
            # A few rows: their KV gathered one slice a row (the same tokens, in order).
            rows = ids.tolist()
            if min(rows) < 0 or max(rows) >= cap:
                raise _out_of_range(rows, cap)
            at: np.ndarray | list[int] = rows
            ends = lengths_np[at].tolist()
            firsts = [0] * n_rows if kv_start is None else _starts(kv_start, n_rows)
            runs = [r2t[r, a:b] for r, a, b in zip(rows, firsts, ends, strict=True) if b > a]
            # One run is a view of the table: a pool that keeps what it is given gets a
            # copy (below); the KV pool's own free list copies it into its stack.
            flat = np.concatenate(runs) if len(runs) > 1 else runs[0] if runs else None
            aliased = len(runs) == 1
        else:
            # Many rows: one gather of whole rows when every row owns [0, L) with one
            # common L, else one boolean-mask gather of each row's owned columns. No
            # numpy reduction on the uniform path (see _non_negative).
            at = ids.numpy()
            aliased = False
            if not _non_negative(at):
                raise _out_of_range(at.tolist(), cap)
            starts = None if start_t is None else _starts_np(start_t, n_rows)
            try:
                lens = lengths_np.take(at)  # the gather's own machinery (warm for the rows)
            except IndexError:  # a slot >= capacity
                raise _out_of_range(at.tolist(), cap) from None
            raw = lens.tobytes()
            if starts is None and raw == raw[: lens.itemsize] * n_rows:  # one common length
                hi = int(lens[0])
                src = r2t if hi == r2t.shape[1] else r2t[:, :hi]
                flat = src.take(at, axis=0).reshape(-1) if hi > 0 else None
            else:
                hi = int(lens.max())
                flat = None
                if hi > 0:
                    cols = np.arange(hi, dtype=np.int32)
                    mask = cols < lens[:, None]
                    if starts is not None:
                        mask &= cols >= starts[:, None]
                    flat = r2t[at, :hi][mask]
        if flat is not None and not flat.size:
            flat = None
        n_tokens = 0 if flat is None else flat.shape[0]
    else:
        tokens = gather_kv(table, ids, start_t)
        n_tokens = tokens.numel()
    errors: list[Exception] = []
    # Our own pool's free list is pushed directly, unless its free() was replaced on the
    # instance (a wrapper that times or counts it, as `terminus bench e2e`'s does): then
    # that is called, as for any other pool.
    own = kv if type(kv) is TokenKVAllocator and "free" not in kv.__dict__ else None
    try:
        if host is None:
            kv.free(tokens)
        elif own is not None and own.page_size == 1:
            # Our own token pool: the gathered ids go into its stack through numpy, with
            # no torch call on the way (see FreeStack.push_host).
            if flat is not None:
                own._free.push_host(flat)
        elif own is not None and own._free._stack_host is not None:
            # Our own paged pool, its free list on the host: their pages found and
            # pushed from numpy (free_host: the same pages in the same order as free of
            # a tensor, no tensor made). One on a device takes free() below.
            if flat is not None:
                own.free_host(flat)
        else:
            kv.free(_empty(table) if flat is None else
                    torch.from_numpy(flat.copy() if aliased else flat))
    except Exception as e:
        errors.append(e)
    else:
        if host is not None:
            host[0][at] = 0
        else:
            table.lengths.index_fill_(0, ids, 0)
    n_mamba = 0
    if mamba is not None:
        if host is not None:
            held = host[1][at]
            held = held[held > 0]
            n_mamba = held.shape[0]
        else:
            m = table.mamba_slots.index_select(0, ids)
            m = m[m > 0]
            n_mamba = m.numel()
        try:
            if not n_mamba:
                pass
            elif host is None:
                mamba.free(m)
            elif type(mamba) is MambaStatePool and "free" not in mamba.__dict__:
                mamba._free.push_host(held)  # our own pool: no torch call (see the KV's)
            else:
                mamba.free(torch.from_numpy(held))
        except Exception as e:
            errors.append(e)
        else:
            if host is not None:
                host[1][at] = 0
            else:
                table.mamba_slots.index_fill_(0, ids, 0)
    if not errors:
        # Only now: a slot that went back with a refused unit in its row would lose it.
        try:
            if req_slots is None and (type(table) is not ReqToTokenTable
                                      or "free" in table.__dict__):
                table.free(ids)  # a subclass's, or one replaced on the instance: called
            elif req_slots is None:
                # What table.free does, minus checking ids again.
                if host is None:
                    table._free.push(ids)
                else:  # the rows' slots, as numpy (a few rows: from their list)
                    table._free.push_host(at if isinstance(at, np.ndarray) else
                                          np.array(at, dtype=np.int64))
            else:
                req_slots.free(ids)
        except Exception as e:
            errors.append(e)
    if errors:
        if len(errors) == 1:
            raise errors[0]
        raise ExceptionGroup("release_batch: several pools refused their frees", errors)
    return BatchRelease(ids.shape[0], n_tokens, n_mamba)
