"""Transition coverage: which declared transitions and (state, event) pairs ran.

`CoverageRecorder` is the process-wide recorder (`fsm.observe.set_recorder`) the pytest
plugin attaches with `--fsm-coverage`; `report()` turns what it saw into a
`CoverageReport` (msgspec, written as the JSON report).

Definitions, per machine:

- declared transitions: every alternative of every cell whose decision is a transition,
  i.e. each (state, event, alt) edge of the diagram; covered when that alternative was
  taken at least once.
- declared pairs: every (state, event) cell; covered when any decision was made there
  (a transition, an ignore, or an error, including "no guard held").
- terminal states reached: terminal states some covered transition entered.
- percent: 100 * covered / declared (100 when nothing is declared). A machine's score is
  the minimum of its transition and pair percentages; `--fsm-coverage-fail-under N`
  fails when any gated machine scores below N.
- gated machines: the registered ones (the pytest plugin registers the user's
  `terminus.machines` entry points, or `--fsm-coverage-machines`) when there are any,
  else every machine seen. Machines learned as `hidden` (the library's own, in a user's
  project) are left out of the report unless registered.
- tests of a decision (`contexts=True`): the pytest node ids during which each
  (state, event, alt) decision was made, from `CoverageRecorder.context`.

Coverage is keyed by machine name (bound copies share their machine's name and
tables). Two different declarations under one name are kept apart: the registered one
keeps the name, the others get `NAME-<digest>` (8 hex digits of their shape).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping
from typing import Any

import msgspec

from .diagram import MachineDiagram, Marks, extract
from .machine import Machine


class TransitionRef(msgspec.Struct, frozen=True):
    """A declared transition: alternative `alt` of the (source, event) cell."""

    source: str
    event: str
    alt: int
    target: str
    guard: str | None = None
    plan: str | None = None

    def __str__(self) -> str:
        guard = f" [{self.guard}]" if self.guard else ""
        plan = f" / {self.plan}" if self.plan else ""
        return f"{self.source} --{self.event}{guard}{plan}--> {self.target} (alt {self.alt})"


class PairRef(msgspec.Struct, frozen=True):
    """A declared (state, event) cell."""

    state: str
    event: str

    def __str__(self) -> str:
        return f"({self.state}, {self.event})"


class TransitionCoverage(msgspec.Struct):
    """Declared transitions covered; `missing` lists the ones never taken."""

    covered: int
    declared: int
    percent: float
    missing: list[TransitionRef]


class PairCoverage(msgspec.Struct):
    """(state, event) pairs exercised; `missing` lists the ones never exercised."""

    covered: int
    declared: int
    percent: float
    missing: list[PairRef]


class TerminalCoverage(msgspec.Struct):
    """Terminal states entered by some covered transition."""

    reached: list[str]
    declared: list[str]
    missing: list[str]


class MachineCoverage(msgspec.Struct):
    """One machine's coverage; `score` = min(transitions.percent, pairs.percent)."""

    states: int
    events: int
    registered: bool
    gated: bool
    score: float
    transitions: TransitionCoverage
    pairs: PairCoverage
    terminals: TerminalCoverage
    decisions: dict[str, int]


class CoverageReport(msgspec.Struct):
    """The session's report: `machines.<name>.{transitions,pairs}.{covered,declared}`..."""

    machines: dict[str, MachineCoverage]
    fail_under: float | None = None
    passed: bool = True
    below: list[str] = msgspec.field(default_factory=list)


def _percent(covered: int, declared: int) -> float:
    return 100.0 if declared == 0 else round(100.0 * covered / declared, 2)


def _digest(d: MachineDiagram) -> str:
    return hashlib.sha256(msgspec.json.encode(d)).hexdigest()[:16]


class CoverageRecorder:
    """Counts every decision of every machine (a `fsm.observe.Recorder`).

    `record` costs a dict lookup and a counter increment; a machine's diagram data is
    extracted once per distinct table object.
    """

    def __init__(self) -> None:
        self._by_cells: dict[int, tuple[Any, str]] = {}  # id(cells) -> (cells, digest)
        self.shapes: dict[str, MachineDiagram] = {}
        self.hits: dict[str, Counter[tuple[int, int, int]]] = {}
        self.registered: set[str] = set()
        self.hidden: set[str] = set()
        self.context: str | None = None
        """The current test's id (set by the plugin); while set, `tests` records it."""
        self.tests: dict[str, dict[tuple[int, int, int], set[str]]] = {}
        """shape digest -> (source, event, alt) -> the contexts that decision ran in."""

    def learn(self, m: Machine, *, registered: bool = False, hidden: bool = False) -> str:
        """Note machine `m` as declared (and registered, or hidden from the report unless
        registered); returns its shape digest."""
        known = self._by_cells.get(id(m.cells))
        if known is not None and known[0] is m.cells:
            key = known[1]
        else:
            d = extract(m)
            key = _digest(d)
            # Holding the cells keeps their id from being reused by another machine.
            self._by_cells[id(m.cells)] = (m.cells, key)
            self.shapes.setdefault(key, d)
            self.hits.setdefault(key, Counter())
        if registered:
            self.registered.add(key)
        if hidden:
            self.hidden.add(key)
        return key

    def record(self, machine: Machine, source: int, event: int, alt: int) -> None:
        """One decision of a scalar instance (see `fsm.observe.Recorder`)."""
        known = self._by_cells.get(id(machine.cells))
        key = known[1] if known is not None and known[0] is machine.cells \
            else self.learn(machine)
        cell = (source, event, alt)
        self.hits[key][cell] += 1
        if self.context is not None:
            self.tests.setdefault(key, {}).setdefault(cell, set()).add(self.context)

    def record_counts(self, machine: Machine,
                      counts: Mapping[tuple[int, int, int], int]) -> None:
        """Decisions of one batched step."""
        key = self.learn(machine)
        hits = self.hits[key]
        for cell, n in counts.items():
            hits[cell] += n
        if self.context is not None:
            tests = self.tests.setdefault(key, {})
            for cell in counts:
                tests.setdefault(cell, set()).add(self.context)

    # -- between processes (pytest-xdist) ------------------------------------------

    def export(self) -> str:
        """Everything recorded, as a JSON string (what an xdist worker sends back)."""
        return msgspec.json.encode({
            "shapes": self.shapes,
            "hits": {k: [[s, e, a, n] for (s, e, a), n in sorted(c.items())]
                     for k, c in self.hits.items()},
            "registered": sorted(self.registered),
            "tests": {k: [[s, e, a, sorted(ids)] for (s, e, a), ids in sorted(c.items())]
                      for k, c in self.tests.items()},
        }).decode()

    def merge(self, data: str) -> None:
        """Add what another process recorded (the string from its `export()`)."""
        obj = msgspec.json.decode(data)
        for key, shape in obj["shapes"].items():
            self.shapes.setdefault(key, msgspec.convert(shape, MachineDiagram))
            self.hits.setdefault(key, Counter())
        for key, rows in obj["hits"].items():
            c = self.hits[key]
            for s, e, a, n in rows:
                c[(s, e, a)] += n
        self.registered.update(obj["registered"])
        for key, rows in obj.get("tests", {}).items():
            tests = self.tests.setdefault(key, {})
            for s, e, a, ids in rows:
                tests.setdefault((s, e, a), set()).update(ids)

    # -- the report --------------------------------------------------------------------

    def names(self) -> dict[str, str]:
        """Report name of each shape digest (see the module docstring), sorted by name;
        hidden machines that are not registered are left out."""
        by_name: dict[str, list[str]] = {}
        for key, d in self.shapes.items():
            if key in self.hidden and key not in self.registered:
                continue
            by_name.setdefault(d.name, []).append(key)
        out: dict[str, str] = {}
        for name, keys in by_name.items():
            reg = sorted(k for k in keys if k in self.registered)
            for k in keys:
                out[k] = name if len(keys) == 1 or (reg and k == reg[0]) else f"{name}-{k[:8]}"
        return dict(sorted(out.items(), key=lambda kv: kv[1]))

    def marks(self) -> dict[str, Marks]:
        """Coverage overlays for `fsm.diagram`, by report name."""
        out: dict[str, Marks] = {}
        for key, name in self.names().items():
            d = self.shapes[key]
            hits = self.hits[key]
            edges = frozenset((d.states[s].name, d.events[e], a) for (s, e, a) in hits
                              if a >= 0)
            pairs = frozenset((d.states[s].name, d.events[e]) for (s, e, _) in hits)
            out[name] = Marks(edges, pairs)
        return out

    def diagrams(self) -> dict[str, MachineDiagram]:
        """Diagram data by report name (renamed where two declarations share a name)."""
        return {name: msgspec.structs.replace(self.shapes[key], name=name)
                for key, name in self.names().items()}

    def report(self, fail_under: float | None = None) -> CoverageReport:
        """The coverage of every machine seen or registered; see the module docstring."""
        names = self.names()
        gate_all = not self.registered
        machines: dict[str, MachineCoverage] = {}
        below = []
        for key, name in names.items():
            d = self.shapes[key]
            hits = self.hits[key]
            taken = {(s, e, a) for (s, e, a) in hits if a >= 0}
            sid = {st.name: i for i, st in enumerate(d.states)}
            eid = {ev: i for i, ev in enumerate(d.events)}
            missing_t = [TransitionRef(x.source, x.event, x.alt, x.target, x.guard, x.plan)
                         for x in d.edges
                         if (sid[x.source], eid[x.event], x.alt) not in taken]
            seen_pairs = {(s, e) for (s, e, _) in hits}
            missing_p = [PairRef(st.name, ev) for i, st in enumerate(d.states)
                         for j, ev in enumerate(d.events) if (i, j) not in seen_pairs]
            n_t, n_p = len(d.edges), len(d.states) * len(d.events)
            tcov = TransitionCoverage(n_t - len(missing_t), n_t,
                                      _percent(n_t - len(missing_t), n_t), missing_t)
            pcov = PairCoverage(n_p - len(missing_p), n_p,
                                _percent(n_p - len(missing_p), n_p), missing_p)
            terminal = [st.name for st in d.states if st.terminal]
            reached = sorted({x.target for x in d.edges if x.terminal and
                              (sid[x.source], eid[x.event], x.alt) in taken},
                             key=terminal.index)
            decisions: Counter[str] = Counter()
            for (s, e, a), n in hits.items():
                decisions[_decision(d, s, e, a)] += n
            gated = gate_all or key in self.registered
            mc = MachineCoverage(
                states=len(d.states), events=len(d.events),
                registered=key in self.registered, gated=gated,
                score=min(tcov.percent, pcov.percent), transitions=tcov, pairs=pcov,
                terminals=TerminalCoverage(reached, terminal,
                                           [t for t in terminal if t not in reached]),
                decisions={k: decisions[k] for k in ("transition", "ignore", "error")})
            machines[name] = mc
            if fail_under is not None and gated and (
                    tcov.covered * 100 < fail_under * n_t
                    or pcov.covered * 100 < fail_under * n_p):
                below.append(name)
        return CoverageReport(machines, fail_under, not below, below)


def _decision(d: MachineDiagram, s: int, e: int, a: int) -> str:
    if a < 0:
        return "error"
    st, ev = d.states[s], d.events[e]
    if any(x.source == st.name and x.event == ev and x.alt == a for x in d.edges):
        return "transition"
    if any(i.event == ev for i in st.ignored):
        return "ignore"
    return "error"


def format_report(r: CoverageReport) -> list[str]:
    """The terminal summary: one table row per machine, then what the gated ones never
    exercised."""
    if not r.machines:
        return ["no fsm machine was declared or seen"]
    w = max(len(n) for n in r.machines)
    head = f"{'machine':<{w}}  {'transitions':>17}  {'(state, event) pairs':>20}  " \
           f"{'terminal reached':>16}"
    lines = [head, "-" * len(head)]
    for name, m in r.machines.items():
        t, p, term = m.transitions, m.pairs, m.terminals
        flag = "" if m.gated else "  (not gated)"
        lines.append(f"{name:<{w}}  {f'{t.covered}/{t.declared}':>9} {t.percent:6.1f}%  "
                     f"{f'{p.covered}/{p.declared}':>12} {p.percent:6.1f}%  "
                     f"{f'{len(term.reached)}/{len(term.declared)}':>16}{flag}")
    for name, m in r.machines.items():
        if m.gated and (m.transitions.missing or m.pairs.missing or m.terminals.missing):
            lines.append(f"{name}: never exercised")
            lines += [f"  transition {x}" for x in m.transitions.missing]
            by_state: dict[str, list[str]] = {}
            for x in m.pairs.missing:
                by_state.setdefault(x.state, []).append(x.event)
            for st, evs in by_state.items():
                what = "every event" if len(evs) == m.events else ", ".join(evs)
                lines.append(f"  pairs      in {st}: {what}")
            lines += [f"  terminal   {x}" for x in m.terminals.missing]
    if r.fail_under is not None:
        if r.passed:
            lines.append(f"fsm coverage: every gated machine reaches {r.fail_under:g}%")
        else:
            lines.append(f"FAIL: fsm coverage below {r.fail_under:g}% (min of transition "
                         f"and pair coverage) for: {', '.join(r.below)}")
    return lines
