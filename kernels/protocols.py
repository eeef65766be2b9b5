"""The interfaces the effect layer calls, and nothing more, in the serving engines' names.

Each Protocol below lists exactly the members that some effect calls; the names and
shapes are SGLang's (``available_size()``, ``alloc(need_size)``, ``free(free_index)``,
``register(lora_ref)``), so an engine's own classes satisfy them as they are
(``isinstance`` works at run time). What only Terminus's pools can do (report their
capacity, check for double and foreign frees, raise naming what is still held) is a
separate Protocol, ``AuditedPool``, detected at run time: a pool without it still works,
and the leak audit says what it could not check.

Paged KV, as the effects use it::

    alloc(k * page_size)  ->  k whole pages, as token indices page*page_size + 0..ps-1
                              (None when fewer than k pages are free)
    free(token_indices)   ->  every page any of them falls in goes back, once

The effects only ever ask ``alloc`` for whole pages (SGLang's paged ``alloc(n)`` gives
``n // page_size`` pages, ours ``ceil(n / page_size)``: both agree on multiples), and
place a request's tokens themselves: a request's partial last page is filled before a
new page is taken, the arithmetic of SGLang's ``alloc_extend``/``alloc_decode`` with
``last_loc``. They never call ``alloc_extend``/``alloc_decode``, ``free_group_*`` or
``backup_state``/``restore_state``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "AdapterRegistry",
    "AuditedPool",
    "KVAllocator",
    "LoRARegistry",
    "MambaPool",
    "ReqSlots",
    "SlotAllocator",
    "page_size_of",
    "require",
]


@runtime_checkable
class KVAllocator(Protocol):
    """KV slot allocator (SGLang's ``TokenToKVPoolAllocator`` /
    ``PagedTokenToKVPoolAllocator`` shape): token indices out, token indices back."""

    page_size: int
    """Tokens per page; 1 for token granularity."""

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` token indices (the effects pass a multiple of ``page_size``:
        whole pages), or None when short (never a partial allocation)."""

    def free(self, free_index: torch.Tensor) -> None:
        """Return token indices: every page any of them falls in goes back, once."""

    def available_size(self) -> int:
        """Token slots that ``alloc`` can hand out now."""


@runtime_checkable
class MambaPool(Protocol):
    """Mamba state slots (SGLang's ``MambaSlotAllocator`` shape)."""

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` slots, or None when short."""

    def free(self, free_index: torch.Tensor) -> None:
        """Return slots."""

    def available_size(self) -> int:
        """Slots that ``alloc`` can hand out now."""


@runtime_checkable
class ReqSlots(Protocol):
    """Request-slot allocator (where ``release_batch`` returns request slots)."""

    def alloc(self, n: int = 1) -> torch.Tensor | None:
        """``n`` request slots, or None when short."""

    def free(self, slots: torch.Tensor) -> None:
        """Return request slots."""


@runtime_checkable
class SlotAllocator(Protocol):
    """Small int slots, e.g. disaggregation metadata buffers (SGLang's
    ``ReqToMetadataIdxAllocator`` shape): ``-1`` means none."""

    def alloc(self) -> int | None:
        """A free slot, or None."""

    def free(self, free_index: int) -> None:
        """Return one slot."""


@runtime_checkable
class AuditedPool(Protocol):
    """What only Terminus's pools can do; optional everywhere, detected with ``isinstance``.

    With it, the leak audit compares what a pool has handed out with what the ledger
    says is owned, runs the pool's own double-free and foreign-index checks, and
    ``assert_full`` names what is still held. Without it, the audit reports that pool
    as not checked.
    """

    @property
    def capacity(self) -> int:
        """Units the pool hands out at most."""

    @property
    def available(self) -> int:
        """Units free now."""

    def check(self) -> None:
        """Raise naming any double or foreign free recorded so far."""

    def assert_full(self) -> None:
        """Raise ``LeakError`` naming what is still held."""


@runtime_checkable
class LoRARegistry(Protocol):
    """Adapter usage counters, as the tokenizer side uses them (SGLang's
    ``LoRARegistry`` has this shape): acquire by name, release by id.

    A synchronous ``release_nowait(ids)``, where present, is used instead of ``release``.
    """

    async def acquire(self, lora_name: Any) -> Any:
        """``name -> id`` or ``[names] -> [ids]``, counting one reference each."""

    async def release(self, lora_id: Any) -> None:
        """Drop one reference per id."""


@runtime_checkable
class AdapterRegistry(Protocol):
    """Adapter registration, as ``AdapterManager`` uses it (SGLang's ``LoRARegistry``).

    ``register`` takes an adapter reference (SGLang's ``LoRARef``: ``lora_id``,
    ``lora_name``, ``lora_path``) that ``AdapterManager`` builds with its
    ``ref_factory``. Optional, detected at run time: ``upsert(name, path)`` (in-place
    reload keeping the id; without it ``AdapterManager.upsert`` says it is not
    supported), ``wait_for_unload(id, timeout)`` accepting a timeout (otherwise the wait
    is wrapped in ``asyncio.wait_for``) and ``count(id)`` (otherwise ``None``).
    """

    async def register(self, lora_ref: Any) -> Any:
        """Register one adapter reference; raises when its name is taken."""

    async def unregister(self, lora_name: str) -> Any:
        """Stop new acquires of ``lora_name``; returns its id."""

    async def wait_for_unload(self, lora_id: Any) -> None:
        """Wait until an unregistered adapter's counter is zero."""


def _members(proto: type) -> list[str]:
    names = set(getattr(proto, "__annotations__", {}))
    names.update(n for n, v in vars(proto).items()
                 if not n.startswith("_") and (callable(v) or isinstance(v, property)))
    return sorted(names)


def require(obj: Any, proto: type, role: str) -> Any:
    """``obj`` when it has every member of ``proto``; otherwise a ``TypeError`` naming
    ``role``, the type of ``obj`` and exactly the members it lacks."""
    missing = [m for m in _members(proto) if not hasattr(obj, m)]
    if missing:
        raise TypeError(
            f"{role}: {type(obj).__name__} is not a {proto.__name__}: it lacks "
            f"{', '.join(missing)}; see terminus.kernels.protocols.{proto.__name__} for "
            "the members the effects call")
    return obj


def page_size_of(kv: Any, page_size: int | None = None) -> int:
    """The page size to use with allocator ``kv`` (None: none given yet).

    ``kv.page_size`` when it has one (``page_size``, when also given, must agree), else
    ``page_size``, else 1. ``ValueError`` for a disagreement or a size below 1.
    """
    have = getattr(kv, "page_size", None) if kv is not None else None
    if page_size is None:
        page_size = have if have is not None else 1
    elif have is not None and have != page_size:
        raise ValueError(f"page_size {page_size} differs from the KV allocator's page_size "
                         f"{have}; pass the allocator's, or leave page_size out")
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    return page_size
