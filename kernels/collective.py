"""Rank collectives over ``torch.distributed``: a MAX reduction and a bounded barrier.

Decisions that every rank of a tensor-/context-parallel attention group must take alike
(whether anyone enters a barrier, say) are taken on a value reduced over the groups,
never on local state alone. These helpers do the two collectives such a decision needs,
over several groups in turn (tp, then cp: a MAX over each is the MAX over the grid)::

    groups = RankCollectives([("tp", tp_group), ("cp", cp_group)], timeout=30.0)
    v = local_class
    for i in range(len(groups)):
        v = groups.reduce_max(i, v)       # every rank, unconditionally
    if v >= ACTIVE:
        for i in range(len(groups)):
            groups.barrier(i, what="prefetch abort of 'rid-1'")

Both are bounded. The barrier is an ``all_reduce`` of a one-element tensor posted with
``async_op=True`` and polled with ``Work.is_completed()`` until a deadline, which behaves
the same on gloo and NCCL (``dist.monitored_barrier`` exists on gloo only, and an NCCL
``Work.wait(timeout)`` does not block the host). On timeout, `CollectiveTimeout` names
what waited, the group and its ranks, and carries the still-outstanding work as
``ticket``: passing it back to ``barrier(..., ticket=...)`` waits for the *same*
collective again instead of posting a new one, so a late peer completes the first
barrier rather than pairing with a second. A group whose peer never comes back is
broken for further collectives (as with any timed-out collective): tear it down.

Any other error of a collective (gloo's "Connection closed by peer" when a peer process
died, a backend error NCCL reports) is raised as `CollectiveError`, naming the same
things and chaining the backend's exception; such a group is unusable: tear it down.

Tensors live on ``device``: "cpu" with gloo; with NCCL pass the rank's CUDA device (or,
as serving engines do, give these helpers the gloo CPU group kept beside the NCCL one).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from terminus.kernels.errors import KernelError

__all__ = [
    "CollectiveError",
    "CollectiveTimeout",
    "RankCollectives",
    "attention_groups",
    "grid_partitions",
]


class CollectiveTimeout(KernelError, TimeoutError):
    """A collective waited ``timeout`` seconds and some peer of ``group`` never arrived.

    Fields: ``what`` (who waited: the caller's description), ``op`` ("barrier" or
    "reduce_max"), ``group`` (its name), ``ranks`` (its global ranks, when known),
    ``timeout``, ``ticket`` (the outstanding work, to wait on again).
    """

    def __init__(
        self,
        what: str,
        op: str,
        group: str,
        ranks: Sequence[int],
        timeout: float,
        ticket: Any = None,
    ) -> None:
        self.what = what
        self.op = op
        self.group = group
        self.ranks = list(ranks)
        self.timeout = timeout
        self.ticket = ticket
        super().__init__(
            f"{what}: {op} on attention group {group!r} (ranks {self.ranks}) timed out "
            f"after {timeout:g}s: a peer never arrived. Every rank of the group must enter "
            "this collective; find the rank that returned early. Retry with the ticket "
            "once it arrives, or tear the group down."
        )


class CollectiveError(KernelError, RuntimeError):
    """A collective raised a backend error (a peer process died, the link broke).

    Fields: ``what``, ``op``, ``group``, ``ranks`` as `CollectiveTimeout`; ``error``, the
    backend's exception (also ``__cause__``). The group cannot be used again.
    """

    def __init__(self, what: str, op: str, group: str, ranks: Sequence[int],
                 error: BaseException) -> None:
        self.what = what
        self.op = op
        self.group = group
        self.ranks = list(ranks)
        self.error = error
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        super().__init__(
            f"{what}: {op} on attention group {group!r} (ranks {self.ranks}) raised "
            f"{type(error).__name__}: {first[:300]}. A peer of the group is gone or the "
            "link broke; the group cannot be used again: tear it down."
        )
        self.__cause__ = error


def attention_groups(**groups: Any) -> list[tuple[str, Any]]:
    """The named groups to reduce over, in order, keeping only those of size > 1.

    ``attention_groups(tp=tp_group, cp=cp_group)``; a group of one rank (or None when
    the process group is not initialized) has nothing to agree on and is dropped.
    """
    out = []
    for name, g in groups.items():
        if g is None or not dist.is_initialized():
            continue
        if dist.get_world_size(g) > 1:
            out.append((name, g))
    return out


class RankCollectives:
    """The named attention groups of one rank, with bounded MAX reduction and barrier.

    ``groups``: ``[(name, ProcessGroup), ...]`` in reduction order. ``timeout``: seconds
    any one collective may wait. Counters (``reduces``, ``barriers``: collectives
    entered, per group index) let tests check that every rank entered alike.
    """

    def __init__(
        self,
        groups: Sequence[tuple[str, Any]],
        *,
        timeout: float = 30.0,
        device: str | torch.device = "cpu",
        poll_s: float = 0.0005,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.groups = list(groups)
        self.timeout = float(timeout)
        self.device = torch.device(device)
        self.poll_s = poll_s
        self.reduces = [0] * len(self.groups)
        self.barriers = [0] * len(self.groups)

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def names(self) -> tuple[str, ...]:
        """Group names in reduction order."""
        return tuple(n for n, _ in self.groups)

    def ranks(self, i: int) -> list[int]:
        """Global ranks of group ``i`` (empty when unknown)."""
        try:
            return list(dist.get_process_group_ranks(self.groups[i][1]))
        except Exception:  # not every backend/version can tell; only used in messages
            return []

    def _wait(self, work: Any, i: int, what: str, op: str) -> None:
        deadline = time.monotonic() + self.timeout
        try:
            while not work.is_completed():
                if time.monotonic() >= deadline:
                    raise CollectiveTimeout(
                        what, op, self.groups[i][0], self.ranks(i), self.timeout, work
                    )
                time.sleep(self.poll_s)
            work.wait()  # surfaces a backend error of a completed collective
        except CollectiveTimeout:
            raise
        except Exception as e:
            raise CollectiveError(what, op, self.groups[i][0], self.ranks(i), e) from e

    def _post(self, i: int, what: str, op: str, t: torch.Tensor,
              red: Any = None) -> Any:
        try:
            if red is None:
                return dist.all_reduce(t, group=self.groups[i][1], async_op=True)
            return dist.all_reduce(t, op=red, group=self.groups[i][1], async_op=True)
        except Exception as e:  # a broken group can refuse the post itself
            raise CollectiveError(what, op, self.groups[i][0], self.ranks(i), e) from e

    def reduce_max(self, i: int, value: int, what: str = "reduce_max") -> int:
        """MAX of ``value`` over group ``i``; bounded like the barrier (no ticket reuse).

        Raises `CollectiveTimeout` after ``timeout`` seconds, `CollectiveError` when the
        backend raises.
        """
        self.reduces[i] += 1
        t = torch.tensor([int(value)], dtype=torch.int32, device=self.device)
        work = self._post(i, what, "reduce_max", t, dist.ReduceOp.MAX)
        self._wait(work, i, what, "reduce_max")
        return int(t.item())

    def barrier(self, i: int, what: str = "barrier", ticket: Any = None) -> None:
        """Wait until every rank of group ``i`` arrives, at most ``timeout`` seconds.

        ``ticket``: the work of a barrier that timed out before: wait for it again
        (a retry) instead of entering a new one; a retry is not counted as an entry.
        Raises `CollectiveTimeout` (with the ticket) or `CollectiveError` as `reduce_max`.
        """
        if ticket is None:
            self.barriers[i] += 1
            t = torch.ones(1, dtype=torch.int32, device=self.device)
            ticket = self._post(i, what, "barrier", t)
        self._wait(ticket, i, what, "barrier")


def grid_partitions(world_size: int, tp: int) -> list[tuple[str, list[list[int]]]]:
    """The tp and cp groups of a ``world_size`` grid with ``tp`` consecutive ranks per tp group.

    Returns ``[(name, [[ranks of group 0], ...]), ...]`` for every kind whose groups have
    more than one rank; rank ``r`` is in tp group ``r // tp`` and cp group ``r % tp``.
    Every rank must call ``dist.new_group`` for every group, in this order.
    """
    if tp < 1 or world_size % tp:
        raise ValueError(f"tp={tp} must be >= 1 and divide world_size={world_size}")
    cp = world_size // tp
    kinds = [
        ("tp", [list(range(c * tp, (c + 1) * tp)) for c in range(cp)]),
        ("cp", [list(range(t, world_size, tp)) for t in range(tp)]),
    ]
    return [(name, parts) for name, parts in kinds if len(parts[0]) > 1]
