"""The tokenizer side of a serving engine, driving REQUEST and SAMPLING machines.

    submit(prompt, lora, rid=)      one request: acquire ─► tokenize ─► send
    submit_batch(prompts, loras, n, rid= | rids=)
                                    n == 1: one request per prompt;
                                    n > 1: sampling group(s) ─► warm-ups ─► fan-out
    abort(rid)                      client abort (a group: its warm-ups or children too)
    on_output / on_finish / on_error / on_dispatch_failed(rid, ...)
                                    what the scheduler (or the transport) reports

The driver never releases anything itself: it delivers events, and the machines' terminal
transitions release what the ledger says each instance owns. A LoRA id is recorded in the
ledger in the same step the registry hands it out (no await between them), so every
reference has an owner from its first instant; an abort that overtook the acquire makes
that owner terminal already, and the ledger returns the reference at once (I6).

Every instance is keyed by a `RequestKey(group, role, index)`; the scheduler link is
sent that key, and the client's stream carries `key.rid`. Events are looked up by either,
never parsed. A request's *family* is the request itself, or a sampling group with its
warm-ups and children; the family stays reachable by every one of its ids for as long
as any member lives (so `abort(group_rid)` reaches the children of a group that fanned
out, whatever else ran since), and is forgotten when its last member ends. An event for
an id no live family has is counted in `unknown_events` and dropped (nothing it could
reach owns anything). An event for an id a live group reserved but has not created yet
(a child before fan-out, a warm-up before tokenization) raises `NotCreatedYet`.

Only a real engine's internals are abstract here: the tokenizer (`Tokenizer`), the
scheduler transport (`effects.request.SchedulerLink`) and the client stream
(`effects.request.OutputSink`).
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections.abc import Collection, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import ExceptionGroup

from terminus.fsm import Instance, Ledger
from terminus.kernels.protocols import LoRARegistry
from terminus.states.request import (
    AcquireFailed,
    DispatchFailed,
    Finished,
    LoRAAcquired,
    Output,
    Request,
    RequestAbort,
    RequestKey,
    SchedulerError,
    SubmittedAcquiring,
    SubmittedNoAcquire,
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

__all__ = ["InvalidRequest", "NotCreatedYet", "RequestKey", "Tokenizer", "TokenizerSide"]


# Events without a payload to speak of, made once (events are frozen). `Submitted(acquire=)`
# as its two unguarded events: the machine asks no guard for them.
_SUBMIT = SubmittedNoAcquire()
_SUBMIT_ACQUIRE = SubmittedAcquiring()
_VALIDATED = Validated()
_OUTPUT = Output()
_FAN_OUT = FanOut()
_WARMUP_FINISHED = WarmupFinished()
# `Finished(reason)` for the reasons schedulers report most.
_FINISHED = {r: Finished(r) for r in ("stop", "length", "abort")}


# `_GATHERED`: one coroutine is awaited directly rather than through `asyncio.gather`,
# which would wrap it in a task, run it at the loop's next iteration, and wake the caller
# two iterations after it ends (its done callback, then the caller's wake-up): the
# direct await yields to the loop only where the awaited call does, as a single
# request's `submit` does (the loop iterations the gather took are not kept: they cost
# a sampling group five trips through the event loop, and decided nothing).


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


class NotCreatedYet(LookupError):
    """An event named a warm-up or child a live sampling group reserved but has not
    created yet (the scheduler was never sent it). Nothing changed."""


class _Batch:
    """The parents of one parallel-sampling batch: they fan out together or not at all.

    `interrupted`: the `submit_batch` call that made it was cancelled (or raised), so no
    parent may fan out any more; every request of the batch is being ended.
    """

    __slots__ = ("fanned", "interrupted", "parents")

    def __init__(self, parents: list[SamplingGroup]) -> None:
        self.parents = parents
        self.fanned = False
        self.interrupted = False


def _unknown_adapter(exc: BaseException) -> bool:
    # kernels.UnknownAdapter is a KeyError; other registries raise ValueError for a name
    # they do not know. Either way the client named something that is not there.
    return isinstance(exc, (KeyError, ValueError))


def _derived_keys(group: RequestKey, prompts: int, n: int) -> dict[Any, RequestKey]:
    """Every key a group of `prompts` prompts sampled `n` times may give a warm-up (one
    per prompt) or a child (n per prompt), by its id: warm-ups first, in index order.
    Each id is its key's `rid`, written out as `RequestKey.rid` writes it (without the
    property, for keys the side makes itself; a test checks that the two agree)."""
    g = group.group
    derived = {}
    for i in range(prompts):
        derived[f"{g}-warmup-{i}"] = RequestKey(g, "warmup", i)
    for k in range(prompts * n):
        derived[f"{g}-{k}"] = RequestKey(g, "child", k)
    return derived


class TokenizerSide:
    """Tokenizer-side request handling with exactly-once LoRA ownership.

    Args:
        registry: the LoRA registry (`kernels.lora.LoRARegistry` or any object with the
            `kernels.protocols.LoRARegistry` shape).
        tokenizer: validates and tokenizes prompts (`Tokenizer`).
        scheduler: sends tokenized requests and aborts (`effects.request.SchedulerLink`);
            it is given each request's `RequestKey`.
        sink: receives each request id's one terminal output (`OutputSink`).
        ledger: a shared ledger to record LoRA handles in (its resources need the
            attributes of `RequestResources`); by default a new one.
        async_release: release through the registry's awaitable `release` (see
            `RequestResources`); `await drain()` then waits for those releases.
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
    ) -> None:
        self.registry = registry
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.sink = sink
        if ledger is None:
            ledger = lora_ledger(RequestResources(registry, sink, scheduler, async_release))
        elif LORA not in ledger.kinds:
            ledger = lora_ledger(ledger.resources, ledger)
        self.ledger = ledger
        self.requests = bind_request(ledger)
        """REQUEST bound to its plans over `ledger` (its `stats` count plans and ignores)."""
        self.sampling = bind_sampling(ledger)
        """SAMPLING bound to its plans over `ledger`."""
        # State ids the side compares with (`inst.state == name`, without the property
        # and the string: its requests and groups run on these two machines).
        self._dispatched = self.requests.states.index("dispatched")
        # REQUEST's terminal flags by state id: `req.terminal` for a request the side
        # made is `self._ended[req._s]`, one attribute read less than `req._m.terminal`.
        self._ended = self.requests.terminal
        self._finished = self.requests.states.index("finished")
        sampling = self.sampling.states
        self._warming_up = sampling.index("warming_up")
        self._ready = sampling.index("ready")
        self._fanned_out = sampling.index("fanned_out")
        self._group_aborted = sampling.index("aborted")
        self._group_failed = (sampling.index("rejected"), sampling.index("errored"))
        # Instances not yet terminal, by key.
        self._live: dict[RequestKey, Instance] = {}
        # Every member of a live family (terminal ones too), by the id its client sees.
        self._names: dict[Any, Instance] = {}
        # Ids a live sampling group will give its warm-ups and children, not created yet:
        # no other request may take one, or it would be orphaned when the group does.
        self._reserved: dict[Any, RequestKey] = {}
        self._batches: dict[RequestKey, _Batch] = {}
        # Each live group's `_derived_keys` ids, in order (made once, at submission; their
        # keys are in `_reserved` until each member is made).
        self._derived: dict[RequestKey, list[Any]] = {}
        self._ids = itertools.count(1)
        self.unknown_events = 0
        """Events for ids no live family has (dropped: nothing they could reach owns
        anything)."""
        track_lora_side(self)

    # -- lookup ---------------------------------------------------------------------------

    def get(self, rid: Any) -> Instance | None:
        """The instance (a Request or a SamplingGroup) of a live family that `rid` names:
        its `RequestKey`, or the id its client sees."""
        if isinstance(rid, RequestKey):
            inst = self._live.get(rid)  # a live instance is its family's under its id
            if inst is not None:
                return inst
            inst = self._names.get(rid.rid)
            return inst if inst is not None and inst.key == rid else None
        return self._names.get(rid)

    @property
    def live(self) -> dict[RequestKey, Instance]:
        """Instances not yet terminal, by key (a copy)."""
        return dict(self._live)

    @property
    def live_count(self) -> int:
        """How many instances are not yet terminal (`len(live)`, without the copy)."""
        return len(self._live)

    def children(self, rid: Any) -> list[Request]:
        """The child requests a sampling group fanned out to (empty before fan-out)."""
        inst = self.get(rid)
        return list(inst.children) if isinstance(inst, SamplingGroup) else []

    def _claim(self, rid: Any, taken: set[Any]) -> Any:
        """Decide the client id of a new request or group (`None`: make one up); refuse
        one in use. Changes nothing but `taken` (the ids this call already decided)."""
        if rid is None:
            rid = f"req-{next(self._ids)}"
            while rid in self._names or rid in self._reserved or rid in taken:
                rid = f"req-{next(self._ids)}"
        elif isinstance(rid, RequestKey):
            raise ValueError(f"pass the client's rid, not a RequestKey ({rid!r}); the "
                             "side makes the keys")
        holder = self._names.get(rid)
        if rid in taken or (holder is not None and holder.key.role in ("request", "group")):
            raise ValueError(
                f"request id {rid!r} is already in flight; give every request a distinct "
                "rid (or pass rid=None to get one)"
            )
        key = self._reserved.get(rid) or (holder.key if holder is not None else None)
        if key is not None:
            raise ValueError(
                f"request id {rid!r} belongs to a request of sampling group "
                f"{key.group!r} (its warm-ups are <group>-warmup-<i>, its "
                "children <group>-<k>); choose another rid"
            )
        taken.add(rid)
        return rid

    def _take(self, names: Collection[Any], group: RequestKey, taken: set[Any]) -> None:
        """Add the ids `group` will give its warm-ups and children to `taken` (the ids
        this call already decided); refuse the first one in use. `_take_each`, with its
        common case (distinct ids, none in use) in a few set operations."""
        new = set(names)
        if (len(new) == len(names) and taken.isdisjoint(new)
                and self._names.keys().isdisjoint(new)
                and self._reserved.keys().isdisjoint(new)):
            taken |= new
        else:
            self._take_each(names, group, taken)

    def _take_each(self, names: Iterable[Any], group: RequestKey, taken: set[Any]) -> None:
        """`_take`, one id at a time: refuses the first id in use, having added those
        before it to `taken` (which the refused call drops)."""
        for name in names:
            if name in self._names or name in self._reserved or name in taken:
                raise ValueError(
                    f"sampling group {group.group!r} would name a request {name!r}, "
                    "which is already in flight or reserved; choose another group rid")
            taken.add(name)

    def _not_created(self, rid: Any) -> None:
        """Raise `NotCreatedYet` if `rid` is reserved by a live group; else return."""
        name = rid.rid if isinstance(rid, RequestKey) else rid
        key = self._reserved.get(name)
        if key is None or (isinstance(rid, RequestKey) and rid != key):
            return
        group = self._names[key.group]
        what = (f"the warm-up of its prompt {key.index}" if key.role == "warmup"
                else f"its child {key.index}")
        when = ("once the group's prompts are tokenized" if key.role == "warmup"
                else "at fan-out, once every warm-up of its batch has finished")
        raise NotCreatedYet(
            f"{name!r} is {what} of sampling group {key.group!r}, which has not created it "
            f"yet (the group is {group.state}; it is created {when}). Report results only "
            f"for requests the scheduler was sent; to end the group, abort {key.group!r}. "
            "Nothing was changed."
        )

    # -- submission -----------------------------------------------------------------------

    @sanitized
    async def submit(self, prompt: Any, lora: str | None = None, *, rid: Any = None) -> Request:
        """Run one request up to its dispatch; returns its instance (maybe terminal).

        Bad input ends the request as `rejected` with its terminal output streamed; it
        raises nothing. A cancelled submit aborts the request (releasing its reference)
        and re-raises.
        """
        # `_claim`, without the call in the common case: a rid nobody holds or reserved.
        if (rid in self._names or rid in self._reserved or (
                rid.__class__ is not str and (rid is None or isinstance(rid, RequestKey)))):
            rid = self._claim(rid, set())
        req = Request(self.requests, RequestKey(rid), prompt, lora)  # (by position: no dict)
        req._rid = rid  # its key's `rid`, known here (read by its terminal output)
        self._names[rid] = req  # `_new_request`, inline
        self._live[req.key] = req
        await self._run_request(req)
        return req

    def _new_request(self, rid: Any, prompt: Any, lora: str | None) -> Request:
        req = Request(self.requests, RequestKey(rid), prompt, lora)
        req._rid = rid
        self._names[rid] = req
        self._live[req.key] = req
        return req

    async def _run_request(self, req: Request) -> None:
        """A new request up to its dispatch (`submit`, and each request of
        `submit_batch`): its LoRA reference, its tokens, then the scheduler."""
        # Submitted, LoRAAcquired and Validated never end a request (each leads to a
        # live state, or is absorbed by a terminal one), so they are fired without
        # `_fire`'s retire check; the failures go through `_fire`. The `finally`
        # retires a request an observer ended from inside one of those fires.
        lora = req.lora
        try:
            if lora is None:
                req.fire(_SUBMIT)
            else:
                req.fire(_SUBMIT_ACQUIRE)
                try:
                    lora_id = await self.registry.acquire(lora)
                except Exception as e:
                    self._fire(req, AcquireFailed(400 if _unknown_adapter(e) else 500,
                                                  str(e)))
                    return
                # Owned from this instant; released at once if an abort came first (I6).
                self.ledger.acquire(req, LORA, lora_id)
                req.lora_id = lora_id
                req.fire(LoRAAcquired((lora_id,)))
            if self._ended[req._s]:  # `req.terminal`, without the property
                return
            try:
                req.tokens = await self.tokenizer.tokenize(req.prompt)
            except InvalidRequest as e:
                self._fire(req, ValidationFailed(e.status, str(e)))
                return
            except Exception as e:
                self._fire(req, ValidationFailed(500, f"tokenizer failed: {e!r}"))
                return
            req.fire(_VALIDATED)  # absorbed when an abort came first
            if req._s == self._dispatched:  # (as `_start` sends)
                try:
                    self.scheduler.send(req.key, req.tokens, req.lora_id)
                except Exception as e:
                    self._send_failed(req, e)
        except BaseException:
            self._end(req, "submission was interrupted")
            raise
        finally:
            if self._ended[req._s] and self._live.get(req.key) is req:
                self._request_retired(req, None)

    async def _run_batched(self, req: Request) -> None:
        """`_run_request` for a request of `submit_batch`, whose gathered task starts
        later: an abort may have ended it first (it never acquired anything then)."""
        if not req._m.terminal[req._s]:  # `req.terminal`, without the property
            await self._run_request(req)

    @sanitized
    async def submit_batch(
        self,
        prompts: Sequence[Any],
        loras: str | Sequence[str | None] | None = None,
        *,
        n: int = 1,
        rid: Any = None,
        rids: Sequence[Any] | None = None,
    ) -> list[Instance]:
        """Submit a batch of prompts, each sampled `n` times.

        `loras` is one adapter name for all prompts or one (or None) per prompt. The rid
        arguments mean the same whatever `n` is: `rids` names each prompt's own request
        (n == 1) or sampling group (n > 1); `rid` names the batch's one request (n == 1,
        one prompt) or its one sampling group (n > 1, every prompt); with neither, the
        ids are made up. Each group of n > 1 owns its prompts' `n` references each until
        fan-out, then hands one to each child. Returns the requests (n == 1) or the
        groups (n > 1); a group's children are `children(group_rid)`.

        Everything is checked before anything is created or acquired; a refused call
        raises `ValueError` and changes nothing. A cancelled (or raising) call ends every
        request of the batch before it re-raises.
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
        if rid is not None and rids is not None:
            raise ValueError("pass rid= (one id for the batch) or rids= (one per prompt), "
                             "not both")
        if rid is not None and n == 1 and len(prompts) > 1:
            raise ValueError(
                f"rid={rid!r} names one request, but with n == 1 these {len(prompts)} "
                "prompts are as many independent requests: name each with rids=[...], or "
                "sample them as one group with n > 1"
            )
        taken: set[Any] = set()
        if rids is not None:
            rids = list(rids)
            if len(rids) != len(prompts):
                raise ValueError(f"{len(rids)} rids for {len(prompts)} prompts; give one "
                                 "per prompt")
            names = [self._claim(r, taken) for r in rids]
        elif n == 1:
            names = [self._claim(rid, taken) for _ in prompts] if rid is None \
                else [self._claim(rid, taken)]
        else:
            names = [self._claim(rid, taken)]
        if n == 1:
            reqs = [self._new_request(r, p, lo)
                    for r, p, lo in zip(names, prompts, per_prompt, strict=True)]
            try:
                await asyncio.gather(*(self._run_batched(r) for r in reqs))
            except BaseException:
                self._end_all(reqs, "its batch was interrupted")
                raise
            return list(reqs)
        # Each group's name, prompts and LoRA names.
        if rids is not None:
            shapes = [(r, [p], [lo]) for r, p, lo in zip(names, prompts, per_prompt, strict=True)]
        else:
            shapes = [(names[0], prompts, per_prompt)]
        decided = []
        for r, ps, los in shapes:
            key = RequestKey(r, "group")
            derived = _derived_keys(key, len(ps), n)
            self._take(derived, key, taken)
            decided.append((key, ps, los, derived))
        # Decided; from here on, create.
        parents: list[SamplingGroup] = []
        batch = _Batch(parents)
        for key, ps, los, derived in decided:
            p = SamplingGroup(self.sampling, key, ps, los, n)  # (by position: no dict)
            parents.append(p)
            self._names[key.group] = p
            self._live[key] = p
            self._batches[key] = batch
            self._derived[key] = list(derived)
            self._reserved.update(derived)
        try:
            if len(parents) == 1:  # one group: no task to gather (see `_GATHERED`)
                await self._prepare_group(parents[0], batch)  # (nothing follows it)
            else:
                await asyncio.gather(*(self._prepare_group(p, batch) for p in parents))
        except BaseException:
            batch.interrupted = True
            self._end_all(parents, "its batch was interrupted")
            raise
        return list(parents)

    async def _prepare_group(self, group: SamplingGroup, batch: _Batch) -> None:
        """Acquire, tokenize and warm up one group; fan-out follows the last warm-up."""
        if group._m.terminal[group._s]:  # `group.terminal`, without the property
            return  # aborted before its preparation started: it never acquired anything
        try:
            names = [lo for lo in group.loras if lo is not None for _ in range(group.n)]
            self._fire(group, _SUBMIT_ACQUIRE if names else _SUBMIT)
            if names:
                try:
                    ids = list(await self.registry.acquire(names))
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
                        f"{len(errors)} late LoRA releases of {group.rid!r} raised", errors)
                if len(ids) != len(names):
                    # The registry broke its protocol: no child could get exactly one
                    # reference. The group releases what it was given and fails.
                    self._fire(group, AcquireFailed(500, (
                        f"the LoRA registry returned {len(ids)} id(s) for {len(names)} "
                        f"acquired name(s) of sampling group {group.rid!r}; it must return "
                        "one id per name")))
                    return
                self._fire(group, LoRAAcquired(tuple(ids)))
            if group._m.terminal[group._s]:
                return
            try:
                prompts = group.prompts
                if len(prompts) == 1:  # one prompt: no task to gather (see `_GATHERED`)
                    group.tokens.append(await self.tokenizer.tokenize(prompts[0]))
                else:
                    group.tokens.extend(await asyncio.gather(
                        *(self.tokenizer.tokenize(p) for p in prompts)))
            except InvalidRequest as e:
                self._fire(group, ValidationFailed(e.status, str(e)))
                return
            except Exception as e:
                self._fire(group, ValidationFailed(500, f"tokenizer failed: {e!r}"))
                return
            self._fire(group, _VALIDATED)
            if group._s != self._warming_up:
                return
            handles = self.ledger.owned(group, LORA)
            names = self._derived[group.key]  # warm-ups first (the group is live)
            reserved = self._reserved
            loras, tokens, n = group.loras, group.tokens, group.n
            k = 0
            warmups = group.warmups
            for i, prompt in enumerate(group.prompts):  # (a lora and tokens each)
                lora, name = loras[i], names[i]
                # (its key, out of the reservation; a warm-up streams nothing)
                w = Request(self.requests, reserved.pop(name), prompt, lora, False, group)
                w._rid = name
                w.tokens = tokens[i]
                if lora is not None:
                    # The warm-up uses the prompt's references but owns none of them.
                    for h in handles[k:k + n]:
                        self.ledger.observe(h, w)
                    w.lora_id = handles[k].value
                    k += n
                warmups.append(w)
            group.pending_warmups = len(warmups)
            self._created(group, warmups)
            for w in warmups:
                if group._m.terminal[group._s]:
                    break
                self._start(w)
        except BaseException:
            batch.interrupted = True  # no sibling may fan out any more
            self._end(group, "submission was interrupted")
            raise

    def _created(self, group: SamplingGroup, members: list[Request]) -> None:
        """Reserved warm-ups or children of `group` now exist (each made with the key its
        id reserved, taken out of `_reserved`): each one's id (given it when it was made:
        its key's `rid`) finds it, and it is live until it is retired."""
        group.live_members += len(members)
        names, live = self._names, self._live
        for inst in members:
            name = inst._rid
            names[name] = inst
            live[inst.key] = inst

    def _start(self, req: Request) -> None:
        """A tokenized warm-up or child, from its creation to its dispatch. Submitted and
        Validated never end a request (see `_run_request`): they are fired without
        `_fire`'s retire check, made once after the send for an observer that ended it."""
        req.fire(_SUBMIT)
        req.fire(_VALIDATED)
        if req._s == self._dispatched:  # else aborted (or failed) before it could be sent
            try:
                self.scheduler.send(req.key, req.tokens, req.lora_id)
            except Exception as e:
                self._send_failed(req, e)
        if self._ended[req._s] and self._live.get(req.key) is req:
            self._request_retired(req, None)

    def _send_failed(self, req: Request, e: Exception) -> None:
        self._fire(req, DispatchFailed(f"could not send to the scheduler: {e!r}"))

    def _fan_out(self, batch: _Batch) -> None:
        if batch.fanned or batch.interrupted:
            return
        ready = []  # every parent must be ready or ended (`state`, `terminal` read direct)
        for p in batch.parents:
            if p._s == self._ready:
                ready.append(p)
            elif not p._m.terminal[p._s]:
                return
        # Decide for the whole batch before creating any child: each child that uses a
        # LoRA must get exactly one of its group's references.
        for group in ready:
            owned = len(self.ledger.owned(group, LORA))
            takers = (len(group.loras) - group.loras.count(None)) * group.n
            if owned != takers:
                msg = (f"sampling group {group.rid!r} owns {owned} LoRA reference(s) but "
                       f"{takers} of its children use a LoRA; each needs exactly one. No "
                       "child was created; the batch's references are released.")
                for g in batch.parents:
                    if not g.terminal:
                        self._fire(g, BatchFailed(500, msg))
                return
        batch.fanned = True
        for group in ready:
            # The children's ids and keys, made at submission, after the warm-ups'.
            names = self._derived[group.key]
            reserved = self._reserved
            prompts, loras, tokens, n = group.prompts, group.loras, group.tokens, group.n
            j = len(prompts)
            children = group.children
            for i, prompt in enumerate(prompts):  # (a lora and tokens each)
                lora, toks = loras[i], tokens[i]
                for _ in range(n):
                    name = names[j]  # (its key, out of the reservation)
                    c = Request(self.requests, reserved.pop(name), prompt, lora, True, group)
                    c._rid = name
                    c.tokens = toks
                    children.append(c)
                    j += 1
            self._created(group, children)
            self._fire(group, _FAN_OUT)  # transfers one reference to each child
            for c in children:
                self._start(c)

    # -- events from the client and the scheduler ----------------------------------------

    @sanitized
    def abort(self, rid: Any, message: str = "aborted by client") -> bool:
        """Abort `rid`: a request, or a group (its warm-ups, or its children after fan-out).

        Returns False for an id no live family has. An abort of a terminal member of a
        live family is absorbed by its machine (an abort echo after finish). Raises
        `NotCreatedYet` for a warm-up or child a live group has not created yet. A
        group's abort reaches every child even when a release raises on the way (the
        group's own, or a child's): the first error is raised after all of them
        (an `ExceptionGroup` of them when several raised).
        """
        inst = self.get(rid)
        if inst is None:
            self._not_created(rid)
            self.unknown_events += 1
            return False
        if isinstance(inst, SamplingGroup):
            self._abort_group(inst, message, live_only=False)
        else:
            self._fire(inst, RequestAbort(message))
        return True

    def _abort_group(self, group: SamplingGroup, message: str, *, live_only: bool) -> None:
        """Abort `group`, then each of its children (`live_only`: those not terminal
        yet), every one of them even when a release raises on the way; then raise the
        first error (an `ExceptionGroup` when several raised). A refused abort of the
        group (it is as it was) raises at once, its children untouched."""
        errors: list[Exception] = []
        if not (live_only and group.terminal):
            try:
                self._fire(group, RequestAbort(message))
            except Exception as e:
                if not group._m.terminal[group._s]:
                    raise
                errors.append(e)  # the group ended; a release of its raised
        for c in group.children:
            if live_only and c.terminal:
                continue
            try:
                self._fire(c, RequestAbort(message))
            except Exception as e:  # the other children are aborted all the same
                errors.append(e)
        if errors:
            raise errors[0] if len(errors) == 1 else ExceptionGroup(
                f"aborting group {group.key!r}: {len(errors)} releases raised", errors)

    @sanitized
    def on_output(self, rid: Any) -> bool:
        """The scheduler streamed a non-final output for `rid`."""
        return self._deliver(rid, _OUTPUT)

    @sanitized
    def on_finish(self, rid: Any, reason: str = "stop") -> bool:
        """The scheduler finished `rid` (an abort echo arrives as one for a dead rid)."""
        try:
            event = _FINISHED[reason]
        except (KeyError, TypeError):
            event = Finished(reason)
        return self._deliver(rid, event)

    @sanitized
    def on_error(self, rid: Any, status: int = 500, message: str = "") -> bool:
        """The scheduler failed `rid` with an HTTP-like `status` (400, 500, 503, ...)."""
        return self._deliver(rid, SchedulerError(status, message))

    @sanitized
    def on_dispatch_failed(self, rid: Any, message: str = "") -> bool:
        """The transport reports that `rid` never reached the scheduler."""
        return self._deliver(rid, DispatchFailed(message))

    def _deliver(self, rid: Any, event: Any) -> bool:
        # `get`, with its common case first: the key of a live request (a client id is
        # no key: never found there; None, for no live instance, is no Request).
        inst = self._live.get(rid)
        if inst.__class__ is Request:  # `_fire`, inline: this runs for every result
            try:
                inst.fire(event)
            finally:
                if self._ended[inst._s] and self._live.get(inst.key) is inst:
                    self._request_retired(inst, event)
            return True
        if inst is None:
            # A request of its own that ended (an abort echo): `get` and `_not_created`
            # without the calls. Its id is its group; no group reserves a key of this role.
            if (rid.__class__ is RequestKey and rid.role == "request"
                    and self._names.get(rid.group) is None):
                self.unknown_events += 1
                return False
            inst = self.get(rid)
            if inst is None:
                self._not_created(rid)
                self.unknown_events += 1
                return False
        if isinstance(inst, SamplingGroup):
            warm, child = (RequestKey(inst.key.group, r, 0).rid for r in ("warmup", "child"))
            raise ValueError(
                f"{inst.rid!r} is a sampling group, which the scheduler never sees; deliver "
                f"scheduler results to its requests (warm-ups {warm!r}, ..., children "
                f"{child!r}, ...)"
            )
        self._fire(inst, event)
        return True

    async def drain(self) -> None:
        """Wait for every asynchronous release the ledger still runs."""
        await self.ledger.drain()

    # -- the one place events are delivered ----------------------------------------------

    def _fire(self, inst: Instance, event: Any) -> None:
        try:
            inst.fire(event)
        finally:
            # Newly terminal: every instance is live (in `_live`) from its creation
            # until it is retired here, once. (`inst.terminal`, read without the
            # property: this runs for every event the side delivers.)
            if inst._m.terminal[inst._s] and self._live.get(inst.key) is inst:
                self._retired(inst, event)

    def _end(self, inst: Instance, message: str) -> None:
        """Abort `inst` (and a group's children) where not terminal yet."""
        if isinstance(inst, SamplingGroup):
            self._abort_group(inst, message, live_only=True)
        elif not inst.terminal:
            self._fire(inst, RequestAbort(message))

    def _end_all(self, insts: Iterable[Instance], message: str) -> None:
        errors: list[Exception] = []
        for inst in insts:
            try:
                self._end(inst, message)
            except Exception as e:  # every member is ended even when one release raises
                errors.append(e)
        if errors:
            raise errors[0] if len(errors) == 1 else ExceptionGroup(
                f"ending {len(errors)} requests of an interrupted batch raised", errors)

    def _retired(self, inst: Instance, event: Any) -> None:
        """`inst` (live, in `_live`) is newly terminal: retire it, once. Callers that
        know it is a Request call `_request_retired`."""
        if inst.__class__ is Request or isinstance(inst, Request):
            self._request_retired(inst, event)
            return
        key = inst.key
        del self._live[key]
        if isinstance(inst, SamplingGroup):
            names = self._derived.pop(key)  # (set with `_live[key]`, in submit_batch)
            # (none to free once it made a member with each: after its fan-out)
            if len(inst.warmups) + len(inst.children) < len(names):
                reserved, g = self._reserved, key.group
                for name in names:
                    d = reserved.get(name)
                    if d is not None and d.group == g:  # ids it never used are free again
                        del reserved[name]
            self._group_ended(inst, event)
            if not inst.live_members:
                self._forget(inst)

    def _request_retired(self, req: Request, event: Any) -> None:
        """`_retired` for a Request."""
        key = req.key
        del self._live[key]
        parent = req.parent
        if parent is None:
            # A request of its own (`_new_request`: its key is `RequestKey(rid)`) is its
            # whole family, and has no batch. Its id is its own while it lives (`_claim`
            # gives no other request or group an id in `_names`): forgotten now.
            del self._names[key.group]
            return
        # A member of a group: one live member less (see `_created`).
        parent.live_members -= 1
        # (`req.role`, without the property: the side keys every member)
        if (key.role if req._role is None else req._role) == "warmup":
            self._warmup_ended(req, event)
        if not parent.live_members and parent._m.terminal[parent._s]:
            self._forget(parent)  # it was the family's last (`parent.terminal`, direct)

    def _forget(self, group: SamplingGroup) -> None:
        """Forget the family of a terminal group none of whose members is live any more:
        its ids are free again, and each member's `parent` becomes None (the group keeps
        its `warmups` and `children`): members pointing at the group that lists them are
        a reference cycle, which would keep the whole family in memory until the cyclic
        collector ran."""
        names = self._names
        key = group.key
        name = key.group  # (`client_rid(key)`: the side keys its groups by their rid)
        if names.get(name) is not group:
            return  # forgotten already (its last member ended inside its end)
        del names[name]
        self._batches.pop(key, None)
        for members in (group.warmups, group.children):
            for m in members:
                name = m._rid  # (`m.rid`: the side made each member with its id)
                if names.get(name) is m:
                    del names[name]
                m.parent = None  # (no cycle left: see above)

    def _group_ended(self, group: SamplingGroup, event: Any) -> None:
        batch = self._batches.get(group.key)
        s = group._s  # (terminal: what is fired below leaves it as it is)
        if s != self._fanned_out:  # (`group.state`, without the property and the string)
            for w in group.warmups:
                self._fire(w, RequestAbort("its sampling group ended"))
        if batch is None:
            return
        if s in self._group_failed:
            # A batch fans out whole or not at all: one failed prompt fails its siblings.
            status = int(getattr(event, "status", 500))
            msg = getattr(event, "message", "")
            if not isinstance(event, BatchFailed):
                msg = f"{group.rid!r} failed before fan-out: {msg}"
            for p in batch.parents:
                if not p.terminal:
                    self._fire(p, BatchFailed(status, msg))
        elif s == self._group_aborted:
            self._fan_out(batch)  # the siblings may all be ready now

    def _warmup_ended(self, w: Request, event: Any) -> None:
        group = w.parent
        if w._s == self._finished:  # (`w.state`, `group.state` without the property)
            group.pending_warmups -= 1
            self._fire(group, _WARMUP_FINISHED)
            batch = self._batches.get(group.key)
            if batch is not None and group._s == self._ready:
                self._fan_out(batch)
            return
        status = int(getattr(event, "status", 503 if w.state == "dispatch_failed" else 500))
        self._fire(group, BatchFailed(
            status, f"prefix warm-up {w.rid!r} ended {w.state}: "
                    f"{getattr(event, 'message', '')}"))
