"""Stand-ins with the shapes and semantics of SGLang's (0.5.x) pool and registry classes,
written here from reading them, so the conformance tests run without SGLang.

What each keeps of the original, and what a test relies on:

- `PagedAllocator` (`PagedTokenToKVPoolAllocator`): a tensor of free page ids (pages
  1..size/page_size; page 0 is padding); `alloc(n)` hands out `n // page_size` whole
  pages as token indices, or None when short (below one page: an empty tensor);
  `alloc_extend` / `alloc_decode` place each request's new tokens after its `last_loc`
  until its page is full, then on new pages; `free(indices)` puts back every page any
  index falls in, once per call, with no double-free check (a page freed twice sits in
  `get_all_free_pages()` twice, and `available_size()` exceeds the size). No
  `capacity`, `check` or `assert_full`.
- `TokenAllocator` (`TokenToKVPoolAllocator`, page size 1).
- `MambaSlots` (`MambaSlotAllocator`): `alloc(n)`, `free(slots)`, `available_size()`.
- `MetadataSlots` (`ReqToMetadataIdxAllocator`): `alloc() -> int | None`, `free(i)`.
- `LoRARef` and `LoRARegistry` (`sglang.srt.lora.lora_registry`): `register(lora_ref)`
  returns None (the id is the reference's string `lora_id`), `unregister(name) -> id`,
  `acquire(name | [names])`, `release(id | [ids])`, `wait_for_unload(id)` with no
  timeout; no `upsert`, no `count`; unknown names are a `ValueError`.

`real_*` return the SGLang classes themselves when they import on this machine, else
call `pytest.skip` (they are never a dependency of this project).
"""

from __future__ import annotations

import asyncio
from typing import Any
from uuid import uuid4

import msgspec
import pytest
import torch

__all__ = [
    "LoRARef",
    "LoRARegistry",
    "MambaSlots",
    "MetadataSlots",
    "PagedAllocator",
    "TokenAllocator",
    "real_allocator",
    "real_lora",
    "real_mamba",
]


class PagedAllocator:
    """SGLang's paged KV allocator, on CPU (its native, non-Triton path)."""

    def __init__(self, size: int, page_size: int, device: str = "cpu") -> None:
        self.size = size
        self.page_size = page_size
        self.device = device
        self.num_pages = size // page_size
        self.clear()

    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64)
        self.free_group: list[torch.Tensor] | None = None

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size

    def alloc(self, need_size: int) -> torch.Tensor | None:
        ps = self.page_size
        num_pages = need_size // ps  # not ceil: a partial page is not handed out
        if num_pages > len(self.free_pages):
            return None
        out = self.free_pages[:num_pages]
        self.free_pages = self.free_pages[num_pages:]
        return (out[:, None] * ps + torch.arange(ps)).reshape(-1)

    def _place(self, prefix: list[int], seq: list[int], last_loc: list[int]) -> torch.Tensor | None:
        ps = self.page_size
        need = sum(-(-s // ps) - -(-p // ps) for p, s in zip(prefix, seq, strict=True))
        if need > len(self.free_pages):
            return None
        pages = self.free_pages[:need].tolist()
        out, k = [], 0
        for p, s, loc in zip(prefix, seq, last_loc, strict=True):
            for t in range(p, s):
                if t % ps == 0:  # this request's page is full (or it has none): a new one
                    loc = pages[k] * ps
                    k += 1
                else:
                    loc += 1
                out.append(loc)
        self.free_pages = self.free_pages[need:]
        return torch.tensor(out, dtype=torch.int64)

    def alloc_extend(self, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor,
                     seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor,
                     last_loc: torch.Tensor, extend_num_tokens: int) -> torch.Tensor | None:
        """Tokens `prefix_lens[i]..seq_lens[i]-1` of each request, in request order;
        `last_loc[i]` is the location of token `prefix_lens[i]-1` (-1 when none)."""
        out = self._place(prefix_lens_cpu.tolist(), seq_lens_cpu.tolist(), last_loc.tolist())
        assert out is None or out.numel() == extend_num_tokens
        return out

    def alloc_decode(self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor,
                     last_loc: torch.Tensor) -> torch.Tensor | None:
        """One token per request, the `seq_lens[i]`-th."""
        return self._place((seq_lens_cpu - 1).tolist(), seq_lens_cpu.tolist(),
                           last_loc.tolist())

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(free_index.clone())
            return
        pages = torch.unique(torch.div(free_index, self.page_size, rounding_mode="floor"))
        self.free_pages = torch.cat((pages, self.free_pages))

    def free_group_begin(self) -> None:
        self.free_group = []

    def free_group_end(self) -> None:
        group, self.free_group = self.free_group, None
        if group:
            self.free(torch.cat(group))

    def get_all_free_pages(self) -> torch.Tensor:
        return self.free_pages


class TokenAllocator(PagedAllocator):
    """SGLang's page-size-1 KV allocator."""

    def __init__(self, size: int, device: str = "cpu") -> None:
        super().__init__(size, 1, device)


class MambaSlots:
    """SGLang's Mamba slot allocator: slots 1..size, slot 0 is padding."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.free_slots = torch.arange(1, size + 1, dtype=torch.int64)

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        if need_size > len(self.free_slots):
            return None
        out = self.free_slots[:need_size]
        self.free_slots = self.free_slots[need_size:]
        return out

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel():
            self.free_slots = torch.cat((self.free_slots, free_index))


class MetadataSlots:
    """SGLang's disaggregation metadata index allocator."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.free_slots = list(range(size))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self) -> int | None:
        return self.free_slots.pop(0) if self.free_slots else None

    def free(self, free_index: int) -> None:
        self.free_slots.append(free_index)


class LoRARef(msgspec.Struct, frozen=True):
    """An adapter reference: a unique string id, a name and a path."""

    lora_id: str = msgspec.field(default_factory=lambda: uuid4().hex)
    lora_name: str | None = None
    lora_path: str | None = None
    pinned: bool | None = None


class _Counter:
    def __init__(self) -> None:
        self.value = 0
        self.cond = asyncio.Condition()

    async def add(self, n: int) -> None:
        async with self.cond:
            self.value += n
            self.cond.notify_all()

    async def wait_for_zero(self) -> None:
        async with self.cond:
            await self.cond.wait_for(lambda: self.value == 0)


class LoRARegistry:
    """SGLang's LoRA registry: names to references, a usage counter per id."""

    def __init__(self) -> None:
        self._registry: dict[str, LoRARef] = {}
        self._counters: dict[str, _Counter] = {}

    async def register(self, lora_ref: Any) -> None:
        if lora_ref.lora_name in self._registry:
            raise ValueError(f"LoRA with name {lora_ref.lora_name} already exists")
        self._registry[lora_ref.lora_name] = lora_ref
        self._counters[lora_ref.lora_id] = _Counter()

    async def unregister(self, lora_name: str) -> str:
        ref = self._registry.pop(lora_name, None)
        if ref is None:
            raise ValueError(f"LoRA with name {lora_name} does not exist")
        return str(ref.lora_id)

    async def acquire(self, lora_name: str | list[str]) -> str | list[str]:
        names = [lora_name] if isinstance(lora_name, str) else list(lora_name)
        for n in names:
            if n not in self._registry:
                raise ValueError(f"The following requested LoRA adapters are not loaded: {n}")
        ids = [str(self._registry[n].lora_id) for n in names]
        for i in ids:
            await self._counters[i].add(1)
        return ids[0] if isinstance(lora_name, str) else ids

    async def release(self, lora_id: str | list[str]) -> None:
        for i in [lora_id] if isinstance(lora_id, str) else lora_id:
            await self._counters[i].add(-1)

    async def wait_for_unload(self, lora_id: str) -> None:
        counter = self._counters.get(lora_id)
        if counter is None:
            return
        await counter.wait_for_zero()
        del self._counters[lora_id]

    def held(self) -> dict[str, int]:
        """Counters that are not zero (a test helper; SGLang has no such method)."""
        return {i: c.value for i, c in self._counters.items() if c.value}


# -- the real classes, where they can be had -------------------------------------------


def _sglang(module: str) -> Any:
    try:
        return __import__(module, fromlist=["_"])
    except Exception as e:  # ImportError, or a CUDA-only package failing at import
        pytest.skip(f"SGLang's {module} does not import here ({type(e).__name__}: {e})")


def real_allocator(size: int, page_size: int) -> Any:
    """SGLang's own KV allocator of `page_size` on CPU, or a skip."""
    m = _sglang("sglang.srt.mem_cache.allocator")
    if page_size == 1:
        return m.TokenToKVPoolAllocator(size, torch.float16, "cpu", None, False)
    return m.PagedTokenToKVPoolAllocator(size, page_size, torch.float16, "cpu", None, False)


def real_mamba(size: int) -> Any:
    """SGLang's own Mamba slot allocator, or a skip."""
    return _sglang("sglang.srt.mem_cache.allocator.mamba").MambaSlotAllocator(size, "cpu")


def real_lora() -> tuple[Any, Any]:
    """SGLang's own (LoRARegistry, LoRARef), or a skip."""
    m = _sglang("sglang.srt.lora.lora_registry")
    return m.LoRARegistry(), m.LoRARef
