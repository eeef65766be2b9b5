"""Loading and unloading LoRA adapters through the registry, one LORA_ADAPTER each.

    load(name) ──► ready ──upsert(name)──► ready (same id)
                     └──unload(name, timeout)──► unloading ──counter == 0──► unloaded
                                                    └─ timeout: UnloadTimeout, still unloading;
                                                       wait_unloaded(name) waits again

The machine makes the waiting visible (an adapter stuck in `unloading` is a leaked
reference somewhere, and the timeout names its id and count); the registry does the
counting (`kernels.lora.LoRARegistry`).
"""

from __future__ import annotations

from typing import Any

from terminus.fsm import Instance
from terminus.kernels.errors import UnloadTimeout
from terminus.kernels.lora import LoRARegistry
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

__all__ = ["AdapterManager"]


class AdapterManager:
    """Registry-side adapter lifecycle over a `LoRARegistry`.

    `adapters[name]` is the adapter's machine instance (key: its name); `ids[name]` its
    stable id. Names are reusable once their adapter is unloaded (a new id, a new
    instance).
    """

    def __init__(self, registry: LoRARegistry) -> None:
        self.registry = registry
        self.machine = LORA_ADAPTER.bind()
        self.adapters: dict[str, Instance] = {}
        self.ids: dict[str, int] = {}

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
        inst = self.machine.create(name)
        self.adapters[name] = inst
        try:
            lora_id = await self.registry.register(name, path)
        except Exception as e:
            inst.fire(LoadFailed(str(e)))
            raise
        self.ids[name] = lora_id
        inst.fire(Loaded(lora_id))
        return lora_id

    @sanitized
    async def upsert(self, name: str, path: str | None = None) -> int:
        """Load new weights for a ready adapter in place; its id and counter stay."""
        inst = self.adapters.get(name)
        if inst is None or inst.state != "ready":
            raise ValueError(f"adapter {name!r} is not ready "
                             f"({'never loaded' if inst is None else inst.state}); load() it")
        lora_id = await self.registry.upsert(name, path)
        assert lora_id == self.ids[name], "an upsert must keep the stable id"
        inst.fire(Upserted())
        return lora_id

    @sanitized
    async def unload(self, name: str, timeout: float | None = None) -> int:
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
    async def wait_unloaded(self, name: str, timeout: float | None = None) -> int:
        """Wait for an unloading adapter's users to drain; returns its id."""
        inst = self.adapters[name]
        lora_id = self.ids[name]
        if inst.state == "unloaded":
            return lora_id
        try:
            await self.registry.wait_for_unload(lora_id, timeout)
        except UnloadTimeout as e:
            inst.fire(UnloadTimedOut(e.count))
            raise
        inst.fire(UsersDrained())
        return lora_id

    def count(self, name: str) -> int:
        """In-flight references of the adapter loaded as `name`."""
        return self.registry.count(self.ids[name])

    def __repr__(self) -> str:
        states: dict[str, Any] = {n: i.state for n, i in self.adapters.items()}
        return f"AdapterManager({states})"
