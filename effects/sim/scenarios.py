"""Scenarios that reproduce the seed bugs, for tests and for `terminus simulate`.

`disagg_seed(naive, seed)` replays the production case of the disaggregated-prefill
abort leak (seeds/disagg-prefill-abort-leak.txt): a hybrid Mamba model, chunked
prefill with overlap (chunk k+1 is launched before chunk k's result is processed), and
aborts racing chunk results, some with a sender whose abort raises. The same seeded
script drives either

* the naive reference loop (`naive=True`): the pre-fix logic, written out as it was:
  an abort while a chunk is in flight only marks the request; an aborted middle result
  is dropped without release; a final result is not checked, so an aborted request is
  cached, sent and reported as finished; the sender's abort is called before the local
  releases and, when it raises, skips them; or
* the declared machines (`naive=False`): `terminus.effects.disagg.DisaggPrefill`.

Either way the run ends by evicting the prefix cache, and the report counts what the
pools are still missing and what reached the outside wrongly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from terminus.effects.disagg import DisaggPools, DisaggPrefill
from terminus.effects.output import OutputLog, OutputSink, TerminalOutput
from terminus.effects.prefix_cache import PrefixCache
from terminus.effects.transport import Poll, TransportError

from .transport import FakeTransport

__all__ = ["DisaggLeak", "PrefixLockLeak", "disagg_seed", "prefix_lock_leak"]


class DisaggLeak(msgspec.Struct, frozen=True):
    """What one `disagg_seed` run left behind (all zero means no leak).

    `kv_tokens_leaked`..`req_slots_leaked`: units the pools still miss after the run
    (prefix cache evicted); `kv_chunks_leaked` is `kv_tokens_leaked / chunk_size`.
    `aborted_cached` / `aborted_sent`: aborted requests inserted into the prefix cache /
    whose KV send started after the abort; `streams_missing` / `streams_duplicated`:
    requests that streamed no terminal output / more than one; `wrong_status`: aborted
    requests whose terminal output was not an abort. `ledger_handles`: handles the
    machines' ledger still records as owned after the run (the naive loop has none).
    """

    loop: str
    seed: int
    requests: int
    aborts: int
    sender_abort_failures: int
    chunk_size: int
    kv_tokens_leaked: int
    kv_chunks_leaked: float
    mamba_states_leaked: int
    metadata_slots_leaked: int
    host_pages_leaked: int
    req_slots_leaked: int
    aborted_cached: int
    aborted_sent: int
    streams_missing: int
    streams_duplicated: int
    wrong_status: int
    ledger_handles: int = 0

    @property
    def leaked(self) -> bool:
        """True when anything at all was left behind or reached the outside wrongly."""
        return any(getattr(self, f) for f in self.__struct_fields__[6:])


@dataclass(frozen=True)
class _Plan:
    rid: str
    prompt_len: int
    n_chunks: int
    # None: never aborted; -1: while waiting; k: just before chunk k's result is
    # processed (k == n_chunks: during the transfer).
    abort_at: int | None
    sender_fails: bool
    host_pages: int


def _script(seed: int, requests: int, chunk_size: int, max_chunks: int, p_abort: float,
            p_sender_fail: float) -> list[_Plan]:
    rng = random.Random(seed)
    plans = []
    for i in range(requests):
        n = rng.randint(1, max_chunks)
        prompt = (n - 1) * chunk_size + rng.randint(1, chunk_size)
        abort_at = rng.randint(-1, n) if rng.random() < p_abort else None
        plans.append(_Plan(f"req-{i}", prompt, n, abort_at,
                           abort_at is not None and rng.random() < p_sender_fail,
                           rng.randint(0, 2)))
    return plans


# -- the naive reference loop (pre-fix logic) ------------------------------------------


@dataclass
class _NaiveReq:
    plan: _Plan
    metadata: int = -1
    prefetch: Any = None
    req_slot: torch.Tensor | None = None
    mamba: torch.Tensor | None = None
    kv: list[torch.Tensor] = field(default_factory=list)
    in_flight: dict[int, torch.Tensor] = field(default_factory=dict)
    scheduled: int = 0
    aborted: bool = False
    state: str = "bootstrapping"


class _SeedAbort:
    """The pre-fix abort of a disaggregated-prefill request (the seed's): with chunks in
    flight it only marks the request, its cleanup deferred to a result path that drops
    it; otherwise the sender is told first, and when that raises the local releases are
    skipped. Shared by the seed's reproduction (`_Naive`) and the naive baseline's
    prefill server (`terminus.effects.sim.naive`), each with its own `_cleanup_abort`."""

    reqs: dict[str, Any]
    pools: DisaggPools

    def _cleanup_abort(self, r: Any) -> None:
        raise NotImplementedError

    def _release_local(self, r: Any) -> None:
        """The request's local releases, by hand, each field cleared as it is freed
        (its metadata slot, host pages, settled chunks' KV, Mamba state, table row)."""
        p = self.pools
        if r.metadata >= 0:
            p.metadata.free(r.metadata)
            r.metadata = -1
        if r.prefetch is not None:
            r.prefetch.terminate()
            r.prefetch.release()
            r.prefetch = None
        for kv in r.kv:
            p.kv.free(kv)
        r.kv = []
        if r.mamba is not None:
            p.mamba.free(r.mamba)
            r.mamba = None
        if r.req_slot is not None:
            p.table.free(r.req_slot)
            r.req_slot = None

    def abort(self, rid: str) -> None:
        """The client aborts `rid`."""
        r = self.reqs[rid]
        if r.state in ("aborted", "succeeded"):
            return
        if r.in_flight:
            r.aborted = True  # cleanup deferred to the result path
            return
        try:
            self._cleanup_abort(r)
        except TransportError:
            pass


class _Naive(_SeedAbort):
    """The pre-fix result loop, kept deliberately as it was (see the module docstring)."""

    def __init__(self, pools: DisaggPools, transport: FakeTransport, cache: PrefixCache,
                 sink: OutputSink, chunk_size: int, mamba_per_request: int) -> None:
        self.pools, self.transport, self.cache, self.sink = pools, transport, cache, sink
        self.chunk_size = chunk_size
        self.mamba_per_request = mamba_per_request
        self.reqs: dict[str, _NaiveReq] = {}
        self._anon = 1 << 40  # token ids no two prompts share

    def add(self, p: _Plan) -> None:
        r = self.reqs[p.rid] = _NaiveReq(p)
        if p.host_pages:
            r.prefetch = self.pools.host.prefetch(p.host_pages)

    def bootstrap(self, rid: str) -> None:
        r = self.reqs[rid]
        i = self.pools.metadata.alloc()
        assert i is not None
        r.metadata = i
        r.state = "waiting"

    def _cleanup_abort(self, r: _NaiveReq) -> None:
        r.state = "aborted"
        self.transport.abort(r.plan.rid)  # raises before the local releases: the bug
        self._release_local(r)
        self.sink.put(TerminalOutput(r.plan.rid, "aborted", message="aborted"))

    def schedule(self, rid: str) -> int | None:
        r = self.reqs[rid]
        if (r.aborted or r.state not in ("waiting", "prefilling")
                or r.scheduled >= r.plan.n_chunks):
            return None
        k = r.scheduled
        if k == 0:
            r.req_slot = self.pools.table.alloc(1)
            r.mamba = self.pools.mamba.alloc(self.mamba_per_request)
        n = min(self.chunk_size, r.plan.prompt_len - k * self.chunk_size)
        kv = self.pools.kv.alloc(n)
        assert kv is not None and r.req_slot is not None and r.mamba is not None
        r.in_flight[k] = kv
        r.scheduled += 1
        r.state = "prefilling"
        return k

    def result(self, rid: str, k: int) -> None:
        r = self.reqs[rid]
        kv = r.in_flight.pop(k)
        last = k == r.plan.n_chunks - 1
        if not last:
            if r.aborted:
                return  # dropped without release: the seed's leak
            r.kv.append(kv)
            return
        # The final chunk is not checked for an abort.
        r.kv.append(kv)
        kv_all = torch.cat(r.kv)
        self.cache.insert(rid, tuple(range(self._anon, self._anon + kv_all.numel())), kv_all)
        self._anon += int(kv_all.numel())
        r.kv = []
        r.state = "transferring"
        self.transport.send(rid, torch.cat([kv]))

    def transferring(self, rid: str) -> bool:
        return self.reqs[rid].state == "transferring"

    def poll(self, rid: str) -> None:
        r = self.reqs[rid]
        if self.transport.poll(rid) is Poll.SUCCESS:
            r.state = "succeeded"
            self._release_local(r)
            self.sink.put(TerminalOutput(rid, "succeeded"))


class _Machines:
    """The same happenings through the declared machines."""

    def __init__(self, engine: DisaggPrefill) -> None:
        self.e = engine

    def add(self, p: _Plan) -> None:
        self.e.add(p.rid, p.prompt_len, chunk_size=self.chunk_size, host_pages=p.host_pages)

    chunk_size = 0

    def bootstrap(self, rid: str) -> None:
        self.e.bootstrap(rid)

    def abort(self, rid: str) -> None:
        self.e.abort(rid)

    def schedule(self, rid: str) -> int | None:
        c = self.e.schedule(rid)
        return None if c is None else c.index

    def result(self, rid: str, k: int) -> None:
        self.e.result(rid, k)

    def transferring(self, rid: str) -> bool:
        # Aborted while sending, it still waits for the sender's confirmation (a poll).
        return self.e.req(rid).state in ("transferring", "awaiting_sender")

    def poll(self, rid: str) -> None:
        self.e.poll_transfer(rid)


def disagg_seed(naive: bool, seed: int = 0, *, requests: int = 64, chunk_size: int = 256,
                max_chunks: int = 4, p_abort: float = 0.5, p_sender_fail: float = 0.25,
                mamba_per_request: int = 1, device: str = "cpu") -> DisaggLeak:
    """Replay the seed's production case through the naive loop or the machines.

    Pools are sized so that nothing is ever short, even when the naive loop leaks, so
    both loops see exactly the same script; the result counts the leak.
    """
    if requests < 1 or chunk_size < 1 or max_chunks < 1:
        raise ValueError("disagg_seed: requests, chunk_size and max_chunks must be >= 1, got "
                         f"{requests}, {chunk_size}, {max_chunks}")
    plans = _script(seed, requests, chunk_size, max_chunks, p_abort, p_sender_fail)
    pools = DisaggPools.make(
        kv_tokens=requests * max_chunks * chunk_size, requests=requests,
        mamba_slots=requests * mamba_per_request, metadata_slots=requests,
        host_pages=2 * requests, max_context_len=max_chunks * chunk_size, device=device)
    transport = FakeTransport(auto_complete=True)
    failing = [p.rid for p in plans if p.sender_fails]
    if failing:
        transport.fail("abort", failing)
    cache = PrefixCache(pools.kv)
    sink = OutputLog()
    loop: Any
    if naive:
        loop = _Naive(pools, transport, cache, sink, chunk_size, mamba_per_request)
    else:
        engine = DisaggPrefill(pools, transport=transport, cache=cache, sink=sink,
                               mamba_per_request=mamba_per_request)
        loop = _Machines(engine)
        loop.chunk_size = chunk_size

    for p in plans:
        loop.add(p)
        loop.bootstrap(p.rid)
    in_flight: dict[str, list[tuple[int, int]]] = {p.rid: [] for p in plans}
    aborted: dict[str, int] = {}  # rid -> KV sends it had started when aborted

    def abort(rid: str) -> None:
        if rid not in aborted:
            aborted[rid] = transport.sends[rid]
            loop.abort(rid)

    for step in range(max_chunks + 4):
        for p in plans:
            rid = p.rid
            if p.abort_at == -1:
                abort(rid)
            k = loop.schedule(rid)  # overlap: launch k+1 before k's result is processed
            if k is not None:
                in_flight[rid].append((k, step))
            if in_flight[rid] and in_flight[rid][0][1] < step:
                k, _ = in_flight[rid].pop(0)
                if p.abort_at == k:
                    abort(rid)
                loop.result(rid, k)
            if loop.transferring(rid):
                if p.abort_at == p.n_chunks and rid not in aborted:
                    abort(rid)
                else:
                    loop.poll(rid)

    cache.evict_all()
    outs: dict[str, list[TerminalOutput]] = {}
    for o in sink.outputs:
        outs.setdefault(o.rid, []).append(o)
    used = pools.in_use()  # our pools: every one is audited
    kv_leak = used["kv"]
    return DisaggLeak(
        loop="naive" if naive else "machines",
        seed=seed,
        requests=requests,
        aborts=len(aborted),
        sender_abort_failures=len(failing),
        chunk_size=chunk_size,
        kv_tokens_leaked=kv_leak,
        kv_chunks_leaked=kv_leak / chunk_size,
        mamba_states_leaked=used["mamba"],
        metadata_slots_leaked=used["metadata"],
        host_pages_leaked=pools.host.occupied,
        req_slots_leaked=pools.table.capacity - pools.table.available,
        aborted_cached=sum(1 for r in aborted if cache.inserts[r]),
        aborted_sent=sum(1 for r, n in aborted.items() if transport.sends[r] > n),
        streams_missing=sum(1 for p in plans if p.rid not in outs),
        streams_duplicated=sum(1 for o in outs.values() if len(o) > 1),
        wrong_status=sum(1 for r in aborted if r in outs and outs[r][0].outcome != "aborted"),
        ledger_handles=0 if naive else engine.ledger.count(),
    )


# -- the prefix-cache lock leak -------------------------------------------------------------


class PrefixLockLeak(msgspec.Struct, frozen=True):
    """What one `prefix_lock_leak` run shows. `refused`: turns that could not get KV
    even after evicting every unlocked cached page (the pool exhausted);
    `locked_at_end`: cached tokens still locked after every request ended (a lock
    leak); `kv_tokens_leaked`: token slots missing from the pool once the cache is
    evicted (the locked pages)."""

    loop: str
    conversations: int
    kv_tokens: int
    page_size: int
    aborted: int
    refused: int
    evicted_tokens: int
    locked_at_end: int
    kv_tokens_leaked: int

    @property
    def exhausted(self) -> bool:
        """True when some request was refused for want of KV."""
        return self.refused > 0


def prefix_lock_leak(naive: bool, *, conversations: int = 96, kv_tokens: int = 4096,
                     turn_tokens: int = 64, page_size: int = 16) -> PrefixLockLeak:
    """Conversations whose second turn matches the first (cached) turn, locks it, and
    is aborted during its prefill. The machines release the lock in the abort's plan,
    so eviction keeps making room; the naive loop (the pre-fix abort path: free the
    request's own KV, forget its `dec_lock_ref`) pins each conversation's prefix until
    the pool is exhausted and new turns are refused.
    """
    import torch

    from terminus.effects.sequence import RunningBatch, SchedulerPools
    from terminus.states.sequence import (
        ChunkLaunched,
        Finish,
        LastChunkDone,
        SequenceAbort,
    )

    if conversations < 1 or kv_tokens < 2 * turn_tokens or turn_tokens < 2:
        raise ValueError("prefix_lock_leak: need conversations >= 1, turn_tokens >= 2 and "
                         "kv_tokens >= 2 * turn_tokens")
    pools = SchedulerPools(rows=4, max_context_len=4 * turn_tokens, kv_tokens=kv_tokens,
                           mamba_slots=4, page_size=page_size, strict=True)
    cache = PrefixCache(pools.kv)
    rb = RunningBatch(pools, cache=cache)
    refused = aborted = 0

    def toks(c: int, turn: int) -> list[int]:
        return [10_000 * (c + 1) + 100 * turn + i for i in range(turn_tokens)]

    for c in range(conversations):
        first = toks(c, 0)
        # Turn 1 runs to the end: its prompt is cached.
        rows = rb.admit(1, mamba=False, prompts=[list(first)])
        assert rows is not None
        if not rb.append_kv(rows, torch.tensor([turn_tokens])):
            refused += 1
            rb.fire(rows, SequenceAbort)
            continue
        rb.fire(rows, ChunkLaunched)
        rb.fire(rows, LastChunkDone)
        rb.fire(rows, Finish)
        # Turn 2 extends turn 1: it matches and locks the cached turn, then is aborted.
        second = first + toks(c, 1)
        if naive:
            m = cache.match(second, limit=len(second) - 1)
            cache.tree.inc_lock_ref(m.node)  # the lock the pre-fix abort path forgets
            own = pools.kv.alloc(len(second) - m.length)
            if own is None:
                cache.evict(len(second) - m.length - pools.kv.available_size())
                own = pools.kv.alloc(len(second) - m.length)
            if own is None:
                refused += 1
                continue
            aborted += 1
            pools.kv.free(own)  # the abort frees the request's own KV; no dec_lock_ref
            continue
        rows = rb.admit(1, mamba=False, prompts=[second])
        assert rows is not None
        if not rb.append_kv(rows, torch.tensor([len(second) - rb.matched(int(rows[0]))])):
            refused += 1
            rb.fire(rows, SequenceAbort)
            continue
        rb.fire(rows, ChunkLaunched)
        rb.fire(rows, SequenceAbort)  # drains its chunk first
        rb.fire(rows, LastChunkDone)
        aborted += 1
    locked = cache.locked_tokens
    evicted = cache.evicted_tokens
    cache.evict_all()
    used = pools.in_use()
    return PrefixLockLeak(
        loop="naive" if naive else "machines", conversations=conversations,
        kv_tokens=kv_tokens, page_size=page_size, aborted=aborted, refused=refused,
        evicted_tokens=evicted, locked_at_end=locked, kv_tokens_leaked=used["kv"])
