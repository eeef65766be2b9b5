"""The compiled runtime: integer tables, slotted instances, a table lookup per event.

    rows[state] : {EventClass: code}     code >= 0   plain transition to state `code`
                                         code <  0   everything else (guards, ignores,
                                                     errors, terminal edges, observed)

`Instance.fire` handles the common case (an unguarded transition between non-terminal
states, nobody observing) with one dict lookup and one store; everything else takes
`Machine._fire_slow`, which evaluates guards, counts ignores, raises errors, records
observations, runs release plans, and queues events fired while it runs
(run-to-completion).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from . import observe as _obs
from .errors import InvalidDefinition, ReleaseFailed, TransitionNotAllowed, UnknownEvent
from .plan import _ENGINE, EMPTY_PLAN, Action, Plan, PlanReport, Release, ReleaseContext, call_step
from .spec import DECISIONS, ERRORED, GUARDED, IGNORED, TRANSITION, Alt

if TYPE_CHECKING:
    import torch

    from .batch import Batch
    from .ledger import Ledger
    from .spec import Spec


class Tables(msgspec.Struct, frozen=True):
    """The compiled tables, indexed [state][event] by declaration order.

    `next`: the target of the cell's transition, the state itself for an ignore, -1 for
    an error, -2 for a guarded cell. `decision`: TRANSITION (0), IGNORE (1), ERROR (2)
    or GUARDED (3). `plan`: index into `plan_names` of the plan the edge runs, or -1.
    """

    next: tuple[tuple[int, ...], ...]
    decision: tuple[tuple[int, ...], ...]
    plan: tuple[tuple[int, ...], ...]
    terminal: tuple[bool, ...]
    plan_names: tuple[str, ...]

    def to_torch(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """The same tables as int64/bool tensors on `device` (keys as the fields)."""
        import torch

        return {
            "next": torch.tensor(self.next, dtype=torch.int64, device=device),
            "decision": torch.tensor(self.decision, dtype=torch.int64, device=device),
            "plan": torch.tensor(self.plan, dtype=torch.int64, device=device),
            "terminal": torch.tensor(self.terminal, dtype=torch.bool, device=device),
        }


class Stats:
    """Counters a machine keeps off the fast path: ignores and plan runs."""

    __slots__ = ("effect_errors", "ignored", "plans_run")

    def __init__(self) -> None:
        self.ignored: Counter[tuple[str, str]] = Counter()
        self.plans_run: Counter[str] = Counter()
        self.effect_errors = 0


class Machine:
    """A validated, frozen, compiled machine. Build one with `Spec(...).build()`.

    `bind(plans=..., ledger=...)` gives a copy whose terminal transitions run those
    release plans over that ledger; `create()` makes instances; `batch()` makes a
    tensor of instances stepped together.
    """

    name: str
    spec: Spec
    states: tuple[str, ...]
    events: tuple[type, ...]
    initial: int
    terminal: tuple[bool, ...]
    cells: tuple[tuple[tuple[Alt, ...], ...], ...]
    tables: Tables
    ledger: Ledger | None
    stats: Stats
    _guards: dict[str, Any]
    _eidx: dict[type, int]
    _enames: tuple[str, ...]
    _fast_rows: tuple[dict[type, int], ...]
    _slow_rows: tuple[dict[type, int], ...]
    _rows: tuple[dict[type, int], ...]
    _plans: dict[str, Plan]
    _sinks: list[Any]
    _observed: bool

    _frozen = False

    def __setattr__(self, key: str, value: Any) -> None:
        if self._frozen and not key.startswith("_"):
            raise AttributeError(
                f"machine {self.name!r} is frozen; declare changes in its Spec and "
                "build it again"
            )
        object.__setattr__(self, key, value)

    @classmethod
    def _compile(
        cls,
        spec: Spec,
        cells: list[list[tuple[Alt, ...]]],
        initial: int,
        terminal: tuple[bool, ...],
    ) -> Machine:
        m = object.__new__(cls)
        m.name = spec.name
        m.spec = spec
        m.states = tuple(s.name for s in spec.states)
        m.events = spec.events
        m.initial = initial
        m.terminal = terminal
        m.cells = tuple(tuple(r) for r in cells)
        m._guards = dict(spec.guards)
        m._eidx = {ev: i for i, ev in enumerate(spec.events)}
        m._enames = tuple(ev.__name__ for ev in spec.events)
        plan_names = sorted({a.plan for r in cells for alts in r for a in alts if a.plan})
        pid = {p: i for i, p in enumerate(plan_names)}
        nxt, dec, pl = [], [], []
        fast: list[dict[type, int]] = []
        slow: list[dict[type, int]] = []
        n_ev = len(spec.events)
        for s, row in enumerate(cells):
            nr, dr, pr = [], [], []
            frow: dict[type, int] = {}
            srow: dict[type, int] = {}
            for e, alts in enumerate(row):
                slow_code = -1 - (s * n_ev + e)
                a = alts[0]
                if len(alts) > 1 or a.guard is not None:
                    nr.append(-2)
                    dr.append(GUARDED)
                    pr.append(-1)
                else:
                    nr.append(a.target if a.decision != ERRORED else -1)
                    dr.append(a.decision)
                    pr.append(pid[a.plan] if a.plan else -1)
                plain = (len(alts) == 1 and a.guard is None and a.decision == TRANSITION
                         and not terminal[a.target])
                frow[spec.events[e]] = a.target if plain else slow_code
                srow[spec.events[e]] = slow_code
            nxt.append(tuple(nr))
            dec.append(tuple(dr))
            pl.append(tuple(pr))
            fast.append(frow)
            slow.append(srow)
        m.tables = Tables(tuple(nxt), tuple(dec), tuple(pl), terminal, tuple(plan_names))
        m._fast_rows = tuple(fast)
        m._slow_rows = tuple(slow)
        m._init_runtime(None, None)
        return m

    def _init_runtime(self, plans: dict[str, Plan] | None, ledger: Ledger | None) -> None:
        self._plans = plans or {}
        self.ledger = ledger
        self.stats = Stats()
        self._sinks = []
        self._rows = self._fast_rows
        _obs.register(self)
        self._refresh()
        self._frozen = True

    def _refresh(self) -> None:
        observed = bool(self._sinks) or _obs.recorder() is not None
        self._observed = observed
        self._rows = self._slow_rows if observed else self._fast_rows

    # -- binding and instances ---------------------------------------------------------

    @property
    def plan_names(self) -> tuple[str, ...]:
        """Names of the release plans the declaration's terminal edges run, sorted."""
        return self.tables.plan_names

    def bind(self, plans: Mapping[str, Plan] | None = None,
             ledger: Ledger | None = None) -> Machine:
        """A copy of this machine whose terminal edges run `plans` over `ledger`.

        Every plan the declaration names needs an implementation, and every
        `Release(kind)` step without its own function needs the ledger's releaser for
        that kind; both are checked here, not at the first terminal transition.
        """
        plans = dict(plans or {})
        declared = set(self.plan_names)
        for p in plans:
            if p not in declared:
                raise InvalidDefinition(
                    self.name, f"plan {p!r} is implemented but no edge runs it",
                    "remove it, or name it with go(..., plan=...) on a terminal edge")
            if not isinstance(plans[p], Plan):
                raise InvalidDefinition(
                    self.name, f"plan {p!r} is {plans[p]!r}, not a Plan",
                    "wrap its steps: Plan(Action(...), Release(...))")
        if plans or ledger is not None:
            for p in self.plan_names:
                if p not in plans:
                    raise InvalidDefinition(
                        self.name, f"plan {p!r} has no implementation",
                        f"pass plans={{{p!r}: Plan(...)}} to bind()")
        for p, plan in plans.items():
            for step in plan.steps:
                if isinstance(step, Release) and ledger is None:
                    raise InvalidDefinition(
                        self.name,
                        f"plan {p!r} releases kind {step.kind!r} but the machine has no "
                        "ledger, so it could never own such a handle",
                        "pass ledger=Ledger(...) to bind(), or drop the Release step")
                if isinstance(step, Release) and step.fn is None and (
                        ledger is None or step.kind not in ledger._releasers):
                    raise InvalidDefinition(
                        self.name,
                        f"plan {p!r} releases kind {step.kind!r} but the ledger has no "
                        "releaser for it",
                        f"pass releasers={{{step.kind!r}: effect}} to the Ledger, or "
                        "give the step its own effect: Release(kind, effect)")
        m = object.__new__(type(self))
        for k, v in self.__dict__.items():
            if k not in ("_frozen",):
                object.__setattr__(m, k, v)
        m._init_runtime(plans, ledger)
        return m

    def create(self, key: Any = None) -> Instance:
        """A new instance in the initial state; `key` names it in errors and traces."""
        return Instance(self, key)

    def batch(self, n: int, device: str | torch.device = "cpu",
              plans: Mapping[str, Any] | None = None) -> Batch:
        """`n` instances as a tensor of state ids on `device`; see `fsm.batch.Batch`."""
        from .batch import Batch

        return Batch(self, n, device, plans)

    def event_id(self, event: type | str) -> int:
        """The index of an event class (or its name) in this machine's tables."""
        if isinstance(event, str):
            try:
                return self._enames.index(event)
            except ValueError:
                raise UnknownEvent(self.name, "-", event, self._enames) from None
        try:
            return self._eidx[event]
        except KeyError:
            raise UnknownEvent(self.name, "-", getattr(event, "__name__", repr(event)),
                               self._enames) from None

    def state_id(self, name: str) -> int:
        """The index of a state name in this machine's tables."""
        try:
            return self.states.index(name)
        except ValueError:
            raise KeyError(f"machine {self.name!r} has no state {name!r}; states: "
                           f"{', '.join(self.states)}") from None

    @property
    def event_names(self) -> tuple[str, ...]:
        """Event class names in declaration order."""
        return self._enames

    # -- observation ---------------------------------------------------------------------

    def add_sink(self, sink: Any) -> None:
        """Call `sink(TransitionRecord)` for every decision this machine object makes."""
        self._sinks.append(sink)
        self._refresh()

    def remove_sink(self, sink: Any) -> None:
        """Stop calling `sink`."""
        self._sinks.remove(sink)
        self._refresh()

    def _observe(self, inst: Any, s: int, e: int, k: int, alt: Alt | None,
                 plan: str | None) -> None:
        rec = _obs.recorder()
        if rec is not None:
            rec.record(self, s, e, k)
        if self._sinks:
            key = inst.key if inst.key is not None else id(inst)
            target = self.states[alt.target] if alt is not None else self.states[s]
            decision = DECISIONS[alt.decision] if alt is not None else "error"
            r = _obs.TransitionRecord(self.name, key, self.states[s], self._enames[e],
                                      target, decision, plan, time.monotonic())
            for sink in self._sinks:
                sink(r)

    # -- the slow path -------------------------------------------------------------------

    def _fire_slow(self, inst: Instance, event: Any) -> PlanReport | None:
        q = inst._q
        if q is not None:  # run-to-completion: handled after the running step
            q.append(event)
            return None
        inst._q = q = deque()
        result: PlanReport | None = None
        errors: list[Exception] = []
        try:
            try:  # the fired event's own step: its report is what fire() returns
                result = self._step(inst, event)
            except Exception as e:
                errors.append(e)
            while q:  # events its effects fired at this instance, in order
                try:
                    self._step(inst, q.popleft())
                except Exception as e:
                    errors.append(e)
        finally:
            inst._q = None
        if errors:
            if len(errors) > 1 and hasattr(errors[0], "add_note"):  # 3.11+
                for extra in errors[1:]:
                    errors[0].add_note(f"also raised while draining queued events: {extra!r}")
            raise errors[0]
        return result

    def _step(self, inst: Instance, event: Any) -> PlanReport | None:
        s = inst._s
        e = self._eidx.get(type(event))
        if e is None:
            raise UnknownEvent(self.name, self.states[s], type(event).__name__, self._enames)
        alts = self.cells[s][e]
        k = -1
        alt: Alt | None = None
        for i, a in enumerate(alts):
            if a.guard is None or self._guards[a.guard](inst, event):
                k, alt = i, a
                break
        if alt is None or alt.decision == ERRORED:
            if self._observed:
                self._observe(inst, s, e, k, alt, None)
            if alt is None:
                reason = "no guard held (" + ", ".join(str(a.guard) for a in alts) + ")"
            else:
                reason = "the declaration makes it an error here"
            raise TransitionNotAllowed(self.name, self.states[s], self._enames[e], reason,
                                       inst.key)
        if alt.decision == IGNORED:
            self.stats.ignored[(self.states[s], self._enames[e])] += 1
            if self._observed:
                self._observe(inst, s, e, k, alt, None)
            return None
        inst._s = alt.target
        if not self.terminal[alt.target]:
            if self._observed:
                self._observe(inst, s, e, k, alt, alt.plan)
            return None
        try:
            if self._observed:
                self._observe(inst, s, e, k, alt, alt.plan)
        finally:
            # The instance is terminal now: its plan runs even when a sink raised (I1).
            report = self._run_plan(inst, alt.plan, event, s, alt.target)
        return report

    def _run_plan(self, inst: Instance, name: str | None, event: Any, src: int,
                  dst: int) -> PlanReport:
        pname = name or "<release owned>"
        plan = self._plans.get(name, EMPTY_PLAN) if name else EMPTY_PLAN
        ledger = self.ledger
        ctx = ReleaseContext(_ENGINE, self.name, inst, event, pname, self.states[src],
                             self.states[dst], ledger)
        report = PlanReport(self.name, inst, pname)
        # While the plan runs, a handle acquired for the instance is the plan's to
        # release (its leftover sweep below); once it ended, the ledger releases it.
        if ledger is not None:
            ledger._in_plan.add(id(inst))
        try:
            for step in plan.steps:
                if isinstance(step, Release):
                    if ledger is not None:
                        ledger._release_owned(ctx, inst, step.kind, step.fn, report,
                                              step.name, step.best_effort)
                else:
                    assert isinstance(step, Action)
                    call_step(step.fn, (ctx,), report, ledger, step.name, step.best_effort)
            # A plan orders releases; it cannot forget one (I3).
            if ledger is not None:
                ledger._release_owned(ctx, inst, None, None, report, None, False)
        finally:
            ctx._live = False
            if ledger is not None:
                ledger._in_plan.discard(id(inst))
        self.stats.plans_run[pname] += 1
        if report.errors:
            self.stats.effect_errors += len(report.errors)
            if ledger is not None:
                ledger.errors.extend(report.errors)
            fatal = [er for er in report.errors if not er.best_effort]
            if fatal:
                raise ReleaseFailed(
                    f"machine {self.name!r}: {len(fatal)} step(s) of plan {pname!r} "
                    "raised; every other step ran",
                    list(fatal), report)
        return report


class Instance:
    """One live machine: a state id and nothing else the engine needs.

    Subclass it with `__slots__` for the data your guards read. Only the engine
    changes the state (`fire`); `state`, `terminal` and `busy` read it.
    """

    __slots__ = ("_m", "_q", "_s", "key")

    def __init__(self, machine: Machine, key: Any = None) -> None:
        self._m = machine
        self._s = machine.initial
        self._q: deque[Any] | None = None
        self.key = key

    def fire(self, event: Any) -> PlanReport | None:
        """Deliver `event`. Returns the PlanReport when it ran a release plan, else None.

        Raises TransitionNotAllowed where the declaration makes the event an error,
        UnknownEvent for an object that is not one of the machine's events, and
        ReleaseFailed when a non-best-effort release step raised (after every step ran).
        """
        if self._q is None:
            try:
                code = self._m._rows[self._s][event.__class__]
            except KeyError:
                return self._m._fire_slow(self, event)
            if code >= 0:
                self._s = code
                return None
        return self._m._fire_slow(self, event)

    @property
    def machine(self) -> Machine:
        """The (bound) machine this instance runs on."""
        return self._m

    @property
    def state_id(self) -> int:
        """The current state's index in the machine's tables."""
        return self._s

    @property
    def state(self) -> str:
        """The current state's name."""
        return self._m.states[self._s]

    @property
    def terminal(self) -> bool:
        """True once the instance has entered a terminal state."""
        return self._m.terminal[self._s]

    @property
    def busy(self) -> bool:
        """True while the engine runs a step of this instance (events are queued)."""
        return self._q is not None

    def __repr__(self) -> str:
        key = "" if self.key is None else f" {self.key!r}"
        return f"<{self._m.name}{key} {self.state}>"
