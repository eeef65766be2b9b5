"""The prefix cache's ownership: who holds each KV page, and who gives it back.

`kernels.radix.RadixTree` keeps the tree and its lock counts; this module keeps the
ownership the lifecycle needs around it::

    KV pool ──alloc──► live request ──terminal plan──┬─ success: insert ──► cache
       ▲                   │  (own pages)             │    taken pages: the cache's
       │                   │                          │    duplicates + unaligned tail ─┐
       │                   └ matched prefix: a lock   └─ abort / failure: freed ────────┤
       │                     handle ("prefix_lock")       (never inserted)              │
       │                     released exactly once                                      │
       ├──────────────────────── free (the kind's KV releaser) ◄────────────────────────┘
       └──────── evict: unlocked leaves only, least recently used first ◄── cache

A request that matched a prefix owns a lock handle (kind `PREFIX_LOCK`, value a
`PrefixLock`) in the ledger; its terminal plan releases it whichever terminal state it
reaches, so the lock is dropped exactly once. A page the cache holds is freed only by
`PrefixCache.evict`, which never drops a locked node. `audit_pages` says at any moment
who holds every page (the pool, the cache locked or evictable, a live request) and
raises when a page has two holders or none.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from terminus.fsm import ReleaseContext, release_effect
from terminus.kernels.kv import TokenKVAllocator
from terminus.kernels.protocols import AuditedPool, KVAllocator, page_size_of
from terminus.kernels.radix import RadixInsert, RadixMatch, RadixNode, RadixTree

__all__ = ["PREFIX_LOCK", "PageAudit", "PrefixCache", "PrefixLock", "audit_pages",
           "release_prefix_lock"]

PREFIX_LOCK = "prefix_lock"
"""Ledger kind of a request's lock on the prefix it matched."""


class PrefixLock:
    """A live request's lock on the cached prefix it matched: `length` tokens at KV
    `indices`, ending at `node`. `release()` unlocks it; a second call raises."""

    __slots__ = ("cache", "indices", "length", "node", "released")

    def __init__(self, cache: PrefixCache, match: RadixMatch) -> None:
        self.cache = cache
        self.node: RadixNode = match.node
        self.indices = match.indices
        self.length = match.length
        self.released = False

    def release(self) -> None:
        """Unlock the matched path (exactly once)."""
        if self.released:
            raise RuntimeError(f"prefix lock on {self.node!r} released twice; a lock is "
                               "released only by its owner's terminal plan")
        self.cache.unlock(self.node)
        self.released = True

    def __repr__(self) -> str:
        return f"PrefixLock({self.length} tokens, released={self.released})"


@release_effect
def release_prefix_lock(ctx: ReleaseContext, handle: Any) -> None:
    """Default releaser of `PREFIX_LOCK` handles: unlock the matched prefix."""
    handle.value.release()


class PrefixCache:
    """A radix prefix cache over a KV allocator: the cache's pages come from `kv` and
    go back to it only through `evict`.

    `page_size` defaults to the allocator's. Counters for reports: `lookups`, `hits`
    (lookups that matched something), `lookup_tokens`, `hit_tokens`, `inserts` (per
    request id), `inserted_tokens`, `duplicate_tokens`, `evicted_tokens`,
    `peak_cached_tokens`.
    """

    def __init__(self, kv: KVAllocator, page_size: int | None = None,
                 device: str | torch.device = "cpu") -> None:
        self.kv = kv
        self.page_size = page_size_of(kv, page_size)
        self.tree = RadixTree(self.page_size, device)
        self.inserts: Counter[Any] = Counter()
        self.lookups = self.hits = self.lookup_tokens = self.hit_tokens = 0
        self.inserted_tokens = self.duplicate_tokens = 0
        self.evicted_tokens = 0
        self.peak_cached_tokens = 0

    # -- sizes -------------------------------------------------------------------------

    @property
    def held_tokens(self) -> int:
        """KV token slots the cache holds (whole pages), locked or not."""
        return self.tree.total_size()

    @property
    def locked_tokens(self) -> int:
        """Cached tokens some live request locks."""
        return self.tree.protected_size()

    @property
    def evictable_tokens(self) -> int:
        """Cached tokens no live request locks."""
        return self.tree.evictable_size()

    # -- match and locks ------------------------------------------------------------------

    def match(self, tokens: Sequence[int], *, limit: int | None = None) -> RadixMatch:
        """The longest cached prefix of `tokens[:limit]` (whole pages). Lock it before
        anything can evict (`lock`). Counts the lookup."""
        m = self.tree.match_prefix(tokens, limit=limit)  # (cuts without copying twice)
        self.lookups += 1
        n = len(tokens)
        self.lookup_tokens += n if limit is None or limit >= n else max(0, limit)
        if m.length:
            self.hits += 1
            self.hit_tokens += m.length
        return m

    def lock(self, match: RadixMatch) -> PrefixLock:
        """Lock `match`'s path; the returned `PrefixLock` is what a request owns."""
        self.tree.inc_lock_ref(match.node)
        return PrefixLock(self, match)

    def unlock(self, node: RadixNode) -> None:
        """Drop one lock on `node`'s path (`PrefixLock.release` calls this)."""
        self.tree.dec_lock_ref(node)

    # -- insert and eviction --------------------------------------------------------------

    def insert(self, rid: Any, tokens: Sequence[int], kv_indices: torch.Tensor, *,
               owned_from: int = 0) -> RadixInsert:
        """Cache a finished request's KV (`kv_indices[i]` holds `tokens[i]`); returns
        what the tree took and what the caller must free (`duplicates`, `leftover`:
        free them through the KV releaser). `owned_from`: the request's matched, locked
        prefix length (those indices are the tree's already). Raises (nothing changed)
        when the tree refuses; the caller's pages are then all still its own."""
        return self._inserted(rid, self.tree.insert(tokens, kv_indices,
                                                    owned_from=owned_from))

    def insert_host(self, rid: Any, tokens: Sequence[int], kv_indices: np.ndarray, *,
                    owned_from: int = 0) -> RadixInsert:
        """`insert` with the KV indices as a 1-D numpy integer array (a CPU table's row;
        see `RadixTree.insert_host`): the same decisions, counts and errors."""
        return self._inserted(rid, self.tree.insert_host(tokens, kv_indices,
                                                         owned_from=owned_from))

    def _inserted(self, rid: Any, res: RadixInsert) -> RadixInsert:
        """Count an insert the tree did (`res`)."""
        tree = self.tree
        inserts = self.inserts  # (a Counter's += on a new key calls its __missing__)
        inserts[rid] = inserts.get(rid, 0) + 1
        self.inserted_tokens += res.taken_count
        self.duplicate_tokens += res.duplicate_count
        held = tree.total_size()
        if held > self.peak_cached_tokens:
            self.peak_cached_tokens = held
        return res

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` cached tokens (when that many are unlocked) to the
        KV pool, least recently used leaves first; returns the tokens freed."""
        if num_tokens <= 0:
            return 0
        kv = self.kv
        if (type(kv) is TokenKVAllocator and kv._free._stack_host is not None
                and self.tree.device.type == "cpu" and "free" not in kv.__dict__):
            # Our own pool with its free list on the host (exactly the class, its free
            # its own: a fault plan's proxy, or a free wrapped on the instance, as bench
            # e2e's pool clock does, takes free() below): the dropped indices as numpy,
            # freed through free_host (the same pages in the same order, no torch op).
            idx_np = self.tree.evict_host(num_tokens)
            n = idx_np.shape[0]
            if n:
                kv.free_host(idx_np[::self.page_size] if self.page_size > 1 else idx_np)
                self.evicted_tokens += n
            return n
        idx = self.tree.evict(num_tokens)
        n = int(idx.numel())
        if n:
            # Tree values are whole pages, each page's tokens in order: one index per
            # page names it (the allocator frees whole pages).
            self.kv.free(idx[::self.page_size] if self.page_size > 1 else idx)
            self.evicted_tokens += n
        return n

    def evict_all(self) -> int:
        """Free every unlocked cached token to the KV pool; returns how many."""
        return self.evict(self.tree.evictable_size())

    def stats(self) -> dict[str, Any]:
        """The simulator's `prefix_cache` figures."""
        return {
            "hit_rate": self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0,
            "request_hit_rate": self.hits / self.lookups if self.lookups else 0.0,
            "lookups": self.lookups,
            "hit_tokens": self.hit_tokens,
            "inserted_tokens": self.inserted_tokens,
            "duplicate_tokens": self.duplicate_tokens,
            "evicted_tokens": self.evicted_tokens,
            "peak_cached_tokens": self.peak_cached_tokens,
            "cached_tokens": self.held_tokens,
            "locked_at_end": self.locked_tokens,
        }


class PageAudit(dict[str, int]):
    """KV token slots by holder: `free`, `cache_locked`, `cache_evictable`, `requests`
    (and `capacity`); `audit_pages` returns one after checking it adds up."""


def audit_pages(kv: KVAllocator, cache: PrefixCache | None,
                requests: Iterable[torch.Tensor]) -> PageAudit:
    """Check that every KV page has exactly one holder: the pool (free), the cache
    (locked or evictable) or one live request (`requests`: each live request's own
    indices, not its matched prefix). Returns the token slots by holder.

    Raises AssertionError naming the pages held twice (by the cache and a request, or
    by two requests), or the count that does not add up to the pool's capacity (a page
    nobody holds: a leak; or one counted free and held). Pools that cannot report
    their capacity (not `AuditedPool`) are checked for double holders only.
    """
    ps = page_size_of(kv, None)

    def pages(idx: torch.Tensor) -> torch.Tensor:
        idx = idx.to(torch.int64).reshape(-1)
        return idx if ps == 1 else torch.unique(torch.div(idx, ps, rounding_mode="floor"))

    tree = cache.tree if cache is not None else None
    locked = pages(tree.cached_indices(locked=True)) if tree is not None else None
    evictable = pages(tree.cached_indices(locked=False)) if tree is not None else None
    parts = [pages(r) for r in requests]
    req_pages = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    held = [t for t in (locked, evictable, req_pages) if t is not None and t.numel()]
    every = torch.cat([t.cpu() for t in held]) if held else torch.empty(0, dtype=torch.int64)
    uniq, counts = torch.unique(every, return_counts=True)
    twice = uniq[counts > 1]
    if twice.numel():
        raise AssertionError(f"KV pages with two holders (cache and a request, or two "
                             f"requests): {twice[:16].tolist()}")
    out = PageAudit(
        cache_locked=int(locked.numel()) * ps if locked is not None else 0,
        cache_evictable=int(evictable.numel()) * ps if evictable is not None else 0,
        requests=int(req_pages.numel()) * ps)
    if isinstance(kv, AuditedPool):
        out["free"] = kv.available
        out["capacity"] = kv.capacity
        total = out["free"] + out["cache_locked"] + out["cache_evictable"] + out["requests"]
        if total != kv.capacity:
            why = ("a page nobody holds: a leak" if total < kv.capacity
                   else "a page counted free and held")
            raise AssertionError(
                f"KV pages do not add up: free {out['free']} + cache locked "
                f"{out['cache_locked']} + cache evictable {out['cache_evictable']} + live "
                f"requests {out['requests']} = {total}, capacity {kv.capacity} "
                f"({why})")
    return out
