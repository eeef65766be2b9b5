"""The seed scenarios for `terminus explore`: the real drivers under every ordering.

Each scenario is data -- its actors (the lifelines), its bounds (faults per run) and a
world builder -- and each world is a thin adapter: it builds the real driver
(`TokenizerSide`, `DisaggPrefill`, `PrefetchSite` on simulated ranks) or the seed's
pre-fix logic (`naive=True`, from `terminus.effects.sim.naive` / `.scenarios`), lists
the steps enabled now, fires one by calling the driver, and reports the invariants.
The generic search is `terminus.fsm.explore`.

    lora         seed 1: a request and a sampling group (n=2, one prompt) on adapter
                 "a": acquire, tokenize, warm-up, fan-out, scheduler results; abort and
                 client disconnect at every point; an adapter upsert; one fault per run
                 (acquire, tokenize, send or a scheduler error)
    disagg       seed 2: one request of 3 chunks, at most 2 in flight; abort, bootstrap
                 failure, transfer failure at every point, a sender whose abort raises;
                 an abort during the transfer waits (`awaiting_sender`) for the sender:
                 it confirms it stopped, or (never told) finishes or fails the transfer,
                 or the clock passes its deadline; two faults per run
    prefetch-N   seed 3 (N = 2, 3, 4 ranks): every local class (none, pending, active;
                 on 2 ranks also with a page written; up to 3 also completed) on every
                 rank when the abort comes;
                 one rank's collective failing at each collective, the peers' timeouts
                 and the group teardown that follows

Invariants after every step (names as the report prints them): `pool-ledger` (each
pool's units in use equal what the ledger -- or, for the naive logic, its own
bookkeeping -- says is held), `double-release`, `release-outside-terminal`,
`freed-while-read` (a running chunk's pages, a peer still in the collective),
`one-terminal-output`, `driver-error` (the driver raised on a happening of the
scenario), `rank-waiting-forever`; at quiescence: `pools-full`, `lora-counters-zero`,
`every-request-terminal`. Per-step facts are kept as sticky counts in the world's key,
so the reduction keeps them (see `terminus.fsm.explore`).

Nothing in the library imports this module; `terminus explore` does (its entry point).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Generator, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from terminus.effects.disagg import DisaggPools, DisaggPrefill
from terminus.effects.output import OutputLog, TerminalOutput
from terminus.effects.prefetch import BarrierOp, PrefetchSite, ReduceOp
from terminus.effects.prefix_cache import PrefixCache
from terminus.effects.tokenizer import InvalidRequest, TokenizerSide
from terminus.effects.transport import Poll, TransportError
from terminus.fsm import DoubleRelease, TransitionRecord
from terminus.fsm.explore import ExploreReport, Step, Violation, explore, mermaid, parse_steps
from terminus.fsm.explore import replay as replay_steps
from terminus.kernels import ReleaseUnderflow
from terminus.kernels.collective import CollectiveTimeout, grid_partitions
from terminus.kernels.errors import DoubleFree, UnknownAdapter
from terminus.kernels.host import HostPagePool
from terminus.kernels.lora import LoRARegistry
from terminus.states.request import client_rid

from .naive import NaiveTokenizer
from .scenarios import _Naive, _Plan
from .transport import FakeTransport

__all__ = ["SCENARIOS", "SimScenario", "main", "scenario"]

_DOUBLE = (DoubleFree, DoubleRelease, ReleaseUnderflow)


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    stack = [e]
    while stack:
        x = stack.pop()
        if x in out:
            continue
        out.append(x)
        stack.extend(getattr(x, "exceptions", ()) or ())
        stack.extend(getattr(x, "errors", ()) or ())
        for y in (getattr(x, "error", None), x.__cause__, x.__context__):
            if isinstance(y, BaseException):
                stack.append(y)
    return out


class _Sticky:
    """Per-step facts kept as counts (part of the key), and the fault budget."""

    def __init__(self, faults: int) -> None:
        self.sticky: Counter[str] = Counter()
        self.detail: dict[str, str] = {}
        self.faults_left = faults
        self.used: set[str] = set()

    def note(self, invariant: str, detail: str) -> None:
        self.sticky[invariant] += 1
        self.detail.setdefault(invariant, detail)

    def caught(self, e: BaseException, where: str) -> None:
        """An exception escaped the driver while `where` happened."""
        if any(isinstance(x, _DOUBLE) for x in _chain(e)):
            self.note("double-release", f"{where}: {e!r}")
        else:
            self.note("driver-error", f"{where}: {type(e).__name__}: {e}")

    def sticky_violations(self) -> list[Violation]:
        return [(k, self.detail[k]) for k in sorted(self.sticky)]

    def sticky_key(self) -> tuple[Any, ...]:
        return (tuple(sorted(self.sticky.items())), self.faults_left, tuple(sorted(self.used)))

    def once(self, name: str) -> bool:
        return name not in self.used

    def fault_ok(self, name: str) -> bool:
        return self.faults_left > 0 and name not in self.used

    def spend(self, name: str, fault: bool = False) -> None:
        self.used.add(name)
        if fault:
            self.faults_left -= 1


def _terminal_sink(counter: list[int]) -> Callable[[TransitionRecord], None]:
    # Counts transitions into terminal states, whatever the machine; the plan runs there.
    def sink(r: TransitionRecord) -> None:
        if r.decision == "transition" and r.plan is not None:
            counter[0] += 1
    return sink


# =====================================================================================
# seed 1: LoRA usage counters over TokenizerSide and the real registry
# =====================================================================================

_ACTOR: contextvars.ContextVar[str] = contextvars.ContextVar("explore_actor", default="?")


class _Calls:
    """The outside calls a driver awaits (acquire, tokenize): each waits until the
    explorer completes it (`ok`) or fails it, as its own step."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pending: dict[tuple[str, str], asyncio.Future[bool]] = {}

    async def wait(self, what: str) -> bool:
        f: asyncio.Future[bool] = self.loop.create_future()
        self.pending[(_ACTOR.get(), what)] = f
        try:
            return await f
        finally:
            self.pending.pop((_ACTOR.get(), what), None)


class _GateRegistry:
    def __init__(self, inner: LoRARegistry, calls: _Calls) -> None:
        self.inner = inner
        self.calls = calls
        self.release_nowait = inner.release_nowait

    async def acquire(self, names: Any) -> Any:
        if not await self.calls.wait("acquire"):
            raise UnknownAdapter(["a"])
        return await self.inner.acquire(names)

    async def release(self, ids: Any) -> None:
        await self.inner.release(ids)


class _GateTokenizer:
    def __init__(self, calls: _Calls) -> None:
        self.calls = calls

    async def tokenize(self, prompt: Any) -> Any:
        if not await self.calls.wait("tokenize"):
            raise InvalidRequest(f"prompt {prompt!r} is not valid input")
        return [1, 2]


class _Scheduler:
    """The scheduler link: records what was sent, by the `RequestKey` it was given (the
    results go back by that key); a send armed to fail (by client id) raises."""

    def __init__(self) -> None:
        self.running: dict[Any, bool] = {}  # key -> aborted by the tokenizer
        self.fail: set[Any] = set()
        self.sent = 0

    def send(self, key: Any, tokens: Any, lora_id: int | None) -> None:
        if client_rid(key) in self.fail:
            raise ConnectionError(f"scheduler link closed while sending {key}")
        self.running[key] = False
        self.sent += 1

    def abort(self, key: Any) -> None:
        if key in self.running:
            self.running[key] = True

    def take(self, rid: str) -> Any:
        """Forget the request whose client id is `rid`; returns its key."""
        key = next(k for k in self.running if client_rid(k) == rid)
        del self.running[key]
        return key


class LoRAWorld:
    """Seed 1's world: `TokenizerSide` (or `NaiveTokenizer`) over the real registry."""

    RID, GROUP = "r", "g"

    def __init__(self, naive: bool, faults: int = 1) -> None:
        self.naive = naive
        self.s = _Sticky(faults)
        self.loop = asyncio.new_event_loop()
        self.registry = LoRARegistry()
        self.loop.run_until_complete(self.registry.register("a", "/w/a"))
        self.calls = _Calls(self.loop)
        self.front = _GateRegistry(self.registry, self.calls)
        self.scheduler = _Scheduler()
        self.sink = OutputLog()
        self.terminal = [0]
        self.side: Any
        if naive:
            self.side = NaiveTokenizer(self.front, _GateTokenizer(self.calls), self.scheduler,
                                       self.sink)
        else:
            self.side = TokenizerSide(self.front, _GateTokenizer(self.calls), self.scheduler,
                                      self.sink)
            for m in (self.side.requests, self.side.sampling):
                m.add_sink(_terminal_sink(self.terminal))
        self.tasks: dict[str, asyncio.Task[Any]] = {}
        self._spawn(self.RID, lambda: self.side.submit("p", "a", rid=self.RID))
        self._spawn(self.GROUP, lambda: self.side.submit_batch(["q"], "a", n=2,
                                                               rid=self.GROUP))
        self._settle()

    def _spawn(self, actor: str, make: Callable[[], Any]) -> None:
        ctx = contextvars.copy_context()
        ctx.run(_ACTOR.set, actor)
        self.tasks[actor] = self.loop.create_task(make(), context=ctx)

    def _settle(self) -> None:
        loop: Any = self.loop
        for _ in range(64):
            loop.call_soon(loop.stop)
            loop.run_forever()
            if not loop._ready:
                break
        for actor, t in self.tasks.items():
            if t.done() and not t.cancelled() and f"task {actor}" not in self.s.used:
                exc = t.exception()
                if exc is not None:
                    self.s.used.add(f"task {actor}")
                    self.s.caught(exc, f"{actor}'s submission")

    def close(self) -> None:
        for t in self.tasks.values():
            t.cancel()
        try:
            self._settle()
        finally:
            self.loop.close()

    # -- steps --------------------------------------------------------------------------

    def _owner(self, rid: str) -> str:
        return self.GROUP if rid.startswith(self.GROUP) else self.RID

    def enabled(self) -> list[Step]:
        out: list[Step] = []
        reg = frozenset({"registry"})
        # Footprints: the actor ("r" or "g": its requests, calls, scheduler entries and
        # link), "registry" for any step that may acquire or release a reference, and
        # "faults" for the steps that spend the shared fault budget.
        faults = frozenset({"faults"})
        for (actor, what) in sorted(self.calls.pending):
            fp = frozenset({actor}) | reg
            out.append(Step("registry" if what == "acquire" else "tokenizer",
                            f"{what} of {actor} returns", fp, to=actor))
            if self.s.fault_ok(f"fail {what} {actor}"):
                out.append(Step("registry" if what == "acquire" else "tokenizer",
                                f"{what} of {actor} fails", fp | faults, to=actor))
        for actor in (self.RID, self.GROUP):
            fp = frozenset({actor, "registry"})
            if self.s.once(f"abort {actor}"):
                out.append(Step("client", f"abort {actor}", fp, to=actor))
            t = self.tasks[actor]
            if not t.done() and self.s.once(f"disconnect {actor}"):
                out.append(Step("client", f"disconnect {actor}", fp, to=actor))
        for key in sorted(self.scheduler.running, key=str):
            rid = str(client_rid(key))
            fp = frozenset({self._owner(rid), "registry"})
            if self.scheduler.running[key]:
                out.append(Step("scheduler", f"abort echo of {rid}", fp, to=self._owner(rid)))
            else:
                out.append(Step("scheduler", f"finish {rid}", fp, to=self._owner(rid)))
                if self.s.fault_ok(f"error {rid}"):
                    out.append(Step("scheduler", f"error {rid}", fp | faults,
                                    to=self._owner(rid)))
        for rid in (self.RID, self.GROUP):
            if self.s.fault_ok(f"break send {rid}"):
                out.append(Step("scheduler", f"link breaks for {rid}",
                                frozenset({rid}) | faults, to=rid))
        if self.s.once("upsert"):
            out.append(Step("admin", "upsert a", reg, to="registry"))
        return out

    def fire(self, step: Step) -> None:
        name = step.name
        before = self._held()
        late0 = 0 if self.naive else self.side.ledger.late_released
        term0 = self.terminal[0]
        under0 = self.side.underflows if self.naive else 0
        try:
            self._do(name)
        except Exception as e:
            self.s.caught(e, step.label)
        self._settle()
        if self.naive and self.side.underflows > under0:
            # The naive logic swallows the underflow (in production: a negative counter).
            self.s.note("double-release", f"{step.label} released a reference twice "
                                          "(the registry counter would go below zero)")
        if not self.naive and self._held() < before and self.terminal[0] == term0 \
                and self.side.ledger.late_released == late0:
            self.s.note("release-outside-terminal",
                        f"{step.label} returned a reference with no terminal transition")

    def _do(self, name: str) -> None:
        words = name.split()
        if name.endswith(" returns") or name.endswith(" fails"):
            what, actor, ok = words[0], words[2], words[3] == "returns"
            if not ok:
                self.s.spend(f"fail {what} {actor}", fault=True)
            self.calls.pending[(actor, what)].set_result(ok)
        elif words[0] == "abort" and words[1] != "echo":
            self.s.spend(name)
            self.side.abort(words[1])
        elif words[0] == "disconnect":
            self.s.spend(name)
            self.tasks[words[1]].cancel()
        elif name.startswith("abort echo of "):
            self.side.on_finish(self.scheduler.take(words[-1]), "abort")
        elif words[0] == "finish":
            self.side.on_finish(self.scheduler.take(words[1]))
        elif words[0] == "error":
            self.s.spend(name, fault=True)
            self.side.on_error(self.scheduler.take(words[1]), 500, "scheduler failed")
        elif words[0] == "link":
            self.s.spend(f"break send {words[-1]}", fault=True)
            rid = words[-1]
            self.scheduler.fail.update({rid, f"{rid}-warmup-0", f"{rid}-0", f"{rid}-1"})
        elif name == "upsert a":
            self.s.spend("upsert")
            self.loop.run_until_complete(self.registry.upsert("a", "/w/a2"))
        else:  # pragma: no cover - steps come from enabled()
            raise ValueError(f"unknown step {name!r}")

    # -- invariants ---------------------------------------------------------------------

    def _held(self) -> int:
        return sum(self.registry.counts().values())

    def _owned(self) -> int:
        """References the driver will release: ledger handles, or the naive's states."""
        if self.naive:
            return sum(1 for st in self.side.rid_to_state.values()
                       if st.get("lora_id") is not None)
        return self.side.ledger.count("lora")

    def check(self) -> list[Violation]:
        bad = self.s.sticky_violations()
        held, owned = self._held(), self._owned()
        if held != owned:
            bad.append(("pool-ledger", f"the registry counts {held} reference(s) in use, "
                                       f"the owners will release {owned}"))
        dup = sorted(r for r, n in self.sink.counts.items() if n > 1)
        if dup:
            bad.append(("one-terminal-output", f"{dup} streamed more than one terminal output"))
        return bad

    def check_final(self) -> list[Violation]:
        bad: list[Violation] = []
        if self._held():
            bad.append(("lora-counters-zero", f"counters {self.registry.counts()} at quiescence"))
        live = sorted(str(k) for k in (self.side.rid_to_state if self.naive
                                       else self.side.live))
        pending = sorted(a for a, t in self.tasks.items() if not t.done())
        if live or pending:
            bad.append(("every-request-terminal",
                        f"not terminal at quiescence: {live}; submissions pending: {pending}"))
        return bad

    def key(self) -> Hashable:
        if self.naive:
            inst: Any = tuple(sorted((str(r), st.get("lora_id") is not None,
                                      "tokens" in st, st.get("stream", True))
                                     for r, st in self.side.rid_to_state.items()))
        else:
            seen = {}
            for r in ("r", "g", "g-warmup-0", "g-0", "g-1"):
                i = self.side.get(r)
                if i is not None:
                    seen[r] = (i.state, len(self.side.ledger.owned(i)))
            inst = tuple(sorted(seen.items()))
        return (inst, tuple(sorted(self.registry.counts().items())),
                tuple(sorted(self.calls.pending)),
                tuple(sorted((str(k), v) for k, v in self.scheduler.running.items())),
                tuple(sorted(self.scheduler.fail)),
                tuple(sorted(self.sink.counts.items())),
                tuple((a, t.done()) for a, t in sorted(self.tasks.items())),
                self.s.sticky_key())


# =====================================================================================
# seed 2: disaggregated prefill over DisaggPrefill and real pools
# =====================================================================================


class DisaggWorld:
    """Seed 2's world: one request of 3 chunks (2 tokens each), at most 2 in flight.

    `transfer_live`: the sender may still read the KV. It stays set after an abort
    during the transfer until the sender says it stopped (a poll: ABORTED once told,
    else done or failed) or the clock passes the sender's deadline (the sender's own
    reads are bounded by it: its transport times out too).
    """

    RID = "d"
    CHUNK = 2
    CHUNKS = 3
    HOST = 1

    def __init__(self, naive: bool, faults: int = 2) -> None:
        self.naive = naive
        self.s = _Sticky(faults)
        self.pools = DisaggPools.make(kv_tokens=self.CHUNK * self.CHUNKS * 2, requests=1,
                                      mamba_slots=1, metadata_slots=1, host_pages=4,
                                      max_context_len=self.CHUNK * self.CHUNKS)
        self.transport = FakeTransport()
        self.cache = PrefixCache(self.pools.kv)
        self.sink = OutputLog()
        self.in_flight: list[int] = []
        self.scheduled = 0
        self.sender_armed = False
        self.transfer_live = False  # the sender may still be reading the KV
        self.late = False  # the clock passed the sender's deadline
        self.terminal = [0]
        plen = self.CHUNK * self.CHUNKS
        self.eng: Any
        if naive:
            self.eng = _Naive(self.pools, self.transport, self.cache, self.sink, self.CHUNK, 1)
            self.eng.add(_Plan(self.RID, plen, self.CHUNKS, None, False, self.HOST))
        else:
            self.eng = DisaggPrefill(self.pools, transport=self.transport, cache=self.cache,
                                     sink=self.sink, sender_deadline_s=1.0,
                                     clock=lambda: 2.0 if self.late else 0.0)
            for m in (self.eng.requests_machine, self.eng.chunks_machine):
                m.add_sink(_terminal_sink(self.terminal))
            self.eng.add(self.RID, plen, chunk_size=self.CHUNK, host_pages=self.HOST)

    # -- the request's state, either way ------------------------------------------------

    def _state(self) -> str:
        if self.naive:
            r = self.eng.reqs[self.RID]
            return "draining" if r.aborted and r.state == "prefilling" else r.state
        return str(self.eng.req(self.RID).state)

    def _terminal(self) -> bool:
        if self.naive:
            return self._state() in ("aborted", "succeeded", "bootstrap_failed", "failed")
        return bool(self.eng.req(self.RID).terminal)

    def enabled(self) -> list[Step]:
        out: list[Step] = []
        st = self._state()
        fp = frozenset({self.RID})
        if st == "bootstrapping" and self.s.once("bootstrap"):
            out.append(Step("sender", "bootstrap succeeds", fp, to="prefill"))
        if st in ("waiting", "prefilling") and self.scheduled < self.CHUNKS \
                and len(self.in_flight) < 2 and not (self.naive and self.eng.reqs[self.RID]
                                                     .aborted):
            out.append(Step("scheduler", f"launch chunk {self.scheduled}", fp, to="prefill"))
        if self.in_flight:
            out.append(Step("scheduler", f"result of chunk {self.in_flight[0]}", fp,
                            to="prefill"))
        if st in ("transferring", "awaiting_sender") and self.transfer_live:
            if self.transport.poll_state(self.RID) is Poll.ABORTED:
                # The abort reached the sender: it stops, and says so at the next poll.
                out.append(Step("sender", "confirms it stopped", fp, to="prefill"))
            else:
                # Still sending (never told, or its abort raised): it may finish or fail.
                out.append(Step("sender", "transfer done", fp, to="prefill"))
                if self.s.fault_ok("transfer fails"):
                    out.append(Step("sender", "transfer fails", fp, to="prefill"))
        if st == "awaiting_sender":
            # The confirmation may never come: the deadline ends the wait.
            out.append(Step("clock", "sender deadline passes", fp, to="prefill"))
        if self.s.once("abort"):
            out.append(Step("client", "abort", fp, to="prefill"))
        if self.s.fault_ok("bootstrap fails") and st not in ("transferring",
                                                             "awaiting_sender"):
            # The handshake can fail until the KV transfer starts (or be reported late).
            out.append(Step("sender", "bootstrap fails", fp, to="prefill"))
        if not self.sender_armed and self.s.fault_ok("sender abort raises") \
                and not self._terminal():
            out.append(Step("sender", "its abort will raise", fp, to="sender"))
        return out

    def fire(self, step: Step) -> None:
        before = self._in_use()
        term0 = self.terminal[0]
        try:
            self._do(step.name)
        except Exception as e:
            self.s.caught(e, step.label)
        after = self._in_use()
        freed = any(after[k] < before[k] for k in after)
        if freed and self.terminal[0] == term0 and not self.naive:
            self.s.note("release-outside-terminal", f"{step.label} freed pool units with no "
                                                    "terminal transition")

    def _do(self, name: str) -> None:
        e, rid = self.eng, self.RID
        if name == "bootstrap succeeds":
            self.s.spend("bootstrap")
            e.bootstrap(rid)
        elif name.startswith("launch chunk"):
            k = e.schedule(rid)
            if k is not None:
                self.in_flight.append(self.scheduled)
                self.scheduled += 1
        elif name.startswith("result of chunk"):
            k = self.in_flight.pop(0)
            sends = self.transport.sends[rid]
            e.result(rid, k)
            if self.transport.sends[rid] > sends:
                self.transfer_live = True
        elif name in ("transfer done", "transfer fails"):
            if name == "transfer done":
                self.transport.complete(rid)
            else:
                self.s.spend(name, fault=True)
                self.transport.break_transfer(rid)
            self.transfer_live = False
            e.poll(rid) if self.naive else e.poll_transfer(rid)
        elif name == "confirms it stopped":
            self.transfer_live = False
            e.poll_transfer(rid)
        elif name == "sender deadline passes":
            # The sender's reads are bounded by the same deadline (its transport times
            # out): past it, nothing reads the KV any more.
            self.late = True
            self.transfer_live = False
            e.poll_transfer(rid)
        elif name == "abort":
            self.s.spend("abort")
            try:
                e.abort(rid)
            except TransportError:
                if not self.naive:
                    raise
            # A sender told of the abort keeps reading until it confirms it stopped.
        elif name == "bootstrap fails":
            self.s.spend(name, fault=True)
            if self.naive:
                self._naive_bootstrap_failed()
            else:
                e.bootstrap_failed(rid)
        elif name == "its abort will raise":
            self.s.spend("sender abort raises", fault=True)
            self.sender_armed = True
            self.transport.fail("abort", rid)
        else:  # pragma: no cover
            raise ValueError(f"unknown step {name!r}")

    def _naive_bootstrap_failed(self) -> None:
        # The pre-fix bootstrap-failure cleanup: releases at once, in-flight chunks or not.
        r = self.eng.reqs[self.RID]
        if r.state in ("aborted", "succeeded", "bootstrap_failed"):
            return
        r.state = "bootstrap_failed"
        self.eng._release_local(r)
        self.sink.put(TerminalOutput(self.RID, "bootstrap_failed", message="bootstrap"))

    # -- accounting ---------------------------------------------------------------------

    def _in_use(self) -> dict[str, int]:
        p: Any = self.pools
        return {"kv": p.kv.capacity - p.kv.available, "mamba": p.mamba.capacity
                - p.mamba.available, "metadata": p.metadata.capacity - p.metadata.available,
                "host": p.host.occupied, "req_slot": p.table.capacity - p.table.available}

    def _held(self) -> dict[str, int]:
        """Units the driver's bookkeeping says it holds (the cache's KV counted as held)."""
        if not self.naive:
            acc = self.eng.accounting()
            out = {k: acc[k][0] for k in acc}
            out["host"] = out.pop("hicache")
            out["kv"] += self.cache.held_tokens
            return out
        r = self.eng.reqs[self.RID]
        kv = sum(int(t.numel()) for t in r.kv) + sum(int(t.numel())
                                                       for t in r.in_flight.values())
        return {"kv": kv + self.cache.held_tokens, "mamba": int(r.mamba is not None),
                "metadata": int(r.metadata >= 0),
                "host": int(r.prefetch.pages.numel()) if r.prefetch is not None else 0,
                "req_slot": int(r.req_slot is not None)}

    def _read_while_freed(self) -> str:
        # While a chunk runs it reads every earlier chunk's KV, the Mamba state and the
        # request's row; while the transfer is live the sender reads the KV.
        use = self._in_use()
        if self.in_flight:
            need = self.CHUNK * (max(self.in_flight) + 1)
            short = [k for k, v in (("kv", need), ("mamba", 1), ("req_slot", 1))
                     if use[k] < v]
            if short:
                return f"{short} freed while chunk {max(self.in_flight)} still runs"
        if self.transfer_live and use["kv"] < self.CHUNK * self.CHUNKS:
            return "KV freed while the sender still reads it"
        return ""

    def check(self) -> list[Violation]:
        bad = self.s.sticky_violations()
        read = self._read_while_freed()
        if read:
            bad.append(("freed-while-read", read))
        use, held = self._in_use(), self._held()
        diff = {k: (use[k], held[k]) for k in use if use[k] != held[k]}
        if diff:
            bad.append(("pool-ledger", "(in use, held) " + ", ".join(
                f"{k}={v}" for k, v in sorted(diff.items()))))
        dup = sorted(r for r, n in self.sink.counts.items() if n > 1)
        if dup:
            bad.append(("one-terminal-output", f"{dup} streamed more than one terminal output"))
        return bad

    def check_final(self) -> list[Violation]:
        bad: list[Violation] = []
        use = self._in_use()
        use["kv"] -= self.cache.held_tokens
        left = {k: v for k, v in use.items() if v}
        if left:
            bad.append(("pools-full", f"units still in use at quiescence: {left}"))
        if not self._terminal():
            bad.append(("every-request-terminal", f"the request is {self._state()!r}"))
        elif not self.sink.counts[self.RID]:
            bad.append(("every-request-terminal", "the request streamed no terminal output"))
        return bad

    def key(self) -> Hashable:
        if self.naive:
            r = self.eng.reqs[self.RID]
            inst: Any = (r.state, r.aborted, r.scheduled, len(r.kv), r.metadata >= 0)
        else:
            req = self.eng.req(self.RID)
            inst = (req.state, tuple(c.state for c in req.chunks),
                    tuple(sorted(Counter(h.kind for h in self.eng.ledger._iter()).items())))
        return (inst, tuple(self.in_flight), self.scheduled, self.transfer_live,
                self.transport.poll_state(self.RID), self.late, self.sender_armed,
                tuple(sorted(self._in_use().items())),
                self.cache.held_tokens, tuple(sorted(self.sink.counts.items())),
                self.s.sticky_key())


# =====================================================================================
# seed 3: the prefetch abort across ranks, PrefetchSite on simulated ranks
# =====================================================================================


class PrefetchWorld:
    """Seed 3's world: N ranks, each with its own host pool and `PrefetchSite`.

    Before a rank handles the abort its local state can move (queue, start the I/O,
    write a page, complete); the abort reaches every rank, each runs its protocol
    generator (`PrefetchSite.abort_steps`) up to its next collective, and a collective
    completes when every rank of its group waits at it. One rank's collective may fail
    (a fault): its generator gets the `CollectiveTimeout`, its peers time out once the
    collective can never complete, and `close_group` releases each stalled rank once no
    rank of its groups is still in a collective.
    """

    RID = "x"
    PAGES = 2
    ANCHOR = 1

    def __init__(self, ranks: int, naive: bool, faults: int = 1) -> None:
        self.n = ranks
        self.naive = naive
        self.s = _Sticky(faults)
        # Pages a rank's I/O may have written when the abort comes: 0 or 1 on 2 ranks, 0
        # beyond; a completed prefetch up to 3 ranks; with 4 only the three abort classes
        # (none, pending, active). A written page or a completed prefetch changes no
        # decision (completed is the missing class), and each multiplies the worlds.
        self.written = 1 if ranks <= 2 else 0
        self.groups = grid_partitions(ranks, 2 if ranks == 4 else ranks)
        self.names = tuple(g for g, _ in self.groups)
        self.cached: list[int] = [0] * ranks
        self.sites = [PrefetchSite(HostPagePool(self.PAGES + self.ANCHOR + 1), rank=r,
                                   insert=self._inserter(r)) for r in range(ranks)]
        self.anchors = []
        for site in self.sites:
            a = site.host.alloc(self.ANCHOR)
            assert a is not None
            self.anchors.append(a)
        self.aborted = False
        self.gens: dict[int, Generator[Any, Any, Any]] = {}
        self.waiting: dict[int, Any] = {}
        self.done: dict[int, str] = {}  # rank -> "ok" | "failed"
        self.failed_groups: set[tuple[int, int]] = set()  # (group kind, part index)
        self.in_barrier: dict[int, list[int]] = {}  # rank -> members of that barrier
        self.terminal = [0]
        for site in self.sites:
            site.machine.add_sink(_terminal_sink(self.terminal))

    def _locals(self) -> list[str]:
        out = ["pending", "active"]
        if self.written:
            out.append("active, 1 page written")
        if self.n <= 3:
            out.append("completed")
        return out

    def _inserter(self, r: int) -> Callable[[Any, torch.Tensor], None]:
        def insert(rid: Any, pages: torch.Tensor) -> None:
            self.cached[r] += int(pages.numel())
        return insert

    def _local(self, r: int) -> str:
        inst = self.sites[r].requests.get(self.RID)
        return "none" if inst is None else str(inst.state)

    def _part(self, gi: int, r: int) -> int:
        return next(i for i, p in enumerate(self.groups[gi][1]) if r in p)

    def _peers(self, r: int) -> set[int]:
        out: set[int] = set()
        for _, parts in self.groups:
            for p in parts:
                if r in p:
                    out.update(p)
        out.discard(r)
        return out

    def enabled(self) -> list[Step]:
        out: list[Step] = []
        # Footprints: a rank's own steps touch that rank, a collective's completion its
        # members; the abort and a collective's failure touch everything. Once a
        # collective failed, every step touches "collective" too: which ranks are stuck
        # (and may time out, or close their group) then depends on every rank.
        proto = frozenset({"collective"}) if self.failed_groups else frozenset()
        for r in range(self.n):
            a = f"rank {r}"
            fp = frozenset({a})
            pfp = fp | proto
            if not self.aborted:
                # The local state each rank is in when the abort comes, chosen in one step
                # (its I/O moving on until the rank handles the abort commutes with every
                # other rank's steps; "none" is choosing nothing).
                if self.s.once(f"local {r}"):
                    for local in self._locals():
                        out.append(Step(a, f"prefetch {local}", fp))
            elif r not in self.gens:
                out.append(Step(a, "handle abort", pfp, to="collective"))
            if r in self.waiting:
                if self.s.fault_ok("collective fails"):
                    out.append(Step(a, "its collective fails", None, to="collective"))
                if r in self._stuck_set(("failed",)):
                    out.append(Step(a, "collective times out", pfp, to="collective"))
            inst = self.sites[r].requests.get(self.RID)
            if inst is not None and inst.state in ("stalled", "abort_requested", "broken") \
                    and r not in self.waiting and not any(p in self.waiting
                                                          for p in self._peers(r)):
                out.append(Step(a, "close group", pfp))
        if not self.aborted:
            out.append(Step("client", "abort", None, to="collective"))
        for gi, (name, parts) in enumerate(self.groups):
            for pi, members in enumerate(parts):
                ops = [self.waiting.get(m) for m in members]
                if all(o is not None and o.group == gi for o in ops):
                    kind = "reduce" if isinstance(ops[0], ReduceOp) else "barrier"
                    out.append(Step("collective", f"{kind} {name}{pi} completes",
                                    proto | {f"rank {m}" for m in members}))
        return out

    def _stuck_set(self, causes: tuple[str, ...] = ("ok", "failed")) -> set[int]:
        """Ranks waiting at a collective that can never complete because a member of its
        group finished its protocol with one of `causes` ("ok": it left normally;
        "failed": its collective failed), waits at another kind of collective of the
        same group, or is itself stuck (a fixed point over the waiting ranks)."""
        stuck: set[int] = set()
        changed = True
        while changed:
            changed = False
            for r, op in self.waiting.items():
                if r in stuck:
                    continue
                members = self.groups[op.group][1][self._part(op.group, r)]
                for m in members:
                    w = self.waiting.get(m)
                    if self.done.get(m) in causes or m in stuck or (
                            w is not None and w.group == op.group and type(w) is not type(op)):
                        stuck.add(r)
                        changed = True
                        break
        return stuck

    def fire(self, step: Step) -> None:
        try:
            self._do(step)
        except Exception as e:
            self.s.caught(e, step.label)

    def _advance(self, r: int, reply: Any = None, error: BaseException | None = None) -> None:
        g = self.gens[r]
        try:
            op = g.throw(error) if error is not None else g.send(reply)
        except StopIteration:
            self.done[r] = "ok"
            self.waiting.pop(r, None)
            self.in_barrier.pop(r, None)
            return
        except Exception:
            self.done[r] = "failed"
            self.waiting.pop(r, None)
            self.in_barrier.pop(r, None)
            return
        self.waiting[r] = op
        if isinstance(op, BarrierOp):
            self.in_barrier[r] = self.groups[op.group][1][self._part(op.group, r)]

    def _do(self, step: Step) -> None:
        name = step.name
        if step.actor == "client":
            self.aborted = True
            return
        if step.actor == "collective":
            kind, gname = name.split()[0], name.split()[1]
            gi = self.names.index(gname.rstrip("0123456789"))
            pi = int(gname[len(self.names[gi]):])
            members = self.groups[gi][1][pi]
            if kind == "reduce":
                v = max(self.waiting[m].value for m in members)
                for m in members:
                    self._advance(m, reply=v)
            else:
                for m in members:
                    self.in_barrier.pop(m, None)
                    self._advance(m)
            return
        r = int(step.actor.split()[1])
        site = self.sites[r]
        if name.startswith("prefetch "):
            self.s.spend(f"local {r}")
            local = name[len("prefetch "):]
            site.queue(self.RID, self.anchors[r])
            if local != "pending":
                site.start(self.RID, self.PAGES)
            if local in ("active, 1 page written", "completed"):
                site.transfer(self.RID, 1)
            if local == "completed":
                site.complete(self.RID)
        elif name == "handle abort":
            self.gens[r] = site.abort_steps(self.RID, self.names, naive=self.naive)
            self._advance(r)
        elif name in ("its collective fails", "collective times out"):
            op = self.waiting[r]
            if name == "its collective fails":
                self.s.spend("collective fails", fault=True)
                self.failed_groups.add((op.group, self._part(op.group, r)))
            self.in_barrier.pop(r, None)
            kind = "reduce_max" if isinstance(op, ReduceOp) else "barrier"
            gname, parts = self.groups[op.group]
            if name == "its collective fails":
                # The backend raises on this rank (a peer process died): the abort ends
                # in PrefetchCollectiveFailed, `broken` after a barrier.
                self._advance(r, error=RuntimeError(
                    f"explored rank {r}: {kind} on {gname!r}: connection closed by peer"))
            else:
                self._advance(r, error=CollectiveTimeout(
                    f"explored rank {r}", kind, gname, parts[self._part(op.group, r)], 0.0,
                    ticket=None))
        elif name == "close group":
            site.close_group(self.RID)
        else:  # pragma: no cover
            raise ValueError(f"unknown step {name!r}")

    def _released(self, r: int) -> bool:
        return any(t[0] in ("free_tail", "free_prefix", "unlock")
                   for t in self.sites[r].trace)

    def _read_while_freed(self) -> str:
        # A rank releases only once no peer of its groups is still in the barrier: the
        # peer may still be writing pages the abort's barrier protects (I7, I10).
        for r in range(self.n):
            if self._released(r) and self.sites[r].requests[self.RID].state == "released":
                # Only a barrier of a group r belongs to protects r's pages.
                inside = sorted(p for p, members in self.in_barrier.items()
                                if p != r and r in members)
                if inside:
                    return f"rank {r} released while rank(s) {inside} are still in the barrier"
        return ""

    # -- accounting ---------------------------------------------------------------------

    def _accounts(self, r: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """((pages in use, pages held), (locked pages, locks held)) on rank r."""
        site = self.sites[r]
        held = self.ANCHOR + self.cached[r]
        locks = 0
        for h in site.ledger.owned(site.requests[self.RID]) if self.RID in site.requests \
                else []:
            if h.kind == "host_pages":
                p = h.value
                held += p.completed if p.terminated else int(p.pages.numel())
            else:
                locks += int(h.value.numel())
        return (site.host.occupied, held), (site.host.locked_pages(), locks)

    def check(self) -> list[Violation]:
        bad = self.s.sticky_violations()
        read = self._read_while_freed()
        if read:
            bad.append(("freed-while-read", read))
        for r in range(self.n):
            (use, held), (lk, lh) = self._accounts(r)
            if use != held or lk != lh:
                bad.append(("pool-ledger", f"rank {r}: host pages in use {use}, held {held}; "
                                           f"locked {lk}, lock references {lh}"))
                break
        # Stuck with no failed collective behind it: a rank left a collective its peers
        # are in (after a failure, the peers' timeouts are the documented recovery).
        by_fault = self._stuck_set(("failed",))
        forever = sorted(self._stuck_set() - by_fault)
        if forever:
            r = forever[0]
            bad.append(("rank-waiting-forever",
                        f"rank {r} waits in {type(self.waiting[r]).__name__} on group "
                        f"{self.names[self.waiting[r].group]!r}, which a peer left "
                        "without any collective failing"))
        return bad

    def check_final(self) -> list[Violation]:
        bad: list[Violation] = []
        for r in range(self.n):
            site = self.sites[r]
            if site.host.occupied != self.ANCHOR + self.cached[r] or site.host.locked_pages() \
                    or site.host.prefetch_occupied:
                bad.append(("pools-full", f"rank {r}: {site.host.occupied} pages in use "
                                          f"({self.ANCHOR + self.cached[r]} cached), "
                                          f"{site.host.locked_pages()} locked"))
                break
        live = [r for r in range(self.n) if self._local(r) not in ("none", "released",
                                                                    "completed")]
        if live or not self.aborted or self.waiting:
            bad.append(("every-request-terminal",
                        f"ranks {live} not released; waiting: {sorted(self.waiting)}"))
        return bad

    def key(self) -> Hashable:
        ranks = []
        for r in range(self.n):
            site = self.sites[r]
            p = site.prefetch_of(self.RID)
            ranks.append((self._local(r), None if p is None else (p.completed, p.stopped,
                                                                  p.terminated),
                          r in self.gens, self.done.get(r), repr(self.waiting.get(r)),
                          site.host.occupied, site.host.locked_pages(), self.cached[r],
                          self._released(r)))
        return (tuple(ranks), self.aborted, tuple(sorted(self.failed_groups)),
                tuple(sorted(self.in_barrier)), self.s.sticky_key())


# =====================================================================================
# scenarios as data, and the command
# =====================================================================================


@dataclass(frozen=True)
class SimScenario:
    """A named scenario: its actors (lifelines, in order), its world builder and what it
    covers. `naive` selects the seed's pre-fix logic instead of the machines."""

    name: str
    actors: tuple[str, ...]
    make: Callable[[bool], Any]
    doc: str
    naive: bool = False

    def build(self) -> Any:
        """A fresh world."""
        return self.make(self.naive)

    def with_naive(self, naive: bool) -> SimScenario:
        """The same scenario over the machines (False) or the naive logic (True)."""
        return SimScenario(self.name, self.actors, self.make, self.doc, naive)


def _prefetch(n: int) -> SimScenario:
    return SimScenario(
        f"prefetch-{n}", ("client", *(f"rank {r}" for r in range(n)), "collective"),
        lambda naive: PrefetchWorld(n, naive),
        f"seed 3 on {n} ranks: every local state, one collective failing at each one")


SCENARIOS: dict[str, SimScenario] = {
    s.name: s for s in (
        SimScenario("lora", ("client", "r", "g", "registry", "tokenizer", "scheduler",
                             "admin"),
                    lambda naive: LoRAWorld(naive),
                    "seed 1: a request and a sampling group (n=2) on one adapter"),
        SimScenario("disagg", ("client", "scheduler", "prefill", "sender", "clock"),
                    lambda naive: DisaggWorld(naive),
                    "seed 2: 3 chunks, 2 in flight, abort and faults at every point"),
        _prefetch(2), _prefetch(3), _prefetch(4),
    )
}
"""The shipped scenarios by name."""


def scenario(name: str, naive: bool = False) -> SimScenario:
    """The shipped scenario `name`; ValueError naming the known ones."""
    try:
        return SCENARIOS[name].with_naive(naive)
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; scenarios: "
                         f"{', '.join(SCENARIOS)}") from None


def _run_one(sc: SimScenario, bound: int | None, time_limit: float | None,
             reduction: bool, console: Any) -> ExploreReport:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                  TextColumn("{task.fields[states]} worlds, {task.fields[rate]:.0f}/s"),
                  TimeElapsedColumn(), console=console, transient=True,
                  disable=not console.is_terminal) as bar:
        task = bar.add_task(sc.name + (" (naive)" if sc.naive else ""), total=None,
                            states=0, rate=0.0)

        def progress(r: ExploreReport) -> None:
            bar.update(task, states=r.states, rate=r.worlds_per_second)

        return explore(sc, bound=bound, time_limit=time_limit, reduction=reduction,
                       progress=progress)


def main(argv: list[str]) -> int:
    """`terminus explore`: see README (Exploring every interleaving)."""
    from rich.console import Console

    from terminus.fsm.cli import CliError, parser, write_json

    p = parser("terminus explore", "Run the real drivers through every ordering of each "
               "seed scenario's events and faults, checking the invariants after every step.")
    p.add_argument("--scenario", action="append", choices=sorted(SCENARIOS),
                   help="a scenario to explore (repeatable; default: all)")
    p.add_argument("--bound", type=int, default=None, metavar="K",
                   help="at most K steps per run (default: none; the scenarios are finite)")
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="stop each scenario's search after S seconds (then not exhaustive)")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON to PATH")
    p.add_argument("--baseline", choices=["naive"],
                   help="explore the seeds' pre-fix logic instead of the machines")
    p.add_argument("--no-reduction", action="store_true",
                   help="explore without the sleep-set reduction (for comparison)")
    p.add_argument("--replay", metavar="FILE",
                   help="replay one counterexample (JSON with \"steps\", or one step a line)")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="write each counterexample as DIR/<scenario>-<invariant>.mmd "
                        "(Mermaid) and .json (replayable)")
    a = p.parse_args(argv)
    if a.bound is not None and a.bound < 1:
        raise CliError(f"--bound must be >= 1, got {a.bound}")
    naive = a.baseline == "naive"
    console = Console(stderr=False)
    names = a.scenario or list(SCENARIOS)
    if a.replay:
        if len(names) != 1:
            raise CliError("--replay needs exactly one --scenario")
        try:
            with open(a.replay) as f:
                labels = parse_steps(f.read())
        except OSError as e:
            raise CliError(f"cannot read {a.replay!r}: {e.strerror or e}") from None
        except ValueError as e:
            raise CliError(f"{a.replay!r}: {e}") from None
        sc = scenario(names[0], naive)
        try:
            rows = replay_steps(sc, labels)
        except ValueError as e:
            raise CliError(str(e)) from None
        broke = False
        for i, (step, bad) in enumerate(rows, 1):
            print(f"  {i}. {step.label}")
            for inv, detail in bad:
                broke = True
                print(f"     => {inv}: {detail}")
        print("replay: " + ("invariants broken" if broke else "no invariant broken"))
        return 1 if broke and not naive else 0
    out: dict[str, Any] = {"baseline": a.baseline or "machines", "scenarios": {}}
    found = 0
    for name in names:
        sc = scenario(name, naive)
        t0 = time.perf_counter()
        r = _run_one(sc, a.bound, a.time_limit, not a.no_reduction, console)
        dt = time.perf_counter() - t0
        out["scenarios"][name] = r.to_json()
        status = "exhaustive" if r.exhaustive else "CUT by the bound or time"
        print(f"{name}{' (naive)' if naive else ''}: {r.states} worlds, {r.transitions} "
              f"steps, {r.interleavings} interleavings, {r.quiescent} quiescent, depth "
              f"{r.max_depth}, {dt:.2f}s ({r.worlds_per_second:.0f} worlds/s; "
              f"{r.cpu_seconds:.2f}s of CPU), {status}; "
              f"{len(r.violations)} violation(s)")
        for v in r.violations:
            found += 1
            print(f"  {v.invariant}: {len(v.steps)} step(s)")
            print(v.numbered())
            if a.out:
                os.makedirs(a.out, exist_ok=True)
                stem = os.path.join(a.out, f"{name}{'-naive' if naive else ''}-{v.invariant}")
                with open(stem + ".mmd", "w") as f:
                    f.write(mermaid(sc.actors, v.steps, title=f"{name}: {v.invariant}",
                                    broke=f"{v.invariant}: {v.detail}"))
                with open(stem + ".json", "w") as f:
                    json.dump({"scenario": name, "baseline": a.baseline or "machines",
                               **v.to_json()}, f, indent=2)
                    f.write("\n")
    if a.json:
        write_json(a.json, out)
    sys.stdout.flush()
    return 1 if found and not naive else 0


def _demo(names: Sequence[str] = ()) -> None:  # pragma: no cover - manual timing aid
    for n in names or SCENARIOS:
        for naive in (False, True):
            r = explore(scenario(n, naive))
            print(n, naive, r.states, r.transitions, f"{r.seconds:.2f}s",
                  [(v.invariant, len(v.steps)) for v in r.violations])
