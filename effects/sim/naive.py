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
* Disaggregated prefill (seeds/disagg-prefill-abort-leak.txt): the result loop of
  `terminus.effects.sim.scenarios`' naive reference (middle results of an aborted
  request dropped without release, final results not checked, a raising sender abort
  skipping the local releases), inside the serving work of SGLang's prefill server
  that the machines do too: the prompt's cached prefix matched and locked, the
  request-to-token table written per chunk, all of the KV sent, and on success
  inserted into the prefix cache under the prompt's token ids (`NaiveDisagg`).
* Prefetch abort (seeds/unified-radix-prefetch-abort.txt): each rank decides on its own
  local state; ranks without active I/O skip the barrier the active ranks wait in.
"""

from __future__ import annotations

from typing import Any

import torch

from terminus.effects.disagg import DisaggPools
from terminus.effects.output import OutputSink, TerminalOutput
from terminus.effects.prefix_cache import PrefixCache
from terminus.effects.tokenizer import InvalidRequest
from terminus.effects.transport import Poll, TransportError
from terminus.kernels import ReleaseUnderflow
from terminus.states.request import RequestKey

from .scenarios import _SeedAbort
from .serving import Parts, Shared, SimConfig, SimPrefetch, SimScheduler, disagg_leaks
from .transport import FakeTransport
from .workload import prompt_tokens

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


class _PrefillReq:
    """One request of the naive prefill server, kept as SGLang's `Req` keeps it: fields
    set and cleared by hand (a field's "nothing" is None or -1)."""

    __slots__ = ("aborted", "cached", "in_flight", "kv", "mamba", "metadata", "n_chunks",
                 "node", "prefetch", "prefix", "prompt_len", "req_slot", "rid", "row",
                 "scheduled", "state", "tokens")

    def __init__(self, rid: str, tokens: tuple[int, ...], chunk_size: int) -> None:
        self.rid = rid
        self.tokens = tokens
        self.prompt_len = len(tokens)
        self.cached = 0  # prompt tokens matched in the prefix cache
        self.prefix: torch.Tensor | None = None  # their KV indices (the cache's pages)
        self.node: Any = None  # the radix node locked for them (None: no lock held)
        self.n_chunks = -(-self.prompt_len // chunk_size)
        self.metadata = -1
        self.prefetch: Any = None
        self.req_slot: torch.Tensor | None = None
        self.row = -1
        self.mamba: torch.Tensor | None = None
        self.kv: list[torch.Tensor] = []  # KV of its settled chunks, in order
        self.in_flight: dict[int, torch.Tensor] = {}
        self.scheduled = 0
        self.aborted = False
        self.state = "bootstrapping"


class _NaivePrefill(_SeedAbort):
    """The pre-fix disaggregated-prefill result loop as a serving prefill server.

    The same bugs as `scenarios._Naive` (the seed's reproduction, which this does not
    change): an abort while chunks are in flight only marks the request; an aborted
    middle result is dropped without release; the final result is not checked, so an
    aborted request is sent, cached and reported as succeeded; the sender's abort is
    called before the local releases and, when it raises, skips them (its prefix lock
    included). Around them, the serving work SGLang's prefill server does, the naive
    way (fields, direct pool and tree calls): the bootstrap handshake; a match of the
    prompt's longest cached prefix (all but its last token) locked until the request
    ends (`inc_lock_ref` / `dec_lock_ref`); chunks over the uncached rest, each chunk's
    KV written into the request's row of the request-to-token table (the matched prefix
    with the first); all of the request's KV sent when its last chunk settles; on
    success the KV inserted into the prefix cache under the prompt's token ids, what the
    tree did not take freed, the prefix unlocked (`cache_finished_req`).
    """

    def __init__(self, pools: DisaggPools, transport: FakeTransport, cache: PrefixCache,
                 sink: OutputSink, chunk_size: int, mamba_per_request: int = 1) -> None:
        self.pools, self.transport, self.cache, self.sink = pools, transport, cache, sink
        self.chunk_size = chunk_size
        self.mamba_per_request = mamba_per_request
        self.reqs: dict[str, _PrefillReq] = {}

    def add(self, rid: str, tokens: tuple[int, ...], host_pages: int) -> _PrefillReq:
        """A new request (its host prefetch started)."""
        r = self.reqs[rid] = _PrefillReq(rid, tokens, self.chunk_size)
        if host_pages:
            r.prefetch = self.pools.host.prefetch(host_pages)
        return r

    def bootstrap(self, r: _PrefillReq) -> None:
        """The handshake (TransportError when it fails), a metadata slot, the sender's
        init; then the cached prefix is matched and locked (after the handshake, as
        SGLang matches when it schedules the request: one whose handshake fails
        matches nothing; the machines match at `add` and unlock at the failure)."""
        self.transport.bootstrap(r.rid)
        i = self.pools.metadata.alloc()
        assert i is not None
        r.metadata = i
        r.state = "waiting"
        self.transport.init(r.rid, r.prompt_len, i)
        m = self.cache.match(r.tokens, limit=r.prompt_len - 1)
        if m.length:
            self.cache.tree.inc_lock_ref(m.node)
            r.node, r.prefix, r.cached = m.node, m.indices, m.length
            r.n_chunks = -(-(r.prompt_len - m.length) // self.chunk_size)

    def _release_local(self, r: _PrefillReq) -> None:
        # The seed's releases (`_SeedAbort`), and the prefix lock this server also takes.
        if r.node is not None:
            self.cache.tree.dec_lock_ref(r.node)
            r.node = None
        super()._release_local(r)

    def _cleanup_abort(self, r: _PrefillReq) -> None:
        r.state = "aborted"
        self.transport.abort(r.rid)  # raises before the local releases: the bug
        self._release_local(r)
        self.sink.put(TerminalOutput(r.rid, "aborted", message="aborted"))

    def schedule(self, r: _PrefillReq) -> int | None:
        """Launch the next chunk of `r`: its index, or None."""
        if (r.aborted or r.state not in ("waiting", "prefilling")
                or r.scheduled >= r.n_chunks):
            return None
        p = self.pools
        k = r.scheduled
        if k == 0:
            r.req_slot = p.table.alloc(1)
            assert r.req_slot is not None
            r.row = int(r.req_slot.tolist()[0])
            r.mamba = p.mamba.alloc(self.mamba_per_request)
        start = r.cached + k * self.chunk_size
        n = min(self.chunk_size, r.prompt_len - start)
        ps = p.page_size
        units = n if ps == 1 else -(-n // ps) * ps  # a chunk starts on a page of its own
        kv = p.kv.alloc(units)
        assert kv is not None and r.mamba is not None
        if units != n:
            kv = kv[:n]
        if k == 0 and r.prefix is not None:
            p.table.write(r.row, 0, torch.cat((r.prefix, kv)))
        else:
            p.table.write(r.row, start, kv)
        r.in_flight[k] = kv
        r.scheduled += 1
        r.state = "prefilling"
        return k

    def result(self, r: _PrefillReq, k: int) -> None:
        """Chunk `k`'s result reached the scheduler."""
        kv = r.in_flight.pop(k)
        if k != r.n_chunks - 1:
            if r.aborted:
                return  # dropped without release: the seed's leak
            r.kv.append(kv)
            return
        # The final chunk is not checked for an abort.
        r.kv.append(kv)
        r.state = "transferring"
        parts = [r.prefix, *r.kv] if r.prefix is not None else r.kv
        self.transport.send(r.rid, torch.cat(parts) if len(parts) > 1 else parts[0])

    def poll(self, r: _PrefillReq) -> None:
        """Poll the transfer; on success cache the KV and release."""
        if self.transport.poll(r.rid) is Poll.SUCCESS:
            r.state = "succeeded"
            self._cache_finished(r)
            self._release_local(r)
            self.sink.put(TerminalOutput(r.rid, "succeeded"))

    def _cache_finished(self, r: _PrefillReq) -> None:
        """Insert the prompt's KV under its token ids; free what the tree did not take."""
        own = r.kv
        r.kv = []
        ps = self.pools.page_size
        keep = r.cached
        for kv in own:  # up to the first chunk that ends inside a page
            keep += int(kv.numel())
            if ps != 1 and kv.numel() % ps:
                break
        parts = [r.prefix, *own] if r.prefix is not None else own
        kv_all = torch.cat(parts) if len(parts) > 1 else parts[0]
        free = self.pools.kv.free
        size = int(kv_all.numel())
        if keep < size:
            free(kv_all[keep:])  # past the first unaligned chunk: not cacheable
            kv_all = kv_all[:keep]
        tokens = r.tokens if keep == r.prompt_len else r.tokens[:keep]
        res = self.cache.insert(r.rid, tokens, kv_all, owned_from=r.cached)
        if res.duplicate_count:
            free(res.duplicates)
        if ps != 1:  # (one page a token: no tail past the last whole page)
            tail = res.leftover
            if tail.numel():
                free(tail)


class NaiveDisagg:
    """The naive disaggregated-prefill server (`_NaivePrefill`) on the workload's
    requests, with the prompts' token ids made before the run (as `SimDisagg` makes
    them) and the same memory-pressure eviction as `SimDisagg.step`.

    Its pools are sized so that nothing is ever short, even as it leaks, so it sees the
    same happenings as the machines: the KV pool is the machines' size plus every token
    the requests could ever hold, and the cache is evicted when more than three
    quarters of the machines' size is in use (leaked pages count, as they would).
    """

    def __init__(self, cfg: SimConfig, specs: list[Any], sink: OutputSink) -> None:
        self.cfg = cfg
        c = cfg.chunk_size
        ps = cfg.page_size
        # The prompts' token ids, as the router hands them over (see SimDisagg).
        self.prompts: dict[str, tuple[int, ...]] = {s.rid: tuple(prompt_tokens(s))
                                                    for s in specs}
        # Every chunk of every prompt on pages of its own (no match at all), and slack.
        most = sum(s.prompt_len + -(-s.prompt_len // c) * (ps - 1) for s in specs) + c + ps
        headroom = -(-most // ps) * ps
        n = max(1, len(specs))
        self.pools = DisaggPools.make(kv_tokens=cfg.disagg_kv_tokens + headroom, requests=n,
                                      mamba_slots=n, metadata_slots=n, host_pages=4 * n,
                                      max_context_len=cfg.max_context_len,
                                      device=cfg.device, strict=False, page_size=ps)
        self._low = headroom + cfg.disagg_kv_tokens // 4
        """Fewer free KV tokens than this: evict (the machines' threshold, their pool
        being `cfg.disagg_kv_tokens`)."""
        self.transport = FakeTransport(auto_complete=True)
        self.cache = PrefixCache(self.pools.kv)
        self.sink = sink
        self.loop = _NaivePrefill(self.pools, self.transport, self.cache, sink, c, 1)
        self.live: dict[str, tuple[_PrefillReq, list[int]]] = {}

    def add(self, spec: Any) -> None:
        """A new request (its faults armed as for the machines)."""
        rid = spec.rid
        if spec.fault == "sender_abort":
            self.transport.fail("abort", rid)
        elif spec.fault == "bootstrap":
            self.transport.fail("bootstrap", rid, times=1)
        tokens = self.prompts.pop(rid, None) or tuple(prompt_tokens(spec))
        r = self.loop.add(rid, tokens, min(spec.prefetch_pages, 4))
        try:
            self.loop.bootstrap(r)
        except TransportError:
            # Reported; what it holds (its host pages) is never released.
            r.state = "bootstrap_failed"
            self.sink.put(TerminalOutput(rid, "bootstrap_failed", message="bootstrap"))
            return
        self.live[rid] = (r, [])

    def abort(self, rid: str) -> None:
        """The client aborts `rid`."""
        if rid in self.loop.reqs:
            try:
                self.loop.abort(rid)
            except TransportError:
                pass

    def step(self) -> None:
        """Eviction under pressure, results of last step's chunks, new chunks, transfers."""
        kv: Any = self.pools.kv
        if kv.available < self._low:
            self.cache.evict(self._low - kv.available)
        loop = self.loop
        done = []
        for rid, (r, in_flight) in self.live.items():
            if in_flight:
                loop.result(r, in_flight.pop(0))
            while len(in_flight) < 2:
                k = loop.schedule(r)
                if k is None:
                    break
                in_flight.append(k)
            if r.state == "transferring":
                loop.poll(r)
            if not in_flight and (r.state in ("succeeded", "aborted") or r.aborted):
                done.append(rid)  # (aborted: its cleanup was skipped, nothing will come)
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
