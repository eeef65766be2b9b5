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
from terminus.kernels import MambaStatePool, ReqToTokenTable, TokenKVAllocator, release_batch
from terminus.states.sequence import SEQUENCE, Admit

from .sanitize import sanitized

__all__ = ["RunningBatch", "SchedulerPools"]


class SchedulerPools:
    """The pools a scheduler's running batch draws from."""

    def __init__(self, *, rows: int, max_context_len: int, kv_tokens: int,
                 mamba_slots: int, device: str | torch.device = "cpu",
                 mamba_layers: int = 2, strict: bool = False) -> None:
        self.table = ReqToTokenTable(rows, max_context_len, device, strict=strict)
        self.kv = TokenKVAllocator(kv_tokens, device=device, strict=strict)
        self.mamba = MambaStatePool(mamba_slots, mamba_layers, conv_dims=8, conv_kernel=4,
                                    heads=2, head_dim=4, state_size=4, device=device,
                                    strict=strict)

    def leaks(self) -> dict[str, int]:
        """Units each pool is missing (0 everywhere when nothing leaked)."""
        return {
            "kv_tokens": self.kv.capacity - self.kv.available,
            "mamba_slots": self.mamba.capacity - self.mamba.available,
            "request_slots": self.table.capacity - self.table.available,
        }

    def assert_full(self) -> None:
        """Raise naming what any pool is missing."""
        self.kv.assert_full()
        self.mamba.assert_full()
        self.table.assert_full()


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
        if pools.table.available < n or (mamba and pools.mamba.available < n):
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

        False (nothing taken) when the KV pool is short.
        """
        table, kv = self.pools.table, self.pools.kv
        total = int(counts.sum())
        if total == 0:
            return True
        idx = kv.alloc(total)
        if idx is None:
            return False
        counts = counts.to(device=rows.device, dtype=torch.int64)
        # which[i] = the position in `rows` of the i-th new token (the index form of
        # repeat_interleave is the fast one on CPU).
        which = torch.repeat_interleave(counts)
        row_rep = rows.index_select(0, which)
        starts = torch.cumsum(counts, 0) - counts
        cols = table.lengths.index_select(0, rows).to(torch.int64) - starts
        cols = cols.index_select(0, which) + torch.arange(total, device=rows.device)
        table.req_to_token[row_rep, cols] = idx.to(torch.int32)
        table.lengths.index_add_(0, rows, counts.to(table.lengths.dtype))
        return True

    # -- stepping ----------------------------------------------------------------------

    @sanitized
    def fire(self, rows: torch.Tensor, event: type) -> BatchStep:
        """Deliver one event class to `rows` (no event to the others) in one step."""
        ev = torch.full((self.batch.n,), -1, dtype=torch.int64, device=self.batch.device)
        ev[rows] = self.event[event]
        return self.batch.step(ev)

    @sanitized
    def step(self, events: torch.Tensor) -> BatchStep:
        """Deliver `events[r]` (an event id or -1) to every row at once."""
        return self.batch.step(events)

    def rows_in(self, *states: str) -> torch.Tensor:
        """Rows whose sequence is in one of `states`."""
        st = self.batch.states
        mask = torch.zeros_like(st, dtype=torch.bool)
        for s in states:
            mask |= st == SEQUENCE.state_id(s)
        return mask.nonzero().squeeze(1)
