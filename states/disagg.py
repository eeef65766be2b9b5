"""The disaggregated-prefill request: bootstrap, prefill in chunks, transfer the KV.

    bootstrapping  Bootstrapped -> waiting; BootstrapRetry -> bootstrapping;
                   BootstrapFailed -> bootstrap_failed ▸; DisaggAbort -> aborted ▸; else error
    waiting        ChunkScheduled -> prefilling; BootstrapFailed -> bootstrap_failed ▸;
                   DisaggAbort -> aborted ▸; else error
    prefilling     ChunkScheduled -> prefilling;
                   ChunkSettled -> transferring [last_chunk], else prefilling
                   (ChunkSettledLast -> transferring, ChunkSettledNotLast -> prefilling:
                   its two forms without the guard);
                   DisaggAbort -> draining [chunks_in_flight], else aborted ▸;
                   BootstrapFailed -> draining [chunks_in_flight], else bootstrap_failed ▸;
                   else error
    draining       ChunkSettled, ChunkSettledLast, ChunkSettledNotLast -> aborted ▸
                   [drained], else draining;
                   DisaggAbort, BootstrapFailed -> ignore; else error
    transferring   TransferDone -> succeeded ▸; TransferFailed -> failed ▸;
                   DisaggAbort -> awaiting_sender; else error
    awaiting_sender  TransferDone, TransferFailed, SenderAborted, SenderDeadline
                   -> aborted ▸ release_aborted_transfer;
                   DisaggAbort, BootstrapFailed -> ignore; else error
    T states       succeeded, failed, aborted, bootstrap_failed: ignore everything

    ▸ = the edge runs the release plan named after its target (`release_<target>`);
        the edges out of `awaiting_sender` run `release_aborted_transfer`: the sender
        was told of the abort when the wait began, so the plan does not tell it again

The request owns (in the ledger) its hierarchical-cache state from the start, a
metadata slot once bootstrapped, its request slot and Mamba state once the first chunk
is scheduled, and the KV pages of every committed chunk; each in-flight chunk owns its
own pages (see `states.chunk`). An abort or bootstrap failure while a chunk is still on
the device does not release anything: the request waits in `draining` (I8) until every
chunk it launched has settled, and the result that settles the last one runs
`release_aborted` exactly once. `draining` always ends in `aborted`; the first cause
(abort or bootstrap failure) is kept in `reason` for the terminal output.

An abort while the KV is being transferred does not free it either: the sender may
still be reading those pages (I10). The request waits in `awaiting_sender` until the
sender confirms it stopped (the transfer finished, failed, or was aborted) or the
deadline for that confirmation passes; only then does `release_aborted_transfer` run.
A chunk abandoned while a later overlapped chunk still runs hands its pages to the
request (see `effects.disagg`), so they go back when the drain ends, not before: the
later chunk attends over them.

DisaggAbort is terminal while bootstrapping, so an optimistic bootstrap retry that arrives
after it is ignored, never a resurrection. Every terminal row ignores everything: a
delayed chunk result, a second abort or a duplicate failure after cleanup ran reaches
no effect (I2, I4).
"""

from __future__ import annotations

from typing import Any

from terminus.fsm import ANY, ERROR, IGNORE, Event, Instance, Machine, Spec, State, go

from .chunk import Chunk

__all__ = [
    "DISAGG_PREFILL",
    "BootstrapFailed",
    "BootstrapRetry",
    "Bootstrapped",
    "ChunkScheduled",
    "ChunkSettled",
    "ChunkSettledLast",
    "ChunkSettledNotLast",
    "DisaggAbort",
    "DisaggReq",
    "SenderAborted",
    "SenderDeadline",
    "TransferDone",
    "TransferFailed",
]


class Bootstrapped(Event):
    """The handshake with the decode side finished; a metadata slot was taken."""


class BootstrapRetry(Event):
    """The handshake is retried optimistically (a transient failure)."""


class BootstrapFailed(Event):
    """The handshake (or the sender's init) failed for good."""

    reason: str = ""


class ChunkScheduled(Event):
    """Chunk `chunk` of the prompt was scheduled."""

    chunk: int


class ChunkSettled(Event):
    """Chunk `chunk` settled (committed or abandoned); `last`: it was the final one."""

    chunk: int
    last: bool = False


class ChunkSettledLast(Event):
    """`ChunkSettled(chunk, last=True)` as an event of its own: the same transitions, with
    no guard to ask in `prefilling` (what `effects.disagg` fires)."""

    chunk: int
    last = True  # (a class constant, as `ChunkSettled.last` reads)


class ChunkSettledNotLast(Event):
    """`ChunkSettled(chunk, last=False)` as an event of its own (see `ChunkSettledLast`)."""

    chunk: int
    last = False


class DisaggAbort(Event):
    """The client or the scheduler aborted the request."""

    reason: str = ""


class TransferDone(Event):
    """The KV transfer to the decode side finished."""


class TransferFailed(Event):
    """The KV transfer to the decode side failed."""

    reason: str = ""


class SenderAborted(Event):
    """The sender confirms it stopped the transfer of an aborted request: it no longer
    reads the KV."""


class SenderDeadline(Event):
    """The sender did not confirm in time that it stopped reading the KV of an aborted
    request; the pages are released anyway."""


class DisaggReq(Instance):
    """A request instance: its chunk instances (`chunks`, in launch order) and the cause
    that made it wait before its end (`reason`: the first abort or bootstrap failure of
    a request that drained or waited for the sender), which only the terminal output
    reads."""

    __slots__ = ("chunks", "reason")

    def __init__(self, machine: Machine, key: Any = None) -> None:
        Instance.__init__(self, machine, key)  # not super(): one lookup less per request
        self.chunks: list[Chunk] = []
        self.reason = ""


def chunks_in_flight(inst: DisaggReq, ev: Any) -> bool:
    """Some chunk this request launched has not settled: the device may still write."""
    # (`any(not c.terminal for c in inst.chunks)`, without a generator's frame and a
    # property's per chunk: a chunk's `terminal` is its machine's flag of its state)
    for c in inst.chunks:  # noqa: SIM110 (any() of a generator: a frame of its own)
        if not c._m.terminal[c._s]:
            return True
    return False


def drained(inst: DisaggReq, ev: Any) -> bool:
    """Every chunk this request launched has settled."""
    return not chunks_in_flight(inst, ev)


def last_chunk(inst: DisaggReq, ev: Any) -> bool:
    """The chunk that settled was the prompt's final one (results come in launch order,
    so every earlier chunk has settled too)."""
    return ev.last  # a bool field (no bool() call: the engine takes its truth)


_RELEASE_ABORTED = go("aborted", plan="release_aborted")
_RELEASE_BOOTSTRAP = go("bootstrap_failed", plan="release_bootstrap_failed")
_RELEASE_TRANSFER = go("aborted", plan="release_aborted_transfer")
_TERMINAL_ROW = {ANY: IGNORE}
# A settled chunk ends a drain once every chunk launched has settled.
_DRAIN = [go("aborted", plan="release_aborted", when="drained"), go("draining")]

DISAGG_PREFILL: Machine = Spec(
    "disagg_prefill",
    states=(
        State("bootstrapping", initial=True, doc="handshake with the decode side"),
        State("waiting", doc="bootstrapped, holds a metadata slot, waits for a chunk"),
        State("prefilling", doc="chunks scheduled and run"),
        State("draining", doc="aborted; waits for the chunks still on the device (I8)"),
        State("transferring", doc="KV being sent to the decode side"),
        State("awaiting_sender", doc="aborted while sending; keeps the KV until the sender "
                                     "confirms it stopped, or the deadline passes (I10)"),
        State("succeeded", terminal=True, doc="transferred; KV cached once"),
        State("failed", terminal=True, doc="the transfer failed"),
        State("aborted", terminal=True, doc="aborted; never cached"),
        State("bootstrap_failed", terminal=True, doc="the handshake failed"),
    ),
    events=(Bootstrapped, BootstrapRetry, BootstrapFailed, ChunkScheduled, ChunkSettled,
            ChunkSettledLast, ChunkSettledNotLast, DisaggAbort, TransferDone, TransferFailed,
            SenderAborted, SenderDeadline),
    table={
        "bootstrapping": {
            Bootstrapped: go("waiting"),
            BootstrapRetry: go("bootstrapping"),
            BootstrapFailed: _RELEASE_BOOTSTRAP,
            # Terminal before any retry can run: no resurrection after an abort.
            DisaggAbort: _RELEASE_ABORTED,
            ANY: ERROR,
        },
        "waiting": {
            BootstrapFailed: _RELEASE_BOOTSTRAP,
            ChunkScheduled: go("prefilling"),
            DisaggAbort: _RELEASE_ABORTED,
            ANY: ERROR,
        },
        "prefilling": {
            BootstrapFailed: [go("draining", when="chunks_in_flight"), _RELEASE_BOOTSTRAP],
            ChunkScheduled: go("prefilling"),
            ChunkSettled: [go("transferring", when="last_chunk"), go("prefilling")],
            ChunkSettledLast: go("transferring"),
            ChunkSettledNotLast: go("prefilling"),
            DisaggAbort: [go("draining", when="chunks_in_flight"), _RELEASE_ABORTED],
            ANY: ERROR,
        },
        "draining": {
            ChunkSettled: _DRAIN,
            ChunkSettledLast: _DRAIN,
            ChunkSettledNotLast: _DRAIN,
            DisaggAbort: IGNORE,
            BootstrapFailed: IGNORE,
            ANY: ERROR,
        },
        "transferring": {
            # The sender may still read the KV: wait for it to confirm (I10).
            DisaggAbort: go("awaiting_sender"),
            TransferDone: go("succeeded", plan="release_succeeded"),
            TransferFailed: go("failed", plan="release_failed"),
            ANY: ERROR,
        },
        "awaiting_sender": {
            TransferDone: _RELEASE_TRANSFER,
            TransferFailed: _RELEASE_TRANSFER,
            SenderAborted: _RELEASE_TRANSFER,
            SenderDeadline: _RELEASE_TRANSFER,
            DisaggAbort: IGNORE,
            BootstrapFailed: IGNORE,
            ANY: ERROR,
        },
        "succeeded": _TERMINAL_ROW,
        "failed": _TERMINAL_ROW,
        "aborted": _TERMINAL_ROW,
        "bootstrap_failed": _TERMINAL_ROW,
    },
    guards={"chunks_in_flight": chunks_in_flight, "drained": drained,
            "last_chunk": last_chunk},
    doc="Disaggregated prefill request: bootstrap, chunked prefill, KV transfer.",
).build()
"""The built machine; plans `release_succeeded`, `release_failed`, `release_aborted`,
`release_aborted_transfer`, `release_bootstrap_failed`."""
