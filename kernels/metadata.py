"""Metadata slot allocator: small int slots indexing per-request buffers (``-1`` = none).

Disaggregated prefill keeps a request's output metadata (first token, logprobs, ...)
in row ``i`` of buffers on ``device`` while the transfer runs. The slots are few and
handed out one at a time, so the free list is a Python list, not a tensor.
"""

from __future__ import annotations

import torch

from terminus.kernels._stack import as_int
from terminus.kernels.errors import DoubleFree, ForeignIndex, LeakError
from terminus.kernels.protocols import SlotAllocator

__all__ = ["MetadataSlot", "MetadataSlots"]


class MetadataSlots:
    """``size`` slots ``0 .. size-1``; ``alloc() -> int | None``, ``free(i)``."""

    def __init__(self, size: int, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self._size = size
        self._free = list(range(size - 1, -1, -1))
        self._is_free = bytearray(b"\x01" * size)

    @property
    def capacity(self) -> int:
        """Number of slots."""
        return self._size

    @property
    def available(self) -> int:
        """Slots free now."""
        return len(self._free)

    def available_size(self) -> int:
        """Same as ``available``: the name serving engines call."""
        return len(self._free)

    def check(self) -> None:
        """Nothing to report: a wrong free raises at the free itself, changing nothing."""

    def alloc(self) -> int | None:
        """A free slot, or None when all are in use."""
        if not self._free:
            return None
        i = self._free.pop()
        self._is_free[i] = 0
        return i

    def free(self, i: int) -> None:
        """Return slot ``i``; raises ``ForeignIndex`` / ``DoubleFree`` (changing nothing),
        a TypeError for a slot that is not an int (a bool or a tensor kept in the free
        list would be what the next ``alloc`` hands out)."""
        if i.__class__ is not int:
            j = as_int(i)
            if j is None:
                raise TypeError(f"MetadataSlots.free({i!r}): a slot is an int, as alloc() "
                                f"returns, not {type(i).__name__}")
            i = j
        if not 0 <= i < self._size:
            raise ForeignIndex("MetadataSlots", [i], f"slots 0..{self._size - 1}")
        if self._is_free[i]:
            raise DoubleFree("MetadataSlots", [i])
        self._is_free[i] = 1
        self._free.append(i)

    def acquire(self) -> MetadataSlot | None:
        """A slot wrapped in its owner handle, or None when all are in use."""
        return MetadataSlot.take(self)

    def assert_full(self) -> None:
        """Raise ``LeakError`` naming slots still held."""
        if len(self._free) != self._size:
            held = [i for i in range(self._size) if not self._is_free[i]]
            raise LeakError("MetadataSlots", len(held), held, "slots")


class MetadataSlot:
    """The owner of one metadata slot: ``index`` is the slot, or ``-1`` once released."""

    __slots__ = ("index", "pool")

    def __init__(self, pool: SlotAllocator, index: int) -> None:
        self.pool = pool
        self.index = index

    @classmethod
    def take(cls, pool: SlotAllocator) -> MetadataSlot | None:
        """A slot of any ``SlotAllocator`` (ours or an engine's) in its owner, or None."""
        i = pool.alloc()
        return None if i is None else cls(pool, i)

    def release(self) -> bool:
        """Free the slot and set ``index`` to -1; later calls do nothing. True if it freed.
        A free the pool refuses raises with ``index`` kept, so a retry frees it."""
        i = self.index
        if i < 0:
            return False
        self.pool.free(i)
        self.index = -1
        return True
