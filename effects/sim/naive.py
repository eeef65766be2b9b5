"""The naive baseline: the pre-fix logic of the three seeds, on the simulator's workload.

`terminus simulate --baseline naive` runs the same workload twice through the serving
loop (`terminus.effects.sim.serving.ServingLoop`): with the declared machines
(`machine_parts`) and with these parts (`naive_parts`), the logic each seed fixed,
written out as it was, so the summary can show each one's leak side by side:

* LoRA counters (seeds/lora-usage-counter-lifecycle.txt): a reference is released when
  the request's state is popped from `rid_to_state`. An abort that pops the state while
  the acquire is in flight orphans the id; a prefix warm-up releases a reference it does
  not own (the counter underflows); a parallel-sampling parent that fails before fan-out
  releases one reference of its n.
* The scheduler (seeds/disagg-prefill-abort-leak.txt): an abort while prefill chunks are
  in flight only marks the sequence, and the aborted chunk's result is dropped without
  releasing what the sequence holds (its row, KV tokens and Mamba state).
* Disaggregated prefill: `terminus.effects.sim.scenarios`' naive loop (middle results dropped, final
  results not checked, a raising sender abort skipping the local releases).
* Prefetch abort (seeds/unified-radix-prefetch-abort.txt): each rank decides on its own
  local state; ranks without active I/O skip the barrier the active ranks wait in.
"""

from __future__ import annotations

from typing import Any

from terminus.effects.disagg import DisaggPools
from terminus.effects.output import OutputSink, TerminalOutput
from terminus.effects.prefix_cache import PrefixCache
from terminus.effects.tokenizer import InvalidRequest
from terminus.effects.transport import TransportError
from terminus.kernels import ReleaseUnderflow
from terminus.states.request import RequestKey

from .scenarios import _Naive, _Plan
from .serving import Parts, Shared, SimConfig, SimPrefetch, SimScheduler, disagg_leaks
from .transport import FakeTransport

__all__ = ["NaiveDisagg", "NaiveParts", "NaivePrefetch", "NaiveScheduler", "NaiveTokenizer",
           "naive_parts"]


class NaiveTokenizer:
    """The pre-fix tokenizer: releases are coupled with popping `rid_to_state`."""

    def __init__(self, registry: Any, tokenizer: Any, scheduler: Any, sink: Any) -> None:
        self.registry = registry
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.sink = sink
        self.rid_to_state: dict[Any, dict[str, Any]] = {}
        self.underflows = 0
        self.orphans = 0
        """References acquired that no state will ever release."""

    # what ServingLoop reads
    @property
    def live(self) -> dict[Any, Any]:
        """Requests whose state is still held."""
        return self.rid_to_state

    @property
    def live_count(self) -> int:
        """How many requests' states are still held."""
        return len(self.rid_to_state)

    async def drain(self) -> None:
        """Nothing asynchronous to wait for."""

    def _release(self, lora_id: int | None) -> None:
        if lora_id is None:
            return
        try:
            self.registry.release_nowait(lora_id)
        except ReleaseUnderflow:
            self.underflows += 1  # in production: the counter goes negative, unload hangs

    def _pop(self, rid: RequestKey, outcome: str, status: int) -> None:
        st = self.rid_to_state.pop(rid, None)
        if st is None:
            return
        self._release(st.get("lora_id"))
        if st.get("stream", True):
            self.sink.put(TerminalOutput(rid.rid, outcome, status))

    async def submit(self, prompt: Any, lora: str | None = None, *, rid: Any) -> None:
        """One request: acquire, tokenize, send."""
        rid = RequestKey(rid)
        st: dict[str, Any] = {"lora_id": None}
        self.rid_to_state[rid] = st
        if lora is not None:
            try:
                lora_id = await self.registry.acquire(lora)
            except KeyError:
                self._pop(rid, "rejected", 400)
                return
            if rid not in self.rid_to_state:
                self.orphans += 1  # aborted while acquiring: the seed's race
                return
            st["lora_id"] = lora_id
        try:
            tokens = await self.tokenizer.tokenize(prompt)
        except InvalidRequest:
            self._pop(rid, "rejected", 400)
            return
        if rid not in self.rid_to_state:
            return
        try:
            self.scheduler.send(rid, tokens, st["lora_id"])
        except ConnectionError:
            self._pop(rid, "dispatch_failed", 503)

    async def submit_batch(self, prompts: list[Any], lora: str | None, *, n: int,
                           rid: Any) -> None:
        """Parallel sampling: n references, a warm-up, then n children."""
        rid = RequestKey(rid, "group")
        prompt = prompts[0]
        ids: list[int] = []
        self.rid_to_state[rid] = {"lora_id": None, "stream": False, "n": n}
        if lora is not None:
            try:
                ids = await self.registry.acquire([lora] * n)
            except KeyError:
                self._pop(rid, "rejected", 400)
                return
            if rid not in self.rid_to_state:
                self.orphans += n  # aborted while acquiring: all n orphaned
                return
            self.rid_to_state[rid]["lora_id"] = ids[0]  # the parent remembers one
        try:
            tokens = await self.tokenizer.tokenize(prompt)
        except InvalidRequest:
            # Fails before fan-out: the parent releases the one id it remembers.
            self.rid_to_state[rid]["stream"] = True
            self._pop(rid, "rejected", 400)
            self.orphans += max(0, len(ids) - 1)
            return
        self.rid_to_state[rid]["tokens"] = tokens
        self.rid_to_state[rid]["ids"] = ids
        warm = RequestKey(rid.group, "warmup", 0)
        self.rid_to_state[warm] = {"lora_id": ids[0] if ids else None, "stream": False,
                                   "parent": rid}
        try:
            self.scheduler.send(warm, tokens, ids[0] if ids else None)
        except ConnectionError:
            self._pop(warm, "dispatch_failed", 503)

    def _fan_out(self, group: RequestKey) -> None:
        st = self.rid_to_state.pop(group, None)
        if st is None:
            return
        ids = st.get("ids") or [None] * st["n"]
        for k, lora_id in enumerate(ids):
            child = RequestKey(group.group, "child", k)
            self.rid_to_state[child] = {"lora_id": lora_id}
            try:
                self.scheduler.send(child, st["tokens"], lora_id)
            except ConnectionError:
                self._pop(child, "dispatch_failed", 503)

    def abort(self, rid: Any) -> None:
        """Pop the state (and children) and ask the scheduler to abort."""
        self._pop(RequestKey(rid), "aborted", 499)
        self._pop(RequestKey(rid, "group"), "aborted", 499)
        for k in range(64):
            child = RequestKey(rid, "child", k)
            if child in self.rid_to_state:
                self._pop(child, "aborted", 499)
                self.scheduler.abort(child)
        warm = RequestKey(rid, "warmup", 0)
        if warm in self.rid_to_state:
            self._pop(warm, "aborted", 499)
            self.scheduler.abort(warm)
        self.scheduler.abort(RequestKey(rid))

    def on_output(self, rid: Any) -> bool:
        """A streamed chunk."""
        return rid in self.rid_to_state

    def on_finish(self, rid: Any, reason: str = "stop") -> bool:
        """The scheduler finished `rid` (a warm-up finishing fans its group out)."""
        st = self.rid_to_state.get(rid)
        if st is None:
            return False
        self._pop(rid, "finished", 200)
        parent = st.get("parent")
        if parent is not None:
            self._fan_out(parent)
        return True

    def on_error(self, rid: Any, status: int = 500, message: str = "") -> bool:
        """The scheduler failed `rid`."""
        st = self.rid_to_state.get(rid)
        if st is None:
            return False
        self._pop(rid, "errored" if status >= 500 else "rejected", status)
        parent = st.get("parent")
        if parent is not None and parent in self.rid_to_state:
            self.rid_to_state[parent]["stream"] = True
            self._pop(parent, "errored", status)
        return True


class NaiveScheduler(SimScheduler):
    """The pre-fix scheduler: an abort with chunks in flight only marks the sequence,
    and the aborted chunk's result drops it without releasing what it holds."""

    dropped = 0

    def _apply_aborts(self) -> None:
        keep = []
        for rid in self.aborts:
            seq = self.by_rid.get(rid)
            if seq is not None and seq.row >= 0 and seq.in_flight and not seq.aborted:
                # Marked only; the row's KV, Mamba state and slot are never released.
                seq.aborted = True
                del self.by_row[seq.row]
                self.prefilling.pop(seq.row, None)
                del self.by_rid[rid]
                self.dropped += 1
                self._echo(seq, "aborted")
            else:
                keep.append(rid)
        self.aborts = keep
        super()._apply_aborts()


class NaiveDisagg:
    """`effects.scenarios`' naive disaggregated-prefill loop on the workload's requests.

    Its pools are sized so that nothing is ever short, even as it leaks, so it sees the
    same happenings as the machines.
    """

    def __init__(self, cfg: SimConfig, specs: list[Any], sink: OutputSink) -> None:
        self.cfg = cfg
        c = cfg.chunk_size
        tokens = sum(s.prompt_len for s in specs) + c
        n = max(1, len(specs))
        self.pools = DisaggPools.make(kv_tokens=-(-tokens // c) * c + c, requests=n,
                                      mamba_slots=n, metadata_slots=n, host_pages=4 * n,
                                      max_context_len=cfg.max_context_len,
                                      device=cfg.device, strict=False)
        self.transport = FakeTransport(auto_complete=True)
        self.cache = PrefixCache(self.pools.kv)
        self.sink = sink
        self.loop = _Naive(self.pools, self.transport, self.cache, sink, c, 1)
        self.live: dict[str, list[int]] = {}

    def add(self, spec: Any) -> None:
        """A new request (its faults armed as for the machines)."""
        c = self.cfg.chunk_size
        if spec.fault == "sender_abort":
            self.transport.fail("abort", spec.rid)
        plan = _Plan(spec.rid, spec.prompt_len, -(-spec.prompt_len // c), None,
                     spec.fault == "sender_abort", min(spec.prefetch_pages, 4))
        self.loop.add(plan)
        if spec.fault == "bootstrap":
            self.sink.put(TerminalOutput(spec.rid, "bootstrap_failed", message="bootstrap"))
            self.loop.reqs[spec.rid].state = "bootstrap_failed"
            return
        self.loop.bootstrap(spec.rid)
        self.live[spec.rid] = []

    def abort(self, rid: str) -> None:
        """The client aborts `rid`."""
        if rid in self.loop.reqs:
            try:
                self.loop.abort(rid)
            except TransportError:
                pass

    def step(self) -> None:
        """Results of last step's chunks, new chunks, transfers."""
        done = []
        for rid, in_flight in self.live.items():
            if in_flight:
                self.loop.result(rid, in_flight.pop(0))
            while len(in_flight) < 2:
                k = self.loop.schedule(rid)
                if k is None:
                    break
                in_flight.append(k)
            if self.loop.transferring(rid):
                self.loop.poll(rid)
            if self.loop.reqs[rid].state in ("succeeded", "aborted") and not in_flight:
                done.append(rid)
            elif self.loop.reqs[rid].aborted and not in_flight:
                done.append(rid)  # its cleanup was skipped: nothing will ever come
        for rid in done:
            del self.live[rid]

    @property
    def idle(self) -> bool:
        """No request is live."""
        return not self.live

    def stuck(self) -> list[Any]:
        """A few live requests (for the did-not-drain error)."""
        return list(self.live)[:5]

    def leaks(self) -> dict[str, int]:
        """Units missing from each pool once the cache is evicted."""
        return disagg_leaks(self.pools, self.cache)

    @property
    def requests(self) -> list[str]:
        """Every request id it was given."""
        return list(self.loop.reqs)


class NaivePrefetch(SimPrefetch):
    """The pre-fix prefetch abort: each rank decides on its own local state, so ranks
    without active I/O skip the barrier the active ranks wait in."""

    def abort_on_ranks(self, rid: Any) -> list[Any]:
        """Run the naive protocol (no reduction) of `rid` on every rank."""
        return self.ranks.abort(rid, naive=True)


class NaiveParts:
    """The seeds' pre-fix logic as a serving loop's parts (no declared machines)."""

    loop = "naive"

    def __init__(self, shared: Shared) -> None:
        self.scheduler = NaiveScheduler(shared.running, shared.cfg, shared.spec_of)
        self.tokenizer = NaiveTokenizer(shared.registry, shared.tokenizer, self.scheduler,
                                        shared.sink)
        self.scheduler.tokenizer = self.tokenizer  # type: ignore[assignment]
        self.disagg = NaiveDisagg(shared.cfg, [s for s in shared.workload
                                               if s.kind == "disagg"], shared.sink)
        self.prefetch = NaivePrefetch(shared.cfg)

    def machines(self) -> list[Any]:
        """None: the naive loop has no declared machines of its own."""
        return []

    @property
    def settled(self) -> bool:
        """Always: the naive tokenizer can hold states nothing will ever pop."""
        return True

    def leaks(self) -> dict[str, int]:
        """References orphaned by aborts that overtook an acquire, and counter underflows."""
        return {"lora_refs": self.tokenizer.orphans,
                "lora_underflows": self.tokenizer.underflows}

    def stuck(self) -> dict[str, Any]:
        """Live disagg requests."""
        return {"disagg": self.disagg.stuck()}


def naive_parts(shared: Shared) -> Parts:
    """The parts that run the seeds' pre-fix logic (`terminus simulate --baseline naive`)."""
    return NaiveParts(shared)
