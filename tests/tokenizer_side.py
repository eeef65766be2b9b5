"""Fakes of a serving engine's internals for the tokenizer-side tests, and the harness.

Only what Terminus does not ship is faked: the tokenizer, the scheduler transport and
the client stream. The LoRA registry, the ledger and the machines are the real ones.
`Side` bundles a `TokenizerSide` with them; `await side.finish_clean()` is how every
test ends: releases drained, ledger empty, every counter zero, every adapter unloaded.
"""

from __future__ import annotations

import asyncio
from typing import Any

from terminus.effects.request import TerminalOutput
from terminus.effects.tokenizer import InvalidRequest, TokenizerSide
from terminus.kernels.lora import LoRARegistry


class FakeTokenizer:
    """Splits prompts into words. "bad..." is invalid (400), "crash..." raises (500).

    `gates[prompt]` (an asyncio.Event) holds that prompt's tokenization until set.
    """

    def __init__(self) -> None:
        self.gates: dict[Any, asyncio.Event] = {}
        self.calls = 0

    async def tokenize(self, prompt: Any) -> Any:
        self.calls += 1
        gate = self.gates.get(prompt)
        if gate is not None:
            await gate.wait()
        await asyncio.sleep(0)
        if str(prompt).startswith("bad"):
            raise InvalidRequest(f"prompt {prompt!r} is not valid input")
        if str(prompt).startswith("crash"):
            raise RuntimeError("tokenizer worker died")
        return str(prompt).split()


class FakeScheduler:
    """Records what was sent and aborted, by the id on the wire (`str(key)`, as a socket
    would carry it); `fail` holds ids (or "*") whose send raises."""

    def __init__(self) -> None:
        self.sent: dict[str, tuple[Any, int | None]] = {}
        self.aborted: list[str] = []
        self.fail: set[Any] = set()
        self.keys: list[Any] = []  # what `send` was given, as given

    def send(self, rid: Any, tokens: Any, lora_id: int | None) -> None:
        wire = str(rid)
        self.keys.append(rid)
        if wire in self.fail or "*" in self.fail:
            raise ConnectionError(f"scheduler socket closed while sending {wire!r}")
        assert wire not in self.sent, f"{wire!r} sent twice"
        self.sent[wire] = (tokens, lora_id)

    def abort(self, rid: Any) -> None:
        self.aborted.append(str(rid))


class RecordingSink:
    """Keeps each rid's terminal output; a second output for one rid is recorded as a bug."""

    def __init__(self) -> None:
        self.outputs: dict[Any, TerminalOutput] = {}
        self.duplicates: list[TerminalOutput] = []

    def put(self, output: TerminalOutput) -> None:
        if output.rid in self.outputs:
            self.duplicates.append(output)
        self.outputs[output.rid] = output

    def outcome(self, rid: Any) -> str | None:
        out = self.outputs.get(rid)
        return None if out is None else out.outcome


class GatedRegistry:
    """The real registry, with a gate that holds `acquire` (to race aborts against it).

    `async_only=True` hides `release_nowait`, so releases go through the awaitable path.
    """

    def __init__(self, inner: LoRARegistry, async_only: bool = False) -> None:
        self.inner = inner
        self.gate: asyncio.Event | None = None
        self.waiting = 0
        if not async_only:
            self.release_nowait = inner.release_nowait

    async def acquire(self, names: Any) -> Any:
        if self.gate is not None:
            self.waiting += 1
            try:
                await self.gate.wait()
            finally:
                self.waiting -= 1
        return await self.inner.acquire(names)

    async def release(self, ids: Any) -> None:
        await self.inner.release(ids)


class Side:
    """A TokenizerSide over a real registry, fake engine internals and a recording sink."""

    def __init__(self, registry: LoRARegistry, adapters: dict[str, int], *,
                 gated: bool = False, async_release: bool = False) -> None:
        self.registry = registry
        self.adapters = adapters
        self.front: Any = GatedRegistry(registry, async_only=async_release) if gated \
            else registry
        self.tokenizer = FakeTokenizer()
        self.scheduler = FakeScheduler()
        self.sink = RecordingSink()
        self.side = TokenizerSide(self.front, self.tokenizer, self.scheduler, self.sink,
                                  async_release=async_release)
        self.ledger = self.side.ledger

    def lora_handles(self) -> dict[int, int]:
        """Live ledger handles per adapter id."""
        out: dict[int, int] = {}
        for hs in self.ledger.outstanding().values():
            for h in hs:
                out[h.value] = out.get(h.value, 0) + 1
        return out

    def assert_owned_match_counts(self) -> None:
        """The ownership invariant: each id's counter == handles owned in the ledger."""
        counts = {i: c for i, c in self.registry.counts().items() if c}
        assert counts == self.lora_handles(), (counts, self.lora_handles())

    async def finish_clean(self) -> None:
        """Drain, then prove nothing leaked: ledger empty, counters zero, unloads finish."""
        await self.side.drain()
        assert not self.ledger.errors, self.ledger.errors
        assert not self.sink.duplicates, self.sink.duplicates
        self.ledger.assert_empty()
        self.registry.assert_full()
        for name in self.adapters:
            await self.registry.unload(name, timeout=1.0)
        assert self.registry.counts() == {}


async def make_side(*names: str, **kwargs: Any) -> Side:
    """A Side with adapters `names` (default "a" and "b") registered."""
    registry = LoRARegistry()
    adapters = {}
    for name in names or ("a", "b"):
        adapters[name] = await registry.register(name, f"/weights/{name}")
    return Side(registry, adapters, **kwargs)


async def settle(rounds: int = 20) -> None:
    """Let every runnable task run until it blocks (gates, or nothing left to do)."""
    for _ in range(rounds):
        await asyncio.sleep(0)
