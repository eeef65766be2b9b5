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
    """Counters a machine keeps: ignores, plan runs, effect errors.

    `plans_run` is a Counter of plan name -> runs. The engine counts a scalar plan run
    in a list slot indexed by plan (`_runs`, names in `_names`), which is cheaper than a
    Counter's `+=`; reading `plans_run` folds those counts into the Counter first, so a
    Counter held across later transitions is up to date only after the next read.
    """

    __slots__ = ("_names", "_plans_run", "_runs", "effect_errors", "ignored")

    def __init__(self, plan_names: tuple[str, ...] = ()) -> None:
        self.ignored: Counter[tuple[str, str]] = Counter()
        self._plans_run: Counter[str] = Counter()
        self._names = plan_names
        self._runs = [0] * len(plan_names)
        self.effect_errors = 0

    @property
    def plans_run(self) -> Counter[str]:
        """Release plans run, by name (scalar instances and batched rows)."""
        runs = self._runs
        for i, n in enumerate(runs):
            if n:
                self._plans_run[self._names[i]] += n
                runs[i] = 0
        return self._plans_run


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

    A recorder that only counts may also define `cell_counter(machine, source, event, alt)
    -> list[int] | None`: asked once per compiled cell alternative while attached, it
    returns a one-slot list the engine adds 1 to for each such decision instead of
    calling `record` (None: call `record`). Decisions on the general path (errors,
    guards none of which held, cells not compiled) and batched steps still come through
    `record` and `record_counts`.
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
