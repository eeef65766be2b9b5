"""Fixture machines shared by the tests (not registered as entry points).

JOB has everything the review tooling must show: guarded alternatives with an
unguarded fallback, an all-guarded cell (error when no guard holds), two release plans,
ignores, explicit errors and two terminal states. TOGGLE is unguarded, so batchable.
"""

from __future__ import annotations

from typing import Any

from terminus.fsm import ANY, ERROR, IGNORE, Event, Instance, Machine, Spec, State, go


class Start(Event):
    """Begin the job."""


class Progress(Event):
    """A unit of work finished; `last` when it was the final one."""

    last: bool = False


class Abort(Event):
    """The client went away."""


class Poke(Event):
    """An event that matters only while running (all its alternatives are guarded)."""


class Job(Instance):
    """A job instance: guards read `in_flight`."""

    __slots__ = ("in_flight",)

    def __init__(self, machine: Machine, key: Any = None) -> None:
        super().__init__(machine, key)
        self.in_flight = 0


def last(inst: Job, ev: Progress) -> bool:
    """The progress event reports the final unit."""
    return ev.last


def in_flight(inst: Job, ev: Any) -> bool:
    """Work is still running somewhere, so an abort must wait for it."""
    return inst.in_flight > 0


JOB_SPEC = Spec(
    "job",
    states=(State("queued", initial=True), State("running"), State("draining"),
            State("done", terminal=True), State("aborted", terminal=True)),
    events=(Start, Progress, Abort, Poke),
    table={
        "queued": {Start: go("running"), Abort: go("aborted", plan="release_aborted"),
                   Progress: ERROR, Poke: IGNORE},
        "running": {
            Progress: [go("done", plan="release_done", when="last"), go("running")],
            Abort: [go("draining", when="in_flight"), go("aborted", plan="release_aborted")],
            Start: IGNORE,
            Poke: [go("draining", when="in_flight")],
        },
        "draining": {
            Progress: [go("aborted", plan="release_aborted", when="last"), IGNORE],
            Abort: IGNORE,
            Start: ERROR,
            Poke: IGNORE,
        },
        "done": {ANY: IGNORE},
        "aborted": {ANY: IGNORE, Start: ERROR},
    },
    guards={"last": last, "in_flight": in_flight},
    doc="A job that runs units of work and can be aborted while work is in flight.",
)
JOB = JOB_SPEC.build()


class Go(Event):
    """Move on."""


class Stop(Event):
    """Finish now."""


TOGGLE = Spec(
    "toggle",
    states=(State("idle", initial=True), State("busy"), State("finished", terminal=True)),
    events=(Go, Stop),
    table={
        "idle": {Go: go("busy"), Stop: go("finished", plan="release_finished")},
        "busy": {Go: go("idle"), Stop: go("finished", plan="release_finished")},
        "finished": {Go: IGNORE, Stop: ERROR},
    },
).build()
