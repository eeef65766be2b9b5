"""Observing transitions: trace sinks per machine and one process-wide recorder.

Nothing here costs anything while nobody observes: a machine with no sink and no
recorder runs its fast table; attaching either switches every affected machine to the
table whose every cell goes through the observed path (`Observed.on_recorder_change`).
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Mapping
from typing import Any, Protocol

import msgspec

Machine = Any  # a `fsm.Machine`: this module sits below it and only passes it along


class Stats:
    """Counters a machine keeps off the fast path: ignores, plan runs, effect errors."""

    __slots__ = ("effect_errors", "ignored", "plans_run")

    def __init__(self) -> None:
        self.ignored: Counter[tuple[str, str]] = Counter()
        self.plans_run: Counter[str] = Counter()
        self.effect_errors = 0


class TransitionRecord(msgspec.Struct, frozen=True, gc=False):
    """One decision of one instance: a transition, an ignore or an error.

    `instance` is the instance's key (or its index in a batch, or its id() when it has
    no key); `t` is `time.monotonic()` seconds; `plan` is the release plan run, if any.
    """

    machine: str
    instance: Any
    source: str
    event: str
    target: str
    decision: str
    plan: str | None
    t: float


class Recorder(Protocol):
    """Receives every decision of every machine while attached (the coverage plugin).

    `alt` is the index of the alternative taken in the (state, event) cell, or -1 when
    no guarded alternative held (an error).
    """

    def record(self, machine: Machine, source: int, event: int, alt: int) -> None: ...

    def record_counts(self, machine: Machine, counts: Mapping[tuple[int, int, int], int]) -> None:
        """Counts of (source, event, alt) from one batched step."""
        ...


class Observed(Protocol):
    """A machine that switches tables when the recorder is attached or detached."""

    def on_recorder_change(self) -> None: ...


_machines: weakref.WeakSet[Observed] = weakref.WeakSet()
_recorder: Recorder | None = None


def recorder() -> Recorder | None:
    """The attached process-wide recorder, if any."""
    return _recorder


def set_recorder(rec: Recorder | None) -> Recorder | None:
    """Attach `rec` to every machine (None detaches); returns the previous recorder."""
    global _recorder
    prev, _recorder = _recorder, rec
    for m in list(_machines):
        m.on_recorder_change()
    return prev


def register(machine: Observed) -> None:
    """Called by the engine for every machine object it creates."""
    _machines.add(machine)
