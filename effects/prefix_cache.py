"""A prefix (radix) cache stand-in that counts inserts and owns what it was given.

The real radix tree is outside this package; what the lifecycle must guarantee about it
is countable: a successful request's KV is inserted exactly once, an aborted one's
never. Inserting hands the pages to the cache; `evict_all()` gives them back to the KV
pool, so a test can end with the pool full.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol, runtime_checkable

import torch

from terminus.kernels.protocols import KVAllocator

__all__ = ["CountingPrefixCache", "PrefixCache"]


@runtime_checkable
class PrefixCache(Protocol):
    """What the effects need from a prefix cache."""

    def insert(self, rid: str, kv_indices: torch.Tensor) -> None:
        """Take ownership of `kv_indices`, the whole KV of request `rid`."""


class CountingPrefixCache:
    """Holds inserted KV pages and counts inserts per request id."""

    def __init__(self, kv: KVAllocator) -> None:
        self.kv = kv
        self.inserts: Counter[str] = Counter()
        self._held: list[torch.Tensor] = []
        self.held_tokens = 0  # token slots of the pool held: whole pages

    def insert(self, rid: str, kv_indices: torch.Tensor) -> None:
        """Count the insert and keep the pages until `evict_all()`."""
        self.inserts[rid] += 1
        self._held.append(kv_indices)
        ps = getattr(self.kv, "page_size", 1)
        self.held_tokens += int(kv_indices.numel()) if ps == 1 else ps * int(
            torch.unique(torch.div(kv_indices, ps, rounding_mode="floor")).numel())

    def evict_all(self) -> int:
        """Free every held page to the KV pool; returns the token slots freed (whole
        pages)."""
        n = self.held_tokens
        if self._held:
            self.kv.free(torch.cat(self._held))
        self._held = []
        self.held_tokens = 0
        return n
