"""Request-to-token table: which KV token slots each running request holds.

::

    req_to_token  int32[size, max_context_len]   row = request slot
                  row r: [t0, t1, ..., t(len-1), stale ...]   len = lengths[r]
    lengths       int32[size]                    tokens of row r that the request owns
    mamba_slots   int64[size]                    its Mamba state slot, 0 = none

Request slots are ``0 .. size-1`` (no padding row). Slot alloc/free share the KV
allocator's free list, so a double free of a slot is detected the same way.
"""

from __future__ import annotations

import numpy as np
import torch

from terminus.kernels._stack import (
    _INT_DTYPES,
    FreeStack,
    IdsLike,
    StackPool,
    as_count,
    as_ids,
    as_int,
)

__all__ = ["ReqToTokenTable"]

_NP_DTYPES = (torch.int64, torch.int32)  # token slots `write` stores through numpy
_HOST_ALLOC = 64
"""A CPU table allocates up to this many rows at once through `alloc_host`."""


class ReqToTokenTable(StackPool):
    """``[size, max_context_len]`` int32 table plus a free list of request slots."""

    def __init__(
        self,
        size: int,
        max_context_len: int,
        device: str | torch.device = "cpu",
        *,
        strict: bool = False,
    ) -> None:
        self._free = FreeStack("ReqToTokenTable", 0, size, device, strict=strict, unit="slots")
        dev = self._free.device
        self.max_context_len = max_context_len
        self._rows = size
        self.req_to_token = torch.zeros(size, max_context_len, dtype=torch.int32, device=dev)
        self.lengths = torch.zeros(size, dtype=torch.int32, device=dev)
        self.mamba_slots = torch.zeros(size, dtype=torch.int64, device=dev)
        # release_batch's scratch: the min and max of a batch's lengths, read back at once.
        self._min_max = torch.zeros(2, dtype=torch.int32, device=dev)
        self._min_max_out = (self._min_max[0], self._min_max[1])
        # On a CPU, numpy views of (lengths, mamba_slots, req_to_token): the same memory,
        # for the paths that handle a few rows on the host.
        self._np = ((self.lengths.numpy(), self.mamba_slots.numpy(), self.req_to_token.numpy())
                    if dev.type == "cpu" else None)

    @property
    def available(self) -> int:
        """Request slots free now: the free list's ``available`` (its count of free ids,
        read here without a second property's frame: a disaggregated first chunk asks)."""
        return self._free._top

    def alloc(self, n: int = 1) -> torch.Tensor | None:
        """``n`` request slots with length 0, or None when short (never partial)."""
        if n.__class__ is not int:
            n = as_count("ReqToTokenTable", n)
        if self._np is not None and 0 < n <= _HOST_ALLOC:
            # A CPU table: a few rows popped as numpy and reset through numpy views (the
            # same memory), one tensor made at the end.
            at = self.alloc_host(n)
            return None if at is None else torch.from_numpy(at)
        slots = self._free.pop(n)
        if slots is not None and n:
            self.lengths.index_fill_(0, slots, 0)
            self.mamba_slots.index_fill_(0, slots, 0)
        return slots

    def alloc_host(self, n: int) -> np.ndarray | None:
        """`alloc(n)` of a CPU table as a numpy int64 array of its own (the same checks,
        rows and resets; no tensor made), or None when short. ValueError off the CPU."""
        views = self._np
        if views is None:
            raise ValueError("ReqToTokenTable.alloc_host needs a CPU table; use alloc()")
        at = self._free.pop_host(n)
        if at is None:
            return None
        views[0][at] = 0
        views[1][at] = 0
        return at

    def free(self, slots: IdsLike) -> None:
        """Return request slots. Their KV and Mamba state are the caller's to release."""
        ids = as_ids(slots, self.device, "ReqToTokenTable")
        if ids.numel():
            self._free.push(ids.long())

    def clear(self) -> None:
        """Every slot free again with length 0 and no Mamba slot; recorded violations
        wiped (their KV and Mamba state are the caller's to clear)."""
        self._free.clear()
        self.lengths.zero_()
        self.mamba_slots.zero_()

    def _index(self, what: str, name: str, value: object) -> int:
        """``value`` (a slot or a start) as an int (see ``as_int``), or a TypeError."""
        i = as_int(value)
        if i is None:
            raise TypeError(
                f"ReqToTokenTable.{what}: {name} {value!r} ({type(value).__name__}) is not "
                f"an int; pass {'a slot alloc() returned' if name == 'slot' else 'a start >= 0'}"
                " as an int (a float or a bool is refused, never truncated)")
        return i

    def write(self, slot: int, start: int, tokens: torch.Tensor) -> None:
        """Store ``tokens`` (1-D, an integer dtype) at ``[slot, start:start+len]`` and set
        the length to the end. A slot outside the table, a negative start or tokens that
        are not 1-D are refused (``ValueError``); a slot or start that is not an int (a
        numpy integer or a 0-d integer tensor is one), tokens that are not a tensor (a
        list of ids) or not integers (float, bool: they would be truncated into token
        slots) are refused (``TypeError``); each with nothing written, on every path."""
        if slot.__class__ is not int:
            slot = self._index("write", "slot", slot)
        if start.__class__ is not int:
            start = self._index("write", "start", start)
        if tokens.__class__ is not torch.Tensor and not isinstance(tokens, torch.Tensor):
            raise TypeError(
                f"ReqToTokenTable.write: tokens are a {type(tokens).__name__}, not a tensor: "
                "pass the 1-D integer tensor of token slots the KV allocator returned "
                "(torch.tensor(ids, dtype=torch.int64) for a list of ids); nothing was "
                "written")
        if not 0 <= slot < self._rows or start < 0 or tokens.ndim != 1:
            raise ValueError(
                f"ReqToTokenTable.write: slot {slot} (0..{self._rows - 1}), start "
                f"{start} (>= 0), tokens of shape {tuple(tokens.shape)} (1-D): pass a slot "
                "alloc() returned, a start >= 0 and a 1-D tensor of token slots")
        end = start + tokens.numel()
        if end > self.max_context_len:
            raise ValueError(
                f"ReqToTokenTable: {end} tokens do not fit max_context_len "
                f"{self.max_context_len}; raise max_context_len or cut the request"
            )
        views = self._np
        if views is not None and tokens.is_cpu and tokens.dtype in _NP_DTYPES:
            # A CPU table: through its numpy views (~2 us; two torch setitems ~15).
            views[2][slot, start:end] = tokens.numpy()
            views[0][slot] = end
            return
        if tokens.dtype not in _INT_DTYPES:  # (int64 and int32 never come this far on a CPU)
            raise TypeError(
                f"ReqToTokenTable.write: tokens are {tokens.dtype}, not integers: pass the "
                "token slots the KV allocator returned (an int64 or int32 tensor); nothing "
                "was written")
        self.req_to_token[slot, start:end] = tokens
        self.lengths[slot] = end

    def tokens(self, slot: int) -> torch.Tensor:
        """The token slots ``slot`` owns (a view of its row up to its length). A slot
        outside the table (``ValueError``; a negative one read another row) or not an
        int (``TypeError``) is refused."""
        if slot.__class__ is not int:
            slot = self._index("tokens", "slot", slot)
        if not 0 <= slot < self._rows:
            raise ValueError(f"ReqToTokenTable.tokens: slot {slot} is outside the table "
                             f"(0..{self._rows - 1}); pass a slot alloc() returned")
        return self.req_to_token[slot, : int(self.lengths[slot])]
