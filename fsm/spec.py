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

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import msgspec

from .errors import InvalidDefinition

if TYPE_CHECKING:
    from .machine import Machine

Guard: TypeAlias = Callable[[Any, Any], bool]
"""A named predicate `guard(instance, event) -> bool`; it must not change anything."""


if TYPE_CHECKING:
    # mypy's dataclass_transform refuses a subclass that does not repeat frozen=True;
    # msgspec itself inherits the config, so users subclass Event without repeating it.
    class Event(msgspec.Struct, tag=True, gc=False):
        """Base class for events (see the runtime definition)."""

else:

    class Event(msgspec.Struct, frozen=True, tag=True, gc=False):
        """Base class for events: frozen, tagged msgspec Structs (the tag is the class
        name). Subclass it with the event's fields::

            class ChunkResult(Event):
                chunk: int
                last: bool = False
        """


class State(msgspec.Struct, frozen=True):
    """A state of a machine. Exactly one is `initial`; `terminal` states are final."""

    name: str
    initial: bool = False
    terminal: bool = False
    doc: str = ""


class Go(msgspec.Struct, frozen=True):
    """A transition to `target`, taken when guard `when` holds (always when None).

    `plan` names the release plan run on entry; only edges into terminal states have one.
    """

    target: str
    plan: str | None = None
    when: str | None = None


def go(target: str, *, plan: str | None = None, when: str | None = None) -> Go:
    """Declare a transition cell: `go("aborted", plan="release_aborted")`."""
    return Go(target, plan, when)


class _Marker:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


IGNORE: Final = _Marker("IGNORE")
"""The event is absorbed where it arrives: no state change, no effect, counted."""
ERROR: Final = _Marker("ERROR")
"""The event is a caller error where it arrives: firing it raises TransitionNotAllowed."""
ANY: Final = _Marker("ANY")
"""Row key standing for every event the row does not name."""

Cell: TypeAlias = "Go | str | _Marker | Sequence[Go | str | _Marker]"

# Decisions, as stored in compiled tables.
TRANSITION: Final = 0
IGNORED: Final = 1
ERRORED: Final = 2
DECISIONS: Final = ("transition", "ignore", "error")
GUARDED: Final = 3
"""`Tables.decision` code of a cell decided by guards at run time (not in DECISIONS)."""


class Alt(msgspec.Struct, frozen=True):
    """One compiled alternative of a (state, event) cell, tried in declaration order."""

    decision: int  # TRANSITION, IGNORED or ERRORED
    target: int  # state id; the source state for IGNORED/ERRORED
    plan: str | None
    guard: str | None


def _event_name(ev: Any) -> str:
    return ev.__name__ if isinstance(ev, type) else repr(ev)


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

    # -- validation ---------------------------------------------------------------

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

    def _alts(self, state: str, event: Any, cell: Any) -> list[Go | _Marker]:
        items = list(cell) if isinstance(cell, (list, tuple)) else [cell]
        if not items:
            self._err("empty list of alternatives", "declare go(...), IGNORE or ERROR",
                      state, event)
        alts: list[Go | _Marker] = []
        for it in items:
            if isinstance(it, str):
                it = Go(it)
            if not isinstance(it, (Go, _Marker)) or it is ANY:
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

    def build(self) -> Machine:
        """Validate the declaration and compile it; see the module docstring."""
        from .machine import Machine  # the runtime depends on the declaration, not back

        self._check_events()
        self._check_states()
        names = [s.name for s in self.states]
        sid = {n: i for i, n in enumerate(names)}
        terminal = tuple(s.terminal for s in self.states)
        initial = next(i for i, s in enumerate(self.states) if s.initial)
        ev_ids = {ev: i for i, ev in enumerate(self.events)}

        cells: list[list[tuple[Alt, ...]]] = []
        used_guards: set[str] = set()
        for s in self.states:
            row = self.table.get(s.name, {})
            default = row.get(ANY)
            for key in row:
                if key is not ANY and key not in ev_ids:
                    self._err(
                        "the row names an event that is not declared",
                        "add it to events=, or remove it from the row",
                        s.name,
                        key,
                    )
            out_row: list[tuple[Alt, ...]] = []
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
                compiled: list[Alt] = []
                for a in self._alts(s.name, ev, cell):
                    if a is IGNORE:
                        compiled.append(Alt(IGNORED, sid[s.name], None, None))
                        continue
                    if a is ERROR:
                        compiled.append(Alt(ERRORED, sid[s.name], None, None))
                        continue
                    assert isinstance(a, Go)
                    if s.terminal:
                        self._err(
                            f"a terminal state has an edge to {a.target!r} (I2: a machine "
                            "enters a terminal state once and never leaves)",
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
                    if a.plan is not None and not terminal[sid[a.target]]:
                        self._err(
                            f"release plan {a.plan!r} on an edge to non-terminal state "
                            f"{a.target!r} (I1: release effects run only on entering a "
                            "terminal state)",
                            "move the plan to the edge that enters the terminal state",
                            s.name,
                            ev,
                        )
                    if a.when is not None:
                        if a.when not in self.guards:
                            self._err(
                                f"guard {a.when!r} has no implementation",
                                f"pass guards={{{a.when!r}: predicate}} to the Spec",
                                s.name,
                                ev,
                            )
                        used_guards.add(a.when)
                    compiled.append(Alt(TRANSITION, sid[a.target], a.plan, a.when))
                out_row.append(tuple(compiled))
            cells.append(out_row)

        for g in self.guards:
            if g not in used_guards:
                self._err(
                    f"guard {g!r} is implemented but no edge uses it",
                    "remove it from guards=, or use it with go(..., when=...)",
                )

        succ: list[set[int]] = [
            {a.target for alts in row for a in alts if a.decision == TRANSITION}
            for row in cells
        ]
        seen = {initial}
        todo = deque([initial])
        while todo:
            for t in succ[todo.popleft()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        for i, n in enumerate(names):
            if i not in seen:
                self._err(
                    f"state is unreachable from the initial state {names[initial]!r}",
                    "add a transition into it, or remove it",
                    n,
                )
        pred: list[set[int]] = [set() for _ in names]
        for i, ts in enumerate(succ):
            for t in ts:
                pred[t].add(i)
        ends = {i for i, t in enumerate(terminal) if t}
        todo = deque(ends)
        while todo:
            for p in pred[todo.popleft()]:
                if p not in ends:
                    ends.add(p)
                    todo.append(p)
        for i, n in enumerate(names):
            if i not in ends:
                self._err(
                    "no terminal state can be reached from this state, so whatever it "
                    "owns could never be released",
                    "add a transition from it (an abort, a failure) toward a terminal state",
                    n,
                )

        return Machine._compile(self, cells, initial, terminal)

