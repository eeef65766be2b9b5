"""The reference serving loop: every machine of `states/` driven on one workload.

    client ──► TokenizerSide (REQUEST, SAMPLING; LoRA registry)
                   │ send / abort                    ▲ on_output / on_finish / on_error
                   ▼                                 │
               SimScheduler ── rows of a RunningBatch (SEQUENCE) over KV / Mamba / slots
                   │   chunked prefill, two chunks in flight, batched decode steps,
                   │   one batched release per plan per step
                   ├─► DisaggPrefill (DISAGG_PREFILL, CHUNK) over a fake KV sender
                   └─► SimulatedRanks (PREFETCH) host pages across attention ranks

Nothing here frees a resource: the loop delivers events, and only the machines'
terminal transitions release what the ledger (or the batch row) owns. A real engine
replaces the fakes at the edges (tokenizer, transport, model) and keeps the rest.

The loop owns what both of its variants share (the workload, the scheduler's pools and
running batch, the LoRA registry, the fake tokenizer and the one `OutputLog` every
terminal output goes to: a `Shared`). The rest, the `Parts` (tokenizer side, scheduler,
disagg server, prefetch ranks), comes from a factory: `machine_parts` (here: the
declared machines) or `terminus.effects.sim.naive.naive_parts` (the seeds' pre-fix
logic). The loop itself has no branch on which it drives.
"""

from __future__ import annotations

import asyncio
import itertools
import operator
import sys
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import torch

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import ExceptionGroup

from terminus.effects.callsites import FaultPlan, InjectedFault, call_sites, proxy
from terminus.effects.disagg import DisaggPools, DisaggPrefill, PrefillRequest
from terminus.effects.output import OutputLog
from terminus.effects.prefetch import (
    PrefetchAbortTimeout,
    PrefetchCollectiveFailed,
    PrefetchSite,
)
from terminus.effects.prefix_cache import PrefixCache
from terminus.effects.request import RequestResources, lora_ledger
from terminus.effects.sequence import RunningBatch, SchedulerPools
from terminus.effects.tokenizer import InvalidRequest, TokenizerSide
from terminus.fsm import EffectError, ReleaseFailed, TransitionRecord
from terminus.kernels import HostPagePool, LoRARegistry
from terminus.kernels.collective import grid_partitions
from terminus.kernels.radix import RadixInsert
from terminus.states.request import RequestKey
from terminus.states.sequence import (
    ChunkDone,
    ChunkLaunched,
    Fail,
    Finish,
    LastChunkDone,
    SequenceAbort,
    Token,
)

from .ranks import SimulatedRanks
from .transport import FakeTransport
from .workload import RequestSpec, prompt_tokens, reply_tokens

__all__ = [
    "LEAK_KEYS",
    "NO_OUTPUT",
    "FakeTokenizer",
    "MachineParts",
    "Parts",
    "PartsFactory",
    "ServingLoop",
    "Shared",
    "SimConfig",
    "SimDisagg",
    "SimPrefetch",
    "SimScheduler",
    "machine_parts",
]

_STATUS: dict[str | None, int] = {"scheduler_400": 400, "scheduler_500": 500, "scheduler_503": 503}

LEAK_KEYS = ("kv_tokens", "mamba_slots", "request_slots", "metadata_slots", "host_pages",
             "prefetch_tokens", "lora_refs", "lora_underflows", "ledger_handles",
             "missing_streams", "duplicate_streams", "collective_deadlocks",
             "pool_violations")
"""The leak audit's resources, in the order the summary prints them."""

NO_OUTPUT = "no_output"
"""The outcome counted for a client request that streamed no terminal output at all (a
leak the naive loop has; the machines never count one)."""


class SimConfig(msgspec.Struct, frozen=True):
    """Sizes of the simulated engine (not of the workload)."""

    rows: int = 512
    kv_tokens: int = 1 << 17
    mamba_slots: int = 512
    max_context_len: int = 512
    chunk_size: int = 64
    page_size: int = 1  # KV tokens per page, scheduler and disaggregated prefill
    device: str = "cpu"
    strict: bool = False
    disagg_rows: int = 64
    disagg_kv_tokens: int = 1 << 15
    ranks: int = 4
    tp: int = 2
    host_pages: int = 4096


class _RegistryWithLatency(LoRARegistry):
    """The real registry, whose acquire yields to the event loop once first, as a
    registry behind a lock or an RPC does, so aborts can overtake it."""

    async def acquire(self, names: Any) -> Any:
        await asyncio.sleep(0)
        return await super().acquire(names)


class FakeTokenizer:
    """Tokenizes a prompt (its length) and rejects the prompts marked invalid."""

    def __init__(self) -> None:
        self.invalid: set[Any] = set()

    async def tokenize(self, prompt: Any) -> Any:
        """`prompt` is (rid, length); the tokens are just the length."""
        rid, length = prompt
        if rid in self.invalid:
            raise InvalidRequest(f"prompt of {rid!r} is not valid UTF-8", 400)
        return length


class _Seq:
    """The scheduler's view of one sequence: its spec, progress and row."""

    __slots__ = ("aborted", "chunks_left", "decoding", "fail_status", "in_flight",
                 "mamba", "max_new", "prompt", "reply", "rid", "row", "start", "status",
                 "tail", "tokens")

    def __init__(self, rid: Any, prompt: int, max_new: int, fail: str | None,
                 tokens: list[int] | None = None, reply: list[int] | None = None,
                 mamba: bool = False) -> None:
        self.rid = rid
        self.mamba = mamba  # its request's `RequestSpec.mamba` (it takes a Mamba slot)
        self.prompt = prompt  # prompt tokens still to prefill (past the cached prefix)
        self.tokens = tokens  # prompt and generated token ids (the prefix cache's key)
        self.reply = reply
        """The tokens the model replies (with `tokens` only), read when it finishes (its
        prefix-cache key is then its prompt and reply): a sequence aborted or failed
        before never makes them."""
        self.max_new = max_new
        self.fail_status = _STATUS.get(fail, 0)  # (`fail` None or not a scheduler fault: 0)
        """The status the scheduler fails it with halfway through decode (0: none), from
        its request's fault `fail`."""
        self.row = -1
        self.chunks_left = 0
        self.tail = 0
        """Tokens of its final chunk (the others are whole chunks), set when seated."""
        self.in_flight: deque[bool] = deque()  # True for the final chunk
        self.start = 0
        """The scheduler's decode tick when it started decoding: it has generated
        `ticks - start` tokens since (`SimScheduler.generated`)."""
        self.aborted = False
        self.decoding = False  # its final chunk's result was delivered (not aborted)
        self.status = 0


_row = operator.attrgetter("row")  # a sort key read in C

_PRUNE_TASKS = 256
"""`ServingLoop._submit` drops the done tasks when this many more were added since."""


class SimScheduler:
    """The scheduler process: a SchedulerLink for the tokenizer, rows for sequences."""

    def __init__(self, running: RunningBatch, cfg: SimConfig,
                 spec_of: Callable[[RequestKey], RequestSpec]) -> None:
        self.running = running
        self.cfg = cfg
        self.spec_of = spec_of
        self.tokenizer: TokenizerSide | None = None
        self.queue: deque[_Seq] = deque()
        self.by_row: dict[int, _Seq] = {}
        self.prefilling: dict[int, _Seq] = {}
        """The rows of `by_row` (in its order) with chunks to launch or in flight."""
        self.by_rid: dict[Any, _Seq] = {}
        self.aborts: list[Any] = []
        self.dispatch_failures: set[Any] = set()
        self._replies: dict[tuple[str, int], list[int]] = {}
        self.decoders: dict[int, _Seq] = {}
        """The rows of `by_row` whose sequence decodes (`decoding`, not aborted)."""
        self._failers: dict[int, _Seq] = {}
        """The rows of `decoders` the scheduler fails halfway (`fail_status`)."""
        self.ticks = 0
        """Decode steps made so far (steps whose decoding rows each took a token): a
        decoding sequence's count of generated tokens is `ticks - seq.start`, so a
        token costs no Python work per row; what happens at a count (its first
        output, its finish) is booked under the tick it happens at."""
        self._firsts: defaultdict[int, list[_Seq]] = defaultdict(list)
        """Tick -> sequences whose first token it makes (their `on_output`)."""
        self._finishing: defaultdict[int, list[_Seq]] = defaultdict(list)
        """Tick -> sequences whose last token (`max_new`) it makes."""
        running.on_retired = self._retired

    # -- SchedulerLink ----------------------------------------------------------------

    def send(self, rid: Any, tokens: Any, lora_id: int | None) -> None:
        """Queue a tokenized request; a dispatch fault raises as a broken socket would."""
        spec = self.spec_of(rid)
        if spec.rid in self.dispatch_failures:
            raise ConnectionError("scheduler socket closed")
        warmup = rid.role == "warmup"
        max_new = 1 if warmup else spec.max_new_tokens
        ids = None
        n = int(tokens)
        if self.running.cache is not None:
            ids = prompt_tokens(spec)  # a list of its own: cut in place
            if len(ids) > n:
                del ids[n:]
        seq = _Seq(rid, n, max_new, None if warmup else spec.fault, ids, mamba=spec.mamba)
        self.queue.append(seq)
        self.by_rid[rid] = seq

    def abort(self, rid: Any) -> None:
        """Abort `rid` at the next step (it is answered with an abort echo)."""
        self.aborts.append(rid)

    # -- one scheduler step ---------------------------------------------------------------

    def step(self) -> None:
        """Aborts, admission, chunk results, launches, decode, finishes and faults.

        Admission fires `Admit` at once (a row owning resources is never left vacant);
        every other event of the step is queued and delivered in one `Batch.step` at
        its end (`RunningBatch.flush`), so the rows that turn terminal (aborted,
        finished, failed) are released there, by one batched call per plan. What each
        row is in when the events are chosen follows from the scheduler's own view of
        it (chunks in flight, `decoding`), not from reading the batch back.
        """
        rb = self.running
        self._apply_aborts()
        self._admit()
        # Chunk results of the chunks launched last step (one result per row per step).
        # The same pass picks the rows that launch a chunk below (chunks left, not
        # aborted, fewer than two in flight), in `prefilling`'s order: nothing between
        # here and the launch changes a row's progress.
        done: list[int] = []
        last: list[int] = []
        prefilled: list[int] = []
        seqs: list[_Seq] = []
        prefilling = self.prefilling
        for seq in prefilling.values():
            in_flight = seq.in_flight
            if in_flight:
                if in_flight.popleft():
                    last.append(seq.row)
                    if not seq.aborted:
                        self._start_decoding(seq)
                else:
                    done.append(seq.row)
                if not seq.chunks_left:
                    if not in_flight:
                        prefilled.append(seq.row)
                    continue
            elif not seq.chunks_left:
                continue
            if not seq.aborted and len(in_flight) < 2:
                seqs.append(seq)
        for r in prefilled:
            del prefilling[r]
        rb.queue(done, ChunkDone)
        rb.queue(last, LastChunkDone)
        # Launch chunks: up to two in flight per row (the next overlapped). A second
        # chunk can only go to a row the first pass launched one to (nothing else
        # changes a row between the passes), so the second pass reads only those.
        c = self.cfg.chunk_size
        for _ in range(2):
            if not seqs:
                break
            rows = [seq.row for seq in seqs]
            sizes = [c if seq.chunks_left > 1 else seq.tail for seq in seqs]
            if not rb.append_kv(rows, sizes):
                break  # KV is short: the chunks wait for pages to come back
            for seq in seqs:
                seq.chunks_left -= 1
                seq.in_flight.append(seq.chunks_left == 0)
            rb.queue(rows, ChunkLaunched)
            seqs = [seq for seq in seqs if seq.chunks_left and len(seq.in_flight) < 2]
        # Decode: every decoding row gets one token (one KV slot each, one alloc), in
        # row order; a row the scheduler fails halfway fails before its token.
        decoders = self.decoders
        if self._failers:
            ticks = self.ticks
            failing = sorted((seq for seq in self._failers.values()
                              if ticks - seq.start >= seq.max_new // 2), key=_row)
            if failing:
                for seq in failing:
                    seq.status = seq.fail_status
                    self._stop_decoding(seq)
                rb.queue([seq.row for seq in failing], Fail)
        if decoders:
            rows = sorted(decoders)
            if rb.append_kv(rows, [1] * len(rows)):
                rb.queue(rows, Token)
                self.ticks = ticks = self.ticks + 1
                firsts = self._firsts.pop(ticks, None)
                tok = self.tokenizer
                if firsts is not None and tok is not None:
                    firsts.sort(key=_row)
                    for seq in firsts:
                        if decoders.get(seq.row) is seq:
                            tok.on_output(seq.rid)
                ending = self._finishing.pop(ticks, None)
                if ending is not None:
                    ending.sort(key=_row)
                    finished = []
                    for seq in ending:
                        if decoders.get(seq.row) is seq:
                            self._stop_decoding(seq)
                            if seq.tokens is not None:
                                self._extend_reply(seq)
                            finished.append(seq.row)
                    rb.queue(finished, Finish)
        rb.flush()

    def generated(self, seq: _Seq) -> int:
        """Tokens `seq` generated so far (while it decodes)."""
        return self.ticks - seq.start

    def _start_decoding(self, seq: _Seq) -> None:
        """Its final chunk's result is delivered: it decodes from this step on (its
        first token at the next tick, its last at `max_new` ticks from now)."""
        seq.decoding = True
        t = seq.start = self.ticks
        self.decoders[seq.row] = seq
        if seq.fail_status:
            self._failers[seq.row] = seq
        self._firsts[t + 1].append(seq)
        self._finishing[t + max(seq.max_new, 1)].append(seq)

    def _stop_decoding(self, seq: _Seq) -> None:
        """It finished, failed, was aborted or retired: no more tokens (what is booked
        for it under later ticks is skipped: it is no longer in `decoders`)."""
        seq.decoding = False
        if self.decoders.get(seq.row) is seq:
            del self.decoders[seq.row]
            self._failers.pop(seq.row, None)

    def _extend_reply(self, seq: _Seq) -> None:
        """Append its `max_new` generated tokens to its token ids (the prefix cache's key
        when it retires): the reply's, then 1s past a short reply."""
        toks = seq.tokens
        assert toks is not None
        reply = seq.reply
        if reply is None:
            reply = seq.reply = self._reply(seq)
        n = max(seq.max_new, 1)
        if len(reply) == n:  # (as `reply_tokens` makes it, unless max_new is 0)
            toks += reply
            return
        toks += reply[:n]
        if len(reply) < n:
            toks += [1] * (n - len(reply))

    def _reply(self, seq: _Seq) -> list[int]:
        """`seq`'s reply tokens (`workload.reply_tokens`, a pure function of the request
        and the count): one list, read only, for the samples of a request, which
        decode at about the same steps; the most recent few hundred are kept. A request
        of one sample has no other to share it: its reply is made and not kept."""
        spec = self.spec_of(seq.rid)
        if spec.n == 1:
            return reply_tokens(spec, seq.max_new)
        key = (spec.rid, seq.max_new)
        got = self._replies.get(key)
        if got is None:
            if len(self._replies) >= 512:
                self._replies.clear()
            got = self._replies[key] = reply_tokens(spec, seq.max_new)
        return got

    def _admit(self) -> None:
        rb = self.running
        k = min(len(self.queue), rb.pools.table.available)
        head: list[_Seq] = []
        flags: list[bool] = []
        if k and rb.cache is None:
            head = list(itertools.islice(self.queue, k))
            flags = [seq.mamba for seq in head]
        if head and sum(flags) <= rb.pools.mamba.available_size():
            # Everything at the head fits: the runs admit exactly as one by one would
            # (each run all or nothing, none refused), in one admission per kind. With a
            # prefix cache an admission matches prompts (and may be refused for KV), so
            # it takes the loop below.
            for mamba in (False, True):
                group = [seq for seq, f in zip(head, flags, strict=True) if f == mamba]
                if group:
                    rows = rb.admit(len(group), mamba, queued=True)
                    assert rows is not None
                    self._seat(group, rows)
            for _ in range(k):
                self.queue.popleft()
            return
        while self.queue:
            k = min(len(self.queue), rb.pools.table.available)
            if k == 0:
                return
            # One admission per Mamba/no-Mamba run at the head of the queue.
            queue = self.queue
            mamba = queue[0].mamba
            batch: list[_Seq] = []
            while queue and len(batch) < k and queue[0].mamba == mamba:
                batch.append(queue.popleft())
            prompts = None
            if rb.cache is not None:
                prompts = [seq.tokens if seq.tokens is not None else [] for seq in batch]
            rows = rb.admit(len(batch), mamba, prompts, queued=True)
            if rows is None:
                self.queue.extendleft(reversed(batch))
                return
            self._seat(batch, rows)

    def _seat(self, batch: list[_Seq], rows: torch.Tensor) -> None:
        matched = self.running.matched
        by_row, prefilling = self.by_row, self.prefilling
        c = self.cfg.chunk_size
        for seq, r in zip(batch, rows.tolist(), strict=True):
            seq.row = r
            # The cached prefix is not prefilled again.
            seq.prompt = prompt = seq.prompt - matched(r)
            k = -(-prompt // c)
            seq.chunks_left = k if k > 1 else 1
            # Its final chunk: what the whole chunks before it leave (a prompt the
            # cache holds entirely still prefills one whole chunk).
            tail = prompt - (k - 1) * c
            seq.tail = 1 if tail < 1 else c if tail > c else tail
            by_row[r] = seq
            prefilling[r] = seq

    def _apply_aborts(self) -> None:
        rows = []
        for rid in self.aborts:
            seq = self.by_rid.get(rid)
            if seq is None or seq.aborted:
                continue  # already retired, or a duplicate: the echo went out
            seq.aborted = True
            if seq.decoding:
                self._stop_decoding(seq)
            if seq.row < 0:  # still queued: it never owned a row
                self.queue.remove(seq)
                del self.by_rid[rid]
                self._echo(seq, "aborted")
            else:
                rows.append(seq.row)
        self.aborts.clear()
        self.running.queue(rows, SequenceAbort)

    def _retired(self, rows: torch.Tensor, state: str) -> None:
        seqs = [self.by_row.pop(r) for r in rows.tolist()]
        for seq in seqs:
            self.prefilling.pop(seq.row, None)
            if seq.decoding:
                self._stop_decoding(seq)
        errors: list[Exception] = []
        for seq in seqs:  # one echo refused (a LoRA release underflowing) stops no other
            self.by_rid.pop(seq.rid, None)
            try:
                self._echo(seq, state)
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0] if len(errors) == 1 else ExceptionGroup(
                f"{len(errors)} of {len(seqs)} retired sequences' echoes raised", errors)

    def _echo(self, seq: _Seq, state: str) -> None:
        tok = self.tokenizer
        if tok is None:
            return
        if state == "finished":
            tok.on_finish(seq.rid, "length")
        elif state == "failed" or (state == "aborted" and seq.status):
            tok.on_error(seq.rid, seq.status or 500, "scheduler failed the request")
        else:
            tok.on_finish(seq.rid, "abort")  # the abort echo: absorbed by the request

    @property
    def idle(self) -> bool:
        """Nothing queued, running or waiting to be aborted."""
        return not self.queue and not self.by_row and not self.aborts


_KV_ALLOC = next(s for s in call_sites("allocator") if (s.resource, s.method) == ("kv",
                                                                                "alloc"))


class _RefusingCache(PrefixCache):
    """The prefix cache, refusing the inserts of the request ids in `refusing`."""

    def __init__(self, kv: Any) -> None:
        super().__init__(kv)
        self.refusing: set[str] = set()
        self.refused = 0

    def insert(self, rid: Any, tokens: Sequence[int], kv_indices: torch.Tensor, *,
               owned_from: int = 0) -> RadixInsert:
        if rid in self.refusing:
            self.refused += 1
            raise RuntimeError(f"prefix cache refused the KV of {rid!r} (injected)")
        return super().insert(rid, tokens, kv_indices, owned_from=owned_from)


def disagg_leaks(pools: DisaggPools, cache: PrefixCache) -> dict[str, int]:
    """Units missing from each disaggregated-prefill pool once `cache` is evicted."""
    cache.evict_all()
    used = pools.in_use()  # our pools: every one is audited
    return {
        "kv_tokens": used["kv"],
        "mamba_slots": used["mamba"],
        "request_slots": used["table"],
        "metadata_slots": used["metadata"],
        "host_pages": pools.host.occupied,
    }


_SCHEDULING = ("waiting", "prefilling")  # where `DisaggPrefill.schedule` may launch
_TRANSFERRING = ("transferring", "awaiting_sender")  # where `poll_transfer` polls


class SimDisagg:
    """Disaggregated-prefill requests over a fake KV sender that fails on cue."""

    def __init__(self, cfg: SimConfig, sink: OutputLog,
                 specs: Sequence[RequestSpec] = ()) -> None:
        self.cfg = cfg
        # The prompts' token ids are the workload's, as the router hands them over:
        # made here, before the run (and its clock) starts, not at every `add` (the
        # naive loop's disagg server takes none, so `terminus bench e2e` would charge
        # their synthesis to the machines alone). Each is dropped once added.
        self.prompts: dict[str, tuple[int, ...]] = {
            s.rid: tuple(prompt_tokens(s)) for s in specs if s.kind == "disagg"}
        self.transport = FakeTransport(auto_complete=True)
        pools = DisaggPools.make(kv_tokens=cfg.disagg_kv_tokens, requests=cfg.disagg_rows,
                                 mamba_slots=cfg.disagg_rows, metadata_slots=cfg.disagg_rows,
                                 host_pages=cfg.host_pages,
                                 max_context_len=cfg.max_context_len, device=cfg.device,
                                 strict=cfg.strict, page_size=cfg.page_size)
        self.faults = FaultPlan(strict=False, count=False)  # it injects, it counts nothing
        self._kv = pools.kv
        pools.kv = proxy(pools.kv, "kv", self.faults)  # an allocator fault raises here
        self.cache = _RefusingCache(self._kv)
        self.engine = DisaggPrefill(pools, transport=self.transport, sink=sink,
                                    cache=self.cache)
        self.live: dict[str, tuple[PrefillRequest, deque[int]]] = {}
        """rid -> (its request, the indices of its chunks in flight, oldest first)."""
        self.errors: list[Exception] = []
        """Injected faults the driver raised (each left the request recoverable)."""
        # State ids `step` compares (`req._s`) instead of reading the `state` and
        # `terminal` properties, as the drivers' hot paths do.
        m = self.engine.requests_machine
        self._bootstrapping = m.states.index("bootstrapping")
        self._scheduling = frozenset(m.states.index(s) for s in _SCHEDULING)
        self._transferring = frozenset(m.states.index(s) for s in _TRANSFERRING)
        self._terminal = m.terminal

    def add(self, spec: RequestSpec) -> None:
        """A new request; its fault (if any) is armed on the transport."""
        rid = spec.rid
        fault = spec.fault
        if fault is None:
            pass  # (most requests: none of the tests below)
        elif fault == "bootstrap":
            self.transport.fail("bootstrap", rid, times=1)
        elif fault == "transport":
            self.transport.fail("send", rid, times=1)
        elif fault == "sender_abort":
            self.transport.fail("abort", rid)
        elif fault == "cache_insert":
            self.cache.refusing.add(rid)
        elif fault == "allocator":
            self.faults.arm(_KV_ALLOC)
        pages = spec.prefetch_pages
        req = self.engine.add(rid, spec.prompt_len, chunk_size=self.cfg.chunk_size,
                              host_pages=pages if pages < 4 else 4,  # (no min() call)
                              tokens=self.prompts.pop(rid, None) or tuple(prompt_tokens(spec)))
        self.live[rid] = (req, deque())

    @property
    def pools(self) -> DisaggPools:
        """The disaggregated-prefill server's pools."""
        return self.engine.pools

    def abort(self, rid: str) -> None:
        """The client aborts `rid` (absorbed when it already ended)."""
        if rid in self.engine.requests:
            self.engine.abort(rid, "aborted by client")

    def step(self) -> None:
        """Bootstrap, results of last step's chunks, new chunks, transfers.

        An injected fault (a refused alloc, a refused cache insert) surfaces as the
        driver's error: it is recorded in `errors` (caught at each driver call, with
        no wrapper frame around it), the request stays recoverable, the loop carries on.
        """
        e = self.engine
        kv: Any = self._kv  # our TokenKVAllocator (read past the fault proxy: no call)
        if kv.available < kv.capacity // 4:  # memory pressure: evict unlocked pages
            e.cache.evict(kv.capacity // 4 - kv.available)
        done = []
        errors = self.errors
        result, schedule, poll = e.result, e.schedule, e.poll_transfer
        bootstrapping, scheduling = self._bootstrapping, self._scheduling
        transferring, terminal = self._transferring, self._terminal
        for rid, (req, in_flight) in self.live.items():
            if req._s == bootstrapping:
                e.bootstrap(rid)
                if req._s == bootstrapping:
                    continue  # no metadata slot free yet: poll again next step
            if in_flight:
                try:
                    result(rid, in_flight.popleft())
                except (InjectedFault, ReleaseFailed) as err:
                    errors.append(err)
            # (`schedule` would return None for a request whose chunks are all out, or
            # that is not waiting or prefilling: scheduling leaves it prefilling.)
            if req._s in scheduling:
                chunks = req.chunks
                while len(in_flight) < 2 and len(chunks) < req.n_chunks:
                    try:
                        chunk = schedule(rid)
                    except (InjectedFault, ReleaseFailed) as err:
                        errors.append(err)
                        break
                    if chunk is None:
                        break
                    in_flight.append(chunk.index)
            elif req._s in transferring:  # (scheduling leaves a request prefilling)
                try:
                    poll(rid)
                except (InjectedFault, ReleaseFailed) as err:
                    errors.append(err)
            if not in_flight and terminal[req._s]:
                done.append(rid)
        for rid in done:
            del self.live[rid]
            e.forget(rid)  # a later client abort of it is an unknown id: absorbed here

    @property
    def idle(self) -> bool:
        """No request is live."""
        return not self.live

    def stuck(self) -> list[Any]:
        """A few live requests and their states (for the did-not-drain error)."""
        return [(r, self.engine.req(r).state) for r in list(self.live)[:5]]

    def leaks(self) -> dict[str, int]:
        """Units missing from each pool once the cache is evicted."""
        return {**disagg_leaks(self.engine.pools, self.engine.cache),
                "ledger_handles": self.engine.ledger.count()}


class SimPrefetch:
    """Storage prefetches of prompt prefixes into host pages on every attention rank.

    Ranks progress at different speeds (as they do: their I/O queues differ), so an
    abort finds them in different local states; the abort runs the rank-collective
    protocol on simulated ranks (lockstep, deterministic).
    """

    def __init__(self, cfg: SimConfig) -> None:
        self.cache: dict[tuple[int, Any], torch.Tensor] = {}
        self.sites = [PrefetchSite(HostPagePool(cfg.host_pages, cfg.device), rank=r,
                                   insert=self._inserter(r)) for r in range(cfg.ranks)]
        self.ranks = SimulatedRanks(self.sites, grid_partitions(cfg.ranks, cfg.tp))
        self.live: dict[Any, tuple[int, int]] = {}  # rid -> (start step, pages)
        self._waiting: dict[Any, list[list[Any]]] = {}
        """rid -> the ranks whose prefetch of it has not ended, each `[site, rank,
        running]`: `pending` until `running` is set (what `step` did to it: only
        `step` moves a live prefetch, so it reads no state back), made once when the
        prefetch is added, not at every step."""
        self.deadlocks = 0
        self.aborts = 0
        self.failing: set[Any] = set()  # rids whose abort collective raises
        self.collective_failures = 0

    def _inserter(self, rank: int) -> Callable[[Any, torch.Tensor], None]:
        def insert(rid: Any, pages: torch.Tensor) -> None:
            self.cache[(rank, rid)] = pages  # the host cache owns them now

        return insert

    def add(self, rid: Any, pages: int, now: int) -> None:
        """Queue the prefetch of `pages` pages of `rid` on every rank."""
        for s in self.sites:
            s.queue(rid)
        self.live[rid] = (now, pages)
        self._waiting[rid] = [[s, s.rank, False] for s in self.sites]

    def step(self, now: int) -> None:
        """Start (rank r waits r steps), transfer one page a step, complete."""
        done = []
        waiting = self._waiting
        for rid, (t0, pages) in self.live.items():
            ranks = waiting[rid]
            ended = False
            due = now - t0  # rank r starts once r steps passed
            for entry in ranks:
                s = entry[0]
                if entry[2]:
                    if s.transfer(rid, 1) >= pages:
                        s.complete(rid)
                        if s.requests[rid].terminal:
                            entry[2] = False
                            ended = True
                elif due >= entry[1] and s.start(rid, pages) is not None:
                    entry[2] = True  # (None: host pages short, still pending)
            if ended:
                ranks = waiting[rid] = [e for e in ranks if e[2]
                                        or not e[0].requests[rid].terminal]
                if not ranks:
                    done.append(rid)
        for rid in done:
            del self.live[rid]
            del waiting[rid]
            for s in self.sites:
                s.forget(rid)  # ended on every rank: nothing can reach it any more
        # Cache eviction under pressure, as a real host cache does.
        if any(s.host.available < s.host.capacity // 4 for s in self.sites):
            self.evict()

    def abort(self, rid: Any) -> None:
        """Abort `rid` on every rank together (a no-op once every rank completed).

        A collective that raises (a peer died: the `collective` fault) is recovered as
        documented: the group is torn down, then `close_group` releases on each rank.
        """
        if rid not in self.live:
            return
        del self.live[rid]
        del self._waiting[rid]
        self.aborts += 1
        outcomes = self.abort_on_ranks(rid)
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        failed = [e for e in errors if isinstance(e, PrefetchCollectiveFailed)]
        for e in errors:
            if not isinstance(e, (PrefetchAbortTimeout, PrefetchCollectiveFailed)):
                raise e  # a bug, not a peer that never came: fail loudly
        if failed:
            self.collective_failures += 1
            for e in failed:
                self.sites[e.rank].close_group(rid)
        elif errors:
            self.deadlocks += 1
        for s in self.sites:  # what ended is dropped; a rank left waiting keeps its own
            if s.requests[rid].terminal:
                s.forget(rid)

    def abort_on_ranks(self, rid: Any) -> list[Any]:
        """Run the rank-collective abort protocol of `rid`; each rank's outcome."""
        return self.ranks.abort(rid, fail=rid in self.failing)

    def evict(self) -> None:
        """The host cache drops every prefix it holds: one free per rank, of its pages
        in the order they were cached (the free list ends as one free per prefix
        leaves it, without a validation and a torch call per prefix)."""
        by_rank: dict[int, list[torch.Tensor]] = {}
        for (rank, _), pages in self.cache.items():
            by_rank.setdefault(rank, []).append(pages)
        for rank, held in by_rank.items():
            self.sites[rank].host.free(held[0] if len(held) == 1 else torch.cat(held))
        self.cache.clear()

    @property
    def idle(self) -> bool:
        """No prefetch is live."""
        return not self.live

    def leaks(self) -> dict[str, int]:
        """Host pages and prefetch tokens still held after the cache is evicted."""
        self.evict()
        return {
            "host_pages": sum(s.host.occupied for s in self.sites),
            "prefetch_tokens": sum(s.occupancy_tokens for s in self.sites),
            "ledger_handles": sum(s.ledger.count() for s in self.sites),
        }


@dataclass
class Shared:
    """What a serving loop builds once and lends to its parts."""

    cfg: SimConfig
    workload: list[RequestSpec]
    running: RunningBatch
    registry: LoRARegistry
    tokenizer: FakeTokenizer
    sink: OutputLog
    spec_of: Callable[[RequestKey], RequestSpec]


class Parts(Protocol):
    """The half of a serving loop that differs between the machines and the naive
    baseline. `tokenizer` is a tokenizer side (`submit`, `submit_batch`, `abort`,
    `drain`, `live`, `live_count`, and the scheduler's `on_output` / `on_finish` /
    `on_error`); `disagg` takes the disaggregated-prefill requests (`add`, `abort`, `step`, `idle`,
    `pools`, `leaks()`, `stuck()`)."""

    @property
    def loop(self) -> str:
        """The summary's `loop`: "machines" or "naive"."""
        ...

    @property
    def tokenizer(self) -> Any:
        """The tokenizer side the client talks to."""
        ...

    @property
    def scheduler(self) -> SimScheduler:
        """The scheduler over the loop's running batch."""
        ...

    @property
    def disagg(self) -> Any:
        """The disaggregated-prefill server."""
        ...

    @property
    def prefetch(self) -> SimPrefetch:
        """The storage prefetches across the attention ranks."""
        ...

    def machines(self) -> list[Any]:
        """Every bound machine object the parts drive (for traces and counts)."""
        ...

    @property
    def settled(self) -> bool:
        """The tokenizer side holds nothing that can still end."""
        ...

    def leaks(self) -> dict[str, int]:
        """What only these parts can count, added to the loop's audit (`LEAK_KEYS`)."""
        ...

    def stuck(self) -> dict[str, Any]:
        """What is still live, by part (for the did-not-drain error)."""
        ...


PartsFactory = Callable[[Shared], Parts]
"""Builds a loop's parts from what it shares: `machine_parts` or `naive_parts`."""


class MachineParts:
    """The declared machines: `TokenizerSide` over one LoRA ledger, `SimScheduler`'s
    running batch, `DisaggPrefill` and the prefetch ranks' collective abort."""

    loop = "machines"

    def __init__(self, shared: Shared) -> None:
        self.running = shared.running
        self.scheduler = SimScheduler(shared.running, shared.cfg, shared.spec_of)
        self.ledger = lora_ledger(RequestResources(shared.registry, shared.sink,
                                                   self.scheduler))
        self.tokenizer = TokenizerSide(shared.registry, shared.tokenizer, self.scheduler,
                                       shared.sink, ledger=self.ledger)
        self.scheduler.tokenizer = self.tokenizer
        self.disagg = SimDisagg(shared.cfg, shared.sink, shared.workload)
        self.prefetch = SimPrefetch(shared.cfg)

    def machines(self) -> list[Any]:
        """The tokenizer's REQUEST and SAMPLING, SEQUENCE, DISAGG_PREFILL, CHUNK and
        each rank's PREFETCH."""
        return [self.tokenizer.requests, self.tokenizer.sampling,
                self.running.batch.machine, self.disagg.engine.requests_machine,
                self.disagg.engine.chunks_machine,
                *(site.machine for site in self.prefetch.sites)]

    @property
    def settled(self) -> bool:
        """No request of the tokenizer side is live."""
        return not self.tokenizer.live_count

    def leaks(self) -> dict[str, int]:
        """Handles the LoRA ledger still records as owned."""
        return {"ledger_handles": self.ledger.count()}

    def stuck(self) -> dict[str, Any]:
        """Live disagg and tokenizer-side requests with their states."""
        return {"disagg": self.disagg.stuck(),
                "tokenizer": [(k, v.state) for k, v in list(self.tokenizer.live.items())[:5]]}


def machine_parts(shared: Shared) -> Parts:
    """The parts that drive the declared machines (the default of `ServingLoop`)."""
    return MachineParts(shared)


class ServingLoop:
    """Runs a workload through its parts over real pools; see the module docstring.

    `parts` builds the tokenizer side, scheduler, disagg server and prefetch ranks from
    what the loop shares (`machine_parts` by default; `naive.naive_parts` for the
    seeds' pre-fix logic).
    """

    def __init__(self, workload: list[RequestSpec], cfg: SimConfig | None = None, *,
                 parts: PartsFactory = machine_parts,
                 adapters: tuple[str, ...] = ("sql-lora", "chat-lora", "code-lora"),
                 trace: Callable[[TransitionRecord], None] | None = None,
                 progress: Callable[[int], None] | None = None) -> None:
        self.cfg = cfg or SimConfig()
        self.workload = workload
        self.adapters = adapters
        self.trace = trace
        self.progress = progress
        self.specs = {s.rid: s for s in workload}
        self.pools = SchedulerPools(rows=self.cfg.rows,
                                    max_context_len=self.cfg.max_context_len,
                                    kv_tokens=self.cfg.kv_tokens,
                                    mamba_slots=self.cfg.mamba_slots,
                                    device=self.cfg.device, strict=self.cfg.strict,
                                    page_size=self.cfg.page_size)
        self.cache = PrefixCache(self.pools.kv, self.cfg.page_size, self.cfg.device)
        self.running = RunningBatch(self.pools, cache=self.cache)
        self.registry = _RegistryWithLatency()
        self.sink = OutputLog()
        self.tokenizer_fake = FakeTokenizer()
        self.parts = parts(Shared(self.cfg, workload, self.running, self.registry,
                                  self.tokenizer_fake, self.sink, self.spec_of))
        self.tokenizer = self.parts.tokenizer
        self.scheduler = self.parts.scheduler
        self.disagg = self.parts.disagg
        self.prefetch = self.parts.prefetch
        self.steps = 0
        self.seconds = 0.0
        self._tasks: list[asyncio.Task[Any]] = []
        """The requests' tasks, the done ones dropped at the next `_prune_tasks` (no
        done callback and its event-loop handle per request to drop each at once)."""
        self._prune_at = _PRUNE_TASKS
        self._create_task: Callable[[Any], asyncio.Task[Any]] = asyncio.ensure_future
        """The running loop's `create_task` while `run()` runs (`ensure_future` without
        its checks: `_submit` hands it a coroutine)."""
        self._peak: Counter[str] = Counter()
        self.violations: list[str] = []
        """What the pools' own checks raised at the last audit (`leaks()`)."""
        self.errors: Counter[str] = Counter()
        """Errors the parts recorded and carried on from (a best-effort step that
        raised, an injected fault the disagg driver recovered from), by "where: type"."""
        self.error_samples: dict[str, str] = {}
        """The message of the first error of each `errors` key."""

    def _error_lists(self) -> list[tuple[str, list[Any]]]:
        """The parts' error lists (ledgers, the disagg server and its driver), by where."""
        owners: list[tuple[str, Any]] = [("tokenizer", getattr(self.parts, "ledger", None))]
        engine = getattr(self.disagg, "engine", None)
        owners += [("disagg driver", self.disagg), ("disagg", engine),
                   ("disagg", getattr(engine, "ledger", None))]
        owners += [(f"prefetch rank{s.rank}", s.ledger) for s in self.prefetch.sites]
        out = []
        for where, owner in owners:
            errors = getattr(owner, "errors", None)
            if isinstance(errors, list):
                out.append((where, errors))
        return out

    def _shed_errors(self, lists: list[tuple[str, list[Any]]]) -> None:
        """Count the errors recorded since the last step, keep the first message of
        each kind, and drop the exceptions: kept, each holds its traceback's frames
        (and their locals) alive, which the collector then scans for the rest of the
        run, more at every error."""
        for where, errors in lists:
            if errors:
                for e in errors:
                    cause = e.error if isinstance(e, EffectError) else e
                    key = f"{where}: {type(cause).__name__}"
                    self.errors[key] += 1
                    if key not in self.error_samples:
                        self.error_samples[key] = str(e)
                errors.clear()

    def spec_of(self, key: RequestKey) -> RequestSpec:
        """The workload entry a request (or a child or warm-up of its group) belongs to."""
        return self.specs[key.group]

    def machines(self) -> list[Any]:
        """Every bound machine object the loop drives (for traces and counts)."""
        return self.parts.machines()

    async def run(self) -> None:
        """Drive the whole workload to completion."""
        t0 = time.perf_counter()
        self._create_task = asyncio.get_running_loop().create_task
        for name in self.adapters:
            await self.registry.register(name)
        if self.trace is not None:
            for m in self.machines():
                m.add_sink(self.trace)
        by_step: dict[int, list[RequestSpec]] = {}
        for s in self.workload:
            by_step.setdefault(s.arrival, []).append(s)
            if s.fault == "invalid_prompt":
                self.tokenizer_fake.invalid.add(s.rid)
            if s.fault == "dispatch":
                self.scheduler.dispatch_failures.add(s.rid)
            if s.fault == "stream" and self.parts.loop == "machines":
                # The client's stream is closed when it ends (the naive baseline's
                # loop has no best-effort stream to survive it).
                self.sink.failing.update((s.rid, *self._children(s)))
            if s.fault == "collective" and s.abort_at is not None:
                self.prefetch.failing.add(s.rid)
        aborts: dict[int, list[str]] = {}
        for s in self.workload:
            if s.abort_at is not None:
                aborts.setdefault(s.arrival + s.abort_at, []).append(s.rid)
        last_arrival = max(by_step, default=0)
        error_lists = self._error_lists()
        done = 0
        now = 0
        while True:
            for spec in by_step.get(now, ()):
                self._submit(spec, now)
            # New requests start and wait in their LoRA acquire; an abort due now
            # races it (I6: the reference it then gets is returned at once).
            await asyncio.sleep(0)
            for rid in aborts.pop(now, ()):
                self._abort(rid)
            self.scheduler.step()
            self.disagg.step()
            self.prefetch.step(now)
            self._sample_peaks()
            # Arrivals or aborts to come, or a request's task still running as the loop
            # yields (one that ends later counts as running at the check below: each
            # task's done callback, which dropped it from a set, ran after the loop
            # resumed; the tasks now end without one).
            busy = now < last_arrival or bool(aborts) or self._prune_tasks()
            await asyncio.sleep(0)
            self._shed_errors(error_lists)
            now += 1
            if self.progress is not None:
                arrived = sum(len(by_step.get(t, ())) for t in range(done, now))
                done = now
                if arrived:
                    self.progress(arrived)
            if (not busy and self.scheduler.idle and self.disagg.idle and self.prefetch.idle
                    and self.parts.settled):
                break
            if now > last_arrival + 10_000:
                raise RuntimeError(f"the simulation did not drain: {self._stuck()}")
        await self.tokenizer.drain()
        self._shed_errors(error_lists)
        self.steps = now
        self.seconds = time.perf_counter() - t0
        if self.trace is not None:
            for m in self.machines():
                m.remove_sink(self.trace)

    def _stuck(self) -> str:
        sch = self.scheduler
        parts = {
            "queued": [q.rid for q in list(sch.queue)[:5]],
            "running": [(q.rid, self.running.batch.machine.states[
                int(self.running.batch.states[q.row])]) for q in list(sch.by_row.values())[:5]],
            **self.parts.stuck(),
            "prefetch": list(self.prefetch.live)[:5],
            "tasks": sum(1 for t in self._tasks if not t.done()),
        }
        return ", ".join(f"{k}={v}" for k, v in parts.items() if v)

    def _sample_peaks(self) -> None:
        p, d = self.pools, self.disagg.pools
        pu, du = p.in_use(), d.in_use()  # our pools: every one is audited
        now = {
            "kv_tokens": pu["kv"] + du["kv"],
            "request_rows": pu["table"] + du["table"],
            "mamba_slots": pu["mamba"] + du["mamba"],
            "metadata_slots": du["metadata"],
            "host_pages": sum(s.host.occupied for s in self.prefetch.sites)
            + d.host.occupied,
            "live_requests": self.tokenizer.live_count,
            "cached_tokens": sum(c.held_tokens for c in self._caches()),
        }
        peak = self._peak
        for k, v in now.items():
            if v > peak[k]:
                peak[k] = v

    def peaks(self) -> dict[str, int]:
        """The most of each pool in use at once during the run."""
        return {k: int(self._peak[k]) for k in ("kv_tokens", "request_rows", "mamba_slots",
                                                "metadata_slots", "host_pages",
                                                "live_requests")}

    def _abort(self, rid: str) -> None:
        kind = self.specs[rid].kind
        if kind == "disagg":
            self.disagg.abort(rid)
            return
        if kind == "prefetch":
            self.prefetch.abort(rid)
        self.tokenizer.abort(rid)

    def _submit(self, spec: RequestSpec, now: int) -> None:
        kind, rid = spec.kind, spec.rid
        if kind == "disagg":
            self.disagg.add(spec)
            return
        if kind == "prefetch":
            self.prefetch.add(rid, spec.prefetch_pages, now)
        if spec.n > 1:
            coro: Any = self.tokenizer.submit_batch([(rid, spec.prompt_len)], spec.lora,
                                                    n=spec.n, rid=rid)
        else:
            coro = self.tokenizer.submit((rid, spec.prompt_len), spec.lora, rid=rid)
        tasks = self._tasks
        tasks.append(self._create_task(coro))
        if len(tasks) >= self._prune_at:
            self._prune_tasks()

    def _prune_tasks(self) -> bool:
        """Drop the done tasks; whether a task is still running. (`_submit` calls it
        when the list doubled since the last time: each task is looked at about twice.)"""
        tasks = self._tasks = [t for t in self._tasks if not t.done()]
        self._prune_at = 2 * len(tasks) + _PRUNE_TASKS
        return bool(tasks)

    # -- the audit --------------------------------------------------------------------

    def faults_fired(self) -> dict[str, int]:
        """Faults that really fired, by call-site kind, where the loop can count them."""
        disagg = getattr(self.disagg, "faults", None)
        cache = getattr(self.disagg, "cache", None)
        return {
            "allocator": len(disagg.fired) if disagg is not None else 0,
            "cache_insert": getattr(cache, "refused", 0),
            "collective": self.prefetch.collective_failures,
            "stream": sum(1 for rid in self.sink.failing if self.sink.counts[rid]),
            "transport": len(self.scheduler.dispatch_failures),
        }

    def _caches(self) -> list[PrefixCache]:
        """The scheduler's prefix cache and the disaggregated-prefill server's."""
        caches = [self.cache]
        other = getattr(self.disagg, "cache", None) or getattr(
            getattr(self.disagg, "engine", None), "cache", None)
        if isinstance(other, PrefixCache):
            caches.append(other)
        return caches

    def prefix_cache(self) -> dict[str, Any]:
        """The summary's `prefix_cache`: hit rate (cached prompt tokens over prompt
        tokens looked up), tokens evicted, the most tokens cached at once, cached tokens
        still locked after the run (0 unless a lock leaked), and the page audit: KV
        token slots by holder (free, cache locked, cache evictable, live requests) of
        the scheduler's pool, or the error naming a page with two holders or none.
        Call it after `run()` and before `leaks()` (which evicts the caches)."""
        caches = self._caches()
        looked = sum(c.lookup_tokens for c in caches)
        out: dict[str, Any] = {
            "hit_rate": sum(c.hit_tokens for c in caches) / looked if looked else 0.0,
            "lookups": sum(c.lookups for c in caches),
            "hit_tokens": sum(c.hit_tokens for c in caches),
            "inserted_tokens": sum(c.inserted_tokens for c in caches),
            "duplicate_tokens": sum(c.duplicate_tokens for c in caches),
            "evicted_tokens": sum(c.evicted_tokens for c in caches),
            "peak_cached_tokens": int(self._peak["cached_tokens"]),
            "locked_at_end": sum(c.locked_tokens for c in caches),
        }
        try:
            out["pages_by_holder"] = dict(self.running.audit())
        except AssertionError as e:
            out["pages_by_holder"] = {"error": str(e)}
        return out

    def leaks(self) -> dict[str, int]:
        """What is missing after the run: one number per resource, 0 when nothing leaked."""
        self.cache.evict_all()  # what stays cached is locked: a leak
        out: Counter[str] = Counter(self.pools.leaks())
        for k, v in self.disagg.leaks().items():
            out[k] += v
        for k, v in self.prefetch.leaks().items():
            out[k] += v
        # References not returned: what the registry still counts, plus (from the
        # parts) references a loop dropped with no owner left to return them (the
        # naive loop's orphans; the machines have none: a late acquire is released
        # at once), counter underflows and ledger handles.
        out["lora_refs"] = sum(abs(c) for c in self.registry.counts().values())
        for k, v in self.parts.leaks().items():
            out[k] += v
        streams = self.sink.counts  # read only here (`stream_counts` is a copy)
        out["missing_streams"] = self._missing_streams(streams)
        out["duplicate_streams"] = sum(c - 1 for c in streams.values() if c > 1)
        out["collective_deadlocks"] = self.prefetch.deadlocks
        self.violations = self.pool_violations()
        out["pool_violations"] = len(self.violations)
        return {k: int(out[k]) for k in LEAK_KEYS}

    def pool_violations(self) -> list[str]:
        """What the pools' own checks raise (a double free, a foreign index), one line per
        pool: a non-strict pool records them and its counts can balance a double free
        against a leak, so the audit asks each pool too."""
        d = self.disagg.pools
        pools = {"scheduler kv": self.pools.kv, "scheduler mamba": self.pools.mamba,
                 "scheduler request slots": self.pools.table, "disagg kv": d.kv,
                 "disagg mamba": d.mamba, "disagg request slots": d.table,
                 "disagg host": d.host,
                 **{f"rank {s.rank} host": s.host for s in self.prefetch.sites}}
        out = []
        for name, pool in pools.items():
            check = getattr(pool, "check", None)
            if check is None:
                continue
            try:
                check()
            except Exception as e:
                out.append(f"{name}: {e}")
        return out

    def stream_counts(self) -> Counter[Any]:
        """Terminal outputs per request id, every path."""
        return Counter(self.sink.counts)

    def _expected_streams(self) -> list[Any]:
        return [s.rid for s in self.workload]

    def _children(self, spec: RequestSpec) -> list[Any]:
        """The request ids of a sampling request's children."""
        return [RequestKey(spec.rid, "child", k).rid for k in range(spec.n)] if spec.n > 1 \
            else []

    def _streamed(self, rid: Any, streams: Counter[Any]) -> bool:
        # A sampling group streams through its children once it fanned out.
        return streams[rid] > 0 or any(streams[c] for c in self._children(self.specs[rid]))

    def _missing_streams(self, streams: Counter[Any]) -> int:
        """Client requests that streamed nothing (`_streamed` false): `_streamed` of each
        of `_expected_streams()`, with one dict read for a request that streamed itself
        and no children looked up for one of a single sample."""
        get, specs = streams.get, self.specs
        return sum(1 for rid in self._expected_streams()
                   if get(rid, 0) <= 0 and (specs[rid].n <= 1
                                        or not self._streamed(rid, streams)))

    def max_streams_per_request(self) -> int:
        """The most terminal outputs any one request id streamed (1 is right)."""
        return max(self.sink.counts.values(), default=0)

    def terminal_states(self) -> Counter[str]:
        """One outcome per client request (the values sum to the workload's size).

        A request's outcome is its first terminal output's; a sampling group that fanned
        out streams none itself and counts as `fanned_out` (the group's terminal state),
        its children under `child_terminal_states`; a request that streamed nothing at
        all counts as `NO_OUTPUT`.
        """
        first = self.sink.first()
        get = first.get
        outcomes: list[str] = []
        for spec in self.workload:
            own = get(spec.rid)
            if own is not None:
                outcomes.append(own.outcome)
            elif spec.n > 1 and any(c in first for c in self._children(spec)):
                outcomes.append("fanned_out")
            else:
                outcomes.append(NO_OUTPUT)
        return Counter(outcomes)  # (counted in C, in the order first seen)

    def child_terminal_states(self) -> Counter[str]:
        """Sampling children by the outcome of their first terminal output."""
        return Counter(o.outcome for rid, o in self.sink.first().items()
                       if rid not in self.specs)
