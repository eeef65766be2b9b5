"""Loading and unloading LoRA adapters through the registry, one LORA_ADAPTER each.

    load(name) ──► ready ──upsert(name)──► ready (same id)
                     └──unload(name, timeout)──► unloading ──counter == 0──► unloaded
                                                    └─ timeout: UnloadTimeout, still unloading;
                                                       wait_unloaded(name) waits again

The machine makes the waiting visible (an adapter stuck in `unloading` is a leaked
reference somewhere, and the timeout names its id and count); the registry does the
counting: ours (`kernels.lora.LoRARegistry`) or any `kernels.protocols.AdapterRegistry`,
such as SGLang's `LoRARegistry` (no `upsert`, no `count`, no timeout of its own).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any
from uuid import uuid4

import msgspec

from terminus.fsm import Instance
from terminus.kernels.errors import UnloadTimeout
from terminus.kernels.protocols import AdapterRegistry, require
from terminus.states.lora_adapter import (
    LORA_ADAPTER,
    Loaded,
    LoadFailed,
    UnloadRequested,
    UnloadTimedOut,
    Upserted,
    UsersDrained,
)

from .sanitize import sanitized

__all__ = ["AdapterManager", "AdapterRef"]


class AdapterRef(msgspec.Struct, frozen=True):
    """What `AdapterManager` registers: SGLang's `LoRARef` fields, so SGLang's
    `LoRARegistry.register(lora_ref)` takes it as it is."""

    lora_id: str
    lora_name: str
    lora_path: str | None = None
    pinned: bool | None = None


def new_ref(name: str, path: str | None) -> AdapterRef:
    """A fresh reference with a unique id (a uuid4 hex, as SGLang's `LoRARef`)."""
    return AdapterRef(uuid4().hex, name, path)


class AdapterManager:
    """Registry-side adapter lifecycle over any `kernels.protocols.AdapterRegistry`
    (ours, or SGLang's `LoRARegistry`).

    `adapters[name]` is the adapter's machine instance (key: its name); `ids[name]` its
    stable id: what `register` returned, else the reference's `lora_id`. Names are
    reusable once their adapter is unloaded (a new id, a new instance). `ref_factory(name,
    path)` builds what `register` is given (default: an `AdapterRef`).
    """

    def __init__(self, registry: AdapterRegistry, *,
                 ref_factory: Callable[[str, str | None], Any] = new_ref) -> None:
        self.registry: AdapterRegistry = require(registry, AdapterRegistry,
                                                 "AdapterManager(registry)")
        self.ref_factory = ref_factory
        self.machine = LORA_ADAPTER.bind()
        self.adapters: dict[str, Instance] = {}
        self.ids: dict[str, Any] = {}
        # Ours waits with a timeout of its own; SGLang's wait_for_unload(id) has none.
        params = inspect.signature(registry.wait_for_unload).parameters
        self._wait_takes_timeout = "timeout" in params
    def state(self, name: str) -> str:
        """The adapter's state name; KeyError naming the known adapters if unknown."""
        if name not in self.adapters:
            raise KeyError(f"no adapter {name!r} was loaded here; known: "
                           f"{', '.join(sorted(self.adapters)) or 'none'}")
        return self.adapters[name].state

    @sanitized
    async def load(self, name: str, path: str | None = None) -> int:
        """Register `name`; returns its stable id. Raises what the registry raised."""
        old = self.adapters.get(name)
        if old is not None and not old.terminal:
            raise ValueError(f"adapter {name!r} is {old.state}; upsert() it to load new "
                             "weights in place, or wait for its unload to finish")
        ref = self.ref_factory(name, path)
        inst = self.machine.create(name)
        self.adapters[name] = inst
        try:
            got = await self.registry.register(ref)
        except Exception as e:
            inst.fire(LoadFailed(str(e)))
            raise
        lora_id = got if got is not None else ref.lora_id
        self.ids[name] = lora_id
        inst.fire(Loaded(lora_id))
        return lora_id

    @sanitized
    async def upsert(self, name: str, path: str | None = None) -> Any:
        """Load new weights for a ready adapter in place; its id and counter stay.

        Only with a registry that has `upsert(name, path)` (ours); otherwise a
        `NotImplementedError` says so, changing nothing.
        """
        upsert = getattr(self.registry, "upsert", None)
        if upsert is None:
            raise NotImplementedError(
                f"{type(self.registry).__name__} has no upsert(name, path): unload() "
                f"adapter {name!r} and load() it again with the new weights")
        inst = self.adapters.get(name)
        if inst is None or inst.state != "ready":
            raise ValueError(f"adapter {name!r} is not ready "
                             f"({'never loaded' if inst is None else inst.state}); load() it")
        lora_id = await upsert(name, path)
        assert lora_id == self.ids[name], "an upsert must keep the stable id"
        inst.fire(Upserted())
        return lora_id

    @sanitized
    async def unload(self, name: str, timeout: float | None = None) -> Any:
        """Stop new acquires of `name` and wait until its counter is exactly zero.

        Raises `kernels.errors.UnloadTimeout` (id and count in the message) after
        `timeout` seconds; the adapter then stays `unloading`: `wait_unloaded()` again.
        """
        inst = self.adapters.get(name)
        if inst is None or inst.state not in ("ready", "unloading"):
            raise ValueError(f"adapter {name!r} cannot be unloaded: it is "
                             f"{'unknown here' if inst is None else inst.state}")
        if inst.state == "ready":
            # The registry first: a refused unregister leaves the adapter ready (and
            # acquirable), not unloading while still registered, which no wait ends.
            await self.registry.unregister(name)
            inst.fire(UnloadRequested())
        return await self.wait_unloaded(name, timeout)

    @sanitized
    async def wait_unloaded(self, name: str, timeout: float | None = None) -> Any:
        """Wait for an unloading adapter's users to drain; returns its id.

        A registry whose `wait_for_unload(id)` takes no timeout (SGLang's) is waited
        on under `asyncio.wait_for`; either way the timeout is an `UnloadTimeout`.
        """
        inst = self.adapters[name]
        lora_id = self.ids[name]
        if inst.state == "unloaded":
            return lora_id
        try:
            if self._wait_takes_timeout:
                await self.registry.wait_for_unload(lora_id, timeout)  # type: ignore[call-arg]
            else:
                try:
                    await asyncio.wait_for(self.registry.wait_for_unload(lora_id), timeout)
                except asyncio.TimeoutError:
                    raise UnloadTimeout(lora_id, name, self.count(name),
                                        timeout or 0.0) from None
        except UnloadTimeout as e:
            inst.fire(UnloadTimedOut(-1 if e.count is None else e.count))
            raise
        inst.fire(UsersDrained())
        return lora_id

    def count(self, name: str) -> int | None:
        """In-flight references of the adapter loaded as `name`; None when the registry
        has no `count(id)` (SGLang's)."""
        count = getattr(self.registry, "count", None)
        return None if count is None else int(count(self.ids[name]))

    def __repr__(self) -> str:
        states: dict[str, Any] = {n: i.state for n, i in self.adapters.items()}
        return f"AdapterManager({states})"
