"""The prefill chunk: one slice of a request's prompt, run on the GPU, then settled.

    scheduled ──Launch──► running ──NextLaunched──► overlapped
        │                    │                          │
        │                    └──────Result──────┐ ┌────Result
        │                                       ▼ ▼
        │                                   result_ready ──Commit──► committed T
        └───────────Abandon──────────────────────┴──────Abandon──► abandoned T ▸ release_abandoned

A chunk owns the KV pages it writes from the moment it is scheduled. While it runs
(alone, or `overlapped` with the request's next chunk, which the overlap scheduler
launches before this one's result is processed) the GPU writes those pages, so it can
only be abandoned once its result is in: `Abandon` while running is an error, not a
free. A committed chunk has handed its pages to its request first (the serving loop
transfers the ledger handle), so `release_committed` finds nothing left. An abandoned
chunk (its request was aborted or already retired) is never cached, never streamed, and
does not free its pages either: a later chunk of the request that is still running
attends over them, so `release_abandoned` hands them to the request, whose own release
frees them once its drain ended (a chunk without a request frees them). Late or
duplicate results after a chunk settled are ignored.
"""

from __future__ import annotations

from typing import Any

from terminus.fsm import ANY, ERROR, IGNORE, Event, Instance, Machine, Spec, State, go

__all__ = ["CHUNK", "Abandon", "Chunk", "Commit", "Launch", "NextLaunched", "Result"]


class Launch(Event):
    """The chunk's forward pass was launched on the device."""


class NextLaunched(Event):
    """The request's next chunk was launched while this one still runs (overlap)."""


class Result(Event):
    """The chunk's forward pass finished and its result reached the scheduler."""


class Commit(Event):
    """The request is live: the chunk's pages now belong to it."""


class Abandon(Event):
    """The request is aborted or retired: the chunk's pages go back with the request's
    (never cached)."""


class Chunk(Instance):
    """A chunk instance: its `index` in the request, whether it is the `last` one, and
    the request instance it belongs to (`parent`; `effects.disagg.DisaggPrefill.forget`
    sets it to None when it drops the ended request)."""

    __slots__ = ("index", "last", "parent")

    def __init__(self, machine: Machine, key: Any = None, *, parent: Any = None,
                 index: int = 0, last: bool = False) -> None:
        Instance.__init__(self, machine, key)  # not super(): one lookup less per chunk
        self.parent = parent
        self.index = index
        self.last = last


CHUNK: Machine = Spec(
    "chunk",
    states=(
        State("scheduled", initial=True, doc="KV pages allocated, not launched yet"),
        State("running", doc="the device writes the chunk's pages"),
        State("overlapped", doc="running while the request's next chunk runs too"),
        State("result_ready", doc="the result is in; the device no longer writes"),
        State("committed", terminal=True, doc="pages handed to the live request"),
        State("abandoned", terminal=True,
              doc="request aborted or retired: pages handed back to it, never cached"),
    ),
    events=(Launch, NextLaunched, Result, Commit, Abandon),
    table={
        "scheduled": {
            Launch: go("running"),
            # Aborted before launch: nothing writes the pages yet.
            Abandon: go("abandoned", plan="release_abandoned"),
            ANY: ERROR,
        },
        "running": {
            NextLaunched: go("overlapped"),
            Result: go("result_ready"),
            # The device still writes the pages: wait for the result (I8).
            Abandon: ERROR,
            ANY: ERROR,
        },
        "overlapped": {
            Result: go("result_ready"),
            ANY: ERROR,
        },
        "result_ready": {
            Commit: go("committed", plan="release_committed"),
            Abandon: go("abandoned", plan="release_abandoned"),
            # The next chunk may launch after this result landed: overlap is moot now.
            NextLaunched: IGNORE,
            ANY: ERROR,
        },
        # Delayed and duplicate results after the chunk settled reach no effect (I2, I4).
        "committed": {ANY: IGNORE},
        "abandoned": {ANY: IGNORE},
    },
    doc="A prefill chunk: scheduled, running (maybe overlapped), result, committed or "
        "abandoned.",
).build()
"""The built chunk machine; plans `release_abandoned` and `release_committed`."""
