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

import functools
import linecache
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from types import CodeType
from typing import TYPE_CHECKING, Any

from . import observe as _obs
from ._core import C as _C
from .errors import (
    InvalidDefinition,
    PlanNotBound,
    ReleaseFailed,
    TransitionNotAllowed,
    UnknownEvent,
)
from .ledger import (
    _COMPACT_MIN,
    _SWEEPS,
    PLAN_RUNNING,
    Handle,
    Holder,
    Ledger,
    QueuedInPlan,
    compiled,
)
from .observe import Stats
from .plan import (
    EMPTY_PLAN,
    Action,
    EffectError,
    Plan,
    PlanReport,
    Release,
    ReleaseContext,
    _Edge,
    _made,
    _open,
    step_result,
    unwrapped,
)
from .table import DECISIONS, ERRORED, GUARDED, IGNORED, TRANSITION, Alt, Declaration, Guard, Tables

if TYPE_CHECKING:
    import torch

    from .batch import Batch

__all__ = ["Instance", "Machine", "Stats", "Tables"]

_OnCell = Callable[["Instance", Any], "PlanReport | None"]
"""What `Instance.fire` calls for a cell whose code is < 0 (an entry of `Machine._on`)."""


if TYPE_CHECKING:
    _MachineBase = object
else:  # with the compiled core, the slots `Instance.fire` reads are its `MachineCore`'s
    _MachineBase = object if _C is None else _C.MachineCore


class Machine(_MachineBase):
    """A validated, frozen, compiled machine. Build one with `Spec(...).build()`.

    `bind(plans=..., ledger=...)` gives a copy whose terminal transitions run those
    release plans over that ledger; `create()` makes instances; `batch()` makes a
    tensor of instances stepped together.
    """

    name: str
    spec: Declaration
    states: tuple[str, ...]
    events: tuple[type, ...]
    initial: int
    terminal: tuple[bool, ...]
    cells: tuple[tuple[tuple[Alt, ...], ...], ...]
    tables: Tables
    ledger: Ledger | None
    stats: Stats
    _guards: dict[str, Guard]
    _eidx: dict[type, int]
    _n_events: int
    _enames: tuple[str, ...]
    _fast_rows: tuple[dict[type, int], ...]
    _slow_rows: tuple[dict[type, int], ...]
    _rows: tuple[dict[type, int], ...]
    _plans: dict[str, Plan]
    _partial: bool
    _bound: bool
    _sinks: list[Any]
    _observed: bool
    _rec: Any
    _runs: dict[tuple[int, int, str | None], _Terminal]
    _on: Sequence[_OnCell]
    _on_watched: Sequence[_OnCell]
    _on_recorded: list[_OnCell]
    _on_unobserved: list[_OnCell]

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
        spec: Declaration,
        cells: list[list[tuple[Alt, ...]]],
        initial: int,
        terminal: tuple[bool, ...],
        guards: Mapping[str, Guard],
    ) -> Machine:
        """The runtime of a validated declaration (called by `Spec.build`)."""
        m = _MachineBase.__new__(cls)
        m.name = spec.name
        m.spec = spec
        m.states = tuple(s.name for s in spec.states)
        m.events = spec.events
        m.initial = initial
        m.terminal = terminal
        m.cells = tuple(tuple(r) for r in cells)
        m._guards = dict(guards)
        m._eidx = {ev: i for i, ev in enumerate(spec.events)}
        m._n_events = len(spec.events)
        m._enames = tuple(ev.__name__ for ev in spec.events)
        plan_names = sorted({a.plan for r in cells for alts in r for a in alts if a.plan})
        pid = {p: i for i, p in enumerate(plan_names)}
        nxt, dec, pl = [], [], []
        fast: list[dict[type, int]] = []
        slow: list[dict[type, int]] = []
        n_ev = len(spec.events)
        n_cells = len(cells) * n_ev
        for s, row in enumerate(cells):
            nr, dr, pr = [], [], []
            frow: dict[type, int] = {}
            srow: dict[type, int] = {}
            for e, alts in enumerate(row):
                # < 0: the cell's index less the number of cells, so that it indexes
                # the cell's entry of a table of cells (`_on`) from its end.
                slow_code = s * n_ev + e - n_cells
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
        m._init_runtime(None, None, partial=False, bound=False)
        return m

    def _init_runtime(self, plans: dict[str, Plan] | None, ledger: Ledger | None, *,
                      partial: bool, bound: bool) -> None:
        self._plans = plans or {}
        self._partial = partial
        self._bound = bound
        self.ledger = ledger
        self.stats = _Stats((*self.tables.plan_names, _OWNED))
        self._sinks = []
        self._rows = self._fast_rows
        # Per (state, event) cell, what `Instance.fire` calls for a code < 0 (None: the
        # general path, `_fire_step`), one table per way of being observed; each cell
        # is compiled on its first fire (`_first_fire`), so binding costs a list copy.
        # Nothing in them refers to the machine (they read it from the instance): no
        # reference cycle keeps a dropped machine alive.
        n = len(self.states) * self._n_events
        self._runs = {}
        self._rec = None
        self._on_watched = tuple(_general_table(n))
        self._on_recorded = _lazy_table(n)
        self._on_unobserved = _lazy_table(n)
        _obs.register(self)
        self._refresh()
        self._frozen = True

    def _terminal(self, src: int, dst: int, name: str | None) -> _Terminal:
        """The compiled plan run of a terminal edge (made on first use)."""
        t = self._runs.get((src, dst, name))
        if t is None:
            n = len(self.tables.plan_names)
            pid = self.tables.plan_names.index(name) if name in self.tables.plan_names else n
            t = self._runs[(src, dst, name)] = _Terminal(self, src, dst, name, pid)
        return t

    def _compile_cell(self, cell: int) -> _OnCell | None:
        """Compile `cell` into the table in use (`_on`) and return its function: an
        unguarded terminal edge whose plan can run (`_compile_terminal`), an ignore,
        a plain transition recorded (`_compile_recorded`), or None for the general
        path (guards, errors, unbound plans)."""
        table = self._on
        assert isinstance(table, list)  # the watched table is all general
        s, e = divmod(cell, self._n_events)
        alts = self.cells[s][e]
        a = alts[0]
        f: _OnCell | None = None
        if len(alts) > 1 or a.guard is not None:
            f = self._compile_guarded(cell, s, alts, table is self._on_recorded)
        elif a.decision == IGNORED:
            ignored = (self.states[s], self._enames[e])
            f = (_compile_ignore(self, ignored) if table is self._on_unobserved
                 else _compile_recorded(self, s, s, e, ignored))
        elif a.decision != TRANSITION:
            pass
        elif not self.terminal[a.target]:
            if table is self._on_recorded:  # unobserved, fire() does it itself
                f = _compile_recorded(self, a.target, s, e, None)
        elif a.plan is None or a.plan in self._plans or self._partial:
            f = _compile_terminal(self, self._terminal(s, a.target, a.plan))
            if table is self._on_recorded:
                f = _compile_recorded_terminal(self, s, e, f)
        table[cell] = _general_table(cell + 1)[cell] if f is None else f
        return f

    def _compile_guarded(self, cell: int, s: int, alts: tuple[Alt, ...],
                         recorded: bool) -> _OnCell | None:
        """A guarded cell, unobserved or `recorded` (only the recorder observes): the
        guards in order, then the first alternative that holds, compiled as its own
        cell would be (a plain transition, an ignore, or a terminal edge's plan run;
        recorded with that alternative's index); None (the general path) when one of
        them cannot be compiled (an error cell, an unbound plan)."""
        e = cell % self._n_events
        guards: list[Guard | None] = []
        runs: list[_OnCell | None] = []
        for k, a in enumerate(alts):
            guards.append(None if a.guard is None else self._guards[a.guard])
            if a.decision == IGNORED:
                ignored = (self.states[s], self._enames[e])
                runs.append(_compile_recorded(self, s, s, e, ignored, k) if recorded
                            else _compile_ignore(self, ignored))
            elif a.decision != TRANSITION:
                return None
            elif not self.terminal[a.target]:
                # Unobserved, `fire_guarded` stores the target itself.
                runs.append(_compile_recorded(self, a.target, s, e, None, k) if recorded
                            else None)
            elif a.plan is None or a.plan in self._plans or self._partial:
                run = _compile_terminal(self, self._terminal(s, a.target, a.plan))
                runs.append(_compile_recorded_terminal(self, s, e, run, k) if recorded
                            else run)
            else:
                return None
        return _compile_guarded(cell, tuple(zip(guards, (a.target for a in alts), runs,
                                                strict=True)))

    def _refresh(self) -> None:
        rec = _obs.recorder()
        observed = bool(self._sinks) or rec is not None
        self._observed = observed
        self._rows = self._slow_rows if observed else self._fast_rows
        if rec is not self._rec and rec is not None:
            # The recorded table's cells hold what the recorder they were compiled for
            # gave them (`_tally`): a new recorder compiles them again, on first fire.
            self._on_recorded = _lazy_table(len(self.states) * self._n_events)
        self._rec = rec
        if self._sinks:  # every decision goes through _step, which calls them
            self._on = self._on_watched
        elif rec is not None:
            self._on = self._on_recorded
        else:
            self._on = self._on_unobserved

    def on_recorder_change(self) -> None:
        """Switch tables after a recorder was attached or detached (`fsm.set_recorder`)."""
        self._refresh()

    def __repr__(self) -> str:
        terminal = ", ".join(repr(n) for n, t in zip(self.states, self.terminal, strict=True)
                             if t)
        if self._bound:
            how = ("bound with ledger" if self.ledger is not None else "bound without ledger")
            how += ", missing plans run empty" if self._partial else ""
        else:
            how = "unbound (bind it to run its plans)" if self.plan_names else "unbound"
        return (f"<Machine {self.name!r}: {len(self.states)} states (initial "
                f"{self.states[self.initial]!r}; terminal {terminal}), {len(self.events)} "
                f"events ({', '.join(self._enames)}), plans "
                f"{', '.join(self.plan_names) or 'none'}; {how}>")

    # -- binding and instances ---------------------------------------------------------

    @property
    def guards(self) -> Mapping[str, Guard]:
        """The guard functions by name (`guards=` and those given inline with `when=`)."""
        return dict(self._guards)

    @property
    def bound(self) -> bool:
        """True for a machine returned by `bind()`."""
        return self._bound

    @property
    def plan_names(self) -> tuple[str, ...]:
        """Names of the release plans the declaration's terminal edges run, sorted."""
        return self.tables.plan_names

    def bind(self, plans: Mapping[str, Plan] | None = None,
             ledger: Ledger | None = None, *, partial: bool = False) -> Machine:
        """A copy of this machine whose terminal edges run `plans` over `ledger`.

        Every plan the declaration names needs an implementation, and every
        `Release(kind)` step without its own function needs the ledger's releaser for
        that kind; both are checked here, not at the first terminal transition.
        `partial=True` is the explicit opt-out for declaration-only uses (an oracle, a
        test of the table): a plan not given runs as an empty plan, which releases only
        what the instance owns through the kinds' default releasers.

        A machine that was built and never bound refuses to fire an edge that runs a
        plan (`PlanNotBound`), so a declaration's plans can never run as empty unnoticed.
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
        if not partial:
            missing = [p for p in self.plan_names if p not in plans]
            if missing:
                raise InvalidDefinition(
                    self.name, f"plan {missing[0]!r} has no implementation" if
                    len(missing) == 1 else
                    f"plans {', '.join(map(repr, missing))} have no implementation",
                    f"pass plans={{{missing[0]!r}: Plan(...), ...}} to bind() (or "
                    "partial=True for a declaration-only use, where they run empty)")
        for p, plan in plans.items():
            for step in plan.steps:
                if isinstance(step, Release) and ledger is None:
                    raise InvalidDefinition(
                        self.name,
                        f"plan {p!r} releases kind {step.kind!r} but the machine has no "
                        "ledger, so it could never own such a handle",
                        "pass ledger=Ledger(...) to bind(), or drop the Release step")
                if isinstance(step, Release) and step.fn is None and (
                        ledger is None or step.kind not in ledger.kinds):
                    raise InvalidDefinition(
                        self.name,
                        f"plan {p!r} releases kind {step.kind!r} but the ledger has no "
                        "releaser for it",
                        f"pass releasers={{{step.kind!r}: effect}} to the Ledger, or "
                        "give the step its own effect: Release(kind, effect)")
        m = _MachineBase.__new__(type(self))
        for k, v in self.__dict__.items():
            if k not in ("_frozen",):
                object.__setattr__(m, k, v)
        if _C is not None:  # the compiled core's slots, which are no `__dict__` entries
            object.__setattr__(m, "terminal", self.terminal)
            object.__setattr__(m, "initial", self.initial)
        m._init_runtime(plans, ledger, partial=partial, bound=True)
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
        e = self._eidx.get(event) if isinstance(event, type) else None
        if e is None:
            raise self._unknown("-", event, wanted="class")
        return e

    def _unknown(self, state: str, event: Any, wanted: str = "instance") -> UnknownEvent:
        """The error for firing (or looking up) `event`, which is not one of ours: it
        says what the object was (a class, an instance, another machine's event of the
        same name) and what to pass instead."""
        cls = event if isinstance(event, type) else type(event)
        name = getattr(cls, "__name__", repr(cls))
        ours = self.events[self._enames.index(name)] if name in self._enames else None
        where = f"{ours.__module__}.{name}" if ours is not None else ""
        problem = fix = None
        if ours is not None and cls is not ours:
            problem = (f"{name} from {cls.__module__} is another machine's event; this "
                       f"machine's {name} is {where}")
            fix = f"import and fire {where} (each machine accepts only its own event classes)"
        elif wanted == "instance" and isinstance(event, type) and event in self._eidx:
            problem = f"the event class {name} was fired itself, not an instance of it"
            fix = f"fire an instance: {name}(...)"
        elif wanted == "class" and ours is not None:
            problem = f"{event!r} is an event instance; event_id takes the event class"
            fix = f"pass {name} (or the name {name!r})"
        elif isinstance(event, type):
            problem = f"{name!r} is not an event of this machine"
        return UnknownEvent(self.name, state, name, self._enames, problem=problem, fix=fix)

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

    @property
    def sinks(self) -> tuple[Any, ...]:
        """The sinks attached with `add_sink`, in order."""
        return tuple(self._sinks)

    @property
    def observed(self) -> bool:
        """True while a sink or the process-wide recorder observes this machine."""
        return self._observed

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
        """`fire` of an event the rows do not know, or at a busy instance."""
        q = inst._q
        if q is not None:  # run-to-completion: handled after the running step
            if q is _BUSY:  # the first event queued behind a compiled terminal step
                inst._q = QueuedInPlan((event,))
            elif q is _STEPPING:  # or behind a recorded plain step
                inst._q = [event]
            else:
                q.append(event)
            return None
        return self._fire_step(-1, inst, event)

    def _fire_step(self, cell: int, inst: Instance, event: Any, chosen: int = -1,
                   queued: Any = None) -> PlanReport | None:
        """The general path: one `_step`, then the events it queued. `chosen` >= 0: the
        alternative of the cell a compiled guarded cell already picked (its guards are
        not asked again; `_NONE_HELD`: none held), and `queued` what was fired at the
        instance meanwhile."""
        q: list[Any] = [] if queued is None else list(queued)
        inst._q = q
        try:  # the fired event's own step: its report is what fire() returns
            result = self._step(inst, event, cell, chosen)
        except Exception as e:
            if not q:
                inst._q = None
                raise
            return self._drain(inst, q, [e])
        if q:  # events its effects fired at this instance, in order
            return self._drain(inst, q, [], result)
        inst._q = None
        return result

    def _drain_after_plan(self, inst: Instance, q: Any, errors: list[Exception],
                          result: PlanReport | None = None) -> PlanReport | None:
        """`_drain` for a compiled terminal step: `q` (a `QueuedInPlan`) becomes a plain
        list first, since the plan is done and what is given to the instance now is late."""
        inst._q = q = list(q)
        return self._drain(inst, q, errors, result)

    def _drain(self, inst: Instance, q: list[Any], errors: list[Exception],
               result: PlanReport | None = None) -> PlanReport | None:
        try:
            while q:
                try:
                    self._step(inst, q.pop(0))
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

    def _step(self, inst: Instance, event: Any, cell: int = -1,
              chosen: int = -1) -> PlanReport | None:
        """One event's step; `cell` = state * events + event when the caller already
        looked the pair up (the fast path's code), else -1; `chosen` >= 0: the
        alternative already picked by the cell's guards (-1: ask them here;
        `_NONE_HELD`: none of them held)."""
        s = inst._s
        if cell >= 0:
            e = cell - s * self._n_events
        else:
            e = self._eidx.get(type(event))  # type: ignore[assignment]
            if e is None:
                raise self._unknown(self.states[s], event)
        alts = self.cells[s][e]
        k = -1
        alt: Alt | None = None
        if chosen >= 0:
            k, alt = chosen, alts[chosen]
        elif chosen == _NONE_HELD:
            pass
        else:
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
        if alt.plan is not None and alt.plan not in self._plans and not self._partial:
            raise PlanNotBound(self.name, alt.plan, self.states[s], self._enames[e])
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
            report = self._run_terminal(inst, event, self._terminal(s, alt.target, alt.plan))
        return report

    def _run_terminal(self, inst: Instance, event: Any, t: _Terminal) -> PlanReport:
        """Run the plan of terminal edge `t` for `inst` (already in its target state)."""
        ctx = _open(inst, event, t.edge)  # live until the finally below (I1)
        report = PlanReport(self.name, inst, t.pname)
        ledger = t.ledger
        try:
            if ledger is None:  # bind() refuses Release steps without a ledger
                t.plan.run_actions(ctx, report)
            else:
                ledger._run_steps(ctx, inst, t.plan.steps, report)
        finally:
            ctx._live = False
        self.stats._runs[t.pid] += 1
        if report._errors:
            self._plan_failed(report, ledger)
        return report

    def _plan_failed(self, report: PlanReport, ledger: Ledger | None) -> None:
        """Account for the errors of a plan run; raise ReleaseFailed when one of them
        was not best-effort."""
        errors = report.errors
        if ledger is not None:
            ledger.errors.extend(errors)
        self.stats.effect_errors += len(errors)
        fatal = [er for er in errors if not er.best_effort]
        if fatal:
            raise ReleaseFailed(
                f"machine {self.name!r}: {len(fatal)} step(s) of plan {report.plan!r} "
                "raised; every other step ran",
                list(fatal), report)


class _Stats(Stats):
    """A machine's `Stats`, which first adds what its compiled terminal steps counted
    on their own (`_compile_terminal`) to the plan runs it reports."""

    __slots__ = ("_flushes",)

    def __init__(self, plan_names: tuple[str, ...] = ()) -> None:
        super().__init__(plan_names)
        self._flushes: list[Callable[[], None]] = []

    @property
    def plans_run(self) -> Counter[str]:
        """Release plans run, by name (scalar instances and batched rows)."""
        for flush in self._flushes:
            flush()
        return Stats.plans_run.fget(self)  # type: ignore[attr-defined]


_OWNED = "<release owned>"
"""The plan name of a terminal edge that names none (it releases what the instance owns)."""

_new = object.__new__


def _sole_refs() -> int:
    """What `sys.getrefcount(x)` says of an object only a local `x` refers to."""
    x = object()
    return sys.getrefcount(x)


def _no_reuse(ctx: Any) -> int:
    return -1


_REUSE: bool = (sys.version_info < (3, 14) and getattr(sys, "_is_gil_enabled", lambda: True)()
                and _sole_refs() == 2)
"""Whether a compiled terminal cell reuses a dead context nobody kept (`_compile_terminal`).
Its take is a load and a store with no jump or call between, where the GIL never lets
another thread in; and "nobody kept it" is `getrefcount(ctx) == 2` (the local and the
call's argument), which 3.14's borrowed references no longer guarantee. Elsewhere every
plan opens a new one."""
_refs: Callable[[Any], int] = sys.getrefcount if _REUSE else _no_reuse

_BUSY = PLAN_RUNNING
"""`Instance._q` while a compiled terminal step runs and nothing was queued yet (never
appended to: the first queued event replaces it with a `QueuedInPlan` of its own,
which the step turns into a plain list before it drains it, its plan done)."""

_NONE_HELD = -2
"""`Machine._step`'s `chosen` when a compiled guarded cell found that no guard held."""

_STEPPING: list[Any] = []
"""`Instance._q` while a compiled recorded step runs and nothing was queued yet."""


class _Terminal:
    """One terminal edge's plan run, made at the first fire of a cell that takes it.

    `kinds` is set when the plan has only `Release` steps and the machine a ledger: kind
    -> (index of the first step of that kind, the function it calls unwrapped or None
    for the kind's default releaser, step name, best_effort); `sweep` is the same for a
    handle no step names (released by its kind's default releaser after the last step).
    """

    __slots__ = ("edge", "kinds", "ledger", "pid", "plan", "pname", "sweep", "target")

    def __init__(self, m: Machine, src: int, dst: int, name: str | None, pid: int) -> None:
        self.target = dst
        self.pname = name or _OWNED
        self.pid = pid
        self.plan = m._plans.get(name, EMPTY_PLAN) if name else EMPTY_PLAN
        self.ledger = m.ledger
        self.edge = _Edge(m.name, self.pname, m.states[src], m.states[dst], m.ledger)
        steps = self.plan.steps
        self.sweep = (len(steps), None, None, False)
        self.kinds: dict[str, tuple[int, Any, str | None, bool]] | None = None
        if m.ledger is not None and all(type(st) is Release for st in steps):
            kinds: dict[str, tuple[int, Any, str | None, bool]] = {}
            for i, st in enumerate(steps):
                assert isinstance(st, Release)
                if st.kind not in kinds:
                    kinds[st.kind] = (i, None if st.fn is None else unwrapped(st.fn),
                                      st.name, st.best_effort)
            self.kinds = kinds


def _compile_ignore(m: Machine, ignored: tuple[str, str]) -> Callable[[Instance, Any], None]:
    """An unobserved ignore: counted, nothing else."""
    counts = m.stats.ignored

    def fire_ignored(inst: Instance, event: Any) -> None:
        counts[ignored] += 1

    return fire_ignored


def _tally(m: Machine, s: int, e: int, k: int) -> list[int] | None:
    """The attached recorder's counter for alternative `k` of cell (s, e), when it
    offers one (`observe.Recorder`'s optional `cell_counter`): a one-slot list the compiled
    cell adds 1 to instead of calling `record()`."""
    counter = getattr(m._rec, "cell_counter", None)  # (only a method of that name)
    return counter(m, s, e, k) if callable(counter) else None


def _compile_recorded(m: Machine, target: int, s: int, e: int,
                      ignored: tuple[str, str] | None, k: int = 0) -> _OnCell:
    """A plain transition (`ignored` None) or an ignore while only the process-wide
    recorder observes: the step, then `record()` (of alternative `k` of the cell), with
    the instance busy meanwhile; or, when the recorder gave the cell a counter
    (`_tally`), the step and one add (no code of anyone else runs: nothing can fire at
    the instance meanwhile, so it is not marked busy)."""
    busy = _STEPPING
    tally = _tally(m, s, e, k)
    if tally is not None:
        if ignored is not None:
            ignored_counts = m.stats.ignored

            def fire_ignored_tallied(inst: Instance, event: Any) -> None:
                ignored_counts[ignored] += 1
                tally[0] += 1

            return fire_ignored_tallied

        def fire_tallied(inst: Instance, event: Any) -> None:
            inst._s = target
            tally[0] += 1

        return fire_tallied

    def fire_recorded(inst: Instance, event: Any) -> None:
        m = inst._m
        inst._q = busy
        try:
            if ignored is None:
                inst._s = target
            else:
                m.stats.ignored[ignored] += 1
            m._rec.record(m, s, e, k)
        except Exception as exc:
            q = inst._q
            if q is busy:
                inst._q = None
                raise
            m._drain(inst, q, [exc])
            return
        q = inst._q
        if q is not busy:  # events fired at it meanwhile, in order
            m._drain(inst, q, [])
            return
        inst._q = None

    return fire_recorded


def _compile_recorded_terminal(m: Machine, s: int, e: int, run: _OnCell,
                               k: int = 0) -> _OnCell:
    """A compiled terminal edge while only the recorder observes: `record()` (of
    alternative `k` of the cell), then the step; when `record()` raised, the plan still
    runs (I1) and its error, if any, wins, as in `Machine._step`. With the recorder's
    counter for the cell (`_tally`): one add, then the step."""
    tally = _tally(m, s, e, k)
    if tally is not None:

        def fire_terminal_tallied(inst: Instance, event: Any) -> PlanReport | None:
            tally[0] += 1
            return run(inst, event)

        return fire_terminal_tallied

    def fire_terminal_recorded(inst: Instance, event: Any) -> PlanReport | None:
        m = inst._m
        try:
            m._rec.record(m, s, e, k)
        except Exception:
            run(inst, event)
            raise
        return run(inst, event)

    return fire_terminal_recorded


def _compile_guarded(cell: int,
                     alts: tuple[tuple[Guard | None, int, _OnCell | None], ...]) -> _OnCell:
    """What `Instance.fire` runs for a guarded cell while nobody (or only the recorder)
    observes: the guards in order, with the instance busy meanwhile (an event a guard
    fired at it queues, as on the general path), then the first alternative that holds:
    its target stored (an unobserved plain transition), or its compiled cell (an
    ignore, a terminal edge, a recorded transition). No guard holding is the general
    path's error, told that none held; so is an event a guard fired at the instance,
    told which alternative it picked."""
    stepping = _STEPPING
    guards = tuple(a[0] for a in alts)
    outs = tuple(a[1:] for a in alts)
    if len(alts) == 2 and guards[0] is not None and guards[1] is None:
        return _compile_guarded_else(cell, guards[0], outs)

    def fire_guarded(inst: Instance, event: Any) -> PlanReport | None:
        inst._q = stepping
        try:
            k = 0
            for guard in guards:
                if guard is None or guard(inst, event):
                    break
                k += 1
            else:
                k = -1
        except Exception as exc:
            if inst._q is stepping:  # it fired nothing: nothing changed
                inst._q = None
                raise
            return _guard_raised(inst, exc)
        q = inst._q
        if q is not stepping or k < 0:  # a guard fired at it, or none held: general path
            inst._q = None
            return inst._m._fire_step(cell, inst, event, k if k >= 0 else _NONE_HELD,
                                      None if q is stepping else q)
        inst._q = None
        target, run = outs[k]
        if run is None:
            inst._s = target
            return None
        return run(inst, event)

    return fire_guarded


def _guard_raised(inst: Instance, exc: Exception) -> PlanReport | None:
    """A compiled guarded cell's guard raised after firing events at its instance: those
    events run (the step did not happen), then `exc` is raised (`Machine._drain`)."""
    fired = inst._q
    assert fired is not None  # the guard's events, in a list of their own
    inst._q = q = list(fired)
    return inst._m._drain(inst, q, [exc])


def _compile_guarded_else(cell: int, guard: Guard,
                          outs: tuple[tuple[int, _OnCell | None], ...]) -> _OnCell:
    """`_compile_guarded` for the most common guarded cell, one guard and an
    unguarded alternative after it: the same steps without the loop over guards, each
    alternative's target and compiled cell bound as constants of its branch."""
    stepping = _STEPPING
    (target0, run0), (target1, run1) = outs
    if run0 is None and run1 is None:  # two plain transitions: one store, known here
        return _compile_guarded_else_plain(cell, guard, target0, target1)

    def fire_guarded_else(inst: Instance, event: Any) -> PlanReport | None:
        inst._q = stepping
        try:
            # Its truth is taken here too: an object whose truth raises (a numpy array)
            # is the guard's error, with the events it fired drained.
            missed = not guard(inst, event)
        except Exception as exc:
            if inst._q is stepping:  # it fired nothing: nothing changed
                inst._q = None
                raise
            return _guard_raised(inst, exc)
        if inst._q is not stepping:  # a guard fired at it: the general path, told which
            q, inst._q = inst._q, None  # held
            return inst._m._fire_step(cell, inst, event, 1 if missed else 0, q)
        inst._q = None
        if missed:
            if run1 is None:
                inst._s = target1
                return None
            return run1(inst, event)
        if run0 is None:
            inst._s = target0
            return None
        return run0(inst, event)

    return fire_guarded_else


def _compile_guarded_else_plain(cell: int, guard: Guard, target0: int,
                                target1: int) -> _OnCell:
    """`_compile_guarded_else` when both alternatives are plain transitions (neither
    terminal nor recorded): the guard, then the target it picks stored."""
    stepping = _STEPPING

    def fire_guarded_else_plain(inst: Instance, event: Any) -> PlanReport | None:
        inst._q = stepping
        try:
            # Its truth is taken here too (see `_compile_guarded_else`).
            missed = not guard(inst, event)
        except Exception as exc:
            if inst._q is stepping:  # it fired nothing: nothing changed
                inst._q = None
                raise
            return _guard_raised(inst, exc)
        if inst._q is not stepping:  # a guard fired at it: the general path, told which
            q, inst._q = inst._q, None  # held
            return inst._m._fire_step(cell, inst, event, 1 if missed else 0, q)
        inst._q = None
        inst._s = target1 if missed else target0
        return None

    return fire_guarded_else_plain


def _first_fire(cell: int, inst: Instance, event: Any) -> PlanReport | None:
    """`cell`'s first fire on this machine: compile it, then run it."""
    m = inst._m
    f = m._compile_cell(cell)
    return m._fire_step(cell, inst, event) if f is None else f(inst, event)


def _general_fire(cell: int, inst: Instance, event: Any) -> PlanReport | None:
    """A cell on the general path (guards not compiled, errors, unbound plans, sinks
    watching): `Machine._fire_step` told which cell it is."""
    return inst._m._fire_step(cell, inst, event)


_LAZY: list[_OnCell] = []
_GENERAL: list[_OnCell] = []


def _general_table(n: int) -> list[_OnCell]:
    """A table of `n` cells on the general path: entry `c` is
    `partial(_general_fire, c)`, shared by every machine."""
    while len(_GENERAL) < n:
        _GENERAL.append(functools.partial(_general_fire, len(_GENERAL)))
    return _GENERAL[:n]



def _lazy_table(n: int) -> list[_OnCell]:
    """A table of `n` cells not compiled yet: entry `c` is `partial(_first_fire, c)`,
    shared by every machine (a cell's index is all it holds)."""
    while len(_LAZY) < n:
        _LAZY.append(functools.partial(_first_fire, len(_LAZY)))
    return _LAZY[:n]


def _compile_general(m: Machine, t: _Terminal) -> _OnCell:
    """`_compile_terminal` for a machine without a ledger: the plan runs through
    `Machine._run_terminal`."""
    target, busy = t.target, _BUSY

    def fire_terminal(inst: Instance, event: Any) -> PlanReport | None:
        inst._s = target
        inst._q = busy
        try:
            report = inst._m._run_terminal(inst, event, t)
        except Exception as e:
            q = inst._q
            if q is busy:
                inst._q = None
                raise
            return inst._m._drain_after_plan(inst, q, [e])
        q = inst._q
        if q is not busy:  # events its effects fired at this instance, in order
            return inst._m._drain_after_plan(inst, q, [], report)
        inst._q = None
        return report

    return fire_terminal


def _compile_plan(m: Machine, t: _Terminal) -> _OnCell:
    """`_compile_terminal` for a plan with actions over a ledger: `Ledger._run_steps`'s
    walk, unrolled into one function made for this plan (`_PLAN_BODY`, with one block a
    step: an Action's `_CALL`, or `_RELEASE_STEP`), whose constants are bound here: no
    loop over the steps, no test of each step's type.

    Steps run in order, each even when an earlier one raised (the error goes to the
    report). An `Action` calls its function unwrapped, since the context is the
    engine's own and live (I1). A `Release(kind)` step releases the one handle of that
    kind an instance owns inline, marked first (as `Ledger._release_owned` does), and
    of several each of the kind in order through `Ledger._release_kind`. Then what no
    step named is released by its kind's default releaser. The instance is marked busy
    (`_BUSY`) meanwhile, which is also what makes a handle given to it during the plan
    the plan's (`Ledger._planning`), and the context is dead after the plan.
    """
    ledger = t.ledger
    assert ledger is not None
    # Per step, the constants its block reads: the kind (Release), the function called
    # unwrapped (None for a kind's default releaser, read from `raw` at the call, as
    # `register_kind` may replace it), and the step's (name, best_effort), read only when
    # it raised or returned something.
    env: dict[str, Any] = {
        "target": t.target, "edge": t.edge, "pname": t.pname, "pid": t.pid,
        "mname": m.name, "runs": m.stats._runs, "ledger": ledger,
        "observers": ledger._observers, "raw": ledger._raw, "made": _made,
        "holds": t.edge._holds, "Report": PlanReport, "Hd": Handle, "busy": _BUSY,
        "refs": _refs, "step_failed": _step_failed,
        "step_returned": _step_returned,
    }
    shape: list[str] = []  # per step: "A" (Action), "R" (Release, own function), "D"
    for i, st in enumerate(t.plan.steps):  # (Release by the kind's default releaser)
        env[f"about{i}"] = (st.name, st.best_effort)
        if type(st) is Release:
            env[f"kind{i}"] = st.kind
            env[f"fn{i}"] = fn = None if st.fn is None else unwrapped(st.fn)
            shape.append("D" if fn is None else "R")
        else:
            assert isinstance(st, Action)
            env[f"fn{i}"] = unwrapped(st.fn)
            shape.append("A")
    kinds = "".join(shape)
    # Compiled once per shape (compiling costs milliseconds), named after the plan and
    # its shape (one name, one source: machines of one name may bind other plans).
    name, src = f"<plan {m.name}:{t.pname} {kinds}>", _plan_source(kinds)
    code = _named(_plan_code(kinds), name)
    # Tracebacks through the plan show its lines (a name in linecache's cache with no
    # modification time is kept by `checkcache`).
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)
    exec(code, env)  # our own template, filled with step indices only
    return env["make"]()


@functools.lru_cache(maxsize=256)
def _plan_code(shape: str) -> CodeType:
    """`_plan_source(shape)`, compiled."""
    return compile(_plan_source(shape), "<plan>", "exec")


@functools.lru_cache(maxsize=256)
def _plan_source(shape: str) -> str:
    """`_PLAN_BODY` with one block a step of `shape` (see `_compile_plan`)."""
    blocks = []
    first = True  # no Release step before this one: the report has released nothing
    for i, c in enumerate(shape):
        if c == "A":  # an Action, called unwrapped
            blocks.append(_call(f"fn{i}(ctx)", i, 16))
        else:
            fn = f"raw[kind{i}]" if c == "D" else f"fn{i}"
            step = _RELEASE_STEP.format(i=i, call_cur=_call(f"{fn}(ctx, cur)", i, 24))
            if first:  # (an Action cannot reach the report: only Release steps add to it)
                assert _REPORT_APPEND in step
                step = step.replace(_REPORT_APPEND, _REPORT_FIRST)
                first = False
            blocks.append(step)
    return _PLAN_BODY.replace("                # STEPS\n", "".join(blocks))


@functools.lru_cache(maxsize=1024)  # (a loop binds machines of the same names again)
def _named(code: CodeType, filename: str) -> CodeType:
    """`code` (and the functions it defines) with `filename`, which tracebacks show."""
    consts = tuple(_named(c, filename) if isinstance(c, CodeType) else c
                   for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


# The terminal step of `_compile_plan`, made once per plan: `make()` returns it, closed
# over the one dead context it may reuse (`spare`: one nobody kept after its plan, so
# nobody can see it live again, `_REUSE`). The steps' blocks replace the "# STEPS" line.
_PLAN_BODY = """\
def make():
    spare = None

    def fire_terminal(inst, event):
        nonlocal spare
        inst._s = target
        inst._q = busy
        try:
            ctx = spare
            spare = None  # taken (no jump or call between: no other thread runs between)
            if ctx is None:
                ctx = made(edge)
            ctx.resources = holds.resources
            ctx._live = True  # live until the finally below (I1)
            ctx.instance = inst
            ctx.event = event
            report = Report(mname, inst, pname)
            try:
                # STEPS
                cur = inst._owns
                if cur is not None:  # the handles no step named, by their default releasers
                    ledger._sweep(ctx, inst, cur, report)
            finally:
                ctx._live = False
                # Nobody kept it (ours and the call's), and no effect rebound what it
                # says of its edge (the next plan would read that):
                if refs(ctx) == 2 and ctx.target is edge.target and ctx.ledger is edge.ledger:
                    ctx.instance = ctx.event = None
                    spare = ctx
                    del ctx  # nor does this frame, should a traceback keep it
            runs[pid] += 1
            if report._errors:
                inst._m._plan_failed(report, ledger)
        except Exception as e:
            q = inst._q
            if q is busy:
                inst._q = None
                raise
            return inst._m._drain_after_plan(inst, q, [e])
        q = inst._q
        if q is not busy:  # events its effects fired at this instance, in order
            return inst._m._drain_after_plan(inst, q, [], report)
        inst._q = None
        return report

    return fire_terminal
"""

# A step's call, at the indentation of the block it goes in: every step runs, an error
# (or a returned value) is reported against the step.
_CALL = """\
try:
    res = {call}
except Exception as e:
    step_failed(report, about{i}, e)
else:
    if res is not None:
        step_returned(ledger, res, report, about{i})
"""


def _call(call: str, i: int, indent: int) -> str:
    """`_CALL` of step `i` calling `call`, indented by `indent` spaces."""
    return textwrap.indent(_CALL.format(call=call, i=i), " " * indent)


# A Release(kind): the one handle of the kind inline, marked first; of several,
# `Ledger._release_kind` (each of the kind in order, marked first, one an earlier release
# effect moved or released skipped: the one copy of that loop).
_RELEASE_STEP = """\
                cur = inst._owns
                if cur is not None:
                    if cur.__class__ is not Hd:  # several handles
                        ledger._release_kind(ctx, inst, cur, kind{i}, fn{i}, report,
                                             about{i})
                    elif not cur.released and cur.kind == kind{i}:
                        cur.released = True  # marked first: never released twice
                        inst._owns = cur.owner = None
                        if observers:
                            observers.pop(cur, None)
                        ledger._released += 1
                        if report._released is None:
                            report._released = cur
                        else:
                            report.released.append(cur)
{call_cur}"""

_REPORT_APPEND = """\
                        if report._released is None:
                            report._released = cur
                        else:
                            report.released.append(cur)
"""
_REPORT_FIRST = """\
                        report._released = cur  # the plan's first release
"""


def _step_failed(report: PlanReport, about: tuple[str, bool], e: Exception) -> None:
    """Report that a step (`about`: its name and best_effort) of a compiled plan raised."""
    report.errors.append(EffectError(report.machine, report.plan, about[0], about[1], e))


def _step_returned(ledger: Ledger, res: Any, report: PlanReport,
                   about: tuple[str, bool]) -> None:
    """What a step of a compiled plan returned (not None): an awaitable becomes a task
    the ledger keeps referenced until it ends (`plan.step_result`)."""
    task = step_result(res, report, about[0], about[1])
    if task is not None:
        ledger._keep(task, report, about[0], about[1])

def _compile_terminal(m: Machine, t: _Terminal) -> _OnCell:
    """What `Instance.fire` runs for a terminal edge (an unguarded cell, or the
    alternative a compiled guarded cell picked) while nobody observes, or only the
    recorder (wrapped by `_compile_recorded_terminal`): the whole step, in one function
    whose constants are bound here.

    It moves the instance to the terminal state, marks it busy (events fired at it
    queue, `_BUSY`), runs the plan inside a live context that is dead after it, and
    drains the queue. With a ledger and a plan of `Release` steps (`t.kinds`), an
    instance that owns one handle has it released here: marked first, then its step's
    function (or the kind's default releaser) called unwrapped, since the context is
    the engine's own and live. An instance that owns several handles, and other plans,
    go through `_compile_general` (`Machine._run_terminal`, `Ledger._run_steps`). One
    that owns nothing has nothing of such a plan to run: no effect is called, so no
    context is opened and nothing can be fired at it meanwhile; the plan's run is
    counted and its (empty) report returned.
    """
    ledger, kinds = t.ledger, t.kinds
    if ledger is None:  # no ledger: the plan's actions through `_run_terminal`
        return _compile_general(m, t)
    if _C is not None:  # the compiled core runs every plan over a ledger
        return _plan_cell(m, t)
    if kinds is None:  # a plan with actions
        return _compile_plan(m, t)
    target, edge, pname, pid, steps, sweep = t.target, t.edge, t.pname, t.pid, t.plan.steps, t.sweep
    mname, runs = m.name, m.stats._runs
    observers, raw = ledger._observers, ledger._raw
    kind0, step0 = next(iter(kinds.items()), (None, sweep))
    fn0 = step0[1]
    made, holds, Report, Hd, busy = _made, t.edge._holds, PlanReport, Handle, _BUSY
    # A dead context this cell may reuse: one that nobody kept after its plan (its only
    # references were ours), so nobody can see it live again (`_REUSE`). It saves
    # building one per plan (about a fifth of a terminal fire).
    spare: ReleaseContext | None = None
    refs = _refs
    # Runs of the one-handle path not yet added to `runs[pid]` and `ledger._released`:
    # one count for both, kept a cached small int (under 256) so that counting
    # allocates nothing; `Stats.plans_run` and `Ledger.released` add it first (`flush`).
    n = 0

    def flush() -> None:
        nonlocal n
        k, n = n, 0
        runs[pid] += k
        ledger._released += k

    several = _compile_general(m, t)  # an instance that owns several handles

    def fire_terminal(inst: Instance, event: Any) -> PlanReport | None:
        nonlocal spare, n
        cur = inst._owns
        if cur.__class__ is not Hd:
            if cur is not None:
                return several(inst, event)
            inst._s = target  # owns nothing: no effect runs, no context is opened
            runs[pid] += 1
            return Report(mname, inst, pname)
        inst._s = target
        inst._q = busy
        try:
            ctx = spare
            spare = None  # taken (no jump or call between: no other thread runs between)
            if ctx is None:  # none, or a plan run meanwhile (an effect's fire) holds it
                ctx = made(edge)
            ctx.resources = holds.resources
            ctx._live = True  # live until the finally below (I1)
            ctx.instance = inst
            ctx.event = event
            try:
                kind = cur.kind
                fn = fn0 if kind == kind0 else kinds.get(kind, sweep)[1]
                cur.released = True  # marked first: never released twice
                inst._owns = cur.owner = None
                if observers:
                    observers.pop(cur, None)
                n += 1  # a run of the plan and a handle released
                if n > 200:
                    flush()
                report = Report(mname, inst, pname, cur)
                try:  # what is given to inst meanwhile is the plan's (PLAN_RUNNING)
                    res = (fn or raw[kind])(ctx, cur)
                except Exception as e:  # every step runs; the error is reported
                    res = None
                    _, _, name, best_effort = kinds.get(kind, sweep)
                    report.errors.append(EffectError(
                        mname, pname, name or f"release {kind}", best_effort, e))
                if res is not None:
                    _, _, name, best_effort = kinds.get(kind, sweep)
                    step = name or f"release {kind}"
                    task = step_result(res, report, step, best_effort)
                    if task is not None:
                        ledger._keep(task, report, step, best_effort)
                if inst._owns is not None:  # given to it while its releaser ran
                    i = kinds.get(kind, sweep)[0]
                    ledger._run_steps(ctx, inst, steps[i + 1:], report)
            finally:
                ctx._live = False
                # Nobody kept it (ours and the call's), and no effect rebound what it
                # says of its edge (the next plan would read that):
                if refs(ctx) == 2 and ctx.target is edge.target and ctx.ledger is edge.ledger:
                    ctx.instance = ctx.event = None
                    spare = ctx
                    del ctx  # nor does this frame, should a traceback keep it
            if report._errors:
                inst._m._plan_failed(report, ledger)
        except Exception as e:
            q = inst._q
            if q is busy:
                inst._q = None
                raise
            return inst._m._drain_after_plan(inst, q, [e])
        q = inst._q
        if q is not busy:  # events its effects fired at this instance, in order
            return inst._m._drain_after_plan(inst, q, [], report)
        inst._q = None
        return report

    ledger._flushes.append(flush)  # one per compiled cell of each machine bound to it
    stats = m.stats
    assert isinstance(stats, _Stats)
    stats._flushes.append(flush)
    return fire_terminal


def _plan_cell(m: Machine, t: _Terminal) -> _OnCell:
    """`_compile_terminal` with the compiled core: its `PlanCell`, which runs the plan's
    steps as `_compile_plan`'s unrolled function does (a `Release` of one handle
    inline, of several each of the kind in order, then the handles no step named by
    their default releasers), for plans of `Release` steps and plans with actions alike."""
    assert _C is not None and t.ledger is not None
    steps: list[tuple[str | None, Callable[..., Any] | None, tuple[str, bool]]] = []
    for st in t.plan.steps:
        if type(st) is Release:
            steps.append((st.kind, None if st.fn is None else unwrapped(st.fn),
                          (st.name, st.best_effort)))
        else:
            assert isinstance(st, Action)
            steps.append((None, unwrapped(st.fn), (st.name, st.best_effort)))
    cell: _OnCell = _C.PlanCell(t.target, t.edge, t.pname, t.pid, m.name, m.stats._runs,
                                t.ledger, tuple(steps))
    return cell


class Instance(Holder):
    """One live machine: a state id and nothing else the engine needs (and, in the
    slots of its base `ledger.Holder`, what it owns).

    Subclass it with `__slots__` for the data your guards read. Only the engine
    changes the state (`fire`); `state`, `terminal` and `busy` read it.
    """

    # (The compiled core's `Holder` has the `key` slot, and its own __init__ and fire.)
    __slots__ = ("key",) if TYPE_CHECKING or _C is None else ()

    _m: Machine

    def __init__(self, machine: Machine, key: Any = None) -> None:
        self._m = machine
        self._s = machine.initial
        self._q: list[Any] | None = None
        self._owns = None
        self.key = key

    def __reduce_ex__(self, protocol: Any) -> Any:
        # (copy.copy, copy.deepcopy and pickle all come here, in both cores alike)
        raise TypeError(
            f"{type(self).__name__} instances cannot be copied or pickled: a copy would "
            "share the handles the original owns in its machine's ledger (each is "
            "released once, by its one owner); make a new instance of the machine instead")

    def fire(self, event: Any) -> PlanReport | None:
        """Deliver `event`. Returns the PlanReport when it ran a release plan, else None.

        Raises TransitionNotAllowed where the declaration makes the event an error,
        UnknownEvent for an object that is not one of the machine's events, and
        ReleaseFailed when a non-best-effort release step raised (after every step ran).
        """
        if self._q is None:
            try:
                code = self._m._rows[self._s][type(event)]  # (as the C: not `__class__`)
                if code >= 0:  # (in the try: nothing here raises, and no jump over
                    self._s = code  # the handler on the way out)
                    return None
            except KeyError:
                return self._m._fire_slow(self, event)
            # The cell's code names (state, event) and indexes its entry from the end
            # of the table in use: its compiled function, its first fire (which
            # compiles it), or the general path told which cell it is.
            return self._m._on[code](self, event)
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


if _C is not None:
    # The compiled core's `Holder.__init__` and `Holder.fire` do what these do (the
    # Python `fire`, kept as `_fire_py`, is where it hands a case it does not handle).
    del Instance.__init__
    compiled(Instance, ("fire",))
    _C.setup(Handle=Handle, PlanReport=PlanReport, ReleaseContext=ReleaseContext,
             QueuedInPlan=QueuedInPlan, PLAN_RUNNING=PLAN_RUNNING, step_failed=_step_failed,
             step_returned=_step_returned, sweeps=_SWEEPS, compact_min=_COMPACT_MIN)
