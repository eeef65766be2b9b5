"""The KV sender of disaggregated prefill, as a Protocol.

A real engine's sender (Mooncake, NIXL, ...) is outside Terminus; the effect layer only
calls these five methods, keyed by request id::

    bootstrap(rid)            handshake with the decode side        (raises on failure)
    init(rid, n_kv, meta)     announce the KV size and metadata slot (raises on failure)
    send(rid, kv_indices)     start the KV transfer                 (raises on failure)
    poll(rid) -> Poll         TRANSFERRING / SUCCESS / FAILED / ABORTED
    abort(rid)                tell the peer the request is gone     (may raise: best-effort)

The simulator's in-memory sender, which fails on cue, is
`terminus.effects.sim.transport.FakeTransport`; the drivers never import it.

After `abort(rid)` of a transfer in flight, the sender may still read the KV until `poll`
says it stopped (SUCCESS, FAILED or ABORTED): the request keeps its pages until then.
"""

from __future__ import annotations

import enum
from typing import Protocol, runtime_checkable

import torch

__all__ = ["Poll", "Transport", "TransportError"]


class Poll(enum.Enum):
    """Where a KV transfer stands."""

    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"
    ABORTED = "aborted"
    """The sender stopped the transfer after `abort(rid)`: it no longer reads the KV."""


class TransportError(RuntimeError):
    """A sender step failed (the peer is gone, the link broke, an injected fault)."""


@runtime_checkable
class Transport(Protocol):
    """What the disaggregated-prefill effects need from a KV sender."""

    def bootstrap(self, rid: str) -> None:
        """Handshake with the decode side for `rid`; raises when it fails."""

    def init(self, rid: str, num_kv: int, metadata_index: int) -> None:
        """Announce `num_kv` KV indices and the metadata slot; raises when it fails."""

    def send(self, rid: str, kv_indices: torch.Tensor) -> None:
        """Start sending the KV at `kv_indices`; raises when it cannot start."""

    def poll(self, rid: str) -> Poll:
        """Where the transfer of `rid` stands."""

    def abort(self, rid: str) -> None:
        """Tell the peer that `rid` is gone; may raise (callers treat it as best-effort)."""
