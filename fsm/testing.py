"""Drive instances along generated paths and check that terminal paths release everything.

Use it in a machine's tests to reach every declared transition and (state, event) pair
with real resources::

    from terminus.fsm.testing import drive_machine

    def make():                      # a fresh instance owning real resources
        req = DisaggReq(BOUND, key="rid")
        ledger.acquire(req, "kv", kv_pool.alloc(4))
        return req

    def arrange(req, step):          # build the event so that step.alt is taken
        if step.event is ChunkResult:
            return ChunkResult(chunk=0, last=step.guard == "last_chunk")
        if step.event is Abort:
            req.in_flight = 1 if step.guard == "chunks_in_flight" else 0
            return Abort()
        return step.event()

    summary = drive_machine(BOUND, make, arrange)   # raises AssertionError on failures
    kv_pool.assert_full(); ledger.assert_empty()

`arrange(instance, step)` gets every `fsm.paths.Step` before it is fired: set the
instance's data and build the event so the step's alternative is taken (`step.guard`
must hold and the guards of earlier alternatives of the cell must not). It may also
acquire resources through the ledger.

For each path the helper checks that the instance is in `step.source` before each step,
that the engine took exactly alternative `step.alt` (an error step must raise
`TransitionNotAllowed`), and, at each transition into a terminal state, that everything
the instance owned just before it was released by that transition (`report.released`)
and the ledger holds nothing owned by it afterwards. With `complete=True` (the default)
every path is extended to a terminal state, so every path ends with that check and
leaves nothing owned.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import observe
from .errors import TransitionNotAllowed
from .machine import Instance, Machine
from .paths import Path, Step, complete, covering_paths
from .plan import PlanReport


@dataclass
class DriveSummary:
    """What `drive_paths` did: counts, and one line per failed path."""

    paths: int = 0
    steps: int = 0
    terminal_paths: int = 0
    released: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every path was driven as intended."""
        return not self.failures

    def __str__(self) -> str:
        return (f"{self.paths} paths, {self.steps} steps, {self.terminal_paths} ended in a "
                f"terminal state, {self.released} handles released, "
                f"{len(self.failures)} failed")


class _Spy:
    """A recorder that notes each decision and passes it on (to the coverage plugin)."""

    def __init__(self, inner: observe.Recorder | None) -> None:
        self.inner = inner
        self.seen: list[tuple[Machine, int, int, int]] = []

    def record(self, machine: Machine, source: int, event: int, alt: int) -> None:
        self.seen.append((machine, source, event, alt))
        if self.inner is not None:
            self.inner.record(machine, source, event, alt)

    def record_counts(self, machine: Machine,
                      counts: Mapping[tuple[int, int, int], int]) -> None:
        if self.inner is not None:
            self.inner.record_counts(machine, counts)


def _drive(path: Path, make: Callable[[], Instance],
           arrange: Callable[[Instance, Step], Any], extend: bool, spy: _Spy,
           summary: DriveSummary) -> str | None:
    inst = make()
    m = inst.machine
    ledger = m.ledger
    steps = complete(m, path).steps if extend else path.steps
    for i, step in enumerate(steps):
        where = f"step {i + 1} ({step})"
        if inst.state != step.source:
            return f"{where}: the instance is in {inst.state!r}, not {step.source!r}"
        try:
            ev = arrange(inst, step)
        except Exception as exc:
            return f"{where}: arrange raised {exc!r}"
        if type(ev) is not step.event:
            return (f"{where}: arrange returned {ev!r}; it must return a "
                    f"{step.event.__name__} event")
        owned = list(ledger.owned(inst)) if ledger is not None else []
        spy.seen.clear()
        report = None
        try:
            report = inst.fire(ev)
        except TransitionNotAllowed as exc:
            if step.decision != "error":
                return f"{where}: raised {exc}"
        except Exception as exc:
            return f"{where}: raised {exc!r}"
        else:
            if step.decision == "error":
                return f"{where}: the event was accepted; the step expects an error"
        summary.steps += 1
        mine = next(((s, e, k) for (mm, s, e, k) in spy.seen if mm is m), None)
        want = (m.state_id(step.source), m.event_id(step.event), step.alt)
        if mine != want:
            got = "no decision" if mine is None else f"alternative {mine[2]}"
            need = (f"guard {step.guard!r} hold" if step.guard else "no guard hold") + \
                " (and no guard of an earlier alternative)"
            return (f"{where}: the engine took {got}, not alternative {step.alt}; make "
                    f"arrange() make {need}")
        if step.decision == "transition" and inst.terminal:
            if not isinstance(report, PlanReport):
                return f"{where}: entering terminal {inst.state!r} returned {report!r}"
            rel = {id(h) for h in report.released}
            kept = [h for h in owned if id(h) not in rel]
            if kept:
                return f"{where}: the terminal transition did not release {kept!r}"
            left = ledger.owned(inst) if ledger is not None else []
            if left:
                return f"{where}: the instance still owns {left!r} after its terminal step"
            summary.released += len(report.released)
            summary.terminal_paths += 1
    return None


def drive_paths(paths: Iterable[Path], make: Callable[[], Instance],
                arrange: Callable[[Instance, Step], Any], *, complete: bool = True,
                check: bool = True) -> DriveSummary:
    """Drive a fresh instance from `make()` along each path (see the module docstring).

    `complete`: extend each path to a terminal state first (`fsm.paths.complete`).
    `check`: raise AssertionError listing every failed path after driving them all;
    otherwise the failures are only in the returned summary.
    """
    summary = DriveSummary()
    spy = _Spy(observe.recorder())
    previous = observe.set_recorder(spy)
    try:
        for p in paths:
            summary.paths += 1
            problem = _drive(p, make, arrange, complete, spy, summary)
            if problem is not None:
                summary.failures.append(f"path to {p.goal} [{p}]: {problem}")
    finally:
        observe.set_recorder(previous)
    if check and summary.failures:
        raise AssertionError(f"{len(summary.failures)} of {summary.paths} paths failed:\n  "
                             + "\n  ".join(summary.failures))
    return summary


def drive_machine(machine: Machine, make: Callable[[], Instance],
                  arrange: Callable[[Instance, Step], Any], **kwargs: bool) -> DriveSummary:
    """`drive_paths(covering_paths(machine), ...)`: every transition and every pair."""
    return drive_paths(covering_paths(machine), make, arrange, **kwargs)
