"""Declaring a machine: one table of states x events, validated when built.

A declaration reads as the lifecycle table a reviewer would draw::

    Spec(
        "disagg_prefill",
        states=(State("prefilling", initial=True), State("aborted", terminal=True), ...),
        events=(ChunkResult, Abort, ...),
        table={
            "prefilling": {
                ChunkResult: [go("transferring", when="last_chunk"), go("prefilling")],
                Abort: go("aborted", plan="release_aborted"),
                TransferDone: ERROR,
            },
            "aborted": {ANY: IGNORE},
        },
        guards={"last_chunk": last_chunk},
    ).build()

Each cell is a transition (`go`), a list of guarded alternatives tried in order, an
explicit `IGNORE` or an explicit `ERROR`; `ANY` fills every event a row does not name.
`build()` validates the whole declaration (raising `InvalidDefinition`), builds the
`transitions.Machine` used for diagrams and as the test oracle, and compiles the
integer tables the runtime uses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from .errors import InvalidDefinition
from .graph import invert, reachable
from .machine import Machine
from .table import (
    ANY,
    DECISIONS,
    ERROR,
    ERRORED,
    GUARDED,
    IGNORE,
    IGNORED,
    TRANSITION,
    Alt,
    Cell,
    Event,
    Go,
    Guard,
    Marker,
    State,
    go,
    guard_name,
)

__all__ = ["ANY", "DECISIONS", "ERROR", "ERRORED", "GUARDED", "IGNORE", "IGNORED",
           "TRANSITION", "Alt", "Cell", "Event", "Go", "Guard", "Spec", "State", "go"]

Cells = list[list[tuple[Alt, ...]]]


def _event_name(ev: Any) -> str:
    return ev.__name__ if isinstance(ev, type) else repr(ev)


def _name(state: Any) -> str:
    return state.name if isinstance(state, State) else repr(state)


class Spec:
    """The declaration of one machine. `build()` validates it and returns a `Machine`."""

    def __init__(
        self,
        name: str,
        *,
        states: Sequence[State],
        events: Sequence[type[msgspec.Struct]],
        table: Mapping[str, Mapping[Any, Cell]],
        guards: Mapping[str, Guard] | None = None,
        doc: str = "",
    ) -> None:
        self.name = name
        self.states = tuple(states)
        self.events = tuple(events)
        self.table = {k: dict(v) for k, v in table.items()}
        self.guards = dict(guards or {})
        self.doc = doc

    def __repr__(self) -> str:
        states = [_name(s) for s in self.states]
        initial = [s.name for s in self.states if isinstance(s, State) and s.initial]
        terminal = [s.name for s in self.states if isinstance(s, State) and s.terminal]
        return (f"Spec({self.name!r}, states={states}, initial="
                f"{initial[0] if len(initial) == 1 else initial!r}, terminal={terminal}, "
                f"events={[_event_name(e) for e in self.events]})")

    def build(self) -> Machine:
        """Validate the declaration and compile it; see the module docstring.

        Three steps, each raising `InvalidDefinition` on the first problem it finds:
        the declaration's parts (events, states), cell compilation (every pair declared,
        targets, plans, guards named or given inline) with the guard checks, and the
        graph checks (every state reachable, a terminal state reachable from each).
        """
        self._check_events()
        self._check_states()
        guards = self._resolve_guards()
        cells, used = self._compile_cells(guards)
        self._check_guards(used)
        initial = next(i for i, s in enumerate(self.states) if s.initial)
        terminal = tuple(s.terminal for s in self.states)
        self._check_graph(cells, initial, terminal)
        return Machine._compile(self, cells, initial, terminal, guards)

    # -- the declaration's parts --------------------------------------------------

    def _err(self, problem: str, fix: str, state: str | None = None, event: Any = None) -> None:
        raise InvalidDefinition(
            self.name,
            problem,
            fix,
            state=state,
            event=None if event is None else _event_name(event),
        )

    def _check_events(self) -> None:
        seen: dict[str, type] = {}
        for ev in self.events:
            if not (isinstance(ev, type) and issubclass(ev, msgspec.Struct)):
                self._err(
                    f"{ev!r} is not a msgspec Struct class",
                    "declare events as subclasses of fsm.Event (frozen, tagged Structs)",
                    event=ev,
                )
            cfg = ev.__struct_config__
            if not cfg.frozen or cfg.tag is None:
                self._err(
                    "event classes must be frozen and tagged msgspec Structs",
                    "subclass fsm.Event, or pass frozen=True, tag=True to msgspec.Struct",
                    event=ev,
                )
            if ev.__name__ in seen:
                self._err(
                    "two events share this name",
                    "give every event class of a machine a distinct name",
                    event=ev,
                )
            seen[ev.__name__] = ev

    def _check_states(self) -> None:
        for s in self.states:
            if not isinstance(s, State):
                self._err(
                    f"state {s!r} is a {type(s).__name__}, not a State",
                    f"declare it as State({s!r}) (State({s!r}, initial=True) for the "
                    "initial one, terminal=True where the lifecycle ends)",
                )
        names = [s.name for s in self.states]
        for n in names:
            if names.count(n) > 1:
                self._err("state declared twice", "declare each state once", state=n)
        initial = [s.name for s in self.states if s.initial]
        if not initial:
            self._err(
                "no initial state",
                "mark exactly one state State(name, initial=True)",
            )
        if len(initial) > 1:
            self._err(
                f"several initial states: {', '.join(initial)}",
                "keep initial=True on exactly one of them",
            )
        if not any(s.terminal for s in self.states):
            self._err(
                "no terminal state",
                "mark the states where the lifecycle ends State(name, terminal=True)",
            )
        for row in self.table:
            if row not in names:
                self._err(
                    "the table has a row for a state that is not declared",
                    f"add State({row!r}) to states, or remove the row",
                    state=row,
                )

    # -- cell compilation ---------------------------------------------------------

    def _resolve_guards(self) -> dict[str, Guard]:
        """`guards=` plus the guard functions given inline (`go(..., when=fn)`), by name."""
        guards = dict(self.guards)
        inline: dict[str, Guard] = {}
        for state, row in self.table.items():
            for event, cell in row.items():
                items = cell if isinstance(cell, (list, tuple)) else [cell]
                for it in items:
                    when = it.when if isinstance(it, Go) else None
                    if when is None or isinstance(when, str):
                        continue
                    if not callable(when):
                        self._err(
                            f"guard {when!r} is neither a name nor a function",
                            "write go(..., when='name') with guards={'name': fn}, or "
                            "go(..., when=fn)",
                            state,
                            event,
                        )
                    name = guard_name(when)
                    other = inline.get(name, guards.get(name))
                    if other is not None and other is not when:
                        self._err(
                            f"two different guard functions are named {name!r}",
                            "give each guard function its own name (a def, not a "
                            "lambda, when there are several), or use the same function",
                            state,
                            event,
                        )
                    inline[name] = when
        guards.update(inline)
        return guards

    def _compile_cells(self, guards: Mapping[str, Guard]) -> tuple[Cells, set[str]]:
        """Each (state, event) cell as a tuple of `Alt`, plus the guards the cells use."""
        sid = {s.name: i for i, s in enumerate(self.states)}
        declared = set(self.events)
        cells: Cells = []
        used: set[str] = set()
        for s in self.states:
            row = self.table.get(s.name, {})
            for key in row:
                if key is not ANY and key not in declared:
                    self._err(
                        "the row names an event that is not declared",
                        "add it to events=, or remove it from the row",
                        s.name,
                        key,
                    )
            default = row.get(ANY)
            out: list[tuple[Alt, ...]] = []
            for ev in self.events:
                cell = row.get(ev, default)
                if cell is None:
                    self._err(
                        "no transition, IGNORE or ERROR is declared for this pair (I4: "
                        "every (state, event) pair is declared)",
                        "add the event to the row as go(...), IGNORE or ERROR, or give "
                        "the row an ANY entry",
                        s.name,
                        ev,
                    )
                out.append(tuple(self._compile_alt(s, ev, a, sid, guards, used)
                                 for a in self._alts(s.name, ev, cell)))
            cells.append(out)
        return cells, used

    def _alts(self, state: str, event: Any, cell: Any) -> list[Go | Marker]:
        items = list(cell) if isinstance(cell, (list, tuple)) else [cell]
        if not items:
            self._err("empty list of alternatives", "declare go(...), IGNORE or ERROR",
                      state, event)
        alts: list[Go | Marker] = []
        for it in items:
            if isinstance(it, str):
                it = Go(it)
            if not isinstance(it, (Go, Marker)) or it is ANY:
                self._err(
                    f"cell {it!r} is not a transition, IGNORE or ERROR",
                    "write go('target', plan=..., when=...), IGNORE or ERROR",
                    state,
                    event,
                )
            alts.append(it)
        unguarded = [a for a in alts if not (isinstance(a, Go) and a.when is not None)]
        if len(unguarded) > 1:
            self._err(
                "two unguarded alternatives for one (state, event) pair",
                "give all but the last alternative a guard with when='name'",
                state,
                event,
            )
        if unguarded and alts[-1] is not unguarded[0]:
            self._err(
                "an unguarded alternative comes before others, which could never be taken",
                "put the unguarded alternative last",
                state,
                event,
            )
        return alts

    def _compile_alt(self, s: State, ev: type, a: Go | Marker, sid: Mapping[str, int],
                     guards: Mapping[str, Guard], used: set[str]) -> Alt:
        here = sid[s.name]
        if a is IGNORE:
            return Alt(IGNORED, here, None, None)
        if a is ERROR:
            return Alt(ERRORED, here, None, None)
        assert isinstance(a, Go)
        if s.terminal:
            self._err(
                f"a terminal state has an edge to {a.target!r} (I2: a machine enters a "
                "terminal state once and never leaves)",
                "declare the event IGNORE or ERROR in terminal states",
                s.name,
                ev,
            )
        if a.target not in sid:
            self._err(
                f"transition to undeclared state {a.target!r}",
                "declare the target in states=, or fix its name",
                s.name,
                ev,
            )
        target = sid[a.target]
        if a.plan is not None and not self.states[target].terminal:
            self._err(
                f"release plan {a.plan!r} on an edge to non-terminal state {a.target!r} "
                "(I1: release effects run only on entering a terminal state)",
                "move the plan to the edge that enters the terminal state",
                s.name,
                ev,
            )
        guard = None if a.when is None else guard_name(a.when)
        if guard is not None:
            if guard not in guards:
                self._err(
                    f"guard {guard!r} has no implementation",
                    f"pass guards={{{guard!r}: predicate}} to the Spec, or the function "
                    "itself: go(..., when=predicate)",
                    s.name,
                    ev,
                )
            used.add(guard)
        return Alt(TRANSITION, target, a.plan, guard)

    # -- guard and graph checks ---------------------------------------------------

    def _check_guards(self, used: set[str]) -> None:
        for g in self.guards:
            if g not in used:
                self._err(
                    f"guard {g!r} is implemented but no edge uses it",
                    "remove it from guards=, or use it with go(..., when=...)",
                )

    def _check_graph(self, cells: Cells, initial: int, terminal: tuple[bool, ...]) -> None:
        names = [s.name for s in self.states]
        succ = [{a.target for alts in row for a in alts if a.decision == TRANSITION}
                for row in cells]
        seen = reachable([initial], succ.__getitem__)
        for i, n in enumerate(names):
            if i not in seen:
                self._err(
                    f"state is unreachable from the initial state {names[initial]!r}",
                    "add a transition into it, or remove it",
                    n,
                )
        ends = reachable([i for i, t in enumerate(terminal) if t], invert(succ).__getitem__)
        for i, n in enumerate(names):
            if i not in ends:
                self._err(
                    "no terminal state can be reached from this state, so whatever it "
                    "owns could never be released",
                    "add a transition from it (an abort, a failure) toward a terminal state",
                    n,
                )
