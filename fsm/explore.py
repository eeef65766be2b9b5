"""Bounded exhaustive exploration of a scenario: every ordering of its actors' events.

The explorer knows nothing of LLM serving. A *scenario* builds *worlds*; a world is the
real thing under test (drivers, machines, ledger, pools, fakes of the outside) plus the
scenario's view of it::

    world.enabled()      -> the Steps that can happen now (each: actor, name, footprint)
    world.fire(step)     -> let it happen (the real driver code runs)
    world.key()          -> a canonical, hashable summary: worlds with equal keys behave
                            alike from here on (machine states, who owns what, pool
                            occupancy as counts, pending calls, sticky violation counts)
    world.check()        -> invariants that must hold after every step: [(name, detail)]
    world.check_final()  -> invariants that must hold at quiescence (no step enabled)
    world.close()        -> optional: free what the world holds (an event loop, say)

`explore(scenario)` runs a depth-first search over the enabled steps from
`scenario.build()`. A world that cannot be copied (coroutines, generators, torch pools)
is *rebuilt by replay*: the search keeps the path of steps and, to try a sibling, builds
a fresh world and fires the path again. Worlds are deduplicated by `key()`; the first
path found to a world that breaks an invariant is kept as its counterexample, and the
search goes on past that world (cutting there would lose worlds the reduction counts on
reaching through it). After the search, every violated invariant's
counterexample is shortened by a breadth-first search from the initial world (bounded
by the length of the one found, deduplicated, without reduction), so the reported one is
a shortest sequence of steps that breaks it.

Partial-order reduction (sleep sets, Godefroid 1996)
----------------------------------------------------
Two steps are *independent* when their footprints (`Step.touches`, plus the actor
itself) are disjoint. The scenario promises that a step's footprint names everything
the step reads or writes, its enabling condition included. Then, in any world where
both are enabled, firing one neither enables nor disables the other, and firing them in
either order leads to the same world: they commute.

The search keeps with each world a *sleep set*: steps already explored from an earlier
sibling whose every continuation the current branch would only repeat in another order.
At a world with sleep set S, the steps in enabled - S are explored in order; the child
reached by step t inherits {u in S + (steps explored before t) : u independent of t}.
A step in the sleep set is skipped: any world it leads to is reached by the sibling
branch that explored it first, with the commuting steps in the other order.

Soundness for the properties checked here: sleep sets prune *transitions*, never
*worlds* -- every world reachable from the initial one is still visited (Godefroid's
thesis, theorem 5.2: the sleep-set search visits every reachable state). Every
invariant here is a property of a world: a per-step fact (a release outside a terminal
transition, a release twice) is recorded in the world as a sticky count that `key()`
includes, so it is a world property too. With worlds deduplicated by key, the sleep
set of the first visit is stored; a later visit with sleep set S' explores again only
the steps that were asleep the first time and are awake now (stored - S'), and the
stored set becomes the intersection of the two. That is the standard repair that keeps
sleep sets sound under state caching (no world is lost because its first visit happened to sleep the
step that reaches it). A quiescent world (nothing enabled) is reached either way, so
the quiescence invariants are checked on every quiescent world too.

The argument rests on the footprints being true. `check_independence(scenario)` tests
them: in the first worlds it reaches, every enabled pair declared independent must stay
enabled after the other and reach equal keys in both orders. `tests/test_explore.py`
checks the reduction on a toy model with a known bug (same violations and same worlds
with and without it, fewer transitions with it) and that `check_independence` catches a
footprint that lies; the serving scenarios' tests compare the violations the naive
baselines yield both ways and run `check_independence` on each scenario.

`replay(scenario, labels)` fires a recorded counterexample again and reports what each
step broke; `mermaid(actors, steps, ...)` renders one as a sequence diagram, one
lifeline per actor.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "Counterexample",
    "ExploreReport",
    "ReplayError",
    "Scenario",
    "Step",
    "World",
    "check_independence",
    "explore",
    "mermaid",
    "parse_steps",
    "replay",
    "shortest",
]


@dataclass(frozen=True)
class Step:
    """One thing that can happen: `actor` does `name`.

    `touches`: the names of everything the step reads or writes (its enabling condition
    included); steps of different actors with disjoint footprints commute (see the
    module docstring). `None` means "everything": dependent on every other step.
    `to`: the actor the step is addressed to, for the sequence diagram (an arrow
    `actor ->> to`); None draws a note over `actor`.
    """

    actor: str
    name: str
    touches: frozenset[str] | None = None
    to: str | None = None

    @property
    def label(self) -> str:
        """`actor: name`, the step's identity in counterexamples and replay files."""
        return f"{self.actor}: {self.name}"

    def independent(self, other: Step) -> bool:
        """True when the two steps commute (different actors, disjoint footprints)."""
        if self.actor == other.actor or self.touches is None or other.touches is None:
            return False
        return self.touches.isdisjoint(other.touches)


Violation = tuple[str, str]
"""(invariant name, detail)."""


@runtime_checkable
class World(Protocol):
    """What a scenario builds: see the module docstring."""

    def enabled(self) -> Sequence[Step]: ...

    def fire(self, step: Step) -> None: ...

    def key(self) -> Hashable: ...

    def check(self) -> list[Violation]: ...

    def check_final(self) -> list[Violation]: ...


@runtime_checkable
class Scenario(Protocol):
    """A named, bounded scenario: its actors (lifelines, in order) and a world builder."""

    @property
    def name(self) -> str: ...

    @property
    def actors(self) -> Sequence[str]: ...

    def build(self) -> World: ...


@dataclass
class Counterexample:
    """A sequence of steps from the initial world that breaks `invariant`."""

    invariant: str
    detail: str
    steps: list[Step]
    final: bool = False
    """True for an invariant checked at quiescence."""

    @property
    def labels(self) -> list[str]:
        """The steps' labels, as a replay file lists them."""
        return [s.label for s in self.steps]

    def numbered(self) -> str:
        """The steps as numbered lines, then what broke."""
        lines = [f"  {i}. {s.label}" for i, s in enumerate(self.steps, 1)]
        where = "at quiescence" if self.final else "after the last step"
        lines.append(f"  => {self.invariant} {where}: {self.detail}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """`invariant`, `steps` (labels), `detail`."""
        return {"invariant": self.invariant, "steps": self.labels, "detail": self.detail}


@dataclass
class ExploreReport:
    """What one exploration saw.

    `states`: distinct worlds (keys) visited; `transitions`: steps fired (replays not
    counted); `interleavings`: executions the search ran to an end (quiescence, a world
    already visited, a violation, or the bound); `exhaustive`: nothing was cut by the
    depth bound or the time limit; `violations`: one shortest counterexample per
    violated invariant.
    """

    scenario: str
    states: int = 0
    transitions: int = 0
    interleavings: int = 0
    replayed: int = 0
    """Steps fired again to rebuild worlds (the replay cost)."""
    quiescent: int = 0
    max_depth: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    """CPU time of this process during the search (wall `seconds` include waiting for
    a busy machine's cores)."""
    exhaustive: bool = True
    reduction: bool = True
    violations: list[Counterexample] = field(default_factory=list)

    @property
    def worlds_per_second(self) -> float:
        """Distinct worlds visited per second of search."""
        return self.states / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        """The report as the CLI writes it under `scenarios.<name>`."""
        return {
            "states": self.states,
            "interleavings": self.interleavings,
            "seconds": round(self.seconds, 3),
            "cpu_seconds": round(self.cpu_seconds, 3),
            "exhaustive": self.exhaustive,
            "violations": [v.to_json() for v in self.violations],
            "transitions": self.transitions,
            "replayed_steps": self.replayed,
            "quiescent": self.quiescent,
            "max_depth": self.max_depth,
            "reduction": self.reduction,
        }


class ReplayError(ValueError):
    """A replayed step is not enabled where the recording says it happened."""


# -- the search -------------------------------------------------------------------------


class _Rebuilder:
    """Gives the world at the end of a path: the current one, or a fresh one replayed."""

    def __init__(self, scenario: Scenario, report: ExploreReport) -> None:
        self.scenario = scenario
        self.report = report
        self.world: Any = None
        self.path: list[Step] | None = None

    def at(self, path: list[Step]) -> Any:
        if self.path is not None and self.path == path:
            return self.world
        self.discard()
        w = self.scenario.build()
        for s in path:
            w.fire(s)
        self.report.replayed += len(path)
        self.world, self.path = w, list(path)
        return w

    def fired(self, path: list[Step]) -> None:
        """The held world was stepped along `path` by the caller."""
        self.path = list(path)

    def discard(self) -> None:
        if self.world is not None:
            close = getattr(self.world, "close", None)
            if close is not None:
                close()
        self.world, self.path = None, None


def _world_checks(w: Any, enabled: Sequence[Step]) -> list[tuple[str, str, bool]]:
    """(invariant, detail, checked at quiescence) for every invariant `w` breaks."""
    bad = [(n, d, False) for n, d in w.check()]
    if not enabled:
        bad += [(n, d, True) for n, d in w.check_final()]
    return bad


def explore(
    scenario: Scenario,
    *,
    bound: int | None = None,
    time_limit: float | None = None,
    reduction: bool = True,
    shorten: bool = True,
    progress: Callable[[ExploreReport], None] | None = None,
) -> ExploreReport:
    """Every ordering of `scenario`'s steps, up to `bound` steps per run.

    `time_limit` (seconds) stops the search early (the report is then not
    exhaustive); `reduction` turns the sleep-set reduction on; `shorten` replaces each
    counterexample by a shortest one; `progress(report)` is called now and then.
    """
    report = ExploreReport(scenario.name, reduction=reduction)
    t0 = time.perf_counter()
    c0 = time.process_time()
    found: dict[str, Counterexample] = {}
    visited: dict[Hashable, frozenset[str]] = {}
    worlds = _Rebuilder(scenario, report)

    def out_of_time() -> bool:
        return time_limit is not None and time.perf_counter() - t0 > time_limit

    # Frame: (path, awake steps to explore, sleep set as {label: Step})
    w0 = worlds.at([])
    enabled0 = list(w0.enabled())
    visited[w0.key()] = frozenset()
    report.states = 1
    stack: list[tuple[list[Step], list[Step], dict[str, Step]]] = []
    for name, detail, final in _world_checks(w0, enabled0):
        found.setdefault(name, Counterexample(name, detail, [], final))
    if not enabled0:
        report.quiescent = 1
        report.interleavings = 1
    else:
        stack.append(([], enabled0, {}))
    calls = 0
    try:
        while stack:
            path, todo, sleep = stack[-1]
            if not todo:
                stack.pop()
                continue
            if out_of_time():
                report.exhaustive = False
                break
            step = todo.pop(0)
            child_sleep = ({k: s for k, s in sleep.items() if s.independent(step)}
                           if reduction else {})
            if reduction:
                sleep[step.label] = step
            w = worlds.at(path)
            w.fire(step)
            child = [*path, step]
            worlds.fired(child)
            report.transitions += 1
            report.max_depth = max(report.max_depth, len(child))
            calls += 1
            if progress is not None and calls % 64 == 0:
                report.seconds = time.perf_counter() - t0
                progress(report)
            enabled = list(w.enabled())
            for name, detail, final in _world_checks(w, enabled):
                if name not in found or len(found[name].steps) > len(child):
                    found[name] = Counterexample(name, detail, child, final)
            k = w.key()
            slept = frozenset(child_sleep)
            if k in visited:
                before = visited[k]
                wake = before - slept
                if not wake:
                    report.interleavings += 1
                    continue
                # Steps asleep at the first visit but awake now must be explored here.
                visited[k] = before & slept
                awake = [s for s in enabled if s.label in wake]
            else:
                visited[k] = slept
                report.states += 1
                if not enabled:
                    report.quiescent += 1
                awake = [s for s in enabled if s.label not in slept]
            if not enabled:
                report.interleavings += 1
                continue
            if bound is not None and len(child) >= bound:
                report.exhaustive = False
                report.interleavings += 1
                continue
            if not awake:
                report.interleavings += 1
                continue
            stack.append((child, awake, dict(child_sleep)))
    finally:
        worlds.discard()
    report.seconds = time.perf_counter() - t0
    cexs = sorted(found.values(), key=lambda c: (len(c.steps), c.invariant))
    if shorten and cexs:
        remaining = None if time_limit is None else max(1.0, time_limit - report.seconds)
        cexs = [shortest(scenario, c, time_limit=remaining) for c in cexs]
        report.seconds = time.perf_counter() - t0
    report.cpu_seconds = time.process_time() - c0
    report.violations = cexs
    if progress is not None:
        progress(report)
    return report


def shortest(scenario: Scenario, cex: Counterexample, *,
             time_limit: float | None = None) -> Counterexample:
    """A shortest counterexample of `cex.invariant`: breadth-first from the initial world,
    no deeper than `cex`, worlds deduplicated; `cex` itself when none is shorter (or
    the time runs out)."""
    t0 = time.perf_counter()
    if len(cex.steps) <= 1:
        return cex
    rep = ExploreReport(scenario.name)
    worlds = _Rebuilder(scenario, rep)
    try:
        w = worlds.at([])
        seen = {w.key()}
        frontier: list[tuple[list[Step], list[Step]]] = [([], list(w.enabled()))]
        for _depth in range(len(cex.steps) - 1):
            nxt: list[tuple[list[Step], list[Step]]] = []
            for path, enabled in frontier:
                for step in enabled:
                    if time_limit is not None and time.perf_counter() - t0 > time_limit:
                        return cex
                    w = worlds.at(path)
                    w.fire(step)
                    child = [*path, step]
                    worlds.fired(child)
                    en = list(w.enabled())
                    for name, detail, final in _world_checks(w, en):
                        if name == cex.invariant:
                            return Counterexample(name, detail, child, final)
                    k = w.key()
                    if k in seen:
                        continue
                    seen.add(k)
                    if en:
                        nxt.append((child, en))
            frontier = nxt
            if not frontier:
                break
    finally:
        worlds.discard()
    return cex


# -- replay and rendering -----------------------------------------------------------------


def parse_steps(text: str) -> list[str]:
    """Step labels from a counterexample file: a JSON object with `steps` (or a list of
    labels), or text with one `actor: name` per line (`3. ` numbering and `#` comments
    allowed)."""
    import json

    s = text.strip()
    if s.startswith(("{", "[")):
        obj = json.loads(s)
        steps = obj.get("steps") if isinstance(obj, dict) else obj
        if not isinstance(steps, list) or not all(isinstance(x, str) for x in steps):
            raise ReplayError("a JSON counterexample needs \"steps\": a list of "
                              "\"actor: name\" strings")
        return list(steps)
    out = []
    for line in s.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("=>"):
            continue
        head, dot, rest = line.partition(". ")
        if dot and head.isdigit():
            line = rest.strip()
        out.append(line)
    return out


def replay(scenario: Scenario, labels: Iterable[str]) -> list[tuple[Step, list[Violation]]]:
    """Fire the steps named by `labels` from a fresh world; per step, what it broke.

    The last entry's violations include the quiescence invariants when nothing is
    enabled after it. Raises `ReplayError` naming the step that is not enabled.
    """
    w = scenario.build()
    out: list[tuple[Step, list[Violation]]] = []
    try:
        labels = list(labels)
        for i, label in enumerate(labels, 1):
            enabled = list(w.enabled())
            match = [s for s in enabled if s.label == label]
            if not match:
                names = ", ".join(s.label for s in enabled) or "nothing"
                raise ReplayError(f"step {i} {label!r} is not enabled in scenario "
                                  f"{scenario.name!r} here; enabled: {names}")
            w.fire(match[0])
            en = list(w.enabled())
            bad = list(w.check())
            if i == len(labels) and not en:
                bad += list(w.check_final())
            out.append((match[0], bad))
    finally:
        close = getattr(w, "close", None)
        if close is not None:
            close()
    return out


def _mermaid_id(actor: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in actor) or "_"


def mermaid(actors: Sequence[str], steps: Sequence[Step], *, title: str = "",
            broke: str = "") -> str:
    """A Mermaid sequence diagram of `steps`, one lifeline per actor, numbered."""
    lines = ["sequenceDiagram", "    autonumber"]
    if title:
        lines.insert(1, f"    title {title}")
    names = list(actors)
    for s in steps:
        for a in (s.actor, s.to):
            if a is not None and a not in names:
                names.append(a)
    for a in names:
        lines.append(f"    participant {_mermaid_id(a)} as {a}")
    for s in steps:
        text = s.name.replace(";", ",").replace("#", "")
        if s.to is not None and s.to != s.actor:
            lines.append(f"    {_mermaid_id(s.actor)}->>{_mermaid_id(s.to)}: {text}")
        else:
            lines.append(f"    {_mermaid_id(s.actor)}->>{_mermaid_id(s.actor)}: {text}")
    if broke:
        first, last = _mermaid_id(names[0]), _mermaid_id(names[-1])
        over = first if first == last else f"{first},{last}"
        lines.append(f"    Note over {over}: {broke.replace(';', ',').replace('#', '')}")
    return "\n".join(lines) + "\n"


def check_independence(scenario: Scenario, *, max_worlds: int = 200,
                       bound: int | None = None) -> list[str]:
    """Test the footprints a scenario declares: in up to `max_worlds` worlds (breadth
    first), every pair of enabled steps declared independent must commute -- each stays
    enabled after the other, and both orders reach worlds with equal keys. Returns one
    line per pair that does not (empty: no counterexample to the declared independence).
    """
    problems: list[str] = []
    rep = ExploreReport(scenario.name)
    worlds = _Rebuilder(scenario, rep)
    try:
        w = worlds.at([])
        seen = {w.key()}
        frontier: list[list[Step]] = [[]]
        visited = 0
        while frontier and visited < max_worlds:
            path = frontier.pop(0)
            visited += 1
            enabled = list(worlds.at(path).enabled())
            for i, a in enumerate(enabled):
                for b in enabled[i + 1:]:
                    if not a.independent(b):
                        continue
                    ends: list[Hashable | None] = []
                    for x, y in ((a, b), (b, a)):
                        w = worlds.at(path)
                        w.fire(x)
                        worlds.fired([*path, x])
                        if y.label not in {s.label for s in w.enabled()}:
                            problems.append(f"after {[s.label for s in path]}: {x.label!r} "
                                            f"disables {y.label!r}")
                            ends.append(None)
                            break
                        w.fire(y)
                        worlds.fired([*path, x, y])
                        ends.append(w.key())
                    if len(ends) == 2 and ends[0] != ends[1]:
                        problems.append(f"after {[s.label for s in path]}: {a.label!r} and "
                                        f"{b.label!r} do not commute")
            if bound is not None and len(path) >= bound:
                continue
            for s in enabled:
                w = worlds.at(path)
                w.fire(s)
                worlds.fired([*path, s])
                k = w.key()
                if k not in seen:
                    seen.add(k)
                    frontier.append([*path, s])
    finally:
        worlds.discard()
    return problems
