"""The ownership ledger (I3, I6): every acquired resource is a handle with one owner.

    acquire(owner, "kv", pages) ──► Handle ──transfer(to=child)──► owned by child
                                       │
                 owner's terminal plan ▼ (exactly once; a second release raises)
                                    released

A handle is acquired for an instance, can be transferred to another instance, and is
released only by the terminal transition of whoever owns it at that moment. An
observer (a prefix warm-up request, say) can be recorded against a handle but never
owns it. A handle delivered to an owner that is already terminal (an abort raced the
acquire) is released at once by the engine, through the kind's default releaser.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from ._core import C as _C
from .errors import DoubleRelease, OwnershipError, ReleaseOutsideTerminal
from .plan import (
    Action,
    EffectError,
    Plan,
    PlanReport,
    Release,
    ReleaseContext,
    call_step,
    release_context,
    require_effect,
    step_result,
    unwrapped,
)

_COMPACT_MIN = 4096
"""`Ledger._all` is compacted no more often than every this many acquires."""

_SWEEPS = 16
"""Passes of a plan's last step over what its instance still owns (`Ledger._sweep`)."""

_SWEPT: tuple[None, bool] = (None, False)
"""`Ledger._release_kind`'s `about` for the handles no step of a plan named: each is
"release <kind>", not best-effort."""


class Owner(Protocol):
    """What the ledger reads of an owner (an `fsm.Instance`)."""

    @property
    def machine(self) -> Any: ...
    @property
    def state(self) -> str: ...
    @property
    def terminal(self) -> bool: ...



class _PyHolder:
    """The engine's instances (`fsm.Instance` derives from it): a machine `_m`, a state
    id `_s`, `_q` (None, or the events queued while the engine runs a step of it), and
    `_owns`, where the ledger keeps what the instance owns (None, one `Handle`, or a
    list of them). Owning a handle then costs no dict entry, and an acquire costs the
    same with 10k or 200k handles outstanding. Any other `Owner` works too; the ledger
    keeps its handles in a dict. (With the compiled core, `Holder` is its type of the
    same slots, `key` among them.)"""

    __slots__ = ("_m", "_owns", "_q", "_s")

    _m: Any
    _owns: Any
    _q: Any
    _s: int


if TYPE_CHECKING:
    Holder = _PyHolder
    _LedgerBase = object
elif _C is None:
    Holder, _LedgerBase = _PyHolder, object
else:
    Holder = _C.Holder  # the same slots (and `key`), in C
    _LedgerBase = _C.LedgerCore  # the ledger's slots, and acquire/transfer/owned in C


def compiled(cls: type, names: tuple[str, ...]) -> None:
    """With the compiled core, `cls`'s Python methods `names` (the reference) become
    `_<name>_py`, which the compiled ones its base class defines call for every case
    they do not handle themselves; without it, nothing changes."""
    if _C is None:
        return
    for name in names:
        setattr(cls, f"_{name}_py", cls.__dict__[name])
        delattr(cls, name)


PLAN_RUNNING: list[Any] = []
"""`Holder._q` while the engine's compiled terminal step of the instance runs its plan
and nothing was queued yet: a handle given to it then is its plan's."""


class QueuedInPlan(list[Any]):
    """`Holder._q` once events were queued behind `PLAN_RUNNING` (the plan still runs)."""


_HIDS = itertools.count(1)


class Handle(msgspec.Struct, eq=False):
    """One acquired resource: `kind`, `value` (pages, a slot, an adapter id), `owner`,
    `released`, and `hid` (a process-wide number, given when first asked for: in a
    repr or an error). Compared and hashed by identity. Marked released, it forgets its
    owner (`owner` is None, in its releaser too: the instance is `ctx.instance`), so the
    ledger's list of every handle, compacted only as it doubles, keeps no terminal
    instance alive.

    A msgspec Struct rather than a slotted class: it is built in C (otherwise an
    acquire's largest cost), and with its number given lazily it takes 80 bytes and
    no int object.
    """

    kind: str
    value: Any
    owner: Any
    released: bool = False
    _hid: int = 0

    @property
    def hid(self) -> int:
        """This handle's number, for messages (given on first use, unique per process)."""
        if not self._hid:
            self._hid = next(_HIDS)
        return self._hid

    def __repr__(self) -> str:
        state = "released" if self.released else f"owner={self.owner!r}"
        return f"Handle#{self.hid}({self.kind}, {state})"


class Ledger(_LedgerBase):
    """Who owns what. Shared by every machine whose instances own resources.

    `releasers` maps a handle kind to its default release effect `fn(ctx, handle)`;
    `resources` is handed to effects as `ctx.resources` (pools, registry, transport).
    """

    def __init__(
        self,
        releasers: Mapping[str, Callable[..., Any]] | None = None,
        *,
        resources: Any = None,
    ) -> None:
        self.resources = resources
        self._releasers: dict[str, Callable[..., Any]] = {}
        # The functions the releasers wrap: the engine calls these inside the live
        # context it holds (no second check of a context it just opened).
        self._raw: dict[str, Callable[..., Any]] = {}
        for kind, fn in (releasers or {}).items():
            self.register_kind(kind, fn)
        # What an owner owns: its one handle, or a list of them (most owners own one of
        # a kind at a time). A `Holder` keeps it in its `_owns` slot; any other owner
        # here, by owner.
        self._owned: dict[Any, Handle | list[Handle]] = {}
        # Every handle acquired since the last compaction, released ones included: what
        # `count`, `outstanding` and `assert_empty` walk. Released handles are dropped
        # when it doubles (`_compact`), so appending is all an acquire pays.
        self._all: list[Handle] = []
        self._compact_at = _COMPACT_MIN
        self._observers: dict[Handle, list[Any]] = {}
        self._tasks: set[asyncio.Future[Any]] = set()
        # The instance whose plan runs innermost, and id() of the others whose plans
        # are running around it (a plan's effect fired another instance's terminal
        # event): a handle acquired for (or moved to) one of them is its plan's.
        self._plan_owner: Any = None
        self._in_plan: set[int] = set()
        self.errors: list[EffectError] = []
        """Errors of async steps and of late releases, in the order they happened."""
        self._released = 0
        # Compiled terminal steps (`machine._compile_terminal`) count the handles they
        # release in a small int of their own (no allocation per release); each adds
        # its count here when called, as `released` does first.
        self._flushes: list[Callable[[], None]] = []
        self.late_released = 0
        """Handles released at once because their owner was already terminal (I6)."""

    def register_kind(self, kind: str, release: Callable[..., Any]) -> None:
        """Set the default release effect for handles of `kind`."""
        require_effect(release, f"releaser for kind {kind!r}")
        self._releasers[kind] = release
        self._raw[kind] = unwrapped(release)

    @property
    def released(self) -> int:
        """Handles released so far (by plans, and late releases)."""
        for flush in self._flushes:
            flush()
        return self._released

    @property
    def kinds(self) -> frozenset[str]:
        """The handle kinds this ledger has a default releaser for."""
        return frozenset(self._releasers)

    # -- ownership ----------------------------------------------------------------

    def acquire(self, owner: Owner, kind: str, value: Any) -> Handle:
        """Record that `owner` now owns `value`; returns its handle.

        When `owner` is already terminal, the handle is released at once (I6) and
        returned marked released.
        """
        if kind not in self._releasers:
            raise OwnershipError(
                f"no releaser registered for handle kind {kind!r}; pass "
                f"releasers={{{kind!r}: effect}} to the Ledger before acquiring"
            )
        if isinstance(owner, Holder):  # the engine's instance: its slots, read here
            m = owner._m
            if m.ledger is not self:
                self._require_mine(owner, "acquire for")
            h = Handle(kind, value, owner)
            cur = owner._owns
            if cur is None:
                owner._owns = h
            elif cur.__class__ is list:
                cur.append(h)
            else:
                owner._owns = [cur, h]
            every = self._all
            every.append(h)
            if len(every) >= self._compact_at:
                self._compact()
            if m.terminal[owner._s] and not self._planning(owner):
                self._release_late(h)
            return h
        if owner.machine.ledger is not self:
            self._require_mine(owner, "acquire for")
        h = Handle(kind, value, owner)
        self._link(owner, h)
        every = self._all
        every.append(h)
        if len(every) >= self._compact_at:
            self._compact()
        if owner.terminal and not self._planning(owner):
            self._release_late(h)
        return h

    def _compact(self) -> None:
        """Drop released handles from `_all`; the next compaction waits until it doubles."""
        self._all = live = [h for h in self._all if not h.released]
        self._compact_at = max(2 * len(live), _COMPACT_MIN)

    def _get(self, owner: Any) -> Handle | list[Handle] | None:
        """What `owner` owns: None, one handle, or a list of two or more."""
        if isinstance(owner, Holder):
            return owner._owns
        return self._owned.get(owner)

    def _put(self, owner: Any, cur: Handle | list[Handle] | None) -> None:
        if isinstance(owner, Holder):
            owner._owns = cur
        elif cur is None:
            self._owned.pop(owner, None)
        else:
            self._owned[owner] = cur

    def _planning(self, owner: Any) -> bool:
        """True while `owner`'s release plan runs (a handle given to it is the plan's):
        marked here by `_run_steps`, or on the instance by the compiled terminal step."""
        if owner is self._plan_owner or id(owner) in self._in_plan:
            return True
        if isinstance(owner, Holder):
            q = owner._q
            return q is PLAN_RUNNING or q.__class__ is QueuedInPlan
        return False

    def _enter_plan(self, owner: Any) -> Any:
        """Mark `owner`'s plan running; returns what `_exit_plan` restores."""
        prev = self._plan_owner
        if prev is not None:
            self._in_plan.add(id(prev))
        self._plan_owner = owner
        return prev

    def _exit_plan(self, prev: Any) -> None:
        self._plan_owner = prev
        if prev is not None:
            self._in_plan.discard(id(prev))

    def _link(self, owner: Any, h: Handle) -> None:
        cur = self._get(owner)
        if cur is None:
            self._put(owner, h)
        elif type(cur) is list:
            cur.append(h)
        else:
            self._put(owner, [cur, h])  # type: ignore[list-item]

    def _unlink(self, owner: Any, h: Handle) -> None:
        # Callers hold `h` as owned by `owner` (transfer checks it, a release marks a
        # handle it found there), so `cur` is `h` or a list of two or more holding it.
        # The list is the ledger's own (`owned()` and the plans' snapshots are copies):
        # changed in place, and back to the bare handle when one is left.
        cur: Any = self._get(owner)
        if cur is h:
            self._put(owner, None)
        elif type(cur) is list:
            try:
                cur.remove(h)  # by identity: handles compare by identity
            except ValueError:
                return
            if len(cur) == 1:
                self._put(owner, cur[0])

    def transfer(self, handle: Handle, to: Owner) -> None:
        """Move ownership of `handle` to `to`; released at once if `to` is terminal."""
        if handle.released:
            raise OwnershipError(f"cannot transfer {handle!r}: it was already released")
        owner = handle.owner
        if owner is to:
            return
        if isinstance(to, Holder) and isinstance(owner, Holder):
            # The engine's instances: the same checks and moves on their slots.
            if to._m.ledger is not self:
                self._require_mine(to, "transfer to")
            cur: Any = owner._owns
            # `in` and `remove` compare handles by identity (they are eq=False Structs).
            if cur is not handle and (cur.__class__ is not list or handle not in cur):
                raise OwnershipError(f"{handle!r} is not in the ledger")
            if owner._m.terminal[owner._s] and not self._planning(owner):
                raise OwnershipError(
                    f"cannot transfer {handle!r}: its owner is terminal and has released it"
                )
            if cur is handle:
                owner._owns = None
            else:
                rest: Any = cur  # the list holding it
                rest.remove(handle)
                if len(rest) == 1:
                    owner._owns = rest[0]
            handle.owner = to
            cur = to._owns
            if cur is None:
                to._owns = handle
            elif cur.__class__ is list:
                cur.append(handle)
            else:
                to._owns = [cur, handle]
            if to._m.terminal[to._s] and not self._planning(to):
                self._release_late(handle)
            return
        self._require_mine(to, "transfer to")
        if not self._holds(handle.owner, handle):
            raise OwnershipError(f"{handle!r} is not in the ledger")
        if handle.owner.terminal and not self._planning(handle.owner):
            raise OwnershipError(
                f"cannot transfer {handle!r}: its owner is terminal and has released it"
            )
        self._unlink(handle.owner, handle)
        handle.owner = to
        self._link(to, handle)
        if to.terminal and not self._planning(to):
            self._release_late(handle)

    def _holds(self, owner: Any, h: Handle) -> bool:
        cur = self._get(owner)
        return cur is h or (type(cur) is list and any(x is h for x in cur))

    def _require_mine(self, owner: Owner, what: str) -> None:
        # Only a machine bound to this ledger runs this ledger's releases at its terminal
        # transition; a handle owned by any other instance would never be released.
        if owner.machine.ledger is not self:
            raise OwnershipError(
                f"cannot {what} {owner!r}: its machine {owner.machine.name!r} is not bound "
                "to this ledger, so its terminal transition would never release the "
                "handle; bind the machine with ledger=<this ledger>"
            )

    def observe(self, handle: Handle, observer: Owner) -> None:
        """Record `observer` as a non-owner user of `handle`: its terminal releases nothing."""
        if observer is handle.owner:
            raise OwnershipError(f"{observer!r} owns {handle!r}; an owner is not an observer")
        self._observers.setdefault(handle, []).append(observer)

    def observers(self, handle: Handle) -> list[Any]:
        """Instances recorded as observers of `handle`."""
        return list(self._observers.get(handle, ()))

    def owned(self, owner: Any, kind: str | None = None) -> list[Handle]:
        """The unreleased handles `owner` owns now, of `kind` if given, in acquire order."""
        cur: Any = owner._owns if isinstance(owner, Holder) else self._owned.get(owner)
        if cur.__class__ is Handle:  # one handle, the common case: tested first
            return [cur] if cur.kind == kind or kind is None else []
        if cur is None:
            return []
        if kind is None:
            return list(cur)
        return [h for h in cur if h.kind == kind]

    def outstanding(self) -> dict[Any, list[Handle]]:
        """Every unreleased handle, by owner (owners in the order of their oldest)."""
        out: dict[Any, list[Handle]] = {}
        for h in self._iter():
            if h.owner not in out:
                out[h.owner] = self.owned(h.owner)
        return out

    def count(self, kind: str | None = None) -> int:
        """Number of unreleased handles (of `kind` if given)."""
        return sum(1 for h in self._iter() if kind is None or h.kind == kind)

    def _iter(self) -> Iterator[Handle]:
        return (h for h in self._all if not h.released)

    def assert_empty(self) -> None:
        """Raise AssertionError listing every unreleased handle, if any."""
        out = self.outstanding()
        if out:
            lines = [f"{o!r}: {hs!r}" for o, hs in out.items()]
            raise AssertionError("unreleased handles:\n  " + "\n  ".join(lines))

    # -- release (engine only) ------------------------------------------------------

    def run_plan(self, ctx: ReleaseContext, plan: Plan, report: PlanReport) -> None:
        """Run `plan` over what `ctx.instance` owns, inside the engine's live context.

        Steps run in order, each even when an earlier one raised (errors go to
        `report.errors`): `Release(kind)` releases every handle of that kind the
        instance owns at that moment, `Action` runs once. Then every handle the plan did
        not name is released by its kind's default releaser, so a plan can order
        releases but cannot forget one (I3). While the plan runs, a handle acquired for
        (or transferred to) the instance is the plan's to release, not a late release.
        The engine calls this for a terminal transition; `ctx` must be live.
        """
        if not ctx.live:
            raise ReleaseOutsideTerminal(f"Ledger.run_plan({report.plan!r})")
        self._run_steps(ctx, ctx.instance, plan.steps, report)
        if report._errors:
            self.errors.extend(report._errors)

    def _run_steps(self, ctx: ReleaseContext, owner: Any, steps: tuple[Any, ...],
                   report: PlanReport) -> None:
        """`run_plan`'s body, for the engine, which holds `ctx` live."""
        get = self._get
        prev = self._enter_plan(owner)
        try:
            for step in steps:
                if type(step) is Release:
                    if get(owner) is not None:
                        self._release_owned(ctx, owner, step.kind, step.fn, report,
                                            step.name, step.best_effort)
                else:
                    assert isinstance(step, Action)
                    self._call(step.fn, (ctx,), report, step.name, step.best_effort)
            cur = get(owner)
            if cur is not None:  # the handles the plan did not name
                self._sweep(ctx, owner, cur, report)
        finally:
            self._exit_plan(prev)

    def _sweep(self, ctx: ReleaseContext, owner: Any, cur: Any,
               report: PlanReport) -> None:
        """A plan's last step: release by their kinds' default releasers the handles
        `owner` still owns (`cur`, not None), and again those a releaser gave it
        meanwhile (they are the plan's, `_planning`), until it owns nothing. A releaser
        that gives it another handle every time it runs would never end: after
        `_SWEEPS` passes what is left stays owned (the leak audit shows it) and the plan
        reports an error naming it."""
        holder = isinstance(owner, Holder)
        for _ in range(_SWEEPS):
            if holder:
                self._release_kind(ctx, owner, cur if cur.__class__ is list else (cur,),
                                   None, None, report, _SWEPT)
            else:  # an owner the ledger keeps in its own table
                self._release_owned(ctx, owner, None, None, report, None, False)
            cur = self._get(owner)
            if cur is None:
                return
        self._sweep_failed(owner, cur, report)

    def _sweep_failed(self, owner: Any, cur: Any, report: PlanReport) -> None:
        """`_sweep`'s error: after `_SWEEPS` passes `owner` still owns `cur`."""
        left = cur if cur.__class__ is list else [cur]
        report.errors.append(EffectError(
            report.machine, report.plan, "release what no step named", False,
            RuntimeError(
                f"after {_SWEEPS} passes {owner!r} still owns {len(left)} handle(s) "
                f"({', '.join(sorted({h.kind for h in left}))}): a default releaser "
                "gives the instance it releases a new handle each time it runs; acquire "
                "for another owner, or release without acquiring")))

    def _mark_released(self, handle: Handle) -> None:
        if handle.released:
            raise DoubleRelease(handle)
        handle.released = True
        self._unlink(handle.owner, handle)
        handle.owner = None  # (see `Handle`: its owner is not kept alive by it)
        if self._observers:
            self._observers.pop(handle, None)
        self._released += 1

    def _call(self, fn: Callable[..., Any], args: tuple[Any, ...], report: PlanReport,
              step: str, best_effort: bool) -> None:
        task = call_step(fn, args, report, step, best_effort)
        if task is not None:
            self._keep(task, report, step, best_effort)

    def _release(self, ctx: ReleaseContext, handle: Handle, fn: Callable[..., Any] | None,
                 report: PlanReport, step: str, best_effort: bool) -> None:
        """Release one handle inside a running plan; marks it first, so never twice."""
        self._mark_released(handle)
        report.released.append(handle)
        task = call_step(fn or self._releasers[handle.kind], (ctx, handle), report, step,
                         best_effort)
        if task is not None:
            self._keep(task, report, step, best_effort)

    def _release_owned(self, ctx: ReleaseContext, owner: Owner, kind: str | None,
                       fn: Callable[..., Any] | None, report: PlanReport, step: str | None,
                       best_effort: bool) -> None:
        """Release what `owner` owns (of `kind`) inside its plan.

        An earlier release effect may have moved or released a handle of the snapshot
        (a transfer to a peer): those are skipped, never released twice or for the wrong
        owner.
        """
        cur = self._get(owner)
        if cur is None:
            return
        if type(cur) is Handle:  # one handle: the common case, released inline
            if cur.released or (kind is not None and cur.kind != kind):
                return
            cur.released = True
            cur.owner = None
            self._put(owner, None)
            if self._observers:
                self._observers.pop(cur, None)
            self._released += 1
            report.released.append(cur)
            name = step or f"release {cur.kind}"
            task = call_step(fn or self._releasers[cur.kind], (ctx, cur), report, name,
                             best_effort)
            if task is not None:
                self._keep(task, report, name, best_effort)
            return
        snapshot: list[Handle] = list(cur)  # type: ignore[arg-type]
        for h in snapshot:
            if h.released or h.owner is not owner or (kind is not None and h.kind != kind):
                continue
            self._release(ctx, h, fn, report, step or f"release {h.kind}", best_effort)

    def _release_kind(self, ctx: ReleaseContext, owner: Holder, cur: Sequence[Handle],
                      kind: str | None, fn: Callable[..., Any] | None, report: PlanReport,
                      about: tuple[str | None, bool]) -> None:
        """`_release_owned` of an owner whose handles are the list `cur` (or, for the
        handles no step named, a lone one in a tuple), for the engine's compiled plans
        (`machine._compile_plan`), which hold `ctx` live: `fn`
        is called unwrapped (None: the kind's default releaser, unwrapped). Each handle
        of `kind` (every one when None) is released in order, marked first; one an
        earlier release effect moved or released is skipped. `about` is the step's name
        (None: "release <kind>") and best_effort, read when a release raised or returned
        something."""
        raw, observers = self._raw, self._observers
        for h in tuple(cur):  # a snapshot: releases change `cur`
            # The kind first: a step's kind is never None (only the sweep's is), and most
            # handles a step passes over are of another kind. (A test per handle here is
            # faster than finding them in C, `list(map(attrgetter("kind"), cur))`, for the
            # few handles an owner has: measured in round 6.)
            if (h.kind != kind and kind is not None) or h.released or h.owner is not owner:
                continue
            h.released = True  # marked first: never released twice
            now: Any = owner._owns  # `_unlink`, on the owner's slot: a list, most often
            if now.__class__ is list:
                now.remove(h)
                if len(now) == 1:
                    owner._owns = now[0]
            elif now is h:
                owner._owns = None
            h.owner = None
            if observers:
                observers.pop(h, None)
            self._released += 1
            done = report._released  # `report.released.append(h)`, without the property
            if done is None:
                report._released = h
            elif done.__class__ is list:
                done.append(h)
            else:
                report._released = [done, h]
            try:
                res = (fn or raw[h.kind])(ctx, h)
            except Exception as e:  # every step runs; the error is reported
                report.errors.append(EffectError(report.machine, report.plan,
                                                 about[0] or f"release {h.kind}", about[1], e))
                continue
            if res is not None:
                name = about[0] or f"release {h.kind}"
                task = step_result(res, report, name, about[1])
                if task is not None:
                    self._keep(task, report, name, about[1])

    def _release_late(self, handle: Handle) -> None:
        owner = handle.owner
        m = owner.machine
        state = owner.state
        report = PlanReport(m.name, owner, "<late acquire>")
        with release_context(m.name, owner, None, "<late acquire>", state, state,
                             self) as ctx:
            self._release(ctx, handle, None, report, f"release {handle.kind} (late)", False)
        self.late_released += 1
        if report._errors:
            self.errors.extend(report._errors)
            raise report._errors[0]

    # -- async steps ------------------------------------------------------------------

    def _keep(self, task: asyncio.Future[Any], report: PlanReport, step: str,
              best_effort: bool) -> None:
        # A strong reference until the task ends: the event loop keeps only weak ones,
        # and a release task collected mid-flight would be a leak nobody sees.
        self._tasks.add(task)

        def done(t: asyncio.Future[Any]) -> None:
            self._tasks.discard(t)
            exc: BaseException | None
            if t.cancelled():
                # A release cut short may have freed nothing: never silent.
                exc = asyncio.CancelledError(
                    f"{step} was cancelled before it finished; what it releases may not "
                    "have been freed (check the pool, or let release tasks finish)")
            else:
                exc = t.exception()
            if exc is not None:
                self.errors.append(EffectError(report.machine, report.plan, step,
                                               best_effort, exc))

        task.add_done_callback(done)

    @property
    def pending(self) -> int:
        """Async release steps that have not finished yet."""
        return len(self._tasks)

    async def drain(self) -> list[EffectError]:
        """Wait for every pending async release step; returns all recorded errors."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        return list(self.errors)


compiled(Ledger, ("acquire", "transfer", "owned", "_compact"))
