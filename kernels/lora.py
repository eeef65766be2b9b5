"""LoRA adapter registry with in-flight usage counters (asyncio).

Lifecycle of an adapter id::

    register/upsert ──► registered ──unregister──► unloading ──count == 0──► gone
                        acquire +1                 acquire: UnknownAdapter
                        release -1                 release -1 (only down from here)

``acquire`` looks names up and increments their counters in one step under one lock, so
an unload can never slip between the lookup and the increment. After ``unregister`` a
counter can only fall, which is why ``unload`` waits on an event set when it reaches
exactly zero, with no polling. A release that would go below zero raises
``ReleaseUnderflow`` at that release, not as a hang of some later unload.

No critical section here awaits, so ``release_nowait`` (for synchronous callers such as
a terminal transition's effect) is as atomic as ``release`` under one event loop. A
registry belongs to the event loop that first waits on it.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, overload

from terminus.kernels.errors import (
    LeakError,
    RegistryFull,
    ReleaseUnderflow,
    UnknownAdapter,
    UnloadTimeout,
)

__all__ = ["LoRAAdapter", "LoRARegistry"]


@dataclass
class LoRAAdapter:
    """A registered adapter: its stable ``id``, ``name`` and where it was loaded from."""

    id: int
    name: str
    path: str | None = None
    zero: asyncio.Event = field(default_factory=asyncio.Event, repr=False)


class LoRARegistry:
    """Name → stable id registry with per-id usage counters.

    Args:
        capacity: most adapters registered at once (``RegistryFull`` beyond it).
    """

    def __init__(self, capacity: int = 64) -> None:
        self._capacity = capacity
        self._lock = asyncio.Lock()
        self._by_name: dict[str, LoRAAdapter] = {}
        self._by_id: dict[int, LoRAAdapter] = {}
        self._counts: dict[int, int] = {}
        self._next_id = 1

    # -- pool accounting --------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Most adapters registered at once."""
        return self._capacity

    @property
    def available(self) -> int:
        """Adapters that can still be registered."""
        return self._capacity - len(self._by_name)

    def count(self, lora_id: int) -> int:
        """In-flight references of ``lora_id`` (0 for an id unknown or gone)."""
        return self._counts.get(lora_id, 0)

    def counts(self) -> dict[int, int]:
        """Every live id's counter, unloading ones included (for tests and metrics)."""
        return dict(self._counts)

    def id_of(self, name: str) -> int:
        """The id registered under ``name``; ``UnknownAdapter`` if none."""
        ad = self._by_name.get(name)
        if ad is None:
            raise UnknownAdapter([name])
        return ad.id

    def assert_full(self) -> None:
        """Raise ``LeakError`` naming every id whose counter is not zero."""
        held = {i: c for i, c in self._counts.items() if c}
        if held:
            raise LeakError("LoRARegistry", sum(held.values()), list(held), "references of ids")

    # -- registration ---------------------------------------------------------------------

    async def register(self, name: str | Any, path: str | None = None) -> int:
        """Register a new adapter; returns its id. ``ValueError`` if the name is taken.

        ``name`` may also be an adapter reference with SGLang's ``LoRARef`` fields
        (``lora_name``, ``lora_path``), as ``AdapterManager`` passes; the registry then
        gives it its own int id, returned here.
        """
        if not isinstance(name, str):
            name, path = name.lora_name, name.lora_path
        async with self._lock:
            if name in self._by_name:
                raise ValueError(
                    f"LoRA adapter {name!r} is already registered (id "
                    f"{self._by_name[name].id}); use upsert() to replace it in place"
                )
            return self._add(name, path)

    async def upsert(self, name: str, path: str | None = None) -> int:
        """Register ``name`` or replace its weights in place, keeping its stable id.

        In-flight references keep counting against the same id, so their releases stay
        valid across the upsert.
        """
        async with self._lock:
            ad = self._by_name.get(name)
            if ad is None:
                return self._add(name, path)
            ad.path = path
            return ad.id

    def _add(self, name: str, path: str | None) -> int:
        if len(self._by_name) >= self._capacity:
            raise RegistryFull(
                f"LoRA registry is full ({self._capacity} adapters); unload one before "
                f"registering {name!r}"
            )
        ad = LoRAAdapter(self._next_id, name, path)
        self._next_id += 1
        ad.zero.set()
        self._by_name[name] = ad
        self._by_id[ad.id] = ad
        self._counts[ad.id] = 0
        return ad.id

    async def unregister(self, name: str) -> int:
        """Stop new acquires of ``name``; returns its id, whose counter can now only fall."""
        async with self._lock:
            ad = self._by_name.pop(name, None)
            if ad is None:
                raise UnknownAdapter([name])
            self._forget_if_idle(ad.id)
            return ad.id

    async def wait_for_unload(self, lora_id: int, timeout: float | None = None) -> None:
        """Wait until unregistered ``lora_id``'s counter is exactly zero, then forget it.

        Raises ``UnloadTimeout`` naming the id and its count after ``timeout`` seconds.
        """
        ad = self._by_id.get(lora_id)
        if ad is None:
            return
        if ad.name in self._by_name and self._by_name[ad.name] is ad:
            raise ValueError(
                f"LoRA id {lora_id} ({ad.name!r}) is still registered; unregister() it "
                "first, or its counter could keep rising"
            )
        try:
            await asyncio.wait_for(ad.zero.wait(), timeout)
        except asyncio.TimeoutError:
            raise UnloadTimeout(lora_id, ad.name, self.count(lora_id), timeout or 0.0) from None
        self._forget_if_idle(lora_id)

    async def unload(self, name: str, timeout: float | None = None) -> int:
        """``unregister(name)`` then ``wait_for_unload(id, timeout)``; returns the id."""
        lora_id = await self.unregister(name)
        await self.wait_for_unload(lora_id, timeout)
        return lora_id

    def _forget_if_idle(self, lora_id: int) -> None:
        ad = self._by_id.get(lora_id)
        if ad is not None and self._counts[lora_id] == 0 and self._by_name.get(ad.name) is not ad:
            del self._by_id[lora_id]
            del self._counts[lora_id]

    # -- references -----------------------------------------------------------------------

    @overload
    async def acquire(self, names: str) -> int: ...
    @overload
    async def acquire(self, names: list[str]) -> list[int]: ...

    async def acquire(self, names: str | list[str]) -> int | list[int]:
        """Look up and count one reference per name, atomically; all or nothing."""
        async with self._lock:
            one = isinstance(names, str)
            batch = [names] if isinstance(names, str) else list(names)
            missing = [n for n in batch if n not in self._by_name]
            if missing:
                raise UnknownAdapter(missing)
            ids = [self._by_name[n].id for n in batch]
            for i in ids:
                self._counts[i] += 1
                self._by_id[i].zero.clear()
            return ids[0] if one else ids

    async def release(self, ids: int | list[int]) -> None:
        """Drop one reference per id; ``ReleaseUnderflow`` (releasing nothing) below zero."""
        async with self._lock:
            self.release_nowait(ids)

    def release_nowait(self, ids: int | list[int]) -> None:
        """``release`` for synchronous callers inside the registry's event loop."""
        batch = Counter([ids] if isinstance(ids, int) else ids)
        for i, k in batch.items():
            have = self._counts.get(i, 0)
            if have < k:
                raise ReleaseUnderflow(i, have, k)
        for i, k in batch.items():
            self._counts[i] -= k
            if self._counts[i] == 0:
                self._by_id[i].zero.set()
                self._forget_if_idle(i)
