"""A stateful test of the prefix cache's ownership at the effects level: many sequences
of a `RunningBatch` with a cache, admitted with shared prompts, growing, finishing,
aborting and failing in any order, with eviction under pressure. After every step every
KV page has exactly one holder (the pool, the cache, or one live row) and no locked
page was evicted; at the end, with every row retired and the cache evicted, the pools
are full and no lock is left."""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from terminus.effects.prefix_cache import PrefixCache
from terminus.effects.sequence import RunningBatch, SchedulerPools
from terminus.states.sequence import (
    ChunkDone,
    ChunkLaunched,
    Fail,
    Finish,
    LastChunkDone,
    SequenceAbort,
    Token,
)

_SYSTEMS = [list(range(100 * s, 100 * s + 40)) for s in range(1, 4)]


class CachedBatch(RuleBasedStateMachine):
    page = 1

    def __init__(self) -> None:
        super().__init__()
        self.pools = SchedulerPools(rows=6, max_context_len=96, kv_tokens=320,
                                    mamba_slots=6, strict=True, page_size=self.page)
        self.cache = PrefixCache(self.pools.kv)
        self.retired: list[tuple[int, str]] = []
        self.rb = RunningBatch(self.pools, lambda rows, s: self.retired.extend(
            (int(r), s) for r in rows), cache=self.cache)
        self.live: dict[int, list[int]] = {}  # row -> its token list
        self.in_flight: dict[int, int] = {}

    def _state(self, r: int) -> str:
        return self.rb.batch.machine.states[int(self.rb.batch.states[r])]

    def _t(self, r: int) -> torch.Tensor:
        return torch.tensor([r])

    @rule(system=st.integers(0, 2), own=st.integers(1, 24), salt=st.integers(0, 3))
    def admit(self, system: int, own: int, salt: int) -> None:
        prompt = _SYSTEMS[system] + [7000 + 10 * salt + i for i in range(own)]
        rows = self.rb.admit(1, mamba=salt % 2 == 0, prompts=[prompt])
        if rows is None:
            return
        r = int(rows[0])
        self.live[r] = prompt
        self.in_flight[r] = 0
        if self.rb.matched(r):
            assert self.cache.locked_tokens >= self.rb.matched(r)
        assert self.rb.matched(r) < len(prompt)

    @rule(system=st.integers(0, 2), own=st.integers(1, 24))
    def complete_one(self, system: int, own: int) -> None:
        """A whole request at once: admitted, prefilled, one token, finished (cached)."""
        prompt = _SYSTEMS[system] + [9000 + i for i in range(own)]
        rows = self.rb.admit(1, mamba=False, prompts=[prompt])
        if rows is None:
            return
        r = int(rows[0])
        if not self.rb.append_kv(rows, torch.tensor([len(prompt) - self.rb.matched(r)])):
            self.rb.fire(rows, Fail)
            return
        self.rb.fire(rows, ChunkLaunched)
        self.rb.fire(rows, LastChunkDone)
        self.rb.fire(rows, Finish)

    def _pick(self, i: int, *states: str) -> int | None:
        rows = [r for r in sorted(self.live) if self._state(r) in states]
        return rows[i % len(rows)] if rows else None

    @rule(i=st.integers(0, 5), n=st.integers(1, 20))
    def launch(self, i: int, n: int) -> None:
        r = self._pick(i, "prefill", "prefill_1")
        if r is None:
            return
        n = min(n, self.pools.table.max_context_len - int(self.pools.table.lengths[r]) - 8)
        if n < 1 or not self.rb.append_kv(self._t(r), torch.tensor([n])):
            return
        self.rb.fire(self._t(r), ChunkLaunched)
        self.in_flight[r] += 1

    @rule(i=st.integers(0, 5), last=st.booleans())
    def result(self, i: int, last: bool) -> None:
        r = self._pick(i, "prefill_1", "prefill_2", "draining_1", "draining_2")
        if r is None:
            return
        final = last and self._state(r) == "prefill_1"
        self.rb.fire(self._t(r), LastChunkDone if final or self._state(r) == "draining_1"
                     else ChunkDone)
        self.in_flight[r] -= 1
        self._settle(r)

    @rule(i=st.integers(0, 5))
    def token(self, i: int) -> None:
        r = self._pick(i, "decoding")
        if r is None or int(self.pools.table.lengths[r]) >= self.pools.table.max_context_len:
            return
        if self.rb.append_kv(self._t(r), torch.tensor([1])):
            self.live[r].append(5)
            self.rb.fire(self._t(r), Token)

    @rule(i=st.integers(0, 5), event=st.sampled_from([Finish, SequenceAbort, Fail]))
    def end(self, i: int, event: type) -> None:
        states = ("decoding",) if event is Finish else (
            "prefill", "prefill_1", "prefill_2", "decoding")
        r = self._pick(i, *states)
        if r is None:
            return
        self.rb.fire(self._t(r), event)
        self._settle(r)

    def _settle(self, r: int) -> None:
        if self._state(r) in ("finished", "aborted", "failed"):
            del self.live[r]
            del self.in_flight[r]
            assert self.rb.locks[r] is None

    @precondition(lambda self: self.cache.evictable_tokens > 0)
    @rule(n=st.integers(1, 64))
    def evict(self, n: int) -> None:
        locked = set(self.cache.tree.cached_indices(locked=True).tolist())
        self.cache.evict(n)
        assert locked <= set(self.cache.tree.cached_indices().tolist())

    @invariant()
    def every_page_has_one_holder(self) -> None:
        self.rb.audit()
        self.cache.tree.check()
        longest = max((lock.length for lock in self.rb.locks if lock is not None),
                      default=0)
        assert self.cache.locked_tokens >= longest

    @invariant()
    def locks_belong_to_live_rows(self) -> None:
        for r, lock in enumerate(self.rb.locks):
            assert (lock is not None) <= (r in self.live)
        if not any(self.rb.locks):
            assert self.cache.locked_tokens == 0

    def teardown(self) -> None:
        for r in list(self.live):
            st_ = self._state(r)
            if st_ in ("prefill", "prefill_1", "prefill_2", "decoding"):
                self.rb.fire(self._t(r), SequenceAbort)
            while self._state(r) in ("draining_1", "draining_2"):
                self.rb.fire(self._t(r), LastChunkDone if self._state(r) == "draining_1"
                             else ChunkDone)
            assert self._state(r) in ("aborted", "failed", "finished")
        assert self.cache.locked_tokens == 0
        self.rb.audit()
        self.cache.evict_all()
        assert self.cache.held_tokens == 0
        self.pools.assert_full()


class CachedBatchPaged(CachedBatch):
    page = 16


TestCachedBatch = CachedBatch.TestCase
TestCachedBatch.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
TestCachedBatchPaged = CachedBatchPaged.TestCase
TestCachedBatchPaged.settings = settings(max_examples=40, stateful_step_count=40,
                                         deadline=None)
