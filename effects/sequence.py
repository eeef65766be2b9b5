"""The scheduler's running batch: SEQUENCE rows over the KV, Mamba and request-slot pools.

    row r  = request slot r of the request-to-token table = instance r of the batch
    owns     req_to_token[r, :lengths[r]]   (KV tokens)
             mamba_slots[r]                 (a Mamba state, 0 = none)
             the slot r itself

With a prefix cache (`RunningBatch(cache=)`), admission matches each new row's prompt
and locks what it matched: ``req_to_token[r, :matched[r]]`` are the cache's pages, the
row owns only the columns after them (from `matched(r)`: its release's ``kv_start``).
Retirement inserts a finished row's KV into the cache (duplicates and the unaligned
tail are freed with the row's other pages), frees an aborted or failed row's own KV
without inserting it, and drops every row's lock exactly once, in the same batched plan.
Growth that finds the KV pool short evicts unlocked cached pages first.

A row's resources are written into the table in the same call that allocates them, so
they have an owner from their first instant; they are released only by the batch's
terminal plans, which run `kernels.release_batch` once per plan per step for every row
that turned terminal in that step (one tensor operation per pool), then tell the
caller which rows retired and how (to stream their terminal output).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import torch

from terminus.fsm import BatchStep, ReleaseContext, TransitionNotAllowed, release_effect
from terminus.fsm.batch import _CheckedRuns, dense_rounds
from terminus.kernels import (
    MambaStatePool,
    ReqToTokenTable,
    TokenKVAllocator,
    release_batch,
    repeat_rows,
)
from terminus.kernels._stack import host_ints
from terminus.kernels.protocols import (
    AuditedPool,
    KVAllocator,
    MambaPool,
    page_size_of,
    require,
)
from terminus.kernels.req_table import _HOST_ALLOC
from terminus.states.sequence import SEQUENCE, Admit

from .prefix_cache import PageAudit, PrefixCache, PrefixLock, audit_pages
from .sanitize import sanitized

__all__ = ["RunningBatch", "SchedulerPools"]


class SchedulerPools:
    """The pools a scheduler's running batch draws from.

    `kv` and `mamba` may be an engine's own allocators (any `KVAllocator` /
    `MambaPool`, e.g. SGLang's); otherwise ours are built with `kv_tokens`, `page_size`
    and `mamba_slots`. `page_size` defaults to `kv.page_size` for a given `kv` (and
    must agree with it), else to 1. The request-to-token table is always ours: it is
    the batch's own bookkeeping.
    """

    def __init__(self, *, rows: int, max_context_len: int, kv_tokens: int = 0,
                 mamba_slots: int = 0, device: str | torch.device = "cpu",
                 mamba_layers: int = 2, strict: bool = False, page_size: int | None = None,
                 kv: KVAllocator | None = None, mamba: MambaPool | None = None) -> None:
        page_size = page_size_of(kv, page_size)
        if kv is None and kv_tokens < page_size:
            raise ValueError(f"SchedulerPools: kv_tokens ({kv_tokens}) must hold at least "
                             f"one page of {page_size}; pass kv_tokens or kv=")
        if mamba is None and mamba_slots < 1:
            raise ValueError(f"SchedulerPools: mamba_slots must be >= 1, got {mamba_slots}; "
                             "pass mamba_slots or mamba=")
        self.page_size = page_size
        self.table = ReqToTokenTable(rows, max_context_len, device, strict=strict)
        self.kv: KVAllocator = require(kv, KVAllocator, "SchedulerPools(kv=)") \
            if kv is not None else TokenKVAllocator(kv_tokens, page_size, device, strict=strict)
        self.mamba: MambaPool = require(mamba, MambaPool, "SchedulerPools(mamba=)") \
            if mamba is not None else MambaStatePool(
                mamba_slots, mamba_layers, conv_dims=8, conv_kernel=4, heads=2, head_dim=4,
                state_size=4, device=device, strict=strict)

    def pools(self) -> dict[str, Any]:
        """The pools by name."""
        return {"kv": self.kv, "mamba": self.mamba, "table": self.table}

    def unchecked(self) -> list[str]:
        """Names of the pools the leak audit cannot check (not `AuditedPool`s)."""
        return [n for n, p in self.pools().items() if not isinstance(p, AuditedPool)]

    def in_use(self) -> dict[str, int]:
        """Units each `AuditedPool` has handed out now, by pool name (the others cannot
        say: see `unchecked()`)."""
        return {n: p.capacity - p.available for n, p in audited(self, self.pools())}

    def leaks(self) -> dict[str, int]:
        """Units each pool is missing (0 everywhere when nothing leaked); a pool that
        cannot report its capacity (not an `AuditedPool`) is left out: see
        `unchecked()`."""
        names = {"kv": "kv_tokens", "mamba": "mamba_slots", "table": "request_slots"}
        return {names[n]: v for n, v in self.in_use().items()}

    def check(self) -> None:
        """Each `AuditedPool`'s own double-free and foreign-index check."""
        for p in self.pools().values():
            if isinstance(p, AuditedPool):
                p.check()

    def assert_full(self) -> list[str]:
        """Raise naming what any `AuditedPool` is missing; returns the names of the
        pools it could not check (`unchecked()`)."""
        for p in self.pools().values():
            if isinstance(p, AuditedPool):
                p.assert_full()
        return self.unchecked()


def audited(owner: Any, pools: dict[str, Any]) -> list[tuple[str, Any]]:
    """`pools`' `AuditedPool`s as (name, pool), remembered on `owner` until a pool is
    replaced: a runtime protocol check costs microseconds, and a serving loop samples
    its pools every step."""
    key = tuple(map(id, pools.values()))
    cached = getattr(owner, "_audited", None)
    if cached is None or cached[0] != key:
        cached = (key, [(n, p) for n, p in pools.items() if isinstance(p, AuditedPool)])
        owner._audited = cached
    return cached[1]


Retired = Callable[[torch.Tensor, str], None]
"""`on_retired(rows, terminal_state)` after the rows' resources went back to the pools."""

# `append_kv` of at most this many rows of a CPU table is written on the host.
_HOST_ROWS = 64
# `append_kv` of more rows than this on a CPU table checks them as one numpy array
# (min, max, gather; a decode step's ends from it); fewer are checked as Python lists,
# cheaper for a handful (tests set it to 0 and to a large number to run both).
_NP_CHECK_ROWS = 24

_TERMINAL_OF_PLAN = {"release_finished": "finished", "release_aborted": "aborted",
                     "release_failed": "failed"}



def _reset_of(ev: torch.Tensor | _CheckedRuns, reset: torch.Tensor | None,
              ) -> torch.Tensor | None:
    """The rows a step starts anew: `reset`, or the ints a CPU batch's runs carry."""
    if ev.__class__ is _CheckedRuns:
        ids = cast("_CheckedRuns", ev).reset
        return host_ints(ids) if ids else None
    return reset


def _drop_locks(held: list[tuple[Any, Any]]) -> None:
    """Release the prefix locks an admission made before it was refused."""
    for _, lock in held:
        if lock is not None:
            lock.release()


class RunningBatch:
    """SEQUENCE instances, one per request slot, stepped and released in batches."""

    def __init__(self, pools: SchedulerPools, on_retired: Retired | None = None, *,
                 cache: PrefixCache | None = None) -> None:
        if cache is not None and (cache.kv is not pools.kv
                                  or cache.page_size != pools.page_size):
            raise ValueError("RunningBatch: the prefix cache must be built over the "
                             "batch's own KV pool (PrefixCache(pools.kv)) with its page size")
        self.pools = pools
        self.cache = cache
        n = pools.table.capacity
        self.locks: list[PrefixLock | None] = [None] * n
        """Per row: its lock on the cached prefix it matched (None: no match)."""
        self.tokens: list[list[int] | None] = [None] * n
        """Per row: its token ids (the prompt given at admission; the caller appends
        the tokens it generates), the cache's key when it finishes."""
        cap = getattr(pools.kv, "capacity", 0)
        self.evict_batch = max(pools.page_size, cap // 32)
        """Tokens evicted at least when growth finds the KV pool short."""
        self.on_retired = on_retired
        self.retired = {name: 0 for name in _TERMINAL_OF_PLAN.values()}
        self.released_tokens = 0
        effect = self._make_effect()
        self.batch = SEQUENCE.batch(pools.table.capacity, pools.table.device,
                                    plans=dict.fromkeys(_TERMINAL_OF_PLAN, effect))
        self.event = {cls: SEQUENCE.event_id(cls) for cls in SEQUENCE.events}
        # Queued for `flush`: (rows, event id) per `queue` call, in order (a row takes
        # its events in the order of the runs that name it), and the ids among them.
        self._runs: list[tuple[list[int], int]] = []
        self._queued_ids: set[int] = set()  # the ids in `_runs`: flush's known=
        # Rows admit(queued=True) gave out, in order: as ints, and (a batch off the CPU)
        # as the tensors admit() returned (a CPU batch builds one only when needed).
        self._admitted_ids: list[int] = []
        self._admitted: list[torch.Tensor] = []
        # Rows admitted by quiet steps the batch has not read back yet: if one of those
        # steps turns out refused, they are admitted again (never left vacant).
        self._unchecked_admits: list[torch.Tensor] = []
        self._vacant = SEQUENCE.state_id("vacant")
        # Per row: 1 from its admission (queued or not) until its release, else 0. What
        # `append_kv` checks (a retired or never-admitted row's slot is free: KV written
        # there would be lost when the slot is admitted again, its length reset to 0).
        # A CPU table's flags are a bytearray, set and read as ints (indexing numpy by a
        # list of rows first fails to read the list as one index, ~1,800 instructions),
        # with numpy and torch views of it; a device table's are an int64 tensor, read
        # with the rows and counts in the device path's one read back.
        dev = pools.table.device
        self._live: bytearray | None = bytearray(n) if dev.type == "cpu" else None
        self._live_np: np.ndarray | None = None
        if self._live is not None:
            self._live_np = np.frombuffer(self._live, np.uint8)
            self._live_t = torch.from_numpy(self._live_np)
        else:
            self._live_t = torch.zeros(n, dtype=torch.int64, device=dev)

    def _make_effect(self) -> Any:
        pools = self.pools

        @release_effect
        def release_rows(ctx: ReleaseContext, rows: torch.Tensor) -> None:
            state = _TERMINAL_OF_PLAN[ctx.plan]
            ids: list[int] | None = None
            try:
                starts: list[int] | None = None
                errors: list[Exception] = []
                if self.cache is not None:
                    if rows.dtype != torch.int64:
                        rows = rows.to(torch.int64)
                    ids = rows.tolist()
                    starts, errors = self._retire_cached(rows, ids, state)
                out = release_batch(rows, pools.table, pools.kv, pools.mamba,
                                    kv_start=starts)
                self.released_tokens += out.kv_tokens
                if errors:  # the rows' pages went back all the same
                    raise errors[0]
            finally:
                # The rows are terminal whatever a pool said (release_batch frees every
                # pool before raising): their owners hear of it either way.
                live = self._live
                if live is not None and ids is not None:
                    for r in ids:
                        live[r] = 0
                else:  # (a torch op: nothing read back)
                    self._live_t.index_fill_(
                        0, rows if rows.dtype == torch.int64 else rows.long(), 0)
                self.retired[state] += int(rows.numel())
                if self.on_retired is not None:
                    self.on_retired(rows, state)

        return release_rows

    def _retire_cached(self, rows: torch.Tensor, ids: list[int], state: str,
                       ) -> tuple[list[int], list[Exception]]:
        """Before `release_batch` frees the rows' own KV: insert each finished row's KV
        into the cache (the first column the row still owns moves past what the tree
        took, so `release_batch` frees the duplicates and the tail with the rest), and
        drop every row's lock. Returns the per-row first owned column (a list of ints:
        `release_batch` reads it as it is for a few rows of a CPU table)."""
        cache = self.cache
        assert cache is not None
        table = self.pools.table
        errors: list[Exception] = []
        locks, tokens = self.locks, self.tokens
        firsts: list[int] = []
        if state != "finished":
            # Nothing goes into the cache: each row's lock is dropped, its own KV (from
            # the end of its matched prefix) freed by release_batch.
            for r in ids:
                lock = locks[r]
                tokens[r] = None
                if lock is None:
                    firsts.append(0)
                    continue
                locks[r] = None
                firsts.append(lock.length)
                try:
                    lock.release()
                except Exception as e:
                    errors.append(e)
            return firsts, errors
        # The rows' lengths in one read (their KV goes into the cache).
        lengths = (table._np[0][ids].tolist() if table._np is not None else
                   table.lengths.index_select(0, rows).tolist())
        r2t = table.req_to_token
        # A CPU table's rows are read and rewritten through a numpy view (one host
        # operation each, where the tensor path takes two or three torch calls).
        # Only our own cache with its own insert: a subclass or a proxy that refuses or
        # counts inserts (a fault plan's, the simulator's refusing cache) or an insert
        # wrapped on the instance is called, as any other cache is (with tensors).
        r2t_np = (table._np[2] if table._np is not None and cache.tree.device.type == "cpu"
                  and type(cache) is PrefixCache and "insert" not in cache.__dict__
                  else None)
        insert, insert_host = cache.insert, cache.insert_host
        for r, length in zip(ids, lengths, strict=True):
            lock, toks = locks[r], tokens[r]
            start = lock.length if lock is not None else 0
            try:
                if toks is not None:
                    n = len(toks)
                    if n > length:
                        n = length
                    if r2t_np is not None:
                        # The row's columns as a view: the tree copies what it takes
                        # (insert_host: numpy copies, its node keeps them as `host`).
                        kv_np = r2t_np[r, :n]
                        res = insert_host(r, toks if n == len(toks) else toks[:n], kv_np,
                                          owned_from=start if start < n else n)
                    else:
                        kv = r2t[r, :n].to(torch.int64)
                        res = insert(r, toks if n == len(toks) else toks[:n], kv,
                                     owned_from=start if start < n else n)
                    taken = res.taken_count
                    if taken:
                        # The tree took kv[prefix_len:end]; the row still owns the
                        # duplicates kv[start:prefix_len] and the tail kv[end:]: move the
                        # taken run first, so the row owns the columns after it.
                        p, end = res.prefix_len, res.prefix_len + taken
                        if r2t_np is not None:
                            # kv_np is the row itself: the duplicates copied before the
                            # taken run (the tree's copy, res.node.host) moves over them.
                            dup = kv_np[start:p].copy() if p > start else None
                            kv_np[start:start + taken] = res.node.host
                            if dup is not None:
                                kv_np[start + taken:end] = dup
                        else:
                            row = torch.cat((kv[:start], kv[p:end], kv[start:p], kv[end:]))
                            r2t[r, :n] = row.to(r2t.dtype)
                        start += taken
            except Exception as e:  # the cache took nothing: the row frees it all
                errors.append(e)
            finally:
                firsts.append(start)
                tokens[r] = None
                locks[r] = None
                if lock is not None:
                    try:
                        lock.release()
                    except Exception as e:
                        errors.append(e)
        return firsts, errors

    # -- admission and growth --------------------------------------------------------

    @sanitized
    def admit(self, n: int, mamba: bool, prompts: Sequence[list[int]] | None = None, *,
              queued: bool = False) -> torch.Tensor | None:
        """Rows for `n` new sequences (with a Mamba state each when `mamba`), admitted
        (state `prefill`), or None.

        `queued=True`: the admission (the rows' reset and `Admit`) is queued as the
        first event of each row and delivered by the next `flush` with the rest of the
        scheduler step, in its one `Batch.step` (the row is vacant in the batch until
        then; queue the rows' next events after this call). If that step is refused,
        the admissions are still delivered, alone, before the error propagates, so a
        row that owns resources is never left vacant. Otherwise they are delivered now,
        in one step of their own.

        `prompts` (with a prefix cache): each row's prompt token ids; the longest
        cached prefix of all but its last token is matched, locked and written into
        the row (its length is the row's `lengths` and `matched(rows)`), so only the
        rest is allocated. The list is kept as the row's tokens (append generated
        tokens to it). All or nothing: when any pool is short, nothing is taken; the
        prompts are matched and locked before any row is taken, so a prompt the cache
        cannot read, or a lock that raises, raises with nothing taken (the locks made
        for the earlier prompts dropped again).
        """
        if prompts is not None and len(prompts) != n:
            raise ValueError(f"admit: {len(prompts)} prompts for {n} rows; pass one "
                             "prompt per row")
        if prompts is not None and self.cache is None:
            raise ValueError("admit: prompts given but the batch has no prefix cache; "
                             "build it with RunningBatch(pools, cache=PrefixCache(pools.kv))")
        pools = self.pools
        table = pools.table
        if table.available < n or (mamba and pools.mamba.available_size() < n):
            return None
        held = self._lock_prompts(prompts) if prompts is not None else None
        try:
            rows, rows_np = self._take_rows(n, mamba)
        except BaseException:
            if held is not None:
                _drop_locks(held)
            raise
        ids = rows_np.tolist() if rows_np is not None else rows.tolist()
        live = self._live
        if live is not None:
            for r in ids:
                live[r] = 1
        else:
            self._live_t.index_fill_(0, rows if rows.dtype == torch.int64 else rows.long(), 1)
        if held is not None:
            assert prompts is not None
            host = table._np  # a CPU table: rows written through numpy views
            tokens, locks = self.tokens, self.locks
            for r, toks, (m, lock) in zip(ids, prompts, held, strict=True):
                tokens[r] = toks
                if lock is None:
                    continue
                locks[r] = lock
                ln = m.length
                if host is not None:
                    # (the same indices, from a host insert; a cache of another kind
                    # may return a match without them)
                    ind_np = getattr(m, "host", None)
                    if ind_np is None:
                        ind = m.indices
                        ind_np = ind.numpy() if ind.is_cpu else ind.cpu().numpy()
                    host[2][r, :ln] = ind_np
                    host[0][r] = ln
                else:
                    table.req_to_token[r, :ln] = m.indices.to(
                        device=table.device, dtype=table.req_to_token.dtype)
                    table.lengths[r] = ln
        if queued:
            self._admitted_ids += ids
            if not rows.is_cpu:
                self._admitted.append(rows.clone())  # the caller's tensor is the caller's
            self._enqueue(ids, self.event[Admit])
        else:
            # Admitted in the same call: a row that owns resources is never left vacant,
            # where an abort would be refused and nothing could release them. One step:
            # the rows start anew (refused unless terminal or vacant) and take Admit.
            ev = torch.full((self.batch.n,), -1, dtype=torch.int64, device=self.batch.device)
            ev.index_fill_(0, rows, self.event[Admit])
            self._deliver(ev, None, rows)
        return rows

    def _lock_prompts(self, prompts: Sequence[list[int]]) -> list[tuple[Any, Any]]:
        """Each prompt's longest cached prefix (of all but its last token), matched and
        locked: (match, lock), or (None, None) without one. A prompt the cache cannot
        read, or a lock that raises, drops the locks already made, then raises."""
        assert self.cache is not None
        match, lock_of = self.cache.match, self.cache.lock
        held: list[tuple[Any, Any]] = []
        try:
            for toks in prompts:
                m = match(toks, limit=len(toks) - 1)
                held.append((m, lock_of(m)) if m.length else (None, None))
        except BaseException:
            _drop_locks(held)
            raise
        return held

    def _take_rows(self, n: int, mamba: bool) -> tuple[torch.Tensor, np.ndarray | None]:
        """`n` table rows (and a Mamba state each when `mamba`), the pools having room:
        the rows as a tensor and, from our own CPU table, as numpy (else None). A Mamba
        pool that raises gives the rows back, then raises."""
        pools = self.pools
        table = pools.table
        rows_np: np.ndarray | None = None
        if (type(table) is ReqToTokenTable and table._np is not None and 0 < n <= _HOST_ALLOC
                and "alloc" not in table.__dict__):
            # Our own CPU table (exactly the class, its alloc its own: a fault plan's
            # proxy, or an alloc wrapped on the instance, as bench e2e's pool clock does,
            # takes alloc()): the rows as numpy, read as a list and an index with no
            # torch call.
            rows_np = table.alloc_host(n)
            assert rows_np is not None
            rows = torch.from_numpy(rows_np)
        else:
            got = table.alloc(n)
            assert got is not None
            rows = got
        if mamba:
            try:
                slots = pools.mamba.alloc(n)
            except BaseException:
                table.free(rows)  # not admitted yet: nobody else can free them
                raise
            assert slots is not None
            if table._np is not None and slots.is_cpu:
                # the table's own memory
                table._np[1][rows_np if rows_np is not None else rows.numpy()] = slots.numpy()
            else:
                table.mamba_slots.index_copy_(0, rows, slots.to(torch.int64))
        return rows, rows_np

    @property
    def admitting(self) -> torch.Tensor:
        """Rows admitted with `queued=True` whose `Admit` is not known delivered yet (the
        next `flush` delivers it, or a quiet step did, not read back yet): they own their
        resources already, though the batch may still have them vacant."""
        pending = self._pending_rows(self._admitted_ids, self._admitted)
        adm = ([pending] if pending is not None else []) + self._unchecked_admits
        if not adm:
            return torch.empty(0, dtype=torch.int64, device=self.pools.table.device)
        return adm[0] if len(adm) == 1 else torch.cat(adm)

    def matched(self, row: int) -> int:
        """Tokens of `row` that came from the prefix cache (0 without a match)."""
        lock = self.locks[row]
        return lock.length if lock is not None else 0

    def audit(self) -> PageAudit:
        """Who holds every KV page now: the pool (free), the prefix cache (locked or
        evictable) or a live row (its own columns, past its matched prefix); token
        slots by holder. Raises AssertionError when a page has two holders or none;
        the leak sanitizer calls it after every driver call."""
        table = self.pools.table
        own = []
        # A retired row's length is 0 (release_batch resets it), as is a vacant one's.
        for r in (table.lengths > 0).nonzero().flatten().tolist():
            own.append(table.req_to_token[r, self.matched(r):int(table.lengths[r])])
        return audit_pages(self.pools.kv, self.cache, own)

    @sanitized
    def append_kv(self, rows: torch.Tensor | Sequence[int],
                  counts: torch.Tensor | Sequence[int]) -> bool:
        """Give each row `counts[i]` more KV tokens, written into its table row at once.

        `rows` and `counts` are int tensors, or lists of Python ints (a scheduler that
        keeps its rows in lists: on a CPU table they are read as they are, no tensor is
        built for a step of a few hundred rows).

        Each request's tokens live on pages of its own: a row's partial last page is
        filled first, then whole new pages are taken for it (one `alloc` of whole pages
        for all rows)::

            page_size 4, row r holds 6 tokens:   page a [a0 a1 a2 a3]  page b [b0 b1 . .]
            append 5:   b2 b3 (the rest of b), then page c: c0 c1 c2 (c3 stays r's)

        Refused before anything is taken: a `ValueError` names rows given twice, rows
        that hold no live sequence (never admitted, or retired: a late append after the
        request ended), a count below zero or a length past the table's
        `max_context_len`. False
        (nothing taken) when the KV pool is short.
        """
        table, ps = self.pools.table, self.pools.page_size
        rows_t, counts_t, total, host, arrays = self._check_append(rows, counts)
        if total == 0:
            return True
        if host[1].count(1) == len(host[1]):  # one token each: a decode step
            return self._append_one_each(rows_t, counts_t, host, arrays)
        if table._np is not None and len(host[0]) <= _HOST_ROWS:
            return self._append_host(host)
        if rows_t is None or counts_t is None:  # lists of many rows: the tensor path
            rows, counts = host_ints(host[0]), host_ints(host[1])
        else:
            rows, counts = rows_t, counts_t
        lengths = table.lengths.index_select(0, rows).to(torch.int64)
        # which[i] = the position in `rows` of the i-th new token (repeat_rows: no
        # OpenMP region on a few hundred rows, whatever torch's thread count); j[i] its
        # place among its row's.
        which = repeat_rows(counts, total)
        starts = torch.cumsum(counts, 0) - counts
        j = torch.arange(total, device=rows.device) - starts.index_select(0, which)
        if ps == 1:
            idx = self._alloc(total)
            if idx is None:
                return False
            idx = idx.to(rows.device)
        else:
            fill = torch.minimum((-lengths) % ps, counts)  # room on each row's last page
            pages = -(-(counts - fill) // ps)
            n_pages = int(pages.sum())
            got = self._alloc(n_pages * ps) if n_pages else None
            if n_pages and got is None:
                return False
            last = table.req_to_token[rows, (lengths - 1).clamp(min=0)].to(torch.int64)
            fill_w = fill.index_select(0, which)
            idx = last.index_select(0, which) + 1 + j
            if got is not None:
                first = (torch.cumsum(pages, 0) - pages) * ps - fill
                pos = (first.index_select(0, which) + j).clamp(0, n_pages * ps - 1)
                idx = torch.where(j < fill_w, idx, got.to(rows.device).index_select(0, pos))
        cols = lengths.index_select(0, which) + j
        table.req_to_token[rows.index_select(0, which), cols] = idx.to(torch.int32)
        table.lengths.index_add_(0, rows, counts.to(table.lengths.dtype))
        return True

    def _append_host(self, host: tuple[list[int], list[int], list[int]]) -> bool:
        """`append_kv` of a few rows of a CPU table: each row's run written through a
        numpy view of the table (a few host operations a row, where the whole-tensor
        path costs ~25 torch calls of fixed cost). Same pages, same order."""
        table, ps = self.pools.table, self.pools.page_size
        rs, cs, ends = host
        lens = [e - c for e, c in zip(ends, cs, strict=True)]
        assert table._np is not None
        r2t = table._np[2]
        fills = [min(-ln % ps, c) for ln, c in zip(lens, cs, strict=True)]
        pages = [-(-(c - f) // ps) for c, f in zip(cs, fills, strict=True)]
        n_pages = sum(pages)
        got = self._alloc(n_pages * ps) if n_pages else None
        if n_pages and got is None:
            return False
        new = None if got is None else got.numpy() if got.is_cpu else got.cpu().numpy()
        at = 0
        for r, ln, c, f, pg in zip(rs, lens, cs, fills, pages, strict=True):
            if f:  # the rest of the row's last page (a partial page: ln > 0)
                last = int(r2t[r, ln - 1])
                r2t[r, ln:ln + f] = np.arange(last + 1, last + 1 + f)
            if c > f:
                assert new is not None
                r2t[r, ln + f:ln + c] = new[at:at + c - f]
            at += pg * ps
        # The new lengths are the ends _check_append read (nothing wrote them since):
        # set, not added (no array of the counts, no gather-add-scatter).
        lens_np = table._np[0]
        if len(rs) == 1:
            lens_np[rs[0]] = ends[0]
        else:
            lens_np[rs] = ends
        return True

    def _append_one_each(self, rows: torch.Tensor | None, counts: torch.Tensor | None,
                         host: tuple[list[int], list[int], list[int]],
                         arrays: tuple[np.ndarray, np.ndarray] | None = None) -> bool:
        """`append_kv` where every row takes one token (a decode step): the positions are
        built on the host from the lists `_check_append` read, a handful of ops (on a
        CPU table, numpy ops on its views: no tensor besides the allocator's).
        `arrays`: the rows and new lengths as int64 arrays, when `_check_append` built
        them (many rows of a CPU table), which this may change: not built again."""
        table, ps = self.pools.table, self.pools.page_size
        rs, _, ends = host
        w = table.max_context_len
        if table._np is not None:
            lens_np, _, r2t = table._np
            flat_np = r2t.reshape(-1)  # a view: the table is contiguous
            n = len(rs)
            if arrays is not None:
                rs_np, last_np = arrays
            else:
                rs_np = np.fromiter(rs, np.int64, n)
                last_np = np.fromiter(ends, np.int64, n)
            last_np -= 1  # each row's new token's column (in place: no temporaries)
            pos_np = rs_np * w
            pos_np += last_np
            if ps == 1:
                got = self._alloc(n)
                if got is None:
                    return False
                idx_np = got.numpy() if got.is_cpu else got.cpu().numpy()
            else:
                # A row whose last page is full (or that has none) takes a new page; the
                # others write the slot after their last token.
                need_np = (last_np % ps == 0).nonzero()[0]
                got = self._alloc(len(need_np) * ps) if len(need_np) else None
                if len(need_np) and got is None:
                    return False
                # The slot after each row's last token, in the table's dtype (what it
                # is written back as). A row with no token yet (column 0) reads the
                # slot before its row (index -1 for row 0: in bounds), but it is one
                # that takes a new page, so that value is overwritten just below.
                idx_np = flat_np[pos_np - 1]
                idx_np += 1
                if got is not None:
                    idx_np[need_np] = (got.numpy() if got.is_cpu else got.cpu().numpy())[::ps]
            flat_np[pos_np] = idx_np
            lens_np[rs_np] += 1  # the rows are distinct (`_check_append`)
            return True
        assert rows is not None and counts is not None  # not a CPU table: tensors
        flat = table.req_to_token.view(-1)
        dev = rows.device
        if ps == 1:
            idx = self._alloc(len(rs))
            if idx is None:
                return False
            idx = idx.to(dev)
        else:
            need = [i for i, e in enumerate(ends) if (e - 1) % ps == 0]
            got = self._alloc(len(need) * ps) if need else None
            if need and got is None:
                return False
            last = host_ints([r * w + max(e - 2, 0) for r, e in zip(rs, ends, strict=True)],
                             dev)
            idx = flat.index_select(0, last).to(torch.int64).add_(1)
            if got is not None:
                at = host_ints(need, dev)
                idx.index_copy_(0, at, got.to(dev).view(len(need), ps)[:, 0])
        pos = host_ints([r * w + e - 1 for r, e in zip(rs, ends, strict=True)], dev)
        flat.index_copy_(0, pos, idx.to(flat.dtype))
        table.lengths.index_add_(0, rows, counts.to(table.lengths.dtype))
        return True

    def _alloc(self, n: int) -> torch.Tensor | None:
        """`n` KV token slots; when the pool is short, unlocked cached pages are evicted
        (least recently used first) to make room, then the allocation is tried again."""
        kv = self.pools.kv
        got = kv.alloc(n)
        if got is None and self.cache is not None:
            short = n - kv.available_size()
            if 0 < short <= self.cache.evictable_tokens:
                # Evict a batch at once (1/32 of the pool at least): one scan of the
                # tree's leaves then serves many allocations.
                self.cache.evict(max(short, self.evict_batch))
                got = kv.alloc(n)
        return got

    def _check_append(self, rows: torch.Tensor | Sequence[int],
                      counts: torch.Tensor | Sequence[int],
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None, int,
                                 tuple[list[int], list[int], list[int]],
                                 tuple[np.ndarray, np.ndarray] | None]:
        """`rows` and `counts` as int64 on the table's device (None for lists of ints on
        a CPU table: not built), the total count and the rows, counts and new lengths
        as host lists, or a ValueError naming what is wrong (nothing taken). One host
        sync when all is well. Last, for a decode step (counts all 1) of more than
        `_NP_CHECK_ROWS` rows of a CPU table: the rows and new lengths as the int64
        arrays it checked them as (for `_append_one_each`, which may change them), else
        None."""
        table = self.pools.table
        arrays: tuple[np.ndarray, np.ndarray] | None = None
        rs: list[int] | None = None
        decode_top = -1  # a decode step's longest new length (-1: not one / not known)
        if not isinstance(rows, torch.Tensor) or not isinstance(counts, torch.Tensor):
            rs, cs = list(rows), list(counts)
            # Plain ints only (exactly int: a bool or numpy int takes the tensor path):
            # a count of `int` among the types, ~0.6x the time of a set of them.
            if (table._np is None or list(map(type, rs)).count(int) != len(rs)
                    or list(map(type, cs)).count(int) != len(cs)):
                # Not a CPU table, or not plain ints: as tensors, checked as tensors are.
                rows, counts, rs = torch.as_tensor(rs), torch.as_tensor(cs), None
        rows_t: torch.Tensor | None = None
        counts_t: torch.Tensor | None = None
        if rs is None:
            assert isinstance(rows, torch.Tensor) and isinstance(counts, torch.Tensor)
            rows_t = rows.to(device=table.device, dtype=torch.int64).reshape(-1)
            counts_t = counts.to(device=table.device, dtype=torch.int64).reshape(-1)
            if rows_t.numel() != counts_t.numel():
                raise ValueError(f"append_kv: {rows_t.numel()} rows but {counts_t.numel()} "
                                 "counts; pass one count per row")
            if rows_t.numel() == 0:
                return rows_t, counts_t, 0, ([], [], []), None
        elif len(rs) != len(cs):
            raise ValueError(f"append_kv: {len(rs)} rows but {len(cs)} counts; "
                             "pass one count per row")
        elif not rs:
            return None, None, 0, ([], [], []), None
        if rs is not None or table._np is not None:
            # On a CPU the few rows of a step are read on the host (no tensor built).
            if rs is None:
                assert rows_t is not None and counts_t is not None
                rs, cs = rows_t.tolist(), counts_t.tolist()
            assert table._np is not None
            live = self._live  # (a CPU table: its rows' flags are on the host too)
            assert live is not None
            if len(rs) > _NP_CHECK_ROWS:
                # Many rows: as an index array (plain ints here: numpy's reductions and
                # gather on it cost less than min(), max() and indexing by the list);
                # an int past int64 is a row outside the table too.
                try:
                    rs_np = np.fromiter(rs, np.int64, len(rs))
                except OverflowError:
                    rs_np = None
                if rs_np is None or rs_np.min() < 0 or rs_np.max() >= table.capacity:
                    raise IndexError(f"append_kv: rows {rs} name a row outside 0.."
                                     f"{table.capacity - 1}; pass rows admit() returned")
                if not cast("np.ndarray", self._live_np)[rs_np].all():
                    raise self._not_live(rs)
                lens_np = table._np[0][rs_np]
            else:
                if min(rs) < 0 or max(rs) >= table.capacity:
                    raise IndexError(f"append_kv: rows {rs} name a row outside 0.."
                                     f"{table.capacity - 1}; pass rows admit() returned")
                if 0 in map(live.__getitem__, rs):
                    raise self._not_live(rs)
                lens_np = table._np[0][rs]
            if cs.count(1) == len(cs):  # one token each (a decode step): one numpy add
                ends_np = np.add(lens_np, 1, dtype=np.int64)
                if len(rs) > _NP_CHECK_ROWS:
                    # Counts of 1: none negative, their sum the row count, the longest
                    # row one numpy reduction (no Python min, max, sum over the lists).
                    # The arrays go to _append_one_each as they are (not built again).
                    decode_top = int(ends_np.max())
                    arrays = (cast("np.ndarray", rs_np), ends_np)
                ends = ends_np.tolist()
            else:
                ends = [a + c for a, c in zip(lens_np.tolist(), cs, strict=True)]
        else:
            assert rows_t is not None and counts_t is not None
            ends_t = table.lengths.index_select(0, rows_t).to(torch.int64) + counts_t
            rs, cs, ends, flags = torch.stack(
                (rows_t, counts_t, ends_t, self._live_t.index_select(0, rows_t))).tolist()
            if flags.count(1) != len(flags):
                raise self._not_live(rs)
        if decode_top < 0 and min(cs) < 0:
            neg = [i for i, c in enumerate(cs) if c < 0]
            raise ValueError(f"append_kv: negative token counts {[cs[i] for i in neg]} for "
                             f"rows {[rs[i] for i in neg]}; counts must be >= 0")
        if len(set(rs)) != len(rs):
            raise ValueError(f"append_kv: rows {rs} name a row more than once; "
                             "pass each row once with its total count")
        limit = table.max_context_len
        if (decode_top if decode_top >= 0 else max(ends)) > limit:
            over = [i for i, e in enumerate(ends) if e > limit]
            raise ValueError(
                f"append_kv: rows {[rs[i] for i in over]} would hold "
                f"{[ends[i] for i in over]} tokens, past the table's max_context_len "
                f"{limit}; finish or abort them, or raise max_context_len")
        return (rows_t, counts_t, len(cs) if decode_top >= 0 else sum(cs), (rs, cs, ends),
                arrays)

    def _not_live(self, rows: list[int]) -> ValueError:
        if self._live is not None:
            live = [self._live[r] for r in rows]
        else:
            live = self._live_t.index_select(
                0, torch.tensor(rows, device=self._live_t.device)).tolist()
        bad = [r for r, v in zip(rows, live, strict=True) if not v]
        return ValueError(f"append_kv: rows {bad} hold no live sequence (never admitted, "
                          "or retired: their slots are free); pass rows admit() returned "
                          "for sequences that have not ended")

    # -- stepping ----------------------------------------------------------------------

    @sanitized
    def fire(self, rows: torch.Tensor, event: type) -> BatchStep:
        """Deliver one event class to `rows` (no event to the others) in one step, read
        back at once (a refusal raises here). Queued events are flushed first."""
        if self._runs:
            self.flush()
        ev = torch.full((self.batch.n,), -1, dtype=torch.int64, device=self.batch.device)
        ev.index_fill_(0, rows, self.event[event])
        return self._deliver(ev, None, None)

    @sanitized
    def step(self, events: torch.Tensor) -> BatchStep:
        """Deliver `events[r]` (an event id or -1) to every row at once; a (rounds, n)
        tensor gives rows several events in order (see `Batch.step`). Queued events are
        flushed first."""
        if self._runs:
            self.flush()
        return self._deliver(events, None, None)

    @sanitized
    def queue(self, rows: list[int], event: type) -> None:
        """Queue `event` for each of `rows`, after the events already queued for it;
        `flush` delivers them all in one step (nothing is taken or released here).
        A row outside the batch is refused here (`IndexError`), with nothing queued:
        found at `flush`, it would cost the step's other events, admissions included."""
        if not rows:
            return
        eid = self.event[event]
        try:  # a copy (the caller may reuse its list) of plain ints (numpy's are not)
            rows = list(map(operator.index, rows))
        except TypeError:
            raise TypeError(f"queue: rows are row ints, as admit() returns; got "
                            f"{rows!r}") from None
        if min(rows) < 0 or max(rows) >= self.batch.n:
            bad = [r for r in rows if not 0 <= r < self.batch.n]
            raise IndexError(f"queue: rows {bad} are outside the batch; rows are "
                             f"0..{self.batch.n - 1}, as admit() returns")
        self._enqueue(rows, eid)

    def _enqueue(self, rows: list[int], eid: int) -> None:
        """Queue `rows` (a list of ints the queue keeps: not the caller's) for `eid`."""
        self._queued_ids.add(eid)
        self._runs.append((rows, eid))

    @sanitized
    def flush(self) -> BatchStep | None:
        """Deliver every queued event in one `Batch.step` (row r's k-th queued event in
        round k, rows without one take none): a scheduler step's admissions, aborts,
        chunk results, launches, tokens, finishes and failures for all rows at once.
        None when nothing was queued. The queue is emptied whether or not the step is
        refused.

        The step says which event ids it holds (`Batch.step(known=)`), so a step none
        of whose events can end a row (admissions, launches, tokens) reads nothing back
        from the device; an error in it is raised by the next step that reads (or
        `check()`), see `fsm.batch`."""
        runs, self._runs = self._runs, []
        known, self._queued_ids = self._queued_ids, set()
        ids, self._admitted_ids = self._admitted_ids, []
        admitted, self._admitted = self._admitted, []
        if not runs:
            return None
        if self.batch.device.type == "cpu" and self.batch.machine.observed:
            # An observed step reads its decisions back whatever it holds (no quiet
            # step), so a CPU batch's is decided on the host, a few list operations
            # per queued run (`Batch.step_runs`, the admitted rows' resets as ints): the
            # same step, without a dense tensor of every row's events and a few dozen
            # small torch calls.
            # (the rows are ints of the batch: queue() and admit() made them so)
            return self._deliver(_CheckedRuns(runs, ids), None, None)
        # Built on the host by a fixed number of numpy calls (`dense_rounds`: no
        # per-row Python work; the rows were checked by queue()), then handed to the
        # batch's device.
        ev = torch.from_numpy(dense_rounds(runs, self.batch.n))
        if self.batch.device.type != "cpu":
            ev = ev.to(self.batch.device)
        return self._deliver(ev, known, self._pending_rows(ids, admitted))

    def _pending_rows(self, ids: list[int], admitted: list[torch.Tensor],
                      ) -> torch.Tensor | None:
        """The rows admitted with `queued=True` (`ids`; `admitted`: their tensors, off
        the CPU) as one int64 tensor on the batch's device, or None."""
        if not ids:
            return None
        if admitted:
            return admitted[0] if len(admitted) == 1 else torch.cat(admitted)
        return host_ints(ids, self.batch.device)

    @sanitized
    def check(self) -> None:
        """Read back the quiet steps not read yet (`Batch.check`): raise the refusal of
        the first refused one (its admissions are delivered again first)."""
        try:
            self.batch.check()
        except TransitionNotAllowed:
            self._readmit(None)
            raise
        self._unchecked_admits.clear()

    def _deliver(self, ev: torch.Tensor | _CheckedRuns, known: set[int] | None,
                 reset: torch.Tensor | None) -> BatchStep:
        """`Batch.step` of a tensor (or of a CPU batch's runs, whose admitted rows they
        carry as ints: a tensor of them is built only when the step is refused or left
        unread), keeping track of admissions a deferred refusal may undo."""
        refused = False
        try:
            return self.batch.step(ev, known=known, reset=reset)
        except TransitionNotAllowed:
            refused = True
            self._readmit(_reset_of(ev, reset))
            raise
        finally:
            # Applied (a plan that raised does not undo a step): if it was read back,
            # every admission so far is known delivered.
            if not refused:
                if not self.batch.unchecked:
                    self._unchecked_admits.clear()
                else:
                    rows = _reset_of(ev, reset)
                    if rows is not None:
                        self._unchecked_admits.append(rows)

    def _readmit(self, reset: torch.Tensor | None) -> None:
        """After a refused step: admit again every row admitted by a refused step (one
        still vacant, or still in the terminal state it was recycled from), so that no
        row owning resources is left where nothing can release it."""
        parts = self._unchecked_admits + ([reset] if reset is not None else [])
        self._unchecked_admits = []
        if not parts:
            return
        rows = torch.cat(parts)
        st = self.batch.states.index_select(0, rows)
        stuck = (st == self._vacant) | self.batch._terminal.index_select(0, st)
        rows = rows[stuck]
        if rows.numel():
            ev = torch.full((self.batch.n,), -1, dtype=torch.int64, device=self.batch.device)
            ev.index_fill_(0, rows, self.event[Admit])
            self.batch.step(ev, reset=rows)

    def rows_in(self, *states: str) -> torch.Tensor:
        """Rows whose sequence is in one of `states`."""
        st = self.batch.states
        mask = torch.zeros_like(st, dtype=torch.bool)
        for s in states:
            mask |= st == SEQUENCE.state_id(s)
        return mask.nonzero().squeeze(1)
