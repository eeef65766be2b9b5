"""KV cache slot allocator, token-granular (``page_size == 1``) or paged.

Token indices address rows of the KV buffers, which therefore need
``size + page_size`` rows::

    token index  0 .. ps-1 | ps .. 2ps-1 | ... | size .. size+ps-1
    page             0     |      1      | ... |    size/ps
                  padding  |  handed out by alloc(), page ids 1 .. size/ps

Page 0 (token 0 when ``page_size == 1``) is the padding slot that dummy and padded batch
rows write into: never handed out, and freeing it raises ``ForeignIndex``.

Paged semantics: ``alloc(n)`` takes ``ceil(n / page_size)`` whole pages and returns the
first ``n`` token indices of them (``page * page_size + offset``), in order. ``free`` takes
token indices and frees every page any of them falls in, once per page, so freeing a
request's ``req_to_token[slot, :length]`` frees exactly its pages even when ``length`` ends
mid-page.
"""

from __future__ import annotations

import numpy as np
import torch

from terminus.kernels._stack import FreeStack, IdsLike, Snapshot, StackPool, as_count, as_ids

__all__ = ["KVSnapshot", "TokenKVAllocator"]

KVSnapshot = Snapshot

# Paged frees of at most this many tokens on a CPU find their pages in Python; more, with
# numpy (tests turn _NP_PAGES off to run the tensor ops a device takes, on a CPU).
_HOST_PAGES = 192
_NP_PAGES = True
# A paged CPU pool of at most this many token slots keeps every page's token indices as
# one (pages, page_size) table (8 bytes a slot), so an alloc's tokens are one gather of
# its pages' rows (~0.4 us) instead of a broadcast multiply-add (two ufuncs, ~2 us and
# more when cold after a scheduler's step). Tests set it to 0 to run the broadcast.
_TOKEN_TABLE_SLOTS = 1 << 21


class TokenKVAllocator(StackPool):
    """KV slot allocator with O(freed) frees, free groups, snapshots and a free bitmap.

    Args:
        size: usable token slots (a multiple of ``page_size``).
        page_size: tokens per page; 1 for token granularity.
        device: where the free list and bitmap live.
        strict: validate every free before it changes anything (one host sync per
            free); otherwise violations are recorded on the device and raised by
            ``check()``, which a scheduler calls once per step.
        detect: keep the double-free/foreign bitmap at all.
    """

    def __init__(
        self,
        size: int,
        page_size: int = 1,
        device: str | torch.device = "cpu",
        *,
        strict: bool = False,
        detect: bool = True,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"TokenKVAllocator: page_size must be >= 1, got {page_size}")
        if size % page_size:
            raise ValueError(
                f"TokenKVAllocator: size {size} is not a multiple of page_size {page_size}; "
                f"use {size - size % page_size}"
            )
        self.size = size
        self.page_size = page_size
        self._free = FreeStack(
            "TokenKVAllocator" if page_size == 1 else f"TokenKVAllocator(page_size={page_size})",
            1,
            size // page_size,
            device,
            strict=strict,
            detect=detect,
            unit="pages" if page_size > 1 else "token slots",
        )
        if page_size > 1:
            self._offsets = torch.arange(page_size, dtype=torch.int64, device=self.device)
        self._offsets_np = (self._offsets.numpy()
                            if page_size > 1 and self.device.type == "cpu" else None)
        # Row p: the token indices of page p (row 0, the padding page, never handed out).
        self._page_tokens = (
            np.arange(size + page_size, dtype=np.int64).reshape(-1, page_size)
            if self._offsets_np is not None and size <= _TOKEN_TABLE_SLOTS else None)

    @property
    def capacity(self) -> int:
        """Usable token slots (padding excluded)."""
        return self._free.capacity * self.page_size

    @property
    def available(self) -> int:
        """Token slots that ``alloc`` can hand out now."""
        return self._free.available * self.page_size

    def available_size(self) -> int:
        """Same as ``available``: the name serving engines call."""
        return self._free.available * self.page_size

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` token indices (int64), or None when short: never a partial allocation.

        ``ValueError`` (naming ``n``) for a negative ``n``, ``TypeError`` for one that is
        not an int (a numpy integer or a 0-d integer tensor is one).
        """
        if n.__class__ is not int:
            n = as_count(self._free.name, n)
        if self.page_size == 1:
            return self._free.pop(n)
        if n < 0:
            raise ValueError(
                f"{self._free.name}: cannot allocate a negative number of tokens ({n}); "
                "ask for n >= 0"
            )
        if self._offsets_np is not None:
            # A CPU pool: the pages popped as numpy and the tokens built by numpy (~4 us
            # for a few pages; four torch ops ~9, and each pays cold code after a
            # scheduler's Python-heavy step).
            k = -(-n // self.page_size)
            table = self._page_tokens
            if table is not None:
                # The pages' rows of the token table, gathered into a new array (the
                # popped ids are read before anything is pushed over them: no copy).
                popped = self._free.pop_view(k)
                if popped is None:
                    return None
                pages_np, checked = popped
                if checked:
                    got = table.take(pages_np, axis=0).reshape(-1)
                else:  # a page id that may be foreign (flagged): computed, never indexed
                    got = (pages_np[:, None] * self.page_size + self._offsets_np).reshape(-1)
            else:
                host = self._free.pop_host(k)
                if host is None:
                    return None
                got = (host[:, None] * self.page_size + self._offsets_np).reshape(-1)
            return torch.from_numpy(got if got.shape[0] == n else got[:n])
        pages = self._free.pop(-(-n // self.page_size))
        if pages is None:
            return None
        tokens = pages.unsqueeze(1) * self.page_size + self._offsets
        return tokens.reshape(-1)[:n]

    def free(self, indices: IdsLike) -> None:
        """Return token indices (any int tensor, e.g. an int32 ``req_to_token`` row).

        ``TypeError`` naming the values for float or bool input, never truncated.
        """
        if self.page_size == 1 and type(indices) is torch.Tensor:
            self._free.push(indices)  # the per-request hot path: keep it to one call
            return
        ids = as_ids(indices, self.device, self._free.name)
        if ids.numel() == 0:
            return
        if self.page_size > 1:
            cpu = ids.is_cpu
            if cpu and ids.numel() <= _HOST_PAGES:
                # A request's tokens on a CPU: its pages, sorted and once each, as
                # torch.unique gives them (3-9 us here; div and unique cost ~11).
                self._free.push_host(self._pages_few(ids.tolist()))
                return
            elif cpu and _NP_PAGES:
                # Many tokens on a CPU: the same pages (floor division, sorted, once
                # each) by numpy, whose ops pay less cold code after a scheduler's step
                # than torch's div and unique.
                self._free.push_host(np.unique(ids.numpy() // self.page_size))
                return
            else:
                ids = torch.unique(torch.div(ids, self.page_size, rounding_mode="floor"))
        self._free.push(ids)

    def _pages_few(self, tokens: list[int]) -> np.ndarray:
        """The pages of a few token indices, sorted and once each (int64)."""
        ps = self.page_size
        return np.array(sorted({v // ps for v in tokens}), dtype=np.int64)

    def free_host(self, indices: np.ndarray) -> None:
        """``free`` of a 1-D numpy array of token indices (int32 or int64; what a release
        gathers from a CPU table), with no tensor made on the way: the same pages reach
        the free list in the same order as ``free(torch.from_numpy(indices))``.
        A CPU pool only (``ValueError`` otherwise)."""
        if self._free._stack_host is None:
            raise ValueError(f"{self._free.name}: free_host needs a CPU pool; use free()")
        if not isinstance(indices, np.ndarray) or indices.ndim != 1 \
                or indices.dtype.kind not in "iu":
            raise TypeError(f"{self._free.name}: free_host takes a 1-D numpy array of "
                            f"integer token indices; got {type(indices).__name__} "
                            f"{getattr(indices, 'dtype', '')}; pass a tensor to free()")
        if self.page_size == 1:
            self._free.push_host(indices)
        elif not indices.shape[0]:
            return
        elif indices.shape[0] <= _HOST_PAGES or not _NP_PAGES:
            # A few tokens: divided by numpy, deduplicated and sorted by Python's set
            # and sorted (no per-token bytecode; numpy's unique costs more on a few).
            self._free.push_host(np.array(sorted(set((indices // self.page_size).tolist())),
                                          dtype=np.int64))
        else:
            self._free.push_host(np.unique(indices // self.page_size))

    def free_group_begin(self) -> None:
        """Collect the frees that follow; they reach the free list at ``free_group_end``."""
        self._free.group_begin()

    def free_group_end(self) -> None:
        """Push all frees since ``free_group_begin`` with one concatenation."""
        self._free.group_end()

    def backup_state(self) -> KVSnapshot:
        """Snapshot for speculative-decoding rollback; O(1).

        Only the latest snapshot can be restored. See ``restore_state``.
        """
        return self._free.backup()

    def restore_state(self, state: KVSnapshot) -> None:
        """Return to exactly the free set at ``backup_state``.

        O(slots allocated since the backup) when only allocations happened; still
        correct when frees happened too: slots freed after the backup count as
        allocated again, as with a copy of the whole free list.
        """
        self._free.restore(state)

    def clear(self) -> None:
        """Everything free again; recorded violations wiped; snapshots invalidated."""
        self._free.clear()

    def assert_full(self) -> None:
        """Raise ``LeakError`` naming held pages unless everything is free again."""
        self._free.assert_full()
