"""The scheduler-side sequence: chunked, overlapped prefill then decode, batched.

One row of a scheduler's running batch, from admission to retirement. Its request slot
(the row of the request-to-token table), its KV tokens and its Mamba state are owned by
the row and released in one batched call per step when the row turns terminal.

    vacant ─Admit─► prefill ─ChunkLaunched─► prefill_1 ─ChunkLaunched─► prefill_2
                        ▲  ◄────ChunkDone────────┘  ◄──────ChunkDone───────┘
                        │        │ LastChunkDone
                        │        ▼
                        │     decoding ─Token─► decoding ─Finish─► finished ▸ release_finished
    SequenceAbort/Fail, chunks in flight: prefill_1 ─► draining_1,  prefill_2 ─► draining_2
    draining_2 ─ChunkDone─► draining_1 ─ChunkDone | LastChunkDone─► aborted ▸ release_aborted

Every guard a scalar machine would use ("is a chunk still in flight?") is a state here:
the number of chunks in flight (0, 1 or 2, the overlap depth) is part of the state, so
the whole machine is unguarded and a scheduler steps all its rows with one gather (I8:
the wait for an overlapped chunk is a declared state, not a flag). Rows start vacant
and own nothing until `Admit`, which the scheduler fires in the same call that gives
the row its slot, Mamba state and KV. A failure with
nothing in flight ends `failed`; a failure or abort with chunks in flight drains them
first and ends `aborted`, whose release never inserts into the prefix cache.
"""

from __future__ import annotations

from terminus.fsm import ANY, ERROR, IGNORE, Event, Spec, State, go

__all__ = [
    "SEQUENCE",
    "Admit",
    "ChunkDone",
    "ChunkLaunched",
    "Fail",
    "Finish",
    "LastChunkDone",
    "SequenceAbort",
    "Token",
]


class Admit(Event):
    """The scheduler gave the sequence its row, Mamba state and first KV pages."""


class ChunkLaunched(Event):
    """A prefill chunk was launched on the model (one more in flight)."""


class ChunkDone(Event):
    """A non-final prefill chunk's result arrived (one fewer in flight)."""


class LastChunkDone(Event):
    """The final prefill chunk's result arrived: the prompt is prefilled."""


class Token(Event):
    """A decode step produced a token for the sequence."""


class Finish(Event):
    """The sequence stopped (EOS or its length limit)."""


class SequenceAbort(Event):
    """The client aborted the request."""


class Fail(Event):
    """The scheduler failed the sequence (an error from the model, a fault)."""


_RELEASE_ABORTED = go("aborted", plan="release_aborted")
_RELEASE_FAILED = go("failed", plan="release_failed")

SEQUENCE = Spec(
    "sequence",
    doc="Scheduler-side sequence: chunked overlapped prefill, decode, batched release.",
    states=(
        State("vacant", initial=True,
              doc="a free row: owns nothing, so nothing but an admission is allowed"),
        State("prefill", doc="admitted, no chunk in flight"),
        State("prefill_1", doc="one prefill chunk in flight"),
        State("prefill_2", doc="two chunks in flight (the next overlapped)"),
        State("decoding"),
        State("draining_1", doc="aborted; one chunk still in flight"),
        State("draining_2", doc="aborted; two chunks still in flight"),
        State("finished", terminal=True),
        State("aborted", terminal=True),
        State("failed", terminal=True),
    ),
    events=(Admit, ChunkLaunched, ChunkDone, LastChunkDone, Token, Finish, SequenceAbort, Fail),
    table={
        # A vacant row owns nothing: an abort or failure aimed at it is a scheduler
        # bug (releasing it would free a request slot someone else may hold).
        "vacant": {
            Admit: go("prefill"),
            ANY: ERROR,
        },
        "prefill": {
            ChunkLaunched: go("prefill_1"),
            SequenceAbort: _RELEASE_ABORTED,
            Fail: _RELEASE_FAILED,
            ANY: ERROR,
        },
        "prefill_1": {
            ChunkLaunched: go("prefill_2"),
            ChunkDone: go("prefill"),
            LastChunkDone: go("decoding"),
            SequenceAbort: go("draining_1"),
            Fail: go("draining_1"),
            ANY: ERROR,
        },
        "prefill_2": {
            ChunkDone: go("prefill_1"),
            SequenceAbort: go("draining_2"),
            Fail: go("draining_2"),
            ANY: ERROR,  # a third chunk, or a final result overtaking its predecessor
        },
        "decoding": {
            Token: go("decoding"),
            Finish: go("finished", plan="release_finished"),
            SequenceAbort: _RELEASE_ABORTED,
            Fail: _RELEASE_FAILED,
            ANY: ERROR,
        },
        "draining_2": {
            ChunkDone: go("draining_1"),
            SequenceAbort: IGNORE,
            Fail: IGNORE,
            ANY: ERROR,
        },
        "draining_1": {
            ChunkDone: _RELEASE_ABORTED,
            LastChunkDone: _RELEASE_ABORTED,  # abandoned: released, never cached
            SequenceAbort: IGNORE,
            Fail: IGNORE,
            ANY: ERROR,
        },
        # Late results and abort echoes are absorbed; a second admission is a bug.
        "finished": {Admit: ERROR, ChunkLaunched: ERROR, ANY: IGNORE},
        "aborted": {Admit: ERROR, ChunkLaunched: ERROR, ANY: IGNORE},
        "failed": {Admit: ERROR, ChunkLaunched: ERROR, ANY: IGNORE},
    },
).build()
