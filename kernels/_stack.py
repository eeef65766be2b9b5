"""The free list every id-granular pool shares: a stack of free ids plus a device bitmap.

Layout (capacity C, ids handed out are ``lo .. lo+C-1``)::

    _stack  int64[C]   ids ─┬─ [0, top)      free, the next alloc pops from the top end
                            └─ [top, C)      stale (ids currently allocated)
    _count  uint8[C+2] slot 0 │ 1 .. C                 │ C+1
                       below  │ copies of id lo+i-1    │ above
                       range  │ in the free list       │ range
                       (2 + copies of foreign ids)      (2 + copies)

``alloc(n)`` is a slice of the top (no copy of the rest); ``free(ids)`` writes the ids at
``top`` (O(number freed), never O(free ids) as a concatenating free list is).

``_count`` is the double-free/foreign bitmap. It is kept as a *count* (not a bool) so one
``scatter_add_`` both records a free and keeps the evidence of a double free (a count of
2) without reading anything back to the host. Frees are written to the stack at once and
folded into ``_count`` in one batched op (``_sync``) before anything reads the bitmap: the
next alloc, ``check()``, a snapshot, or the end of a free group. So N single frees cost N
slice writes and one scatter, and the bitmap is never observed stale. Out-of-range ids are
clamped onto the two sentinel slots, so a bad free can never index out of bounds on a
device (a CUDA device-side assert would kill the process instead of raising).

The counts are kept modulo 256 (uint8): a quarter of the memory traffic of int32, which is
what a fold of 64k ids costs on a CPU. Wraparound cannot hide a violation: a count is the
number of copies of its id in the free list (never negative), so the counts sum to ``top``
exactly unless some id has 256 copies or more, and ``check()`` compares that sum too.

``_bad`` is sticky: an id popped by alloc while its count was not exactly 1 (a double-freed
id handed out, or a foreign one) is flagged there, so the evidence survives the alloc.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from terminus.kernels.errors import DoubleFree, ForeignIndex, KernelError, LeakError, StaleSnapshot

IdsLike = torch.Tensor | int | Sequence[int]

# Element type of the free-list counts (see the module docstring: kept modulo 256).
_COUNT = torch.uint8
# What the two sentinel counts hold with no foreign id folded: not 0 or 1, so that popping
# a foreign id (its count then >= 3) is flagged by the same ``count != 1`` test as a
# double-freed one, even when it was the only foreign id in the free list.
_SENTINEL_BASE = 2
# Pops of at most this many ids on a CPU are done on the host (numpy views of the stack
# and the counts): a scheduler's pops are a handful of ids.
_HOST_POP = 64
# Folds of at most _HOST_FOLD ids, and pops of at most _HOST_TAKE, on a CPU go id by id
# through a memoryview of the counts (~60 ns an id for a fold, ~150 for a pop's test and
# update; one scatter_add_ is ~2.6 us, a pop's numpy gather, tolist and set ~2).
_HOST_FOLD = 32
_HOST_TAKE = 8
# Pops of more ids on a CPU are checked with one numpy gather of their counts and a
# bytes comparison, up to this many (tests lower it to run the torch path on a CPU).
_HOST_POP_BYTES = 1 << 62
_LITTLE_ENDIAN = sys.byteorder == "little"
# Validations of at most this many ids of a CPU pool are checked on the host.
_HOST_VALIDATE = 64


# Tensor dtypes accepted as ids. A float or bool tensor is refused, never truncated.
_INT_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})
# numpy dtypes that push_host writes into a CPU stack itself (others go through push).
_NP_IDS = (np.dtype(np.int64), np.dtype(np.int32))


def as_int(value: object) -> int | None:
    """``value`` as an int (a numpy integer or a 0-d integer tensor is one), or None when
    it is not one (a bool is not: no pool counts or names anything with True)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def as_count(pool: str, n: object) -> int:
    """``n`` as an int (see ``as_int``), or a TypeError naming it."""
    i = as_int(n)
    if i is None:
        raise TypeError(f"{pool}: the number of ids to allocate must be an int, got "
                        f"{type(n).__name__} {n!r}")
    return i


def not_ids(pool: str, values: object, dtype: object) -> TypeError:
    """The error for ids that are not integers: names the pool, the values and the type."""
    shown = values.reshape(-1)[:8].tolist() if isinstance(values, torch.Tensor) else values
    return TypeError(
        f"{pool}: indices must be integers, got {dtype} {shown}; pass the integer ids "
        "alloc() returned (an int64 or int32 tensor, an int, or a list of ints)"
    )


def as_ids(ids: IdsLike, device: torch.device, pool: str = "indices") -> torch.Tensor:
    """A 1-D integer tensor on ``device``; int32 input is kept (the stack write widens it).

    Float, bool or complex input is refused (``TypeError`` naming ``pool`` and the
    values), never truncated.
    """
    if isinstance(ids, torch.Tensor):
        if ids.dtype not in _INT_DTYPES:
            raise not_ids(pool, ids, ids.dtype)
        # (is_cpu is an attribute read; .device makes a device object to compare)
        if not (ids.is_cpu and device.type == "cpu") and ids.device != device:
            ids = ids.to(device)
        if ids.dim() != 1:
            ids = ids.reshape(-1)
        if ids.dtype not in (torch.int64, torch.int32):
            ids = ids.long()
        return ids
    if isinstance(ids, int):
        return torch.tensor([ids], dtype=torch.int64, device=device)
    values = list(ids)
    if not values:
        return torch.empty(0, dtype=torch.int64, device=device)
    t = torch.tensor(values)  # dtype inferred: a float among the values makes it float
    if t.dtype not in _INT_DTYPES:
        raise not_ids(pool, values, "values")
    return t.to(device=device, dtype=torch.int64).reshape(-1)


def long_ids(ids: IdsLike, device: torch.device, pool: str = "indices") -> torch.Tensor:
    """``as_ids`` widened to int64, with no dispatched op when it is int64 already (a
    no-op ``.long()`` still costs a torch call)."""
    t = as_ids(ids, device, pool)
    return t if t.dtype == torch.int64 else t.long()


def host_ints(values: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """An int64 tensor of a list of Python ints: on a CPU through numpy (~1.3 us for a
    few values; ``torch.tensor(list)`` costs ~6 us), elsewhere ``torch.tensor``."""
    # (a torch.device, what callers pass, is read as it is: building one costs ~0.8 us)
    if (device.type if device.__class__ is torch.device else torch.device(device).type) \
            == "cpu":
        return torch.from_numpy(np.array(values, dtype=np.int64).reshape(-1))
    return torch.tensor(values, dtype=torch.int64, device=device)


def _exact(device: torch.device) -> torch.device:
    """``device`` with its index: tensors report ``cuda:0``, never ``cuda``, so a pool on
    ``cuda`` compared with its own tensors' device would see a mismatch (and move them)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass(frozen=True)
class Snapshot:
    """An opaque allocator snapshot from ``backup_state()``; valid until the next backup."""

    generation: int
    top: int


class FreeStack:
    """Stack free list with a device bitmap and lazy double-free/foreign detection.

    ``strict=True`` validates every free before it changes anything (one host sync per
    free) and raises at the free itself; otherwise violations are recorded on the device
    and raised by the next ``check()``. ``detect=False`` turns the bitmap off (used by the
    benchmark to measure what it costs).
    """

    def __init__(
        self,
        name: str,
        lo: int,
        capacity: int,
        device: str | torch.device = "cpu",
        *,
        strict: bool = False,
        detect: bool = True,
        unit: str = "indices",
    ) -> None:
        if capacity < 0:
            raise ValueError(f"{name}: capacity must be >= 0, got {capacity}")
        self.name = name
        self.lo = lo
        self.hi = lo + capacity
        self.unit = unit
        self.strict = strict
        self.detect = detect
        self._cap = capacity
        self._device = _exact(torch.device(device))
        # Maps an id onto its _count slot: lo -> 1.
        self._off = 1 - lo
        self._cpu = self._device.type == "cpu"
        self._plus = torch.ones(1, dtype=_COUNT, device=self._device)
        self._minus = torch.full((1,), 255, dtype=_COUNT, device=self._device)  # -1 mod 256
        # A dense source of ones for scatter_add_: on CPU it runs ~40 % faster than the
        # stride-0 ``_plus.expand(n)``, and folding a batched free is the bitmap's cost.
        self._ones = self._plus
        self._ones_np = np.ones(1, dtype=np.uint8)  # the same, for CPU folds
        self._stack = torch.empty(capacity, dtype=torch.int64, device=self._device)
        self._count = torch.zeros(capacity + 2, dtype=_COUNT, device=self._device)
        # The counts as indexed by id directly, where ids start at 0 or 1 (every pool here):
        # a CPU fold then scatters the ids themselves, with no offset added first.
        self._by_id = self._count[self._off :] if self._off in (0, 1) else None
        # On a CPU the stack and the counts are also seen as numpy arrays (the same
        # memory): a pop or a check of a few ids is then a few host operations of ~1 us
        # instead of half a dozen torch calls of ~5 us each (a scheduler pops a handful
        # of ids at a time).
        self._host = self._cpu and detect and self._by_id is not None
        self._stack_host = self._stack.numpy() if self._cpu else None
        self._stack_np = self._stack_host if self._host else None
        self._by_id_np = self._by_id.numpy() if self._host and self._by_id is not None else None
        self._count_mv = self._count.numpy().data if self._cpu else None  # a memoryview
        self._sentinels = torch.tensor([0, capacity + 1], device=self._device)
        self._bad = torch.zeros(capacity + 2, dtype=torch.bool, device=self._device)
        # Clamped copies of ids go here: a fresh tensor per sync would be a fresh mmap
        # (and page faults) per call for large frees with glibc's allocator.
        self._scratch = torch.empty(capacity, dtype=torch.int64, device=self._device)
        self._group: list[torch.Tensor] | None = None
        self._grouped: set[int] = set()  # a strict pool's ids in the open group
        self._gen = 0
        self.clear()

    # -- state -----------------------------------------------------------------------

    def clear(self) -> None:
        """Every id free again, evidence wiped, free group dropped, snapshots invalidated."""
        torch.arange(self.lo, self.hi, out=self._stack)
        self._count.zero_()
        self._count[1 : self._cap + 1] = 1
        self._count[self._sentinels] = _SENTINEL_BASE
        self._bad.zero_()
        self._top = self._cap
        self._synced = self._cap
        self._group = None
        self._grouped.clear()
        self._gen += 1
        self._snap_top = -1
        self._saved: torch.Tensor | None = None
        self._saved_lo = 0

    @property
    def device(self) -> torch.device:
        """The device every tensor of this free list lives on."""
        return self._device

    @property
    def capacity(self) -> int:
        """How many ids this free list manages."""
        return self._cap

    @property
    def available(self) -> int:
        """Free ids ready for alloc (frees still held in an open free group excluded)."""
        return self._top

    def valid_range(self) -> str:
        """Human description of the ids handed out, for error messages."""
        return f"{self.unit} {self.lo}..{self.hi - 1}"

    # -- bitmap ------------------------------------------------------------------------

    def _slots(self, ids: torch.Tensor) -> torch.Tensor:
        """``_count`` slots of ``ids`` (out-of-range ids land on a sentinel), in scratch."""
        p = self._scratch[: ids.numel()]
        if self._off:
            torch.add(ids, self._off, out=p)
            return p.clamp_(0, self._cap + 1)
        return torch.clamp(ids, 0, self._cap + 1, out=p)

    def _ones_n(self, n: int) -> torch.Tensor:
        """``n`` ones (uint8, contiguous), from a buffer grown to the largest fold so far."""
        if self._ones.numel() < n:
            self._ones = torch.ones(
                max(n, min(2 * self._ones.numel(), self._cap)),
                dtype=_COUNT,
                device=self._device,
            )
        return self._ones.narrow(0, 0, n)

    def _ones_host(self, n: int) -> np.ndarray:
        """``n`` ones (uint8) as a numpy slice of a buffer grown to the largest fold."""
        if self._ones_np.shape[0] < n:
            self._ones_np = np.ones(max(n, min(2 * self._ones_np.shape[0], self._cap)),
                                    dtype=np.uint8)
        return self._ones_np[:n]

    def _count_add(self, ids: torch.Tensor, delta: torch.Tensor | None = None) -> None:
        """Add ``delta`` (default 1) to the counts of ``ids``; RuntimeError: counts unknown."""
        n = ids.numel()
        src = self._ones_n(n) if delta is None else delta.expand(n)
        if self._cpu:
            # CPU scatter checks bounds itself and raises (callers recount then), so the
            # clamp (a third of the cost of a large sync) is only needed where a bad index
            # is a device assert. An id below the range is then a negative index (raises)
            # or the lower sentinel; one past it lands on the upper sentinel or raises.
            counts = self._by_id
            if counts is None:
                ids = torch.add(ids, self._off, out=self._scratch[:n])
                counts = self._count
            counts.scatter_add_(0, ids, src)
        else:
            self._count.scatter_add_(0, self._slots(ids), src)

    def _rebuild_counts(self) -> None:
        """Recount the free list from scratch (O(capacity); only after a foreign id)."""
        self._count.zero_()
        self._count[self._sentinels] = _SENTINEL_BASE
        if self._top:
            p = self._slots(self._stack[: self._top])
            self._count.scatter_add_(0, p, self._ones_n(p.numel()))
        self._synced = self._top

    def _sync(self) -> None:
        if self._synced < self._top and self.detect:
            if self._top - self._synced <= _HOST_FOLD and self._count_mv is not None:
                # A few ids on a CPU: counted one by one, a foreign id onto its sentinel
                # exactly as _slots clamps it (what a recount after a refused scatter
                # gives), so the counts are the same as the scatter's.
                mv, off, last = self._count_mv, self._off, self._cap + 1
                assert self._stack_host is not None
                for v in self._stack_host[self._synced : self._top].tolist():
                    s = v + off
                    if not 0 <= s <= last:
                        s = 0 if s < 0 else last
                    mv[s] = (mv[s] + 1) & 255
                self._synced = self._top
                return
            try:
                if self._stack_host is not None and self._by_id is not None:
                    # CPU: the ids and the ones as numpy slices wrapped by from_numpy (no
                    # dispatched op); scatter_add_ is then the fold's one torch op.
                    n = self._top - self._synced
                    self._by_id.scatter_add_(
                        0,
                        torch.from_numpy(self._stack_host[self._synced : self._top]),
                        torch.from_numpy(self._ones_host(n)),
                    )
                else:
                    self._count_add(
                        self._stack.narrow(0, self._synced, self._top - self._synced)
                    )
            except RuntimeError:
                # A foreign id (out of bounds) stopped the scatter part-way; the id stays
                # in the stack, where check() finds and names it.
                self._rebuild_counts()
        self._synced = self._top

    # -- alloc / free -----------------------------------------------------------------

    def pop(self, n: int) -> torch.Tensor | None:
        """``n`` free ids, or None when fewer than ``n`` are free (nothing is taken then).
        ``n`` is an int (a numpy integer or a 0-d integer tensor is one; kept as it is, a
        tensor would become the stack's top, moved by every later in-place add); any
        other count is a TypeError."""
        if n.__class__ is not int:
            n = as_count(self.name, n)
        if not self._ready(n):
            return None
        if self._stack_np is not None and n:
            got = self._pop_host(n)
            if got is not None:
                return torch.from_numpy(got)
        return self._pop_tensor(n)

    def pop_host(self, n: int) -> np.ndarray | None:
        """``pop(n)`` of a CPU stack as a numpy array of its own (int64), or None when
        fewer than ``n`` are free: for a pool that works on the ids with numpy, a tensor
        and its ``.numpy()`` view less per call. The same checks and the same ids as
        ``pop``; ValueError on a stack that is not on the CPU."""
        if self._stack_host is None:
            raise ValueError(f"{self.name}: pop_host needs a CPU free list; use pop()")
        if n.__class__ is not int:
            n = as_count(self.name, n)
        if not self._ready(n):
            return None
        if self._stack_np is not None and n:
            got = self._pop_host(n)
            if got is not None:
                return got
        return self._pop_tensor(n).numpy()

    def pop_view(self, n: int) -> tuple[np.ndarray, bool] | None:
        """``pop_host(n)`` without its copy: the ids may come as a view of the stack's
        free end, valid only until the next push (for a caller that reads them at once,
        e.g. to gather from them, and keeps nothing of the view); and whether every id
        passed the host's checks (in range, counted exactly once): False when one did
        not and the ids took the general path, which flagged it (``check()`` names it),
        so that a caller does not index its own tables with an id that may be foreign.
        None when fewer than ``n`` are free."""
        if self._stack_host is None:
            raise ValueError(f"{self.name}: pop_view needs a CPU free list; use pop()")
        if n.__class__ is not int:
            n = as_count(self.name, n)
        if not self._ready(n):
            return None
        if self._stack_np is not None and n:
            got = self._pop_host(n, False)
            if got is not None:
                return got, True
        return self._pop_tensor(n).numpy(), False

    def _ready(self, n: int) -> bool:
        """Whether ``n`` ids (an int) can be popped (refusing a negative ``n``), the
        counts synced if so."""
        if n < 0:
            raise ValueError(
                f"{self.name}: cannot allocate a negative number ({n}); ask for n >= 0"
            )
        if n > self._top:
            return False
        if self._synced < self._top:
            self._sync()
        return True

    def _pop_host(self, n: int, copy: bool = True) -> np.ndarray | None:
        """The top ``n`` ids (0 < n <= top, counts synced) checked and taken on the host,
        as a copy (``copy=False``: a view of the stack, see ``pop_view``); None (nothing
        taken) when one of them is out of range or its count is not exactly 1, for
        ``_pop_tensor`` to take and flag."""
        stack_np = self._stack_np
        assert stack_np is not None
        # CPU: checked and taken on the host (see __init__). Every id in range with a
        # count of exactly 1 is the usual case; anything else takes the general path,
        # which flags it.
        old = self._top
        seg = stack_np[old - n : old]
        counts_np = self._by_id_np
        assert counts_np is not None
        if n <= _HOST_TAKE:
            # A few ids: the same test and update, id by id (see _HOST_TAKE).
            mv, off, lo, hi = self._count_mv, self._off, self.lo, self.hi
            assert mv is not None
            vals = seg.tolist()
            for v in vals:
                if not lo <= v < hi or mv[v + off] != 1:
                    return None
            for v in vals:
                mv[v + off] = 0
            self._top = self._synced = old - n
            return seg.copy() if copy else seg  # (a tensor: ~1.5 us; torch.tensor: ~6)
        if n <= _HOST_POP:
            vals = seg.tolist()
            if (self.lo <= min(vals) and max(vals) < self.hi
                    and counts_np[seg].tolist().count(1) == n):
                # Counts of 1 mean no id is twice in `seg`: setting them to 0 is
                # exactly the scatter of -1 in _pop_tensor.
                counts_np[seg] = 0
                self._top = self._synced = old - n
                return seg.copy() if copy else seg
        elif n <= _HOST_POP_BYTES and _LITTLE_ENDIAN and (
                seg - self.lo if self.lo else seg).tobytes()[7::8].isascii():
            # Many ids, none below lo (no int64's top byte has its sign bit set): one
            # gather of their counts from a view that ends at hi (an id past it raises)
            # and a bytes comparison, no numpy reduction (cold after a Python-heavy
            # step) and no torch op.
            try:
                taken = counts_np[: self.hi].take(seg).tobytes()
            except IndexError:
                taken = b""
            if taken == b"\x01" * n:
                counts_np[seg] = 0
                self._top = self._synced = old - n
                return seg.copy() if copy else seg
        return None

    def _pop_tensor(self, n: int) -> torch.Tensor:
        """The top ``n`` ids (n <= top, counts synced) taken with tensor ops, flagging
        any whose count is not exactly 1 (the device path, and the host's odd case)."""
        out = self._stack.narrow(0, self._top - n, n).clone()
        self._top -= n
        self._synced = self._top
        if self.detect and n:
            counts = self._by_id
            if self._cpu and counts is not None:
                # CPU, ids from 0 or 1: the ids index the counts directly, and index_select
                # checks bounds itself (a foreign id raises: the general path below clamps).
                try:
                    got = counts.index_select(0, out)
                except (IndexError, RuntimeError):
                    got = None
                if got is not None and not bool(got.ne(1).any()):
                    # Every count is exactly 1 (the usual case): nothing to flag, and one
                    # scatter takes them to 0. One read, free on a CPU.
                    counts.scatter_add_(0, out, self._minus.expand(n))
                    return out
            p = self._slots(out)
            # Sticky evidence: an id handed out while its count was not exactly 1.
            # An OR per slot, duplicates in p included. (index_put_ with accumulate=True
            # does the same but sorts the indices on CUDA: ~5x the cost of an alloc.)
            flag = self._count.index_select(0, p).ne(1).view(torch.uint8)
            self._bad.view(torch.uint8).scatter_reduce_(0, p, flag, reduce="amax")
            self._count.scatter_add_(0, p, self._minus.expand(n))
        return out

    def push(self, ids: torch.Tensor, *, checked: bool = False) -> None:
        """Return ``ids`` (an int tensor; any device, int32 or int64) to the free list.

        This is the hot path of per-request frees: one slice write, nothing else. A float
        or bool tensor is refused (``TypeError``), never truncated into ids.
        ``checked``: the caller ran ``validate(ids)`` (or on a superset of them) just now
        and nothing changed since, so a strict pool does not validate them again.
        """
        if ids.dtype not in _INT_DTYPES:
            raise not_ids(self.name, ids, ids.dtype)
        if self._group is not None:
            # A strict pool validates each grouped free at once (in range, distinct,
            # none free) and against the group's earlier ones (the ids it holds, as a
            # set): refused, it joins nothing, and the valid frees already grouped still
            # reach the free list at `group_end`.
            if self.strict:
                self.validate(ids)
                vals = ids.reshape(-1).tolist()
                again = self._grouped.intersection(vals)
                if again:
                    raise DoubleFree(self.name, sorted(again))
                self._grouped.update(vals)
            # A view (of the caller's table: a row's columns) is copied, read now: the
            # row may be rewritten before the group ends, given to a new request. A
            # tensor of its own is the pool's once freed, kept as it is.
            self._group.append(ids if ids._base is None else ids.clone())
            return
        if ids.dim() != 1:
            ids = ids.reshape(-1)
        n = ids.numel()
        if n == 0:
            return
        if self.strict or self._top + n > self._cap:
            # More frees than ids allocated is a violation for certain; find and name it
            # rather than write past the end of the stack.
            if not checked or self._top + n > self._cap:
                self.validate(ids)
            if self._top + n > self._cap:
                # These ids are fine: an earlier lazy free put a double free (or a foreign
                # id) in the free list. Name that one; nothing is written.
                self.check()
                raise DoubleFree(self.name, [])  # pragma: no cover - check() raises
        if self._snap_top >= 0 and self._top < self._saved_lo:
            self._save_for_snapshot()
        if self.strict and n <= _HOST_POP and self._stack_np is not None \
                and ids.is_cpu:
            # Validated above (in range, distinct, none free; the counts synced): a few
            # ids of a CPU pool are written and counted (0 -> 1) through numpy views.
            assert self._by_id_np is not None and self._count_mv is not None
            self._stack_np[self._top : self._top + n] = ids.numpy()
            if n <= _HOST_FOLD:
                mv, off = self._count_mv, self._off
                for v in ids.tolist():
                    mv[v + off] = 1
            else:
                self._by_id_np[ids.numpy()] = 1
            self._top = self._synced = self._top + n
            return
        if self._stack_host is not None and ids.is_cpu:
            # A CPU stack: written through its numpy view (one numpy op, widening int32
            # as copy_ does; after a Python-heavy step the cold dispatch of narrow and
            # copy_ costs more than the copy: 1.2 us against 2.6 warm for one id).
            self._stack_host[self._top : self._top + n] = ids.numpy()
        else:
            self._stack.narrow(0, self._top, n).copy_(ids)
        self._top += n
        if self.strict:
            self._sync()

    def push_host(self, ids: np.ndarray) -> None:
        """``push`` of a 1-D numpy array of ids (what a CPU release gathers from its table).

        A CPU stack that is not strict, with no free group open, takes them through its
        numpy view with no torch call: after a scheduler's Python-heavy step each torch
        call of a release (``from_numpy``, ``.numpy()``, ``.device``) pays microseconds
        of cold code. Everything else (a strict pool's validation, a free group, ids past
        the capacity, a device stack) goes through ``push`` exactly as a tensor would;
        ``ids`` may be a view of a table (a group keeps a copy, never the view).
        """
        if not isinstance(ids, np.ndarray) or ids.ndim != 1:
            raise TypeError(f"{self.name}: push_host takes a 1-D numpy array of ids; got "
                            f"{type(ids).__name__} of shape {getattr(ids, 'shape', None)}; "
                            "pass a tensor to push()")
        n = ids.shape[0]
        if (self._stack_host is None or self.strict or self._group is not None
                or self._top + n > self._cap or ids.dtype not in _NP_IDS):
            # push() takes a copy it can keep and torch can wrap (a view of a table row,
            # a negative stride): this path is the cold one.
            self.push(torch.from_numpy(np.ascontiguousarray(ids).copy()))
            return
        if n == 0:
            return
        if self._snap_top >= 0 and self._top < self._saved_lo:
            self._save_for_snapshot()
        top = self._top
        self._stack_host[top : top + n] = ids  # widening int32 as push's write does
        self._top = top + n

    def validate(self, ids: torch.Tensor) -> None:
        """Raise ``ForeignIndex``/``DoubleFree`` if freeing ``ids`` now would be wrong.

        Syncs with the host; changes nothing.
        """
        self._sync()
        mv = self._count_mv
        if mv is not None and ids.numel() <= _HOST_VALIDATE:
            # A few ids of a CPU pool (a strict pool's every free): checked in Python,
            # their counts read through the memoryview (one numpy gather past
            # _HOST_FOLD ids), in a few microseconds instead of a dozen torch ops.
            if not ids.is_cpu or ids.dtype not in _INT_DTYPES:
                ids = ids.to(self._device).long()
            vals = (ids if ids.dim() == 1 else ids.reshape(-1)).tolist()
            lo, hi, off = self.lo, self.hi, self._off
            foreign = [v for v in vals if not lo <= v < hi]
            if foreign:
                raise ForeignIndex(self.name, foreign, self.valid_range())
            if len(vals) <= _HOST_FOLD:
                got = [mv[v + off] for v in vals]
            else:
                got = np.asarray(mv)[np.asarray(vals) + off].tolist()
            if any(got):
                raise DoubleFree(self.name, [v for v, c in zip(vals, got, strict=True) if c])
            if len(set(vals)) != len(vals):
                raise DoubleFree(self.name, sorted({v for v in vals if vals.count(v) > 1}))
            return
        ids = ids.to(self._device).long().reshape(-1)
        n = ids.numel()
        outside = (ids < self.lo) | (ids >= self.hi)
        if bool(outside.any()):
            raise ForeignIndex(self.name, ids[outside].tolist(), self.valid_range())
        counts = self._count.index_select(0, ids + self._off if self._off else ids)
        already = counts.ne(0)
        if bool(already.any()):
            raise DoubleFree(self.name, ids[already].tolist())
        if n > 1:
            s = torch.sort(ids).values
            twice = s[1:][s[1:] == s[:-1]]
            if twice.numel():
                raise DoubleFree(self.name, torch.unique(twice).tolist())

    def outside_or_free(self, ids: torch.Tensor) -> tuple[list[int], list[int]]:
        """``(outside, free)`` among ``ids`` (1-D int64 on this device): the ids outside
        ``lo .. hi-1`` and, when none is, the ids in the free list now (a page listed
        twice is named twice). What a call that only the holder of an id may make (a
        lock) refuses. Changes nothing; one host read on a device, none on a CPU (the ids
        and their counts read on the host). With ``detect=False`` nothing records which
        ids are free: ``free`` is then empty."""
        if not ids.numel():
            return [], []
        if self._synced < self._top:
            self._sync()
        lo, hi = self.lo, self.hi
        mv = self._count_mv
        if mv is not None:
            # A CPU free list: no torch op, a few ids in Python, more through numpy.
            if ids.numel() <= _HOST_VALIDATE:
                vals = ids.tolist()
                outside = [v for v in vals if not lo <= v < hi]
                if outside or not self.detect:
                    return outside, []
                off = self._off
                return [], [v for v in vals if mv[v + off]]
            arr = ids.numpy()
            if int(arr.min()) < lo or int(arr.max()) >= hi:
                return [v for v in arr.tolist() if not lo <= v < hi], []
            if not self.detect:
                return [], []
            got = np.asarray(mv)[arr + self._off]
            return [], arr[got != 0].tolist() if got.any() else []
        mn, mx = ids.aminmax()
        if not self.detect:
            first, last = torch.stack((mn, mx)).tolist()
            return ([v for v in ids.tolist() if not lo <= v < hi]
                    if first < lo or last >= hi else []), []
        # (clamped: an id outside lands on a sentinel, never out of bounds on a device)
        free = self._count.index_select(0, (ids + self._off).clamp_(0, self._cap + 1)).ne(0)
        first, last, n_free = torch.stack((mn, mx, free.sum())).tolist()  # the one read
        if first < lo or last >= hi:
            return [v for v in ids.tolist() if not lo <= v < hi], []
        return [], ids[free].tolist() if n_free else []

    # -- free groups -------------------------------------------------------------------

    def group_begin(self) -> None:
        """Start collecting frees; they reach the free list together at ``group_end``."""
        if self._group is not None:
            raise KernelError(
                f"{self.name}: free_group_begin() while a free group is open; "
                "call free_group_end() first"
            )
        self._group = []
        self._grouped.clear()

    def group_end(self) -> None:
        """Push every free collected since ``group_begin`` with one stack write."""
        group = self._group
        if group is None:
            raise KernelError(f"{self.name}: free_group_end() without free_group_begin()")
        self._group = None
        self._grouped.clear()
        if group:
            try:
                ids = torch.cat(group) if len(group) > 1 else group[0].reshape(-1)
            except RuntimeError:
                # Parts on different devices, or not all 1-D: flatten and move each one
                # (only here, so that the common case adds nothing to each grouped free).
                ids = torch.cat([g.reshape(-1).to(self._device) for g in group])
            # (a strict pool validated every part, and against the others, as it was
            # grouped)
            self.push(ids, checked=self.strict)

    # -- snapshots -----------------------------------------------------------------------

    def _save_for_snapshot(self) -> None:
        # Positions [top, saved_lo) still hold what they held at backup time (every write
        # since then landed at or above saved_lo), so copying them now is enough.
        seg = self._stack[self._top : self._saved_lo].clone()
        self._saved = seg if self._saved is None else torch.cat((seg, self._saved))
        self._saved_lo = self._top

    def backup(self) -> Snapshot:
        """O(1) snapshot of the free list; a later backup replaces it."""
        self._no_group("backup_state")
        self._sync()
        self._gen += 1
        self._snap_top = self._top
        self._saved = None
        self._saved_lo = self._top
        return Snapshot(self._gen, self._top)

    def restore(self, snap: Snapshot) -> None:
        """Return to exactly the free set of ``snap``.

        Ids allocated since the backup are free again; ids freed since the backup are
        allocated again (their owner still holds them), as with a tensor snapshot of the
        whole free list. O(ids allocated since the backup).
        """
        self._no_group("restore_state")
        if snap.generation != self._gen or self._snap_top != snap.top:
            raise StaleSnapshot(
                f"{self.name}: snapshot {snap.generation} was replaced by a later "
                "backup_state() or clear(); restore only the latest snapshot"
            )
        self._sync()
        t = snap.top
        lo_pos = min(self._saved_lo, self._top)
        recount = False
        try:
            if self.detect and self._top > lo_pos:
                self._count_add(self._stack[lo_pos : self._top], self._minus)
        except RuntimeError:
            recount = True
        if self._saved is not None:
            self._stack[self._saved_lo : t] = self._saved
        self._top = self._synced = t
        try:
            if self.detect and not recount and t > lo_pos:
                self._count_add(self._stack[lo_pos:t])
        except RuntimeError:
            recount = True
        if recount:
            self._rebuild_counts()
        self._saved = None
        self._saved_lo = t

    def _no_group(self, what: str) -> None:
        if self._group is not None:
            raise KernelError(f"{self.name}: {what}() inside a free group; end the group first")

    # -- checks ---------------------------------------------------------------------------

    def check(self) -> None:
        """Raise ``ForeignIndex`` or ``DoubleFree`` for any violation recorded so far.

        One host sync when nothing is wrong. Foreign ids still in the free list are named
        exactly; ones already handed out again are reported by the sentinel they hit.
        """
        if not self.detect:
            return
        self._sync()
        free = self._stack[: self._top]
        outside = (free < self.lo) | (free >= self.hi)
        c, b, hi = self._count, self._bad, self._cap + 1
        inner = (c[1:hi] > 1) | b[1:hi]
        n_out, below, above, n_inner, total = torch.stack(
            (
                outside.sum(),
                c[0].long() - _SENTINEL_BASE + b[0].long(),
                c[hi].long() - _SENTINEL_BASE + b[hi].long(),
                inner.sum(),
                c.sum(dtype=torch.int64) - 2 * _SENTINEL_BASE,
            )
        ).tolist()
        if n_out or below or above:
            foreign = free[outside].tolist()
            if not foreign:
                foreign = [self.lo - 1] if below else [self.hi]
            raise ForeignIndex(self.name, sorted(set(foreign)), self.valid_range())
        if n_inner:
            raise DoubleFree(self.name, (torch.nonzero(inner).flatten() + self.lo).tolist())
        if total != self._top:
            # Some id has 256 copies or more in the free list (its count wrapped): count
            # the free list exactly to name it.
            exact = torch.bincount(self._slots(free), minlength=hi + 1)
            dbl = torch.nonzero(exact[1:hi] > 1).flatten()
            raise DoubleFree(self.name, (dbl + self.lo).tolist())

    def held(self, limit: int = 16) -> list[int]:
        """Up to ``limit`` ids currently allocated (not in the free list)."""
        self._sync()
        if not self.detect:
            return []
        held = torch.nonzero(self._count[1 : self._cap + 1] == 0).flatten()[:limit]
        return (held + self.lo).tolist()

    def assert_full(self) -> None:
        """Raise unless every id is back in the free list and no violation was recorded."""
        self.check()
        if self._group is not None:
            raise LeakError(self.name, sum(g.numel() for g in self._group), [], "frees")
        if self._top != self._cap:
            raise LeakError(self.name, self._cap - self._top, self.held(), self.unit)


class StackPool:
    """What every pool built on one ``FreeStack`` (``self._free``) reports the same way."""

    _free: FreeStack

    @property
    def device(self) -> torch.device:
        """Where the pool's tensors live."""
        return self._free.device

    @property
    def capacity(self) -> int:
        """Ids the pool hands out at most (padding excluded)."""
        return self._free.capacity

    @property
    def available(self) -> int:
        """Ids free now."""
        return self._free.available

    def check(self) -> None:
        """Raise ``DoubleFree`` / ``ForeignIndex`` naming what was wrongly freed (one sync)."""
        self._free.check()

    def held(self, limit: int = 16) -> list[int]:
        """Up to ``limit`` ids handed out now (empty when double-free detection is off)."""
        return self._free.held(limit)

    def assert_full(self) -> None:
        """Raise ``LeakError`` naming what is still held."""
        self._free.assert_full()
