"""The one terminal output a request streams when it ends, and where it goes.

Both driver families stream through these: the tokenizer side (`REQUEST`, `SAMPLING`;
`terminus.effects.request`) and the disaggregated-prefill server (`DISAGG_PREFILL`;
`terminus.effects.disagg`). A terminal transition runs once, so each request id streams
exactly one `TerminalOutput`, from the plan of its terminal edge, into an `OutputSink`.

    field           request side                      disaggregated prefill
    rid             the request id                    the request id
    outcome         finished, aborted, rejected,      succeeded, aborted, failed,
                    errored, dispatch_failed          bootstrap_failed
                    (a sampling group: aborted,
                    rejected, errored before fan-out)
    status          HTTP status: 200, 499, 4xx,       None (the prefill server answers
                    5xx, 503                          the router by state, not HTTP)
    message         the error message, or ""          the reason it ended, or ""
    finish_reason   the scheduler's, when finished    None
"""

from __future__ import annotations

from collections import Counter
from operator import attrgetter
from typing import Any, Protocol, runtime_checkable

import msgspec

__all__ = ["OutputLog", "OutputSink", "TerminalOutput"]


class TerminalOutput(msgspec.Struct, frozen=True, gc=False):
    """The one terminal output of a request id (see the module docstring for the values).

    `outcome` is the name of the terminal state the request ended in; `status` its HTTP
    status where the output goes to an HTTP client, else None.
    """

    rid: Any
    outcome: str
    status: int | None = None
    message: str = ""
    finish_reason: str | None = None


_rid = attrgetter("rid")


@runtime_checkable
class OutputSink(Protocol):
    """Where terminal outputs go (the client's stream); called once per request id."""

    def put(self, output: TerminalOutput) -> None:
        """Deliver `output` to its client; may raise when the client is gone (the
        plans stream best-effort, so nothing else is skipped)."""


class OutputLog:
    """An `OutputSink` that keeps what it is given (a stand-in for the client streams).

    `outputs`: every output, in order; `counts`: outputs per request id (1 is right);
    `failing`: request ids whose client stream is closed: `put` records their output,
    then raises `ConnectionError`, as a closed socket would.
    """

    def __init__(self) -> None:
        self.outputs: list[TerminalOutput] = []
        self.counts: Counter[Any] = Counter()
        self.failing: set[Any] = set()

    def put(self, output: TerminalOutput) -> None:
        """Record `output` (counted even when the send then fails)."""
        rid = output.rid
        counts = self.counts
        counts[rid] = counts.get(rid, 0) + 1  # `+= 1` without Counter.__missing__'s call
        self.outputs.append(output)
        if rid in self.failing:
            raise ConnectionError(f"client stream of {rid!r} is closed")

    def first(self) -> dict[Any, TerminalOutput]:
        """Each request id's first output (what its client saw)."""
        outputs = self.outputs
        last = dict(zip(map(_rid, outputs), outputs, strict=True))  # each id's last
        if len(last) == len(outputs):  # one output per id (as it should be): the first
            return last
        out: dict[Any, TerminalOutput] = {}
        for o in outputs:
            out.setdefault(o.rid, o)
        return out
