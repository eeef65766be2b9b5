"""LoRA adapter registry with in-flight usage counters (asyncio).

Lifecycle of an adapter id::

    register/upsert ──► registered ──unregister──► unloading ──count == 0──► gone
                        acquire +1                 acquire: UnknownAdapter
                        release -1                 release -1 (only down from here)

``acquire`` looks names up and increments their counters in one step, so an unload can
never slip between the lookup and the increment. After ``unregister`` a counter can only
fall, which is why ``wait_for_unload`` waits on an event set when it reaches exactly
zero, with no polling. A release that would go below zero raises ``ReleaseUnderflow`` at
that release, not as a hang of some later unload.

No method awaits inside its critical section (the lookup, the check and the update run
with no ``await`` between them), so under one event loop every method is atomic without
a lock, and ``release_nowait`` (for synchronous callers such as a terminal transition's
effect) is as atomic as ``release``. That is also what keeps the round trip cheap: an
``acquire`` plus a ``release`` of one name is two dictionary lookups and two integer
updates, with no lock, condition or event touched unless an unload is waiting. Each
counter lives on its adapter's record, so neither path does a second lookup.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, overload

from terminus.kernels._stack import as_int
from terminus.kernels.errors import (
    LeakError,
    RegistryFull,
    ReleaseUnderflow,
    UnknownAdapter,
    UnloadTimeout,
)

__all__ = ["LoRAAdapter", "LoRARegistry"]


@dataclass(eq=False)
class LoRAAdapter:
    """A registered adapter: its stable ``id``, ``name``, where it was loaded from, and
    ``refs``, its in-flight references."""

    id: int
    name: str
    path: str | None = None
    refs: int = 0
    registered: bool = field(default=True, repr=False)
    # Set when ``refs`` reaches zero after an unregister; made only when someone waits.
    zero: asyncio.Event | None = field(default=None, repr=False)


def _lora_id(i: object) -> int:
    """One LoRA id as an int (a numpy integer is one), or a TypeError naming it."""
    j = i if i.__class__ is int else as_int(i)
    if j is None:
        raise TypeError(f"LoRA release: {i!r} is not a LoRA id; release the int ids "
                        "acquire() returned (a name is not one)")
    return j


def _lora_ids(ids: object) -> int | list[int]:
    """What `release_nowait` was given, other than an int or a list: one id (a numpy
    integer), or several (a tuple, a 1-D integer tensor), or a TypeError."""
    if isinstance(ids, (str, bytes, bool)):
        return _lora_id(ids)
    try:
        return _lora_id(ids)
    except TypeError:
        pass
    try:
        many = list(ids)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"LoRA release: {ids!r} is not a LoRA id nor a list of them; "
                        "release the int ids acquire() returned") from None
    return [_lora_id(i) for i in many]


class LoRARegistry:
    """Name → stable id registry with per-id usage counters.

    Args:
        capacity: most adapters registered at once (``RegistryFull`` beyond it).
    """

    def __init__(self, capacity: int = 64) -> None:
        self._capacity = capacity
        self._by_name: dict[str, LoRAAdapter] = {}
        # Every live id: registered, or unregistered with references still out.
        self._by_id: dict[int, LoRAAdapter] = {}
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
        ad = self._by_id.get(lora_id)
        return 0 if ad is None else ad.refs

    def counts(self) -> dict[int, int]:
        """Every live id's counter, unloading ones included (for tests and metrics)."""
        return {i: ad.refs for i, ad in self._by_id.items()}

    def id_of(self, name: str) -> int:
        """The id registered under ``name``; ``UnknownAdapter`` if none."""
        ad = self._by_name.get(name)
        if ad is None:
            raise UnknownAdapter([name])
        return ad.id

    def assert_full(self) -> None:
        """Raise ``LeakError`` naming every id whose counter is not zero."""
        held = {i: ad.refs for i, ad in self._by_id.items() if ad.refs}
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
        self._by_name[name] = ad
        self._by_id[ad.id] = ad
        return ad.id

    async def unregister(self, name: str) -> int:
        """Stop new acquires of ``name``; returns its id, whose counter can now only fall."""
        ad = self._by_name.pop(name, None)
        if ad is None:
            raise self._not_registered(name)
        ad.registered = False
        if not ad.refs:
            self._gone(ad)
        return ad.id

    def _not_registered(self, name: str) -> UnknownAdapter:
        """The error of an unregister of ``name``, not registered: says whether it is
        unloading already, and which names are registered (the cold path only)."""
        unloading = [ad for ad in self._by_id.values() if ad.name == name and not ad.registered]
        if unloading:
            ad = unloading[-1]
            why = (f"it is unregistered already (id {ad.id}, unloading with {ad.refs} "
                   f"reference(s) still out: wait_for_unload({ad.id}) waits for them)")
        else:
            why = "it was never registered, or was unregistered and unloaded already"
        names = sorted(self._by_name)
        shown = ", ".join(map(repr, names[:16])) + (f", ... ({len(names)} in all)"
                                                   if len(names) > 16 else "")
        return UnknownAdapter([name], (
            f"unregister of unknown LoRA adapter {name!r}: {why}. Registered: [{shown}]. "
            "Nothing was changed; unregister a registered name, once."))

    async def wait_for_unload(self, lora_id: int, timeout: float | None = None) -> None:
        """Wait until unregistered ``lora_id``'s counter is exactly zero, then forget it.

        Raises ``UnloadTimeout`` naming the id and its count after ``timeout`` seconds.
        """
        ad = self._by_id.get(lora_id)
        if ad is None:
            return
        if ad.registered:
            raise ValueError(
                f"LoRA id {lora_id} ({ad.name!r}) is still registered; unregister() it "
                "first, or its counter could keep rising"
            )
        if ad.zero is None:
            ad.zero = asyncio.Event()
        try:
            await asyncio.wait_for(ad.zero.wait(), timeout)
        except asyncio.TimeoutError:
            raise UnloadTimeout(lora_id, ad.name, ad.refs, timeout or 0.0) from None

    async def unload(self, name: str, timeout: float | None = None) -> int:
        """``unregister(name)`` then ``wait_for_unload(id, timeout)``; returns the id."""
        lora_id = await self.unregister(name)
        await self.wait_for_unload(lora_id, timeout)
        return lora_id

    def _gone(self, ad: LoRAAdapter) -> None:
        """An unregistered adapter's last reference went back: forget it, wake waiters."""
        del self._by_id[ad.id]
        if ad.zero is not None:
            ad.zero.set()

    # -- references -----------------------------------------------------------------------

    @overload
    async def acquire(self, names: str) -> int: ...
    @overload
    async def acquire(self, names: list[str]) -> list[int]: ...

    async def acquire(self, names: str | list[str]) -> int | list[int]:
        """Look up and count one reference per name, atomically; all or nothing."""
        if isinstance(names, str):
            ad = self._by_name.get(names)
            if ad is None:
                raise UnknownAdapter([names])
            ad.refs += 1
            return ad.id
        by_name = self._by_name
        batch = list(names)
        missing = [n for n in batch if n not in by_name]
        if missing:
            raise UnknownAdapter(missing)
        ids = []
        for n in batch:
            ad = by_name[n]
            ad.refs += 1
            ids.append(ad.id)
        return ids

    async def release(self, ids: int | list[int]) -> None:
        """Drop one reference per id; ``ReleaseUnderflow`` (releasing nothing) below zero."""
        self.release_nowait(ids)

    def release_nowait(self, ids: int | list[int]) -> None:
        """``release`` for synchronous callers inside the registry's event loop. Ids are
        the ints `acquire` returned (one, or a list of them): anything else (a name, a
        bool, a tensor) is a TypeError, releasing nothing."""
        if ids.__class__ is not int and not isinstance(ids, list):
            ids = _lora_ids(ids)
        if ids.__class__ is int:
            ad = self._by_id.get(ids)
            if ad is None or not ad.refs:
                raise ReleaseUnderflow(ids, 0, 1)
            ad.refs -= 1
            if not ad.refs and not ad.registered:
                self._gone(ad)
            return
        assert isinstance(ids, list)
        if list(map(type, ids)).count(int) != len(ids):
            ids = [_lora_id(i) for i in ids]
        batch: list[tuple[LoRAAdapter, int]] = []
        for i, k in Counter(ids).items():
            ad = self._by_id.get(i)
            if ad is None or ad.refs < k:
                raise ReleaseUnderflow(i, 0 if ad is None else ad.refs, k)
            batch.append((ad, k))
        for ad, k in batch:  # every count checked first: all or nothing
            ad.refs -= k
            if not ad.refs and not ad.registered:
                self._gone(ad)
