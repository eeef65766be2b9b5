"""Mamba (state-space model) state pool: one conv and one temporal state per slot.

::

    conv[i]   [layers, size+1, conv_dim_i, K-1]        one tensor per conv state kind
    temporal  [layers, size+1, heads, head_dim, state_size]
                      ^ slot axis: slot 0 is padding, slots 1..size are handed out

Every op on slots is one tensor op per state tensor over all layers and all slots at
once (``index_fill_`` / ``index_copy_`` along the slot axis), never a Python loop over
layers; the one exception is zeroing a few slots of a CPU pool, done a slot at a time
through numpy views of the tensors' bytes (cheaper there than one ``index_fill_``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from terminus.kernels._stack import FreeStack, IdsLike, StackPool, as_count, long_ids

__all__ = ["MambaStatePool"]

# Allocations of at most this many slots of a CPU pool zero them through byte views.
_HOST_ZERO = 4


class MambaStatePool(StackPool):
    """Conv and temporal (SSM) states of ``size`` requests; slots zeroed on alloc.

    Args:
        size: slots handed out (tensors get one more, the padding slot 0).
        layers: Mamba layers.
        conv_dims: ``conv_dim`` of each conv state tensor (one or more).
        conv_kernel: ``K``; conv states keep the last ``K-1`` inputs.
        heads, head_dim, state_size: temporal state shape per layer and slot.
        conv_dtype, ssm_dtype: storage dtypes.
    """

    def __init__(
        self,
        size: int,
        layers: int,
        conv_dims: int | Sequence[int],
        conv_kernel: int,
        heads: int,
        head_dim: int,
        state_size: int,
        device: str | torch.device = "cpu",
        *,
        conv_dtype: torch.dtype = torch.bfloat16,
        ssm_dtype: torch.dtype = torch.float32,
        strict: bool = False,
    ) -> None:
        self._free = FreeStack("MambaStatePool", 1, size, device, strict=strict, unit="slots")
        dev = self._free.device
        dims = [conv_dims] if isinstance(conv_dims, int) else list(conv_dims)
        if not dims or conv_kernel < 2:
            raise ValueError(
                "MambaStatePool: need at least one conv_dim and conv_kernel >= 2, got "
                f"{dims} and {conv_kernel}"
            )
        self.conv = [
            torch.zeros(layers, size + 1, d, conv_kernel - 1, dtype=conv_dtype, device=dev)
            for d in dims
        ]
        self.temporal = torch.zeros(
            layers, size + 1, heads, head_dim, state_size, dtype=ssm_dtype, device=dev
        )
        self._views: list[np.ndarray] = []
        self._views_of: list[torch.Tensor] = []  # the tensors _views are views of

    def _tensors(self) -> list[torch.Tensor]:
        return [*self.conv, self.temporal]

    def _host_views(self) -> list[np.ndarray] | None:
        """On a CPU, each state tensor's bytes as a numpy array (the same memory; a zero
        state is all zero bytes in every float dtype), rebuilt if a tensor was replaced."""
        tensors = self._tensors()
        seen = self._views_of
        if len(seen) != len(tensors) or any(
                a is not b for a, b in zip(seen, tensors, strict=True)
        ):
            if any(t.device.type != "cpu" or not t.is_contiguous() or t.requires_grad
                   for t in tensors):
                return None
            self._views = [t.view(torch.uint8).numpy() for t in tensors]
            self._views_of = tensors
        return self._views

    def alloc(self, n: int = 1) -> torch.Tensor | None:
        """``n`` slots with zeroed states, or None when short (never partial)."""
        if n.__class__ is not int:
            n = as_count("MambaStatePool", n)
        views = (self._host_views() if 0 < n <= _HOST_ZERO and self._free._stack_host
                 is not None else None)
        if views is not None:
            # A few slots on a CPU: popped as numpy (the same checks and ids as pop) and
            # zeroed through byte views (~0.4 us a tensor and slot; index_fill_ costs
            # ~2 us a tensor).
            got = self._free.pop_host(n)
            if got is None:
                return None
            for s in got.tolist():
                for v in views:
                    v[:, s] = 0
            return torch.from_numpy(got)
        slots = self._free.pop(n)
        if slots is not None and n:
            for t in self._tensors():
                t.index_fill_(1, slots, 0)
        return slots

    def available_size(self) -> int:
        """Same as ``available``: the name serving engines call."""
        return self._free.available

    def free(self, slots: IdsLike) -> None:
        """Return slots; their states are zeroed when next allocated, not now."""
        ids = long_ids(slots, self.device, "MambaStatePool")
        if ids.numel():
            self._free.push(ids)

    def clear(self) -> None:
        """Every slot free again, recorded violations wiped (states are zeroed on alloc)."""
        self._free.clear()

    def copy_from(self, src: IdsLike, dst: IdsLike) -> None:
        """Copy every state of slots ``src`` into slots ``dst`` (pairwise). Slots outside
        1..size are refused (`IndexError`) before any state is written."""
        s = long_ids(src, self.device, "MambaStatePool")
        d = long_ids(dst, self.device, "MambaStatePool")
        if s.numel() != d.numel():
            raise ValueError(
                f"MambaStatePool.copy_from: {s.numel()} sources for {d.numel()} destinations; "
                "pass one source per destination"
            )
        self._check_slots("copy_from", s, d)
        for t in self._tensors():
            t.index_copy_(1, d, t.index_select(1, s))

    def _check_slots(self, what: str, *ids: torch.Tensor) -> None:
        """Refuse (`IndexError`) slots outside 1..size (0 is the padding slot)."""
        both = torch.cat(ids) if len(ids) > 1 else ids[0]
        if not both.numel():
            return
        lo, hi = torch.stack(both.aminmax()).tolist()  # one read
        if lo < 1 or hi > self._free.hi - 1:
            bad = sorted({v for v in both.tolist() if not 1 <= v < self._free.hi})
            raise IndexError(f"MambaStatePool.{what}: slots {bad} outside "
                             f"{self._free.valid_range()}; pass slots alloc() returned "
                             "(slot 0 is padding)")

    def fork(self, src: IdsLike) -> torch.Tensor | None:
        """New slots holding copies of ``src``'s states, or None when short. A source
        outside 1..size is refused (`IndexError`) before any slot is taken."""
        s = long_ids(src, self.device, "MambaStatePool")
        self._check_slots("fork", s)
        dst = self._free.pop(s.numel())
        if dst is not None and s.numel():
            self.copy_from(s, dst)
        return dst


