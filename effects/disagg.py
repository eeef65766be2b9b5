"""Release plans of the disaggregated-prefill request and its chunks, and the loop
that drives them over real pools.

Ownership, as the ledger records it (kinds, and the pool each goes back to)::

    request  hicache   host pages of its storage prefetch   HostPagePool   from add()
             metadata  a MetadataSlot (index -> -1)         MetadataSlots  at bootstrap
             req_slot  its request-to-token row             ReqToTokenTable  first chunk
             mamba     its Mamba state slot(s)              MambaStatePool   first chunk
             kv        pages of every settled chunk         KV allocator   at commit, or
                                                                           at abandon
    chunk    kv        the pages it writes while in flight  KV allocator   at schedule

A chunk hands its pages to its request whether it commits or is abandoned: a later
overlapped chunk of an aborted request still attends over an abandoned chunk's pages,
so they go back with the request's own, when its drain ends (I10).

Each plan releases what the instance owns *now* (a ledger query, never "is this field
None"). Only `release_succeeded` inserts KV into the prefix cache, once per request;
`release_aborted` notifies the sender first, best-effort (I5), so a failing peer
never skips the local releases, and every request plan streams its terminal output
exactly once (best-effort too: the client is outside).

`DisaggPrefill` is the reference loop: it turns scheduler happenings (bootstrap polls,
chunk launches and results, aborts, transfer polls) into events, acquires resources
into the ledger, and hands a chunk's pages to its request when the chunk commits. Each
driver method decides before it changes anything: an event the machine refuses leaves
the request as it was (its recorded reason included). An abort during the transfer
tells the sender at once (best-effort) and keeps the KV until a poll says the sender
stopped (done, failed or aborted) or `sender_deadline_s` passed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from terminus.fsm import (
    Action,
    Handle,
    Instance,
    Ledger,
    Machine,
    Plan,
    PlanReport,
    Release,
    ReleaseContext,
    release_effect,
)
from terminus.kernels._stack import as_int
from terminus.kernels.host import HostPagePool
from terminus.kernels.kv import TokenKVAllocator
from terminus.kernels.mamba import MambaStatePool
from terminus.kernels.metadata import MetadataSlot, MetadataSlots
from terminus.kernels.protocols import (
    AuditedPool,
    KVAllocator,
    MambaPool,
    SlotAllocator,
    page_size_of,
    require,
)
from terminus.kernels.radix import RadixInsert
from terminus.kernels.req_table import ReqToTokenTable
from terminus.states.chunk import CHUNK, Abandon, Chunk, Commit, Launch, NextLaunched, Result
from terminus.states.disagg import (
    DISAGG_PREFILL,
    BootstrapFailed,
    Bootstrapped,
    BootstrapRetry,
    ChunkScheduled,
    ChunkSettled,
    ChunkSettledLast,
    ChunkSettledNotLast,
    DisaggAbort,
    DisaggReq,
    SenderAborted,
    SenderDeadline,
    TransferDone,
    TransferFailed,
)

from .output import OutputLog, OutputSink, TerminalOutput
from .prefix_cache import PREFIX_LOCK, PrefixCache, audit_pages, release_prefix_lock
from .sanitize import sanitized
from .sequence import audited
from .transport import Poll, Transport, TransportError

__all__ = [
    "CHUNK_PLANS",
    "KINDS",
    "REQUEST_PLANS",
    "DisaggPools",
    "DisaggPrefill",
    "DisaggResources",
    "PrefillRequest",
    "make_ledger",
]

KINDS = ("hicache", "metadata", "req_slot", "mamba", "kv", PREFIX_LOCK)
"""Handle kinds this module's ledger knows."""


# -- resources -------------------------------------------------------------------------


@dataclass
class DisaggPools:
    """The pools a disaggregated-prefill server releases into.

    `kv`, `mamba` and `metadata` may be an engine's own (any `KVAllocator`, `MambaPool`,
    `SlotAllocator`: SGLang's allocators have these shapes); `host` and `table` are
    ours. Pools that are also `AuditedPool`s are checked by `assert_full()` and
    compared with the ledger by `DisaggPrefill.accounting()`; the others are listed
    by `unchecked()`.
    """

    kv: KVAllocator
    mamba: MambaPool
    metadata: SlotAllocator
    host: HostPagePool
    table: ReqToTokenTable
    page_size: int = 0
    """Tokens per KV page; 0: the allocator's `page_size`."""

    def __post_init__(self) -> None:
        require(self.kv, KVAllocator, "DisaggPools(kv=)")
        require(self.mamba, MambaPool, "DisaggPools(mamba=)")
        require(self.metadata, SlotAllocator, "DisaggPools(metadata=)")
        self.page_size = page_size_of(self.kv, self.page_size or None)

    @classmethod
    def make(cls, *, kv_tokens: int = 4096, requests: int = 16, mamba_slots: int = 32,
             metadata_slots: int = 16, host_pages: int = 64, max_context_len: int = 4096,
             page_size: int | None = None, device: str | torch.device = "cpu",
             strict: bool = True, kv: KVAllocator | None = None,
             mamba: MambaPool | None = None, metadata: SlotAllocator | None = None,
             host: HostPagePool | None = None,
             table: ReqToTokenTable | None = None) -> DisaggPools:
        """Our small real pools (a tiny Mamba state shape; `strict` raises at a double
        free), except each pool passed in, which is used as it is. `page_size`
        defaults to `kv.page_size` for a given `kv` (and must agree with it), else 1.
        """
        ps = page_size_of(kv, page_size)
        return cls(
            kv=kv if kv is not None else TokenKVAllocator(kv_tokens, ps, device,
                                                          strict=strict),
            mamba=mamba if mamba is not None else MambaStatePool(
                mamba_slots, layers=2, conv_dims=8, conv_kernel=4, heads=2, head_dim=4,
                state_size=4, device=device, strict=strict),
            metadata=metadata if metadata is not None else MetadataSlots(metadata_slots,
                                                                         device),
            host=host if host is not None else HostPagePool(host_pages, device),
            table=table if table is not None else ReqToTokenTable(
                requests, max_context_len, device, strict=strict),
            page_size=ps,
        )

    def pools(self) -> dict[str, Any]:
        """The pools by name."""
        return {"kv": self.kv, "mamba": self.mamba, "metadata": self.metadata,
                "host": self.host, "table": self.table}

    def unchecked(self) -> list[str]:
        """Names of the pools the leak audit cannot check (not `AuditedPool`s)."""
        return [n for n, p in self.pools().items() if not isinstance(p, AuditedPool)]

    def in_use(self) -> dict[str, int]:
        """Units each `AuditedPool` has handed out now, by pool name (the others cannot
        say: see `unchecked()`)."""
        return {n: p.capacity - p.available for n, p in audited(self, self.pools())}

    def assert_full(self) -> list[str]:
        """`assert_full()` on every `AuditedPool` (raises `LeakError` naming what is
        held); returns the names of the pools it could not check (`unchecked()`)."""
        for p in self.pools().values():
            if isinstance(p, AuditedPool):
                p.assert_full()
        return self.unchecked()

    def kv_alloc(self, n: int) -> torch.Tensor | None:
        """`n` KV token indices on whole pages of their own (`alloc` of the pages they
        need, as every `KVAllocator` reads it), or None when short."""
        units = -(-n // self.page_size) * self.page_size
        got = self.kv.alloc(units)
        return got if got is None or units == n else got[:n]

    def kv_units(self, indices: torch.Tensor) -> int:
        """Token slots of the KV pool that `indices` occupy: whole pages."""
        if self.page_size == 1:
            return int(indices.numel())
        return int(torch.unique(torch.div(indices, self.page_size,
                                          rounding_mode="floor")).numel()) * self.page_size


# Payload-free events, made once (events are frozen).
_BOOTSTRAPPED = Bootstrapped()
_NEXTLAUNCHED = NextLaunched()
_LAUNCH = Launch()
_RESULT = Result()
_COMMIT = Commit()
_ABANDON = Abandon()
_TRANSFERDONE = TransferDone()
_SUCCESS = Poll.SUCCESS  # (a module global: a class attribute's read is not specialised)

# The events of chunk `k`, made once per index and shared (events are frozen):
# `_SCHEDULED[k]` is `ChunkScheduled(k)`, `_SETTLED_LAST[k]` `ChunkSettledLast(k)`,
# `_SETTLED_NOT_LAST[k]` `ChunkSettledNotLast(k)`; `_events_for(k)` extends them.
_SCHEDULED: list[ChunkScheduled] = []
_SETTLED_LAST: list[ChunkSettledLast] = []
_SETTLED_NOT_LAST: list[ChunkSettledNotLast] = []


def _events_for(k: int) -> None:
    """Make the events of every chunk index up to `k` (once each)."""
    for i in range(len(_SCHEDULED), k + 1):
        _SCHEDULED.append(ChunkScheduled(i))
        _SETTLED_LAST.append(ChunkSettledLast(i))
        _SETTLED_NOT_LAST.append(ChunkSettledNotLast(i))


_events_for(63)


@dataclass
class DisaggResources:
    """Everything the release effects reach through `ctx.resources`."""

    pools: DisaggPools
    transport: Transport
    cache: PrefixCache
    sink: OutputSink
    staged: dict[Any, list[Handle] | dict[Handle, torch.Tensor | None]] = field(
        default_factory=dict)
    """Per request whose KV was just inserted: what each of its KV handles still frees.
    A list: the tree took every page of the handles it names (the common case, made
    without a dict); a dict: the indices the tree did not take, by handle (a key: they
    hash by identity; None: nothing). A handle not named frees all."""


# -- release effects ---------------------------------------------------------------------


@release_effect
def free_kv(ctx: ReleaseContext, handle: Any) -> None:
    """Return KV pages to the allocator."""
    ctx.resources.pools.kv.free(handle.value)


@release_effect
def free_mamba(ctx: ReleaseContext, handle: Any) -> None:
    """Return Mamba state slots."""
    ctx.resources.pools.mamba.free(handle.value)


@release_effect
def free_req_slot(ctx: ReleaseContext, handle: Any) -> None:
    """Return the request-to-token row (its KV is released through the kv handles)."""
    ctx.resources.pools.table.free(handle.value)


@release_effect
def free_metadata(ctx: ReleaseContext, handle: Any) -> None:
    """Free the metadata slot; its index becomes -1."""
    handle.value.release()


@release_effect
def release_hicache(ctx: ReleaseContext, handle: Any) -> None:
    """Stop the request's host prefetch and free the host pages it reserved."""
    prefetch = handle.value
    prefetch.terminate()
    prefetch.release()


def _insertable(parts: list[torch.Tensor], page_size: int) -> int:
    """Tokens of the concatenated `parts` whose pages line up with token positions: up
    to the end of the first part that does not fill whole pages (each part starts on a
    page of its own, so a page of the key past it would mix two physical pages)."""
    n = 0
    for p in parts:
        n += int(p.numel())
        if p.numel() % page_size:
            break
    return n


@release_effect
def insert_kv_into_cache(ctx: ReleaseContext) -> None:
    """Insert the request's KV into the prefix cache, once per request, before its KV
    handles are released: the tree takes what is new; `free_kv_not_cached` then frees
    the rest (duplicates, the unaligned tail) through the KV releaser. When the insert
    raises, the cache took nothing and every page is freed there."""
    ledger = ctx.ledger
    assert ledger is not None
    res: DisaggResources = ctx.resources
    inst = ctx.instance
    # Its KV handles (and their pages) and its prefix lock (the ledger's lists, by kind;
    # the pages by a loop: a comprehension is a frame of its own).
    handles = ledger.owned(inst, "kv")
    if not handles:
        return
    parts = []
    for h in handles:
        parts.append(h.value)
    ps = res.pools.page_size
    n = _insertable(parts, ps) if ps != 1 else -1  # (one page a token: every part)
    locks = ledger.owned(inst, PREFIX_LOCK)
    if locks:
        lock = locks[0].value
        owned_from = lock.length
        parts.insert(0, lock.indices)
    else:
        owned_from = 0
    kv = torch.cat(parts) if len(parts) > 1 else parts[0]
    tokens = (inst.tokens if inst.__class__ is PrefillRequest or isinstance(inst, PrefillRequest)
              else ())
    size = kv.numel()
    # keep = min(size, len(tokens)), and owned_from + n where it is smaller (comparisons:
    # no call of min(), whose arguments are parsed at every call).
    keep = len(tokens)
    if size < keep:
        keep = size
    if n >= 0 and owned_from + n < keep:
        keep = owned_from + n
    if keep < size:
        kv = kv[:keep]
    result = res.cache.insert(inst.key, tokens if len(tokens) == keep else tokens[:keep],
                              kv, owned_from=owned_from if owned_from < keep else keep)
    t0 = result.prefix_len
    if t0 <= owned_from and t0 + result.taken_count >= size:
        # The tree took every index of the handles (they lie at owned_from..size): the
        # list of them says so (`free_kv_not_cached` frees nothing of those it names).
        res.staged[inst] = handles
    else:
        res.staged[inst] = _not_taken(handles, owned_from, result)


def _not_taken(handles: list[Handle], start: int,
               result: RadixInsert) -> dict[Handle, torch.Tensor | None]:
    """What each KV handle keeps after an insert: None when the tree took all of it;
    those it took nothing of are left out. The handles' values lie end to end
    from position `start` of the sequence inserted, and the tree took one run of it,
    `result.taken`, from `result.prefix_len`: slices, not a search of every index
    among those taken."""
    t0 = result.prefix_len
    t1 = t0 + result.taken_count
    out: dict[Handle, torch.Tensor | None] = {}
    if t1 <= t0:
        return out
    pos = start
    for h in handles:
        v = h.value
        end = pos + int(v.numel())
        a, b = max(t0, pos), min(t1, end)
        if a < b:
            out[h] = (None if a == pos and b == end else v[b - pos:] if a == pos
                      else v[:a - pos] if b == end
                      else torch.cat((v[:a - pos], v[b - pos:])))
        pos = end
    return out


@release_effect
def free_kv_not_cached(ctx: ReleaseContext, handle: Any) -> None:
    """Free the pages of a KV handle that the prefix cache did not take (all of them
    when nothing was inserted)."""
    res: DisaggResources = ctx.resources
    kept: Any = res.staged.get(ctx.instance)  # (narrowed by its class below)
    if kept is None:  # nothing was inserted
        idx = handle.value
    elif kept.__class__ is list:  # the tree took every page of the handles it names
        if handle in kept:
            return
        idx = handle.value
    else:
        idx = kept.get(handle, handle.value)
        if idx is None:  # the tree took all of it
            return
    if idx.numel():
        res.pools.kv.free(idx)


@release_effect
def forget_insert(ctx: ReleaseContext) -> None:
    """Drop the record of what the cache took (every KV handle was released)."""
    ctx.resources.staged.pop(ctx.instance, None)


@release_effect
def sender_abort(ctx: ReleaseContext) -> None:
    """Tell the decode side the request is gone (best-effort in every plan, I5)."""
    ctx.resources.transport.abort(ctx.instance.key)


def _counts(rid: str, **counts: Any) -> list[int]:
    """`add`'s counts as ints (a numpy integer is one), or a TypeError naming the first
    that is not, before anything is made or taken."""
    out = []
    for name, v in counts.items():
        i = as_int(v)
        if i is None:
            raise TypeError(f"request {rid!r}: {name} must be an int, got "
                            + (repr(v) if isinstance(v, bool) else f"{type(v).__name__} {v!r}"))
        out.append(i)
    return out


@release_effect
def hand_kv_to_request(ctx: ReleaseContext) -> None:
    """An abandoned chunk's pages go to its request, which frees them when its drain ends
    (a later overlapped chunk still attends over them); a terminal request frees them at
    once, and the plan's `Release("kv")` frees those of a chunk without a request, and
    those of a chunk never launched (a `schedule` refused after taking them: nothing
    wrote them and nothing attends over them, and the request's KV is what it sends and
    caches, so they must not join it)."""
    parent = getattr(ctx.instance, "parent", None)
    if parent is None or ctx.ledger is None or ctx.source == "scheduled":
        return
    for h in ctx.ledger.owned(ctx.instance, "kv"):
        ctx.ledger.transfer(h, parent)


@release_effect
def stream_terminal(ctx: ReleaseContext) -> None:
    """Stream the request's terminal output; runs once, in the plan of its terminal edge.

    The reason is the cause the request waited on (`inst.reason`: the first abort or
    bootstrap failure of a drain or of a wait for the sender), else the reason the
    terminal event carries."""
    inst = ctx.instance
    reason = ((inst.reason if inst.__class__ is PrefillRequest else getattr(inst, "reason", ""))
              or getattr(ctx.event, "reason", ""))
    key = inst.key
    # (positional: `TerminalOutput(rid, outcome, message=reason)`, status None)
    ctx.resources.sink.put(TerminalOutput(key if key.__class__ is str else str(key),
                                          ctx.target, None, reason))


_LOCAL = (Release("metadata"), Release("hicache"), Release("kv"), Release(PREFIX_LOCK),
          Release("mamba"), Release("req_slot"))

REQUEST_PLANS: dict[str, Plan] = {
    "release_succeeded": Plan(
        Action(insert_kv_into_cache),
        Release("kv", free_kv_not_cached),
        Action(forget_insert),
        Release(PREFIX_LOCK),
        Release("mamba"), Release("req_slot"), Release("metadata"), Release("hicache"),
        Action(stream_terminal, best_effort=True),
    ),
    "release_aborted": Plan(
        Action(sender_abort, best_effort=True),
        *_LOCAL,
        Action(stream_terminal, best_effort=True),
    ),
    # Out of awaiting_sender: the sender was told when the wait began, and has stopped
    # reading (or the deadline passed); it is not told again.
    "release_aborted_transfer": Plan(*_LOCAL, Action(stream_terminal, best_effort=True)),
    "release_bootstrap_failed": Plan(*_LOCAL, Action(stream_terminal, best_effort=True)),
    "release_failed": Plan(*_LOCAL, Action(stream_terminal, best_effort=True)),
}
"""Plans of `states.disagg.DISAGG_PREFILL`."""

CHUNK_PLANS: dict[str, Plan] = {
    # The serving loop moved the pages to the request before Commit; a chunk that
    # still owns some here is released by their default releaser, never leaked.
    "release_committed": Plan(),
    # The pages go back with the request's, when its drain ended (I10); a chunk with no
    # request frees them here.
    "release_abandoned": Plan(Action(hand_kv_to_request), Release("kv")),
}
"""Plans of `states.chunk.CHUNK`."""


def make_ledger(resources: DisaggResources) -> Ledger:
    """A ledger with this module's default releasers over `resources`."""
    return Ledger({"kv": free_kv, "mamba": free_mamba, "req_slot": free_req_slot,
                   "metadata": free_metadata, "hicache": release_hicache,
                   PREFIX_LOCK: release_prefix_lock},
                  resources=resources)


# -- the reference loop --------------------------------------------------------------------


class PrefillRequest(DisaggReq):
    """A request instance plus what the loop needs to cut it into chunks."""

    __slots__ = ("cached", "chunk_size", "matched", "n_chunks", "prompt_len", "row",
                 "sender_deadline", "tokens")

    def __init__(self, machine: Machine, key: str, prompt_len: int, chunk_size: int,
                 tokens: tuple[int, ...] = (), cached: int = 0,
                 matched: torch.Tensor | None = None) -> None:
        # `DisaggReq.__init__`'s fields set here, not by calling it: one frame less per
        # request (as `DisaggReq.__init__` calls the engine's own initialiser).
        Instance.__init__(self, machine, key)
        self.chunks = []
        self.reason = ""
        self.prompt_len = prompt_len
        self.tokens = tokens
        """The prompt's token ids (what the prefix cache is keyed by)."""
        self.chunk_size = chunk_size
        self.cached = cached
        """Prompt tokens matched in the prefix cache (not prefilled again; `set_cached`)."""
        self.matched = matched
        """The KV indices of those tokens (the cache's pages; the request's `PREFIX_LOCK`
        handle keeps them from eviction until its terminal plan)."""
        self.n_chunks = -(-(prompt_len - cached) // chunk_size)
        self.sender_deadline: float | None = None  # set when it starts awaiting_sender
        self.row = -1
        """The request table row of the slot it owns (read when its first chunk is
        scheduled; the slot itself is the ledger's `req_slot` handle)."""

    def set_cached(self, n: int) -> None:
        """The first `n` prompt tokens came from the prefix cache: chunks cover the rest."""
        self.cached = n
        self.n_chunks = -(-(self.prompt_len - n) // self.chunk_size)

    def chunk_len(self, k: int) -> int:
        """Tokens in chunk `k` (chunks start after the cached prefix)."""
        return min(self.chunk_size, self.prompt_len - self.cached - k * self.chunk_size)


class PrefillChunk(Chunk):
    """A chunk the loop scheduled, and the ledger handle of the KV pages it writes
    (`handle`: acquired with it; the ledger still says who owns it).

    Made as `PrefillChunk(machine, key)`, by the engine's own initialiser (no Python
    frame, and no keyword arguments to parse, per chunk); `DisaggPrefill.schedule` sets
    `parent`, `index`, `last` and `handle` at once."""

    __slots__ = ("handle",)

    handle: Handle

    __init__ = Instance.__init__


class DisaggPrefill:
    """Drives disaggregated-prefill requests and their chunks over real pools.

    Every method is one scheduler happening for one request id; each returns the
    `PlanReport` of the release plan it caused, or None. Events that arrive after a
    request's cleanup ran reach the machines and are ignored there, never an effect.
    `transport` is the KV sender (a `Transport`; the simulator's fake is
    `terminus.effects.sim.transport.FakeTransport`); `sink` receives each request's one
    `TerminalOutput` (an `OutputLog` that keeps them when none is given).
    `sender_deadline_s`: how long a request aborted during its transfer waits for the
    sender to confirm it stopped reading, measured on `clock` (seconds). `errors`: the
    best-effort calls made outside a plan that raised (the sender's abort notice, the
    host prefetch of `add`, the polls of a request waiting for its sender), and the
    sender steps that raised something other than `TransportError` (each fails its
    request as a `TransportError` does).
    """

    def __init__(self, pools: DisaggPools | None = None, *,
                 transport: Transport, cache: PrefixCache | None = None,
                 sink: OutputSink | None = None, mamba_per_request: int = 1,
                 sender_deadline_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        pools = pools if pools is not None else DisaggPools.make()
        if mamba_per_request < 1:
            raise ValueError(f"mamba_per_request must be >= 1, got {mamba_per_request}")
        if not sender_deadline_s > 0:
            raise ValueError(f"sender_deadline_s must be > 0 seconds, got "
                             f"{sender_deadline_s!r}")
        self.sender_deadline_s = float(sender_deadline_s)
        self.clock = clock
        self.errors: list[Exception] = []
        self.pools = pools
        self.transport: Transport = transport
        self.cache = cache if cache is not None else PrefixCache(
            pools.kv, pools.page_size, getattr(pools.kv, "device", "cpu"))
        self._anon = 1 << 40  # token ids of prompts given without tokens: never shared
        self.sink: OutputSink = sink if sink is not None else OutputLog()
        self.mamba_per_request = mamba_per_request
        self.resources = DisaggResources(pools, self.transport, self.cache, self.sink)
        self.ledger = make_ledger(self.resources)
        self.requests_machine = DISAGG_PREFILL.bind(REQUEST_PLANS, self.ledger)
        self.chunks_machine = CHUNK.bind(CHUNK_PLANS, self.ledger)
        self.requests: dict[str, PrefillRequest] = {}
        # State ids the hot paths compare (`inst._s`) instead of reading the `state`
        # and `terminal` properties (as effects.tokenizer does).
        ids = {name: i for i, name in enumerate(self.requests_machine.states)}
        self._bootstrapping = ids["bootstrapping"]
        self._prefilling = ids["prefilling"]
        self._transferring = ids["transferring"]
        self._schedulable = frozenset((ids["waiting"], ids["prefilling"]))
        self._polled = frozenset((ids["transferring"], ids["awaiting_sender"]))
        self._req_terminal = self.requests_machine.terminal
        self._running = self.chunks_machine.states.index("running")
        self._chunk_terminal = self.chunks_machine.terminal

    # -- lookups --------------------------------------------------------------------------

    def req(self, rid: str) -> PrefillRequest:
        """The request `rid`; KeyError naming the known ids when there is none."""
        try:
            return self.requests[rid]
        except KeyError:
            known = ", ".join(sorted(self.requests)[:8]) or "none"
            raise KeyError(f"no disaggregated-prefill request {rid!r}; add() it first "
                           f"(known: {known})") from None

    def __iter__(self) -> Iterator[PrefillRequest]:
        return iter(self.requests.values())

    @sanitized
    def forget(self, rid: str) -> None:
        """Drop a request that ended (it and every chunk terminal), so a long-running
        server does not keep every request it ever served; a later event for `rid` is
        then an unknown id (KeyError), as for one never added. Raises ValueError, and
        changes nothing, for a request that may still own or receive anything.

        Its chunks are detached from it (each one's `parent` becomes None; the request
        keeps its `chunks`): a chunk pointing at the request that lists it is a
        reference cycle, which would keep both in memory until the cyclic collector
        ran, walked in each of its passes until then. Detached, they are freed as soon
        as nobody holds them."""
        try:
            req = self.requests[rid]
        except KeyError:
            req = self.req(rid)  # raises, naming the known ids
        done = self._chunk_terminal  # (`c.terminal`, without the property)
        if self._req_terminal[req._s]:
            for c in req.chunks:  # (a loop: the list below only for the error)
                if not done[c._s]:
                    break
            else:
                del self.requests[rid]
                for c in req.chunks:  # (no cycle left: see above)
                    c.parent = None
                return
        live = [i for i, c in enumerate(req.chunks) if not done[c._s]]
        raise ValueError(
            f"request {rid!r} cannot be forgotten: it is {req.state}"
            + (f" with chunk(s) {live} not settled" if live else "")
            + "; forget a request once it and its chunks ended")

    # -- happenings --------------------------------------------------------------------

    @sanitized
    def add(self, rid: str, prompt_len: int, *, chunk_size: int,
            host_pages: int = 0, tokens: tuple[int, ...] | None = None) -> PrefillRequest:
        """A new request in `bootstrapping`; `host_pages` > 0 starts its host prefetch.

        The host prefetch is best-effort: with no room, or when the host pool raises
        (recorded in `errors`), the request runs without host pages.

        `tokens`: the prompt's token ids (`prompt_len` of them), the prefix cache's key:
        the longest cached prefix of all but the last token is matched and locked (a
        `PREFIX_LOCK` handle the request owns, released by whichever terminal plan it
        reaches), and only the rest is prefilled; on success the KV is inserted.
        Without `tokens` nothing is matched and the KV is cached under ids no other
        prompt has.
        """
        if tokens is not None and len(tokens) != prompt_len:
            raise ValueError(f"request {rid!r}: {len(tokens)} tokens given for "
                             f"prompt_len {prompt_len}; pass one token id per position")
        if rid in self.requests:
            raise ValueError(f"request {rid!r} already exists; request ids are unique")
        if (prompt_len.__class__ is not int or chunk_size.__class__ is not int
                or host_pages.__class__ is not int):
            prompt_len, chunk_size, host_pages = _counts(
                rid, prompt_len=prompt_len, chunk_size=chunk_size, host_pages=host_pages)
        if host_pages < 0:
            raise ValueError(f"request {rid!r}: host_pages ({host_pages}) must be >= 0 "
                             "(0: no host prefetch)")
        if prompt_len < 1 or chunk_size < 1:
            raise ValueError(f"request {rid!r}: prompt_len ({prompt_len}) and chunk_size "
                             f"({chunk_size}) must be >= 1")
        limit = self.pools.table.max_context_len
        if prompt_len > limit:
            raise ValueError(f"request {rid!r}: prompt_len {prompt_len} exceeds the "
                             f"request table's max_context_len {limit}; cut the prompt or "
                             "raise max_context_len")
        if tokens is None:
            tokens = tuple(range(self._anon, self._anon + prompt_len))
            self._anon += prompt_len
            match = None
        else:
            if tokens.__class__ is not tuple:
                tokens = tuple(tokens)
            match = self.cache.match(tokens, limit=prompt_len - 1)
            if not match.length:
                match = None
        if match is None:
            req = PrefillRequest(self.requests_machine, rid, prompt_len, chunk_size, tokens)
        else:
            # Its chunks cover the rest of the prompt (`set_cached`, made with it). The
            # lock goes straight into the ledger before the request is known: a lock
            # that raises leaves nothing (no request claiming pages nobody locked).
            req = PrefillRequest(self.requests_machine, rid, prompt_len, chunk_size, tokens,
                                 match.length, match.indices)
            self.ledger.acquire(req, PREFIX_LOCK, self.cache.lock(match))
        self.requests[rid] = req
        if host_pages > 0:
            # Best-effort, as a full host pool is: a prefetch that raises took nothing
            # and is recorded in `errors`; the request is added and runs without host
            # pages (raised out of `add`, it would leave a request the caller was told
            # was refused, holding its prefix lock with nobody to end it).
            try:
                pf = self.pools.host.prefetch(host_pages)
            except Exception as err:
                self.errors.append(err)
                pf = None
            if pf is not None:  # no room: the request just runs without host pages
                self.ledger.acquire(req, "hicache", pf)
        return req

    @sanitized
    def advance_prefetch(self, rid: str, pages: int) -> None:
        """The host prefetch of `rid` completed `pages` more pages."""
        for h in self.ledger.owned(self.req(rid), "hicache"):
            if not h.value.terminated:
                h.value.advance(pages)

    @sanitized
    def bootstrap(self, rid: str) -> PlanReport | None:
        """Poll the handshake; on success take a metadata slot and init the sender.

        Stays in `bootstrapping` when no metadata slot is free (poll again later).
        """
        try:
            req = self.requests[rid]
        except KeyError:
            req = self.req(rid)  # raises, naming the known ids
        if req._s != self._bootstrapping:  # (`req.state`, without the property)
            # A poll after the handshake: ignored by a terminal request, and nothing to
            # do for a live one (firing it there would be a declared error).
            return req.fire(_BOOTSTRAPPED) if req.terminal else None
        try:
            self.transport.bootstrap(rid)
        except Exception as e:
            return self._fail_bootstrap(req, self._sender_failed(e))
        slot = MetadataSlot.take(self.pools.metadata)
        if slot is None:
            return None
        self.ledger.acquire(req, "metadata", slot)
        req.fire(_BOOTSTRAPPED)
        try:
            self.transport.init(rid, req.prompt_len, slot.index)
        except Exception as e:
            return self._fail_bootstrap(req, self._sender_failed(e))
        return None

    def _sender_failed(self, err: Exception) -> str:
        """The reason a sender step that raised gives its request's failure. A
        `TransportError` is the protocol's failure; any other exception (a real sender's
        `ConnectionError`, a bug in it) fails the step the same way and is kept in
        `errors` with its traceback. Raised out of the driver instead, it would leave the
        request past a step the peer never took: after `init`, holding a metadata slot
        the decode side never heard of; after `send`, waiting for a transfer that never
        started."""
        if isinstance(err, TransportError):
            return str(err)
        self.errors.append(err)
        return f"sender failed: {err!r}"

    @sanitized
    def retry_bootstrap(self, rid: str) -> bool:
        """Re-queue the handshake of `rid` after a transient failure (optimistic retry);
        the next `bootstrap()` polls it. False once the request is past bootstrapping;
        a terminal one ignores it: an abort that came first wins, the request is never
        resurrected."""
        req = self.req(rid)
        if req.terminal or req.state == "bootstrapping":
            req.fire(BootstrapRetry())
        return req.state == "bootstrapping"

    @sanitized
    def bootstrap_failed(self, rid: str, reason: str = "bootstrap failed") -> PlanReport | None:
        """The sender reports the handshake failed."""
        return self._fail_bootstrap(self.req(rid), reason)

    def _fail_bootstrap(self, req: PrefillRequest, reason: str) -> PlanReport | None:
        report = req.fire(BootstrapFailed(reason))  # a refusal raises before any change
        self._record_cause(req, reason)
        return report

    def _record_cause(self, req: PrefillRequest, reason: str) -> None:
        # Only after the machine accepted the event: the first cause of a wait is what
        # the terminal output will say (a direct terminal edge streams its event's).
        if req.state in ("draining", "awaiting_sender") and not req.reason:
            req.reason = reason

    @sanitized
    def abort(self, rid: str, reason: str = "aborted") -> PlanReport | None:
        """The client or scheduler aborts `rid`.

        During the transfer the request waits in `awaiting_sender`: the sender is told
        now (best-effort: a raising sender is recorded in `errors`, and the deadline
        still ends the wait) and the KV is kept until `poll_transfer` sees it stopped.
        """
        req = self.req(rid)
        report = req.fire(DisaggAbort(reason))
        self._record_cause(req, reason)
        if req.state == "awaiting_sender" and req.sender_deadline is None:
            req.sender_deadline = self.clock() + self.sender_deadline_s
            try:
                self.transport.abort(rid)
            except Exception as e:  # the outside is best-effort (I5)
                self.errors.append(e)
        return report

    @sanitized
    def schedule(self, rid: str) -> Chunk | None:
        """Schedule and launch the next chunk of `rid`; None when it cannot run now.

        None: the request is not prefilling (terminal, draining, transferring, still
        bootstrapping), every chunk is already scheduled, or a pool is short (nothing
        is taken then).
        """
        try:
            req = self.requests[rid]
        except KeyError:
            req = self.req(rid)  # raises, naming the known ids
        chunks = req.chunks
        k = len(chunks)
        # (`req.state in ("waiting", "prefilling")`, without the property)
        if k >= req.n_chunks or req._s not in self._schedulable:
            return None
        pools = self.pools
        ps = pools.page_size
        size = req.chunk_size
        start = req.cached + k * size
        n = req.prompt_len - start  # (`req.chunk_len(k)`, without the call of min())
        if n > size:
            n = size
        units = n if ps == 1 else -(-n // ps) * ps  # (whole pages)
        # All or nothing, decided before taking anything: every unit taken below has
        # an owner in the ledger at once, so nothing is ever given back by hand. A
        # chunk's KV starts on a page of its own (an abandoned chunk frees only its own).
        # A first chunk also needs a request row and a Mamba state: checked here, taken
        # once the KV is; the KV is taken first, the allocator's None (short, never
        # partial) its check, with nothing taken before it. A first try owns neither
        # kind yet (its row is set once its slot is owned); a retry after a pool raised
        # asks the ledger what it holds, and needs only what it does not.
        if not k:
            owns = {h.kind for h in self.ledger.owned(req)} if req.row >= 0 else ()
            if (("req_slot" not in owns and pools.table.available < 1)
                    or ("mamba" not in owns
                        and pools.mamba.available_size() < self.mamba_per_request)):
                return None
        kv = pools.kv.alloc(units)  # (`pools.kv_alloc(n)`)
        if kv is None:
            return None
        if units != n:
            kv = kv[:n]
        ledger = self.ledger
        chunk = PrefillChunk(self.chunks_machine, (rid, k))
        chunk.parent = req
        chunk.index = k
        chunk.last = k == req.n_chunks - 1
        chunk.handle = ledger.acquire(chunk, "kv", kv)  # (set at once: read in result)
        try:
            if k:
                pools.table.write(req.row, start, kv)
            else:
                # (`owns`: what it holds, above.) Each unit is recorded the moment it
                # is taken: a pool that raises on the next alloc leaves this one owned
                # by the request (its release frees it).
                if "req_slot" not in owns:
                    slot = pools.table.alloc(1)
                    assert slot is not None  # checked above
                    ledger.acquire(req, "req_slot", slot)
                    req.row = slot.tolist()[0]  # (an int64 tensor's: an int)
                if "mamba" not in owns:
                    mamba = pools.mamba.alloc(self.mamba_per_request)
                    assert mamba is not None  # checked above
                    ledger.acquire(req, "mamba", mamba)
                matched = req.matched
                if matched is None:
                    pools.table.write(req.row, start, kv)
                elif matched.numel() == start:
                    # The row starts with the matched prefix (the cache's pages): written
                    # with the first chunk in one call where it ends at the chunk's
                    # start, as `add` sets them (the same row, and length, as two writes).
                    pools.table.write(req.row, 0, torch.cat((matched, kv)))
                else:
                    pools.table.write(req.row, 0, matched)
                    pools.table.write(req.row, start, kv)
        except BaseException:
            # Never launched (a pool or the table raised): its pages go back, not to
            # the request.
            chunk.fire(_ABANDON)
            raise
        # Only the newest chunk can be running: scheduling one moves the one before
        # it to overlapped, and a result moves it on.
        if k and chunks[-1]._s == self._running:
            chunks[-1].fire(_NEXTLAUNCHED)
        chunks.append(chunk)
        try:
            scheduled = _SCHEDULED[k]
        except IndexError:
            _events_for(k)
            scheduled = _SCHEDULED[k]
        req.fire(scheduled)
        chunk.fire(_LAUNCH)
        return chunk

    @sanitized
    def result(self, rid: str, k: int) -> PlanReport | None:
        """The result of chunk `k` of `rid` reached the scheduler.

        Results come in launch order (an earlier chunk's missing result is a
        ValueError that changes nothing). A live request takes the chunk's pages
        (commit); otherwise the chunk is abandoned and frees them. Then the request
        learns the chunk settled, which may start the transfer, or end a drain with
        `release_aborted`. A result for a chunk that already settled, or for a request
        whose cleanup ran, is ignored.
        """
        try:
            req = self.requests[rid]
        except KeyError:
            req = self.req(rid)  # raises, naming the known ids
        chunks = req.chunks
        try:
            chunk = chunks[k] if k >= 0 else None  # (an index from the end is none)
        except IndexError:
            chunk = None
        if chunk is None:
            if req.terminal:
                return req.fire(ChunkSettled(k))  # a stale result: ignored
            raise ValueError(f"request {rid!r} has no chunk {k} in flight "
                             f"({len(chunks)} scheduled)")
        terminal = self._chunk_terminal  # (`c.terminal`, without the property)
        if terminal[chunk._s]:
            chunk.fire(_RESULT)  # a duplicate: ignored by the chunk
            return None
        # Every earlier chunk settled (a loop from the newest, without a range: the list
        # of the early ones only for the error).
        i = k - 1
        while i >= 0 and terminal[chunks[i]._s]:
            i -= 1
        if i >= 0:
            # A chunk computes on its predecessors' KV, so its result cannot precede
            # theirs; settling it first would start the transfer with their KV missing.
            early = [j for j in range(k) if not terminal[chunks[j]._s]]
            raise ValueError(
                f"result of chunk {k} of request {rid!r} arrived before that of "
                f"chunk(s) {early}; deliver chunk results in launch order")
        chunk.fire(_RESULT)
        if req._s == self._prefilling:
            try:
                # The one KV handle it was scheduled with (a `PrefillChunk`'s).
                h = chunk.handle  # type: ignore[attr-defined]
                moved = h.owner is not chunk or h.released
            except AttributeError:  # (a chunk `schedule` did not make)
                moved = True
            if moved:
                for h in self.ledger.owned(chunk, "kv"):
                    self.ledger.transfer(h, req)
            else:
                self.ledger.transfer(h, req)
            chunk.fire(_COMMIT)
        else:
            chunk.fire(_ABANDON)
        # (`ChunkSettled(k, chunk.last)`, in its unguarded form, made once per index)
        settled = _SETTLED_LAST if chunk.last else _SETTLED_NOT_LAST
        try:
            ev = settled[k]
        except IndexError:  # (a chunk `schedule` did not make)
            _events_for(k)
            ev = settled[k]
        report = req.fire(ev)
        if req._s == self._transferring:
            kv = [req.matched] if req.matched is not None else []
            for h in self.ledger.owned(req, "kv"):  # its KV handles' pages, in order
                kv.append(h.value)
            try:
                self.transport.send(rid, torch.cat(kv) if len(kv) > 1 else kv[0])
            except Exception as e:
                return req.fire(TransferFailed(self._sender_failed(e)))
        return report

    @sanitized
    def poll_transfer(self, rid: str) -> PlanReport | None:
        """Poll the KV transfer of `rid`; success or failure ends the request.

        A request aborted during its transfer ends (as `aborted`) once the sender says
        it stopped (success, failure or ABORTED) or its deadline passed; a poll that
        raises then (a dead peer raises at every poll) is recorded in `errors` and the
        deadline still ends the wait. During the transfer a poll that raises changes
        nothing and raises `TransportError` naming the request (the sender's error is
        its `__cause__`): poll again, or abort (the deadline then bounds the wait).
        """
        try:
            req = self.requests[rid]
        except KeyError:
            req = self.req(rid)  # raises, naming the known ids
        if req._s not in self._polled:  # (`req.state`, without the property)
            return None
        try:
            p = self.transport.poll(rid)
        except Exception as err:
            if req._s == self._transferring:
                # The sender may still be reading the KV: nothing is released, and the
                # caller learns which request's poll failed and what is left to do.
                raise TransportError(
                    f"request {rid!r}: the sender's poll raised {err!r} during the "
                    "transfer; nothing changed (its KV is kept while the sender may read "
                    "it): poll again, or abort it (it then waits for the sender at most "
                    "sender_deadline_s)") from err
            self.errors.append(err)  # awaiting the sender: only the deadline is left
            p = None
        if p is _SUCCESS:
            return req.fire(_TRANSFERDONE)
        if p is Poll.FAILED:
            return req.fire(TransferFailed("transfer failed"))
        if req.state == "transferring":
            if p is Poll.ABORTED:
                return req.fire(TransferFailed("the sender aborted the transfer"))
            return None
        if p is Poll.ABORTED:
            return req.fire(SenderAborted())
        assert req.sender_deadline is not None  # set by abort() with the state
        if self.clock() >= req.sender_deadline:
            return req.fire(SenderDeadline())
        return None

    # -- accounting ---------------------------------------------------------------------

    def accounting(self) -> dict[str, tuple[int, int]]:
        """Per resource: (units the ledger says are owned, units the pool has handed
        out). Equal pairs mean no leak and no double ownership at this moment. KV units
        are token slots of whole pages. A pool that cannot report what it handed out
        (not an `AuditedPool`) is left out: see `DisaggPools.unchecked()`."""
        owned = {k: 0 for k in KINDS}
        p = self.pools
        for hs in self.ledger.outstanding().values():
            for h in hs:
                if h.kind == "metadata":
                    owned[h.kind] += 1
                elif h.kind == "hicache":
                    owned[h.kind] += int(h.value.pages.numel())
                elif h.kind == "kv":
                    owned[h.kind] += p.kv_units(h.value)
                elif h.kind == PREFIX_LOCK:
                    owned[h.kind] += 1  # a lock of the cache's pages (counted as cached)
                else:
                    owned[h.kind] += int(h.value.numel())
        cached = getattr(self.cache, "held_tokens", 0)
        out = {"hicache": p.host.occupied}
        for kind, pool in (("kv", p.kv), ("mamba", p.mamba), ("metadata", p.metadata),
                           ("req_slot", p.table)):
            if isinstance(pool, AuditedPool):
                out[kind] = pool.capacity - pool.available - (cached if kind == "kv" else 0)
        return {k: (owned[k], out[k]) for k in KINDS if k in out}

    def assert_accounted(self) -> None:
        """Raise AssertionError when some pool's usage differs from what the ledger owns."""
        bad = {k: v for k, v in self.accounting().items() if v[0] != v[1]}
        if bad:
            raise AssertionError(
                "ledger and pools disagree (owned, handed out): "
                + ", ".join(f"{k}={v}" for k, v in bad.items()))

    def audit(self) -> dict[str, int]:
        """Who holds every KV page now: the pool (free), the prefix cache (locked or
        evictable) or a live request or chunk (its ledger KV handles); KV token slots by
        holder. Raises AssertionError when a page has two holders or none (see
        `terminus.effects.prefix_cache.audit_pages`); the leak sanitizer calls it after
        every driver call."""
        live = [h.value for hs in self.ledger.outstanding().values() for h in hs
                if h.kind == "kv"]
        return dict(audit_pages(self.pools.kv, self.cache, live))

    def finish(self) -> list[str]:
        """End of a run: evict the prefix cache into the KV pool, check every pool is
        full and the ledger empty (raises naming what leaked). Returns the names of
        the pools that could not be checked (not `AuditedPool`s)."""
        evict = getattr(self.cache, "evict_all", None)
        if evict is not None:
            evict()
        unchecked = self.pools.assert_full()
        self.ledger.assert_empty()
        return unchecked
