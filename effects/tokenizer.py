"""The tokenizer side of a serving engine, driving REQUEST and SAMPLING machines.

    submit(prompt, lora)            one request: acquire ─► tokenize ─► send
    submit_batch(prompts, loras, n) n == 1: one request per prompt;
                                    n > 1: sampling group(s) ─► warm-ups ─► fan-out
    abort(rid)                      client abort (a group: its warm-ups or children too)
    on_output / on_finish / on_error / on_dispatch_failed(rid, ...)
                                    what the scheduler (or the transport) reports

The driver never releases anything itself: it delivers events, and the machines' terminal
transitions release what the ledger says each instance owns. A LoRA id is recorded in the
ledger in the same step the registry hands it out (no await between them), so every
reference has an owner from its first instant; an abort that overtook the acquire makes
that owner terminal already, and the ledger returns the reference at once (I6).

Late events (an abort echo, a result for an aborted request) reach the terminal machine
while its instance is remembered (the last `retain_terminal` of them), which absorbs
them as declared; older or unknown rids are counted in `unknown_events` and dropped.

Only a real engine's internals are abstract here: the tokenizer (`Tokenizer`), the
scheduler transport (`effects.request.SchedulerLink`) and the client stream
(`effects.request.OutputSink`).
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import ExceptionGroup

from terminus.fsm import Instance, Ledger
from terminus.kernels.protocols import LoRARegistry
from terminus.states.request import (
    Abort,
    AcquireFailed,
    DispatchFailed,
    Finished,
    LoRAAcquired,
    Output,
    Request,
    SchedulerError,
    Submitted,
    Validated,
    ValidationFailed,
)
from terminus.states.sampling import BatchFailed, FanOut, SamplingGroup, WarmupFinished

from .request import (
    LORA,
    OutputSink,
    RequestResources,
    SchedulerLink,
    bind_request,
    bind_sampling,
    lora_ledger,
)
from .sanitize import sanitized, track_lora_side

__all__ = ["InvalidRequest", "Tokenizer", "TokenizerSide"]


class InvalidRequest(Exception):
    """Raised by a `Tokenizer` for input the client got wrong (status 4xx by default)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@runtime_checkable
class Tokenizer(Protocol):
    """Validates and tokenizes one prompt; raises `InvalidRequest` for bad input."""

    async def tokenize(self, prompt: Any) -> Any:
        """The prompt's tokens."""


class _Batch:
    """The parents of one parallel-sampling batch: they fan out together or not at all."""

    __slots__ = ("fanned", "parents")

    def __init__(self, parents: list[SamplingGroup]) -> None:
        self.parents = parents
        self.fanned = False


def _unknown_adapter(exc: BaseException) -> bool:
    # kernels.UnknownAdapter is a KeyError; other registries raise ValueError for a name
    # they do not know. Either way the client named something that is not there.
    return isinstance(exc, (KeyError, ValueError))


class TokenizerSide:
    """Tokenizer-side request handling with exactly-once LoRA ownership.

    Args:
        registry: the LoRA registry (`kernels.lora.LoRARegistry` or any object with the
            `kernels.protocols.LoRARegistry` shape).
        tokenizer: validates and tokenizes prompts (`Tokenizer`).
        scheduler: sends tokenized requests and aborts (`effects.request.SchedulerLink`).
        sink: receives each request id's one terminal output (`OutputSink`).
        ledger: a shared ledger to record LoRA handles in (its resources need the
            attributes of `RequestResources`); by default a new one.
        async_release: release through the registry's awaitable `release` (see
            `RequestResources`); `await drain()` then waits for those releases.
        retain_terminal: how many terminal instances stay reachable for late events.
    """

    def __init__(
        self,
        registry: LoRARegistry,
        tokenizer: Tokenizer,
        scheduler: SchedulerLink,
        sink: OutputSink,
        *,
        ledger: Ledger | None = None,
        async_release: bool = False,
        retain_terminal: int = 1024,
    ) -> None:
        if retain_terminal < 0:
            raise ValueError(f"retain_terminal must be >= 0, got {retain_terminal}")
        self.registry = registry
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.sink = sink
        if ledger is None:
            ledger = lora_ledger(RequestResources(registry, sink, scheduler, async_release))
        elif LORA not in ledger._releasers:
            ledger = lora_ledger(ledger.resources, ledger)
        self.ledger = ledger
        self.requests = bind_request(ledger)
        """REQUEST bound to its plans over `ledger` (its `stats` count plans and ignores)."""
        self.sampling = bind_sampling(ledger)
        """SAMPLING bound to its plans over `ledger`."""
        self._live: dict[Any, Instance] = {}
        # rids a live sampling group will give its warm-ups and children (-> group key):
        # no other request may take one, or it would be orphaned when the group does.
        self._reserved: dict[Any, Any] = {}
        self._recent: OrderedDict[Any, Instance] = OrderedDict()
        self._retain = retain_terminal
        self._batches: dict[Any, _Batch] = {}
        self._ids = itertools.count(1)
        self.unknown_events = 0
        """Events for rids neither live nor remembered (dropped)."""
        track_lora_side(self)

    # -- lookup ---------------------------------------------------------------------------

    def get(self, rid: Any) -> Instance | None:
        """The live or remembered instance of `rid` (a Request or a SamplingGroup)."""
        return self._live.get(rid) or self._recent.get(rid)

    @property
    def live(self) -> dict[Any, Instance]:
        """Instances not yet terminal, by rid."""
        return dict(self._live)

    def children(self, rid: Any) -> list[Request]:
        """The child requests a sampling group fanned out to (empty before fan-out)."""
        inst = self.get(rid)
        return list(inst.children) if isinstance(inst, SamplingGroup) else []

    def _new_rid(self, rid: Any, used: set[Any] | None = None) -> Any:
        if rid is None:
            rid = f"req-{next(self._ids)}"
            while rid in self._live or rid in self._recent or rid in self._reserved:
                rid = f"req-{next(self._ids)}"
        if rid in self._live or (used is not None and rid in used):
            raise ValueError(
                f"request id {rid!r} is already in flight; give every request a distinct "
                "rid (or pass rid=None to get one)"
            )
        if rid in self._reserved:
            raise ValueError(
                f"request id {rid!r} belongs to a request of sampling group "
                f"{self._reserved[rid]!r} (its warm-ups are <group>-warmup-<i>, its "
                "children <group>-<k>); choose another rid"
            )
        self._recent.pop(rid, None)  # a reused finished rid starts a new life
        return rid

    # -- submission -----------------------------------------------------------------------

    @sanitized
    async def submit(self, prompt: Any, lora: str | None = None, *, rid: Any = None) -> Request:
        """Run one request up to its dispatch; returns its instance (maybe terminal).

        Bad input ends the request as `rejected` with its terminal output streamed; it
        raises nothing. A cancelled submit aborts the request (releasing its reference)
        and re-raises.
        """
        rid = self._new_rid(rid)
        req = Request(self.requests, rid, prompt=prompt, lora=lora)
        self._live[rid] = req
        try:
            self._fire(req, Submitted(acquire=lora is not None))
            if lora is not None:
                try:
                    lora_id = await self.registry.acquire(lora)
                except Exception as e:
                    self._fire(req, AcquireFailed(400 if _unknown_adapter(e) else 500, str(e)))
                    return req
                # Owned from this instant; released at once if an abort came first (I6).
                self.ledger.acquire(req, LORA, lora_id)
                req.lora_id = lora_id
                self._fire(req, LoRAAcquired((lora_id,)))
            if req.terminal:
                return req
            try:
                req.tokens = await self.tokenizer.tokenize(prompt)
            except InvalidRequest as e:
                self._fire(req, ValidationFailed(e.status, str(e)))
                return req
            except Exception as e:
                self._fire(req, ValidationFailed(500, f"tokenizer failed: {e!r}"))
                return req
            self._fire(req, Validated())  # absorbed when an abort came first
            self._send(req)
        except BaseException:
            if not req.terminal:
                self._fire(req, Abort("submission was interrupted"))
            raise
        return req

    @sanitized
    async def submit_batch(
        self,
        prompts: Sequence[Any],
        loras: str | Sequence[str | None] | None = None,
        *,
        n: int = 1,
        rids: Sequence[Any] | None = None,
        parent_rids: Sequence[Any] | None = None,
        rid: Any = None,
    ) -> list[Instance]:
        """Submit a batch of prompts, each sampled `n` times.

        `loras` is one adapter name for all prompts or one (or None) per prompt. With
        n == 1 every prompt is an independent request (`rids` names them). With n > 1
        the batch's `len(prompts) x n` references are acquired by one sampling group
        (`rid` names it) or, with `parent_rids`, by one group per prompt; each group
        hands one reference to each of its children at fan-out. Returns the requests
        (n == 1) or the groups (n > 1); a group's children are `children(group_rid)`.
        """
        prompts = list(prompts)
        if not prompts:
            raise ValueError("submit_batch needs at least one prompt")
        if n < 1:
            raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")
        if loras is None or isinstance(loras, str):
            per_prompt: list[str | None] = [loras] * len(prompts)
        else:
            per_prompt = list(loras)
            if len(per_prompt) != len(prompts):
                raise ValueError(
                    f"{len(per_prompt)} LoRA names for {len(prompts)} prompts; pass one "
                    "name for all, or one (or None) per prompt"
                )
        if n == 1:
            if parent_rids is not None:
                raise ValueError("parent_rids is for parallel sampling (n > 1); use rids")
            names = self._names(rids, len(prompts), "rids")
            return list(await asyncio.gather(*(
                self.submit(p, lo, rid=r)
                for p, lo, r in zip(prompts, per_prompt, names, strict=True))))
        if rids is not None:
            raise ValueError("rids is for n == 1; with n > 1 name the groups with "
                             "rid= or parent_rids=")
        if parent_rids is not None:
            names = self._names(parent_rids, len(prompts), "parent_rids")
            parents = [SamplingGroup(self.sampling, r, prompts=[p], loras=[lo], n=n)
                       for r, p, lo in zip(names, prompts, per_prompt, strict=True)]
        else:
            parents = [SamplingGroup(self.sampling, self._new_rid(rid), prompts=prompts,
                                     loras=per_prompt, n=n)]
        taken = {p.key for p in parents}
        for p in parents:
            for d in _derived_rids(p):
                if d in self._live or d in self._reserved or d in taken:
                    raise ValueError(
                        f"sampling group {p.key!r} would name a request {d!r}, which is "
                        "already in flight or reserved; choose another group rid")
                taken.add(d)
        batch = _Batch(parents)
        for p in parents:
            self._live[p.key] = p
            self._batches[p.key] = batch
            self._reserved.update(dict.fromkeys(_derived_rids(p), p.key))
        await asyncio.gather(*(self._prepare_group(p) for p in parents))
        return list(parents)

    def _names(self, names: Sequence[Any] | None, k: int, what: str) -> list[Any]:
        if names is None:
            return [self._new_rid(None) for _ in range(k)]
        if len(names) != k:
            raise ValueError(f"{len(names)} {what} for {k} prompts; give one per prompt")
        used: set[Any] = set()
        out = []
        for r in names:
            out.append(self._new_rid(r, used))
            used.add(r)
        return out

    async def _prepare_group(self, group: SamplingGroup) -> None:
        """Acquire, tokenize and warm up one group; fan-out follows the last warm-up."""
        if group.terminal:
            return  # aborted before its preparation started: it never acquired anything
        try:
            names = [lo for lo in group.loras if lo is not None for _ in range(group.n)]
            self._fire(group, Submitted(acquire=bool(names)))
            if names:
                try:
                    ids = await self.registry.acquire(names)
                except Exception as e:
                    self._fire(group, AcquireFailed(400 if _unknown_adapter(e) else 500,
                                                    str(e)))
                    return
                # Owned from this instant; released at once if an abort came first (I6).
                # Every id is recorded even when one such release raises.
                errors: list[Exception] = []
                for i in ids:
                    try:
                        self.ledger.acquire(group, LORA, i)
                    except Exception as e:
                        errors.append(e)
                if errors:
                    raise errors[0] if len(errors) == 1 else ExceptionGroup(
                        f"{len(errors)} late LoRA releases of {group.key!r} raised", errors)
                self._fire(group, LoRAAcquired(tuple(ids)))
            if group.terminal:
                return
            try:
                group.tokens = list(await asyncio.gather(
                    *(self.tokenizer.tokenize(p) for p in group.prompts)))
            except InvalidRequest as e:
                self._fire(group, ValidationFailed(e.status, str(e)))
                return
            except Exception as e:
                self._fire(group, ValidationFailed(500, f"tokenizer failed: {e!r}"))
                return
            self._fire(group, Validated())
            if group.state != "warming_up":
                return
            handles = self.ledger.owned(group, LORA)
            k = 0
            warmups = []
            for i, (prompt, lora) in enumerate(zip(group.prompts, group.loras, strict=True)):
                w = Request(self.requests, _warmup_rid(group.key, i), prompt=prompt,
                            lora=lora, role="warmup", stream=False, parent=group)
                w.tokens = group.tokens[i]
                if lora is not None:
                    # The warm-up uses the prompt's references but owns none of them.
                    for h in handles[k:k + group.n]:
                        self.ledger.observe(h, w)
                    w.lora_id = handles[k].value
                    k += group.n
                warmups.append(w)
            group.warmups = warmups
            group.pending_warmups = len(warmups)
            for w in warmups:
                self._reserved.pop(w.key, None)
                self._live[w.key] = w
            for w in warmups:
                if group.terminal:
                    break
                self._fire(w, Submitted(acquire=False))
                self._fire(w, Validated())
                self._send(w)
        except BaseException:
            if not group.terminal:
                self._fire(group, Abort("submission was interrupted"))
            raise

    def _send(self, req: Request) -> None:
        if req.state != "dispatched":
            return  # aborted (or failed) before it could be sent
        try:
            self.scheduler.send(req.key, req.tokens, req.lora_id)
        except Exception as e:
            self._fire(req, DispatchFailed(f"could not send to the scheduler: {e!r}"))

    def _fan_out(self, batch: _Batch) -> None:
        if batch.fanned or not all(p.terminal or p.state == "ready" for p in batch.parents):
            return
        batch.fanned = True
        for group in batch.parents:
            if group.state != "ready":
                continue
            children = []
            for i, (prompt, lora) in enumerate(zip(group.prompts, group.loras, strict=True)):
                for j in range(group.n):
                    c = Request(self.requests, _child_rid(group.key, i * group.n + j),
                                prompt=prompt, lora=lora, role="child", parent=group)
                    c.tokens = group.tokens[i]
                    self._reserved.pop(c.key, None)
                    self._live[c.key] = c
                    children.append(c)
            group.children = children
            self._fire(group, FanOut())  # transfers one reference to each child
            for c in children:
                self._fire(c, Submitted(acquire=False))
                self._fire(c, Validated())
                self._send(c)

    # -- events from the client and the scheduler ----------------------------------------

    @sanitized
    def abort(self, rid: Any, message: str = "aborted by client") -> bool:
        """Abort `rid`: a request, or a group (its warm-ups, or its children after fan-out).

        Returns False for an rid that is neither live nor remembered. An abort of a
        terminal request is absorbed by its machine (an abort echo after finish).
        """
        inst = self.get(rid)
        if inst is None:
            self.unknown_events += 1
            return False
        self._fire(inst, Abort(message))
        if isinstance(inst, SamplingGroup):
            for c in inst.children:
                self._fire(c, Abort(message))
        return True

    @sanitized
    def on_output(self, rid: Any) -> bool:
        """The scheduler streamed a non-final output for `rid`."""
        return self._deliver(rid, Output())

    @sanitized
    def on_finish(self, rid: Any, reason: str = "stop") -> bool:
        """The scheduler finished `rid` (an abort echo arrives as one for a dead rid)."""
        return self._deliver(rid, Finished(reason))

    @sanitized
    def on_error(self, rid: Any, status: int = 500, message: str = "") -> bool:
        """The scheduler failed `rid` with an HTTP-like `status` (400, 500, 503, ...)."""
        return self._deliver(rid, SchedulerError(status, message))

    @sanitized
    def on_dispatch_failed(self, rid: Any, message: str = "") -> bool:
        """The transport reports that `rid` never reached the scheduler."""
        return self._deliver(rid, DispatchFailed(message))

    def _deliver(self, rid: Any, event: Any) -> bool:
        inst = self.get(rid)
        if inst is None:
            self.unknown_events += 1
            return False
        if isinstance(inst, SamplingGroup):
            raise ValueError(
                f"{rid!r} is a sampling group, which the scheduler never sees; deliver "
                f"scheduler results to its requests ({rid!r}-warmup-<i>, {rid!r}-<k>)"
            )
        self._fire(inst, event)
        return True

    async def drain(self) -> None:
        """Wait for every asynchronous release the ledger still runs."""
        await self.ledger.drain()

    # -- the one place events are delivered ----------------------------------------------

    def _fire(self, inst: Instance, event: Any) -> None:
        was_terminal = inst.terminal
        try:
            inst.fire(event)
        finally:
            if inst.terminal and not was_terminal:
                self._retired(inst, event)

    def _retired(self, inst: Instance, event: Any) -> None:
        key = inst.key
        if self._live.get(key) is inst:
            del self._live[key]
        if self._retain:
            self._recent[key] = inst
            while len(self._recent) > self._retain:
                self._recent.popitem(last=False)
        if isinstance(inst, SamplingGroup):
            for d in _derived_rids(inst):  # names it never used are free again
                if self._reserved.get(d) == key:
                    del self._reserved[d]
            self._group_ended(inst, event)
        elif isinstance(inst, Request) and inst.role == "warmup":
            self._warmup_ended(inst, event)

    def _group_ended(self, group: SamplingGroup, event: Any) -> None:
        batch = self._batches.get(group.key)
        if group.state != "fanned_out":
            for w in group.warmups:
                self._fire(w, Abort("its sampling group ended"))
        if batch is None:
            return
        if all(p.terminal for p in batch.parents):
            for p in batch.parents:
                self._batches.pop(p.key, None)
        if group.state in ("rejected", "errored"):
            # A batch fans out whole or not at all: one failed prompt fails its siblings.
            status = int(getattr(event, "status", 500))
            msg = getattr(event, "message", "")
            if not isinstance(event, BatchFailed):
                msg = f"{group.key!r} failed before fan-out: {msg}"
            for p in batch.parents:
                if not p.terminal:
                    self._fire(p, BatchFailed(status, msg))
        elif group.state == "aborted":
            self._fan_out(batch)  # the siblings may all be ready now

    def _warmup_ended(self, w: Request, event: Any) -> None:
        group = w.parent
        if w.state == "finished":
            group.pending_warmups -= 1
            self._fire(group, WarmupFinished())
            batch = self._batches.get(group.key)
            if batch is not None and group.state == "ready":
                self._fan_out(batch)
            return
        status = int(getattr(event, "status", 503 if w.state == "dispatch_failed" else 500))
        self._fire(group, BatchFailed(
            status, f"prefix warm-up {w.key!r} ended {w.state}: "
                    f"{getattr(event, 'message', '')}"))


def _warmup_rid(group: Any, i: int) -> str:
    return f"{group}-warmup-{i}"


def _child_rid(group: Any, k: int) -> str:
    return f"{group}-{k}"


def _derived_rids(group: SamplingGroup) -> list[str]:
    """Every rid `group` may give a warm-up (one per prompt) or a child (n per prompt)."""
    m = len(group.prompts)
    return ([_warmup_rid(group.key, i) for i in range(m)]
            + [_child_rid(group.key, k) for k in range(m * group.n)])
