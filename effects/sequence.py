"""The scheduler's running batch: SEQUENCE rows over the KV, Mamba and request-slot pools.

    row r  = request slot r of the request-to-token table = instance r of the batch
    owns     req_to_token[r, :lengths[r]]   (KV tokens)
             mamba_slots[r]                 (a Mamba state, 0 = none)
             the slot r itself

A row's resources are written into the table in the same call that allocates them, so
they have an owner from their first instant; they are released only by the batch's
terminal plans, which run `kernels.release_batch` once per plan per step for every row
that turned terminal in that step (one tensor operation per pool), then tell the
caller which rows retired and how (to stream their terminal output).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from terminus.fsm import BatchStep, ReleaseContext, release_effect
from terminus.kernels import (
    MambaStatePool,
    ReqToTokenTable,
    TokenKVAllocator,
    release_batch,
    repeat_rows,
)
from terminus.kernels.protocols import (
    AuditedPool,
    KVAllocator,
    MambaPool,
    page_size_of,
    require,
)
from terminus.states.sequence import SEQUENCE, Admit

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

_TERMINAL_OF_PLAN = {"release_finished": "finished", "release_aborted": "aborted",
                     "release_failed": "failed"}


class RunningBatch:
    """SEQUENCE instances, one per request slot, stepped and released in batches."""

    def __init__(self, pools: SchedulerPools, on_retired: Retired | None = None) -> None:
        self.pools = pools
        self.on_retired = on_retired
        self.retired = {name: 0 for name in _TERMINAL_OF_PLAN.values()}
        self.released_tokens = 0
        effect = self._make_effect()
        self.batch = SEQUENCE.batch(pools.table.capacity, pools.table.device,
                                    plans=dict.fromkeys(_TERMINAL_OF_PLAN, effect))
        self.event = {cls: SEQUENCE.event_id(cls) for cls in SEQUENCE.events}
        self._pending: dict[int, list[int]] = {}  # row -> event ids queued for `flush`

    def _make_effect(self) -> Any:
        pools = self.pools

        @release_effect
        def release_rows(ctx: ReleaseContext, rows: torch.Tensor) -> None:
            state = _TERMINAL_OF_PLAN[ctx.plan]
            try:
                out = release_batch(rows, pools.table, pools.kv, pools.mamba)
                self.released_tokens += out.kv_tokens
            finally:
                # The rows are terminal whatever a pool said (release_batch frees every
                # pool before raising): their owners hear of it either way.
                self.retired[state] += int(rows.numel())
                if self.on_retired is not None:
                    self.on_retired(rows, state)

        return release_rows

    # -- admission and growth --------------------------------------------------------

    @sanitized
    def admit(self, n: int, mamba: bool) -> torch.Tensor | None:
        """Rows for `n` new sequences (with a Mamba state each when `mamba`), admitted
        (state `prefill`), or None.

        All or nothing: when any pool is short, nothing is taken.
        """
        pools = self.pools
        if pools.table.available < n or (mamba and pools.mamba.available_size() < n):
            return None
        rows = pools.table.alloc(n)
        assert rows is not None
        if mamba:
            try:
                slots = pools.mamba.alloc(n)
            except BaseException:
                pools.table.free(rows)  # not admitted yet: nobody else can free them
                raise
            assert slots is not None
            pools.table.mamba_slots.index_copy_(0, rows, slots.to(torch.int64))
        # Admitted in the same call: a row that owns resources is never left vacant,
        # where an abort would be refused and nothing could release them.
        self.batch.recycle(rows)
        self.fire(rows, Admit)
        return rows

    @sanitized
    def append_kv(self, rows: torch.Tensor, counts: torch.Tensor) -> bool:
        """Give each row `counts[i]` more KV tokens, written into its table row at once.

        Each request's tokens live on pages of its own: a row's partial last page is
        filled first, then whole new pages are taken for it (one `alloc` of whole pages
        for all rows)::

            page_size 4, row r holds 6 tokens:   page a [a0 a1 a2 a3]  page b [b0 b1 . .]
            append 5:   b2 b3 (the rest of b), then page c: c0 c1 c2 (c3 stays r's)

        Refused before anything is taken: a `ValueError` names rows given twice, a
        count below zero or a length past the table's `max_context_len`. False
        (nothing taken) when the KV pool is short.
        """
        table, kv, ps = self.pools.table, self.pools.kv, self.pools.page_size
        rows, counts, total = self._check_append(rows, counts)
        if total == 0:
            return True
        lengths = table.lengths.index_select(0, rows).to(torch.int64)
        # which[i] = the position in `rows` of the i-th new token (repeat_rows: no
        # OpenMP region on a few hundred rows, whatever torch's thread count); j[i] its
        # place among its row's.
        which = repeat_rows(counts, total)
        starts = torch.cumsum(counts, 0) - counts
        j = torch.arange(total, device=rows.device) - starts.index_select(0, which)
        if ps == 1:
            idx = kv.alloc(total)
            if idx is None:
                return False
            idx = idx.to(rows.device)
        else:
            fill = torch.minimum((-lengths) % ps, counts)  # room on each row's last page
            pages = -(-(counts - fill) // ps)
            n_pages = int(pages.sum())
            got = kv.alloc(n_pages * ps) if n_pages else None
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

    def _check_append(self, rows: torch.Tensor, counts: torch.Tensor,
                      ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """`rows` and `counts` as int64 on the table's device and the total count, or a
        ValueError naming what is wrong (nothing taken). One host sync when all is well."""
        table = self.pools.table
        rows = rows.to(device=table.device, dtype=torch.int64).reshape(-1)
        counts = counts.to(device=table.device, dtype=torch.int64).reshape(-1)
        if rows.numel() != counts.numel():
            raise ValueError(f"append_kv: {rows.numel()} rows but {counts.numel()} counts; "
                             "pass one count per row")
        if rows.numel() == 0:
            return rows, counts, 0
        neg = counts < 0
        ends = table.lengths.index_select(0, rows).to(torch.int64) + counts
        over = ends > table.max_context_len
        s = torch.sort(rows).values
        twice = (s[1:] == s[:-1]).any()
        total, any_neg, any_twice, any_over = torch.stack(
            (counts.sum(), neg.any(), twice, over.any())).tolist()
        if any_neg:
            raise ValueError(f"append_kv: negative token counts {counts[neg].tolist()} for "
                             f"rows {rows[neg].tolist()}; counts must be >= 0")
        if any_twice:
            raise ValueError(f"append_kv: rows {rows.tolist()} name a row more than once; "
                             "pass each row once with its total count")
        if any_over:
            raise ValueError(
                f"append_kv: rows {rows[over].tolist()} would hold {ends[over].tolist()} "
                f"tokens, past the table's max_context_len {table.max_context_len}; "
                "finish or abort them, or raise max_context_len")
        return rows, counts, int(total)

    # -- stepping ----------------------------------------------------------------------

    @sanitized
    def fire(self, rows: torch.Tensor, event: type) -> BatchStep:
        """Deliver one event class to `rows` (no event to the others) in one step."""
        ev = torch.full((self.batch.n,), -1, dtype=torch.int64, device=self.batch.device)
        ev.index_fill_(0, rows, self.event[event])
        return self.batch.step(ev)

    @sanitized
    def step(self, events: torch.Tensor) -> BatchStep:
        """Deliver `events[r]` (an event id or -1) to every row at once; a (rounds, n)
        tensor gives rows several events in order (see `Batch.step`)."""
        return self.batch.step(events)

    @sanitized
    def queue(self, rows: list[int], event: type) -> None:
        """Queue `event` for each of `rows`, after the events already queued for it;
        `flush` delivers them all in one step (nothing is taken or released here)."""
        if not rows:
            return
        eid = self.event[event]
        pending = self._pending
        for r in rows:
            got = pending.get(r)
            if got is None:
                pending[r] = [eid]
            else:
                got.append(eid)

    @sanitized
    def flush(self) -> BatchStep | None:
        """Deliver every queued event in one `Batch.step` (row r's k-th queued event in
        round k, rows without one take none): a scheduler step's aborts, chunk results,
        launches, tokens, finishes and failures for all rows at once. None when nothing
        was queued. The queue is emptied whether or not the step is refused."""
        pending, self._pending = self._pending, {}
        if not pending:
            return None
        n = self.batch.n
        k = max(map(len, pending.values()))
        flat = [-1] * (k * n)
        for r, ids in pending.items():
            for j, e in enumerate(ids):
                flat[j * n + r] = e
        ev = torch.tensor(flat, dtype=torch.int64).view(k, n)
        return self.batch.step(ev.to(self.batch.device))

    def rows_in(self, *states: str) -> torch.Tensor:
        """Rows whose sequence is in one of `states`."""
        st = self.batch.states
        mask = torch.zeros_like(st, dtype=torch.bool)
        for s in states:
            mask |= st == SEQUENCE.state_id(s)
        return mask.nonzero().squeeze(1)
