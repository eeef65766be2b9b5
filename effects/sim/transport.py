"""An in-memory KV sender for the simulator and the tests: it fails on cue.

`FakeTransport` implements `terminus.effects.transport.Transport`, records every call and
can be told to fail any step, for every request or for some, once or always.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch

from terminus.effects.transport import Poll, TransportError

__all__ = ["STEPS", "FakeTransport"]

STEPS = ("bootstrap", "init", "send", "poll", "abort")
"""The sender steps a `FakeTransport` can be told to fail."""


class FakeTransport:
    """An in-memory sender. `fail(step, rids=None, times=None)` arms a fault.

    `rids=None` arms it for every request; `times=None` keeps it armed, an int fails
    that many calls. `complete(rid)` / `break_transfer(rid)` decide what `poll` says for
    a transfer in flight; `auto_complete=True` makes every sent transfer succeed at its
    first poll. `calls` lists every (step, rid); `aborts`, `sends` count per rid.
    """

    def __init__(self, *, auto_complete: bool = False) -> None:
        self.auto_complete = auto_complete
        self.calls: list[tuple[str, str]] = []
        self.aborts: Counter[str] = Counter()
        self.sends: Counter[str] = Counter()
        self.sent_tokens: Counter[str] = Counter()
        # Armed faults by step: those for every request, and those for some, by rid.
        # Each is [calls left (None: always), the order it was armed in]; one whose
        # count ran out is dropped, so a call looks at what can still fire for its rid
        # only, however many faults a long run armed and used up.
        self._any: dict[str, list[list[int | None]]] = {}
        self._by_rid: dict[str, dict[str, list[list[int | None]]]] = {}
        self._armed = 0
        self._transfers: dict[str, Poll] = {}

    def fail(self, step: str, rids: Iterable[str] | str | None = None,
             times: int | None = None) -> None:
        """Make `step` raise `TransportError` for `rids` (all when None), `times` times."""
        if step not in STEPS:
            raise ValueError(f"FakeTransport.fail: unknown step {step!r}; "
                             f"use one of {', '.join(STEPS)}")
        if times is not None and times < 1:
            raise ValueError(f"FakeTransport.fail: times must be >= 1 or None, got {times}")
        self._armed += 1
        if rids is None:
            self._any.setdefault(step, []).append([times, self._armed])
            return
        by_rid = self._by_rid.setdefault(step, {})
        # One count shared by every rid it names (`times` failures in all).
        fault: list[int | None] = [times, self._armed]
        for rid in frozenset([rids] if isinstance(rids, str) else rids):
            by_rid.setdefault(rid, []).append(fault)

    def heal(self, step: str | None = None) -> None:
        """Disarm the faults of `step` (all steps when None)."""
        for armed in (self._any, self._by_rid):
            if step is None:
                armed.clear()
            else:
                armed.pop(step, None)

    def _call(self, step: str, rid: str) -> None:
        self.calls.append((step, rid))
        by_rid = self._by_rid.get(step)
        mine = by_rid.get(rid) if by_rid else None
        every = self._any.get(step)
        if not mine and not every:
            return
        faults = (every or []) + (mine or [])
        if every and mine:
            faults.sort(key=lambda f: f[1] or 0)  # the one armed first fires first
        for fault in faults:
            left = fault[0]
            if left is not None:
                if left <= 0:
                    continue  # used up (by another rid it names)
                fault[0] = left - 1
                if left == 1:  # used up now: no later call looks at it
                    for lst in (every, mine):
                        if lst is not None and fault in lst:
                            lst.remove(fault)
                    if by_rid is not None and mine is not None and not mine:
                        del by_rid[rid]
            raise TransportError(f"injected {step} failure for {rid!r}")

    def bootstrap(self, rid: str) -> None:
        """Handshake; fails when armed."""
        self._call("bootstrap", rid)

    def init(self, rid: str, num_kv: int, metadata_index: int) -> None:
        """Announce sizes; fails when armed, or for a metadata index of -1 (none)."""
        self._call("init", rid)
        if metadata_index < 0:
            raise TransportError(f"init for {rid!r} without a metadata slot (index -1)")

    def send(self, rid: str, kv_indices: torch.Tensor) -> None:
        """Start a transfer; fails when armed."""
        self._call("send", rid)
        self.sends[rid] += 1
        self.sent_tokens[rid] += int(kv_indices.numel())
        self._transfers[rid] = Poll.SUCCESS if self.auto_complete else Poll.TRANSFERRING

    def poll(self, rid: str) -> Poll:
        """The transfer's state; an armed poll fault reports FAILED."""
        try:
            self._call("poll", rid)
        except TransportError:
            return Poll.FAILED
        return self._transfers.get(rid, Poll.FAILED)

    def poll_state(self, rid: str) -> Poll | None:
        """What the transfer of `rid` is now (None: never sent), without polling: no
        call is recorded and no armed poll fault fires."""
        return self._transfers.get(rid)

    def complete(self, rid: str) -> None:
        """Make the transfer of `rid` succeed at its next poll."""
        self._transfers[rid] = Poll.SUCCESS

    def break_transfer(self, rid: str) -> None:
        """Make the transfer of `rid` fail at its next poll."""
        self._transfers[rid] = Poll.FAILED

    def abort(self, rid: str) -> None:
        """Count the abort; fails (after counting) when armed. A transfer still in flight
        stops: the next `poll` says ABORTED (a failed abort leaves it running)."""
        self.aborts[rid] += 1
        self._call("abort", rid)
        if self._transfers.get(rid) is Poll.TRANSFERRING:
            self._transfers[rid] = Poll.ABORTED
