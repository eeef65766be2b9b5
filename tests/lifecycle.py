"""The engine tests' fixture machine (the serving machines live in states/).

`LIFECYCLE` is a small request-like lifecycle with every kind of cell: plain
transitions, a guarded pair with a fallback, ignores, explicit errors and two terminal
states with plans. `spec(**changes)` rebuilds it with one thing changed, for the
declaration tests.
"""

from __future__ import annotations

from typing import Any

from terminus.fsm import ANY, ERROR, IGNORE, Event, Instance, Spec, State, go


class Start(Event):
    """Admit the request."""


class Chunk(Event):
    """A prefill chunk result; `last` marks the final one."""

    last: bool = False


class Finish(Event):
    """The request finished."""


class Abort(Event):
    """The client went away."""


class Job(Instance):
    """An instance carrying what the guards read."""

    __slots__ = ("in_flight",)

    def __init__(self, machine: Any, key: Any = None) -> None:
        super().__init__(machine, key)
        self.in_flight = 0


def last_chunk(inst: Any, ev: Any) -> bool:
    """The chunk result is the final one."""
    return bool(ev.last)


def chunks_in_flight(inst: Any, ev: Any) -> bool:
    """An overlapped chunk is still running."""
    return getattr(inst, "in_flight", 0) > 0


STATES = (
    State("queued", initial=True),
    State("prefilling"),
    State("decoding"),
    State("draining"),
    State("finished", terminal=True),
    State("aborted", terminal=True),
)
EVENTS = (Start, Chunk, Finish, Abort)
TABLE: dict[str, dict[Any, Any]] = {
    "queued": {
        Start: go("prefilling"),
        Chunk: ERROR,
        Finish: ERROR,
        Abort: go("aborted", plan="release_aborted"),
    },
    "prefilling": {
        Start: IGNORE,
        Chunk: [go("decoding", when="last_chunk"), go("prefilling")],
        Finish: ERROR,
        Abort: [go("draining", when="chunks_in_flight"), go("aborted", plan="release_aborted")],
    },
    "decoding": {
        Start: IGNORE,
        Chunk: ERROR,
        Finish: go("finished", plan="release_finished"),
        Abort: go("aborted", plan="release_aborted"),
    },
    "draining": {
        Chunk: go("aborted", plan="release_aborted"),
        ANY: IGNORE,
    },
    "finished": {ANY: IGNORE},
    "aborted": {Start: ERROR, ANY: IGNORE},
}
GUARDS = {"last_chunk": last_chunk, "chunks_in_flight": chunks_in_flight}


def spec(**changes: Any) -> Spec:
    """The LIFECYCLE declaration with keyword arguments of Spec replaced."""
    kw: dict[str, Any] = {
        "states": STATES,
        "events": EVENTS,
        "table": {k: dict(v) for k, v in TABLE.items()},
        "guards": dict(GUARDS),
    }
    kw.update(changes)
    return Spec(kw.pop("name", "lifecycle"), **kw)


LIFECYCLE = spec().build()
