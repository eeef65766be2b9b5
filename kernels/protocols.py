"""The small interfaces the effect layer depends on, instead of on our classes.

Any object with these method names satisfies them (``isinstance`` works at runtime), so
a user can plug in an engine's own allocator: SGLang's ``TokenToKVPoolAllocator`` already
has the ``KVAllocator`` shape.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["KVAllocator", "LoRARegistry", "MambaPool", "ReqSlots", "SlotAllocator"]


@runtime_checkable
class KVAllocator(Protocol):
    """KV slot allocator: token indices out, token indices back."""

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` token indices, or None when short (never a partial allocation)."""

    def free(self, indices: torch.Tensor) -> None:
        """Return token indices."""

    def available_size(self) -> int:
        """Token slots that ``alloc`` can hand out now."""

    def free_group_begin(self) -> None:
        """Start collecting frees."""

    def free_group_end(self) -> None:
        """Return every free collected since ``free_group_begin`` at once."""

    def backup_state(self) -> Any:
        """A snapshot to roll back to."""

    def restore_state(self, state: Any) -> None:
        """Roll back to ``state``."""


@runtime_checkable
class ReqSlots(Protocol):
    """Request-slot allocator (the request-to-token table's slots)."""

    def alloc(self, n: int = 1) -> torch.Tensor | None:
        """``n`` request slots, or None when short."""

    def free(self, slots: torch.Tensor) -> None:
        """Return request slots."""


@runtime_checkable
class MambaPool(Protocol):
    """Mamba state slots: zeroed on alloc, freed in one call, forked by copy."""

    def alloc(self, n: int = 1) -> torch.Tensor | None:
        """``n`` zeroed slots, or None when short."""

    def free(self, slots: torch.Tensor) -> None:
        """Return slots."""

    def fork(self, src: torch.Tensor) -> torch.Tensor | None:
        """New slots holding copies of ``src``'s states."""


@runtime_checkable
class SlotAllocator(Protocol):
    """Small int slots (metadata buffers): ``-1`` means none."""

    def alloc(self) -> int | None:
        """A free slot, or None."""

    def free(self, i: int) -> None:
        """Return slot ``i``."""


@runtime_checkable
class LoRARegistry(Protocol):
    """Adapter usage counters: acquire by name, release by stable id."""

    async def acquire(self, names: Any) -> Any:
        """``name -> id`` or ``[names] -> [ids]``, counting one reference each."""

    async def release(self, ids: Any) -> None:
        """Drop one reference per id."""
