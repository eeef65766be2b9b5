"""Model-based paths: the shortest event sequence to every declared transition and pair.

As XState's test model does, a breadth-first search over the declared transitions
(every guard assumed satisfiable; `fsm.testing` makes each one hold when driving)
finds the shortest route from the initial state to every state; a path to a goal is
that route plus the goal's own step:

    transition_paths(m)  one Path per declared transition (state, event, alt)
    pair_paths(m)        one Path per (state, event) cell: its first alternative, or
                         the ignore/error the cell declares
    covering_paths(m)    the transition paths plus the pair paths that are not
                         transitions, minus any path that is a prefix of another:
                         the fewest runs that still exercise everything
    complete(m, path)    the path extended by the shortest route to a terminal state,
                         so whatever the instance acquired is released at its end

Ties are broken by declaration order (states, events, alternatives), so the paths are
the same on every run.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from .graph import shortest_routes
from .machine import Machine
from .table import DECISIONS, TRANSITION


@dataclass(frozen=True)
class Step:
    """One event of a path: in `source`, deliver an `event` so alternative `alt` is taken.

    `decision` is 'transition', 'ignore' or 'error'; `target` is the state after the step
    (the source for an ignore or an error); `guard` is the guard that must hold for
    `alt` (guards of earlier alternatives must not hold); `plan` is the release plan a
    terminal edge runs.
    """

    source: str
    event: type
    alt: int
    target: str
    decision: str
    guard: str | None = None
    plan: str | None = None

    def __str__(self) -> str:
        guard = f" [{self.guard}]" if self.guard else ""
        if self.decision != "transition":
            return f"{self.source} --{self.event.__name__}{guard}--> ({self.decision})"
        plan = f" / {self.plan}" if self.plan else ""
        return f"{self.source} --{self.event.__name__}{guard}{plan}--> {self.target}"


@dataclass(frozen=True)
class Path:
    """Steps from the initial state; `goal` is the (state, event, alt) it was made for
    (alt -1 for a pair goal that is not about one alternative)."""

    goal: tuple[str, str, int]
    steps: tuple[Step, ...]

    @property
    def final(self) -> str:
        """The state the path ends in."""
        return self.steps[-1].target

    def __str__(self) -> str:
        return " ; ".join(str(s) for s in self.steps)


def _step(m: Machine, s: int, e: int, k: int) -> Step:
    a = m.cells[s][e][k]
    target = a.target if a.decision == TRANSITION else s
    return Step(m.states[s], m.events[e], k, m.states[target], DECISIONS[a.decision],
                a.guard, a.plan)


def transitions_from(m: Machine, s: int) -> Iterator[tuple[tuple[int, int, int], int]]:
    """The declared transitions leaving state `s` as `((s, event, alt), target)`, in
    declaration order: the edges `fsm.graph` walks."""
    for e, alts in enumerate(m.cells[s]):
        for k, a in enumerate(alts):
            if a.decision == TRANSITION:
                yield (s, e, k), a.target


def _steps(m: Machine, route: tuple[tuple[int, int, int], ...]) -> tuple[Step, ...]:
    return tuple(_step(m, s, e, k) for s, e, k in route)


def routes(m: Machine) -> list[tuple[Step, ...] | None]:
    """The shortest route (steps) from the initial state to each state, by state id."""
    found = shortest_routes([m.initial], lambda s: transitions_from(m, s))
    return [_steps(m, found[s]) if s in found else None for s in range(len(m.states))]


def _route(m: Machine, r: list[tuple[Step, ...] | None], s: int) -> tuple[Step, ...]:
    route = r[s]
    if route is None:  # Spec.build() rejects unreachable states; a guard against misuse
        raise ValueError(f"machine {m.name!r}: state {m.states[s]!r} is unreachable")
    return route


def transition_paths(m: Machine) -> list[Path]:
    """One shortest path per declared transition, in declaration order."""
    r = routes(m)
    out = []
    for s, row in enumerate(m.cells):
        for e, alts in enumerate(row):
            for k, a in enumerate(alts):
                if a.decision == TRANSITION:
                    out.append(Path((m.states[s], m.event_names[e], k),
                                    (*_route(m, r, s), _step(m, s, e, k))))
    return out


def pair_paths(m: Machine) -> list[Path]:
    """One shortest path per (state, event) pair, ending with that pair's decision.

    The last step takes the cell's declared ignore or error when it has one, else its
    first alternative.
    """
    r = routes(m)
    out = []
    for s, row in enumerate(m.cells):
        for e, alts in enumerate(row):
            k = next((i for i, a in enumerate(alts) if a.decision != TRANSITION), 0)
            out.append(Path((m.states[s], m.event_names[e], -1),
                            (*_route(m, r, s), _step(m, s, e, k))))
    return out


def covering_paths(m: Machine) -> list[Path]:
    """Transition paths plus non-transition pair paths, without paths that are prefixes
    of others: every declared transition and every pair, in as few paths as this gives."""
    cands = transition_paths(m) + [p for p in pair_paths(m)
                                   if p.steps[-1].decision != "transition"]
    keep = []
    for p in cands:
        n = len(p.steps)
        if not any(q is not p and len(q.steps) > n and q.steps[:n] == p.steps
                   for q in cands):
            keep.append(p)
    return keep


def to_terminal(m: Machine, state: str) -> tuple[Step, ...]:
    """The shortest route from `state` to a terminal state (empty when it is terminal)."""
    found = shortest_routes([m.state_id(state)], lambda s: transitions_from(m, s))
    for s, route in found.items():  # in BFS order: the first terminal one is nearest
        if m.terminal[s]:
            return _steps(m, route)
    raise ValueError(f"machine {m.name!r}: no terminal state is reachable from {state!r}")


def complete(m: Machine, path: Path) -> Path:
    """`path` extended by the shortest route from where it ends to a terminal state."""
    return Path(path.goal, path.steps + to_terminal(m, path.final))


__all__ = ["Path", "Step", "complete", "covering_paths", "pair_paths", "routes",
           "to_terminal", "transition_paths", "transitions_from"]
