"""Batched instances: a tensor of state ids stepped by one gather.

Each instance is stored as its row base `b = state * W + 1` (W = events + 1), so the
cell of (state, event) is `b + event` (event -1 means "no event": column 0). One
packed int64 table gives everything a step needs from one gather:

    packed[b + e] =  next row base                   bits  0..39
                   | newly-terminal flag             bit   40
                   | (plan id + 1)                   bits 41..
                   or -1 (error) / -2 (guarded: not batchable), negative

Because the target of an unguarded cell depends only on (state, event), "became
terminal in this step" is a property of the cell and is precomputed. A step is one
clamp, one add, one gather, two min/max reductions (the ids' reject an id out of range;
the cells' min rejects bad pairs, their max says whether anyone became terminal) and
one mask. The four numbers are the step's only read back to the host (one device
synchronisation on CUDA); only a
step in which some instance became terminal pays for a nonzero and, when the batch has
plans, one more read to group the rows by plan; the plans' releases are one batched
call per plan.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from . import observe as _obs
from .errors import ReleaseFailed, TransitionNotAllowed
from .ledger import Ledger
from .observe import Stats
from .plan import Action, Plan, PlanReport, Release, release_context, release_effect, require_effect
from .table import DECISIONS, GUARDED, IGNORED, Tables

_NEWLY_SHIFT = 40
_PLAN_SHIFT = 41
_BASE_MASK = (1 << _NEWLY_SHIFT) - 1


class Batchable(Protocol):
    """What a batch reads of its machine (an `fsm.Machine`; declared here because the
    machine builds batches, so this module cannot import it)."""

    @property
    def name(self) -> str: ...
    @property
    def states(self) -> tuple[str, ...]: ...
    @property
    def events(self) -> tuple[type, ...]: ...
    @property
    def event_names(self) -> tuple[str, ...]: ...
    @property
    def plan_names(self) -> tuple[str, ...]: ...
    @property
    def initial(self) -> int: ...
    @property
    def tables(self) -> Tables: ...
    @property
    def stats(self) -> Stats: ...
    @property
    def ledger(self) -> Ledger | None: ...
    @property
    def sinks(self) -> tuple[Any, ...]: ...
    def event_id(self, event: type | str) -> int: ...
    def state_id(self, name: str) -> int: ...


def _host(t: torch.Tensor) -> Any:
    """Read `t` back to the host as Python numbers: a device synchronisation on CUDA.
    Stepping reads through here only (and `nonzero`, whose size the host must learn)."""
    return t.tolist()


class BatchStep:
    """The outcome of one batched step.

    `terminal`: int64 indices of the instances that entered a terminal state in this
    step; `plan_ids`: for each of them, the index of its plan in `machine.plan_names`
    (-1 for an edge without a plan).
    """

    __slots__ = ("plan_ids", "terminal")

    def __init__(self, terminal: torch.Tensor, plan_ids: torch.Tensor) -> None:
        self.terminal = terminal
        self.plan_ids = plan_ids

    def by_plan(self, machine: Batchable) -> dict[str, torch.Tensor]:
        """Newly-terminal indices grouped by plan name (edges without one under ''), each
        group in index order. One read back to the host (the group sizes), whatever the
        number of plans."""
        out: dict[str, torch.Tensor] = {}
        if not self.terminal.numel():
            return out
        order = torch.sort(self.plan_ids, stable=True).indices
        sizes = _host(torch.bincount(self.plan_ids + 1, minlength=len(machine.plan_names) + 1))
        groups = self.terminal.index_select(0, order).split(sizes)
        for pid, (size, rows) in enumerate(zip(sizes, groups, strict=True)):
            if size:
                out[machine.plan_names[pid - 1] if pid else ""] = rows
        return out


BatchedEffect = Callable[..., Any]
"""The older form of a batched plan: one `@release_effect` `fn(ctx, rows)`."""


def _as_plan(machine: Batchable, name: str, given: Plan | BatchedEffect) -> Plan:
    """A batched plan as a `Plan` of `Action` steps (each called `fn(ctx)`, the rows in
    `ctx.rows`); a bare `fn(ctx, rows)` becomes a one-step plan."""
    if isinstance(given, Plan):
        for step in given.steps:
            if isinstance(step, Release):
                raise TypeError(
                    f"machine {machine.name!r}: batched plan {name!r} has a "
                    f"Release({step.kind!r}) step; batch rows own no ledger handles (a "
                    "row's resources live in pool tensors indexed by the row), so release "
                    "them in an Action over ctx.rows: Plan(Action(release_rows))")
        return given
    require_effect(given, f"batched plan {name!r}")
    fn = given

    @release_effect
    def rows_step(ctx: Any) -> Any:
        return fn(ctx, ctx.rows)

    rows_step.__name__ = getattr(fn, "__name__", name)
    return Plan(Action(rows_step))


class Batch:
    """`n` instances of one machine on `device`, all starting in the initial state.

    `plans` maps plan names to the same `Plan` objects scalar machines take, with
    `Action` steps only: each step runs `fn(ctx)` once per plan per step, with
    `ctx.rows` the int64 indices of every instance that took an edge running that plan
    in the step (a bare `@release_effect fn(ctx, rows)` is accepted as a one-step plan).
    `Release(kind)` steps are refused: batch rows own no ledger handles.
    """

    def __init__(self, machine: Batchable, n: int, device: str | torch.device = "cpu",
                 plans: Mapping[str, Plan | BatchedEffect] | None = None) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"machine {machine.name!r}: a batch holds n >= 0 instances "
                             f"(an int), got {n!r}")
        self.machine = machine
        self.device = torch.device(device)
        self.n = n
        given = dict(plans or {})
        for name in given:
            if name not in machine.plan_names:
                raise KeyError(f"machine {machine.name!r} runs no plan {name!r}; its plans: "
                               f"{', '.join(machine.plan_names) or 'none'}")
        self._plans = {name: _as_plan(machine, name, p) for name, p in given.items()}
        missing = [p for p in machine.plan_names if self._plans and p not in self._plans]
        if missing:  # a row entering that plan's state would never be released
            raise KeyError(f"machine {machine.name!r}: batched plans given for "
                           f"{', '.join(sorted(self._plans))} but not for "
                           f"{', '.join(missing)}; pass an effect for every plan")
        t = machine.tables
        S, E = len(t.next), len(machine.events)
        self._w = W = E + 1
        nxt = torch.empty((S, W), dtype=torch.int64)
        nxt[:, 0] = torch.arange(S)
        nxt[:, 1:] = torch.tensor(t.next, dtype=torch.int64).reshape(S, E)
        term = torch.tensor(t.terminal, dtype=torch.bool)
        tgt = nxt.clamp(min=0)
        newly = term[tgt] & ~term[:, None] & (nxt >= 0)
        plan = torch.full((S, W), -1, dtype=torch.int64)
        plan[:, 1:] = torch.tensor(t.plan, dtype=torch.int64).reshape(S, E)
        packed = (tgt * W + 1) | (newly.to(torch.int64) << _NEWLY_SHIFT) | (
            (plan + 1) << _PLAN_SHIFT)
        packed = torch.where(nxt < 0, nxt, packed)
        dec = torch.full((S, W), IGNORED, dtype=torch.int64)
        dec[:, 1:] = torch.tensor(t.decision, dtype=torch.int64).reshape(S, E)
        self._packed = packed.reshape(-1).to(self.device)
        self._terminal = term.to(self.device)
        self._decision: list[int] = dec.reshape(-1).tolist()
        self._base = torch.full((n,), machine.initial * W + 1, dtype=torch.int64,
                                device=self.device)

    def __repr__(self) -> str:
        return f"<Batch of {self.n} {self.machine.name!r} instances on {self.device}>"

    @property
    def states(self) -> torch.Tensor:
        """The state id of every instance (int64, on the batch's device)."""
        return torch.div(self._base - 1, self._w, rounding_mode="floor")

    def event_ids(self, events: Sequence[type | None]) -> torch.Tensor:
        """Event classes (None for no event), one per instance, as the int64 tensor
        `step()` takes."""
        m = self.machine
        if not isinstance(events, (list, tuple)):
            what = (f"the event instance {events!r}" if not isinstance(events, type)
                    else f"the class {events.__name__}")
            raise TypeError(f"machine {m.name!r}: event_ids takes a list of event classes "
                            f"(None for no event), one per instance; got {what}; pass "
                            "[Cls, None, ...]")
        ids = []
        for i, e in enumerate(events):
            if e is not None and not isinstance(e, type):
                raise TypeError(
                    f"machine {m.name!r}: event_ids takes event classes; item {i} is the "
                    f"event instance {e!r}; pass its class {type(e).__name__}")
            ids.append(-1 if e is None else m.event_id(e))
        return torch.tensor(ids, dtype=torch.int64, device=self.device)

    def _check_events(self, events: Any) -> None:
        m = self.machine
        if not isinstance(events, torch.Tensor):
            raise TypeError(f"machine {m.name!r}: Batch.step takes an int64 tensor of event "
                            f"ids (one per instance, -1 for none), got "
                            f"{type(events).__name__}; build it with batch.event_ids([...])")
        if events.dtype != torch.int64 or events.shape[-1:] != (self.n,) or \
                events.dim() not in (1, 2):
            raise ValueError(f"machine {m.name!r}: Batch.step takes {self.n} int64 event "
                             f"ids, one per instance (or a (rounds, {self.n}) tensor of "
                             f"them); got {events.dtype} of shape {tuple(events.shape)}; "
                             "build it with batch.event_ids([...]) or "
                             "torch.full((n,), -1, dtype=torch.int64)")
        if events.device != self.device:
            raise ValueError(f"machine {m.name!r}: the event ids are on {events.device}, "
                             f"the batch on {self.device}; move them with "
                             f".to({str(self.device)!r})")

    def step(self, events: torch.Tensor) -> BatchStep:
        """Deliver `events[i]` (an event id, -1 for none) to instance i, all at once.

        `events` may also be a (rounds, n) tensor: `events[j, i]` is the j-th event
        instance i takes in this step (-1 for none), so one call delivers a scheduler
        step in which a row takes several events in order (a chunk result, then the
        next launch) and different rows take different events. The rounds are gathered
        one after the other on the device; the step still reads back one set of
        numbers, runs each plan once for all the rows that turned terminal in any round
        and is rejected as a whole.

        Rejects the whole step, changing nothing, when any instance's event id is out of
        range (IndexError) or its (state, event) pair is an error or guarded
        (TransitionNotAllowed), naming the first such instance. A step in which no row
        became terminal or was rejected reads one pair of numbers back from the device;
        only newly-terminal rows cost more (their indices, and one read to group them by
        plan). Ignored events are counted in `machine.stats.ignored` only while a
        recorder or sink observes the machine (counting them costs a bincount per step).
        """
        self._check_events(events)
        if not self.n:
            return BatchStep(events.reshape(-1), events.reshape(-1))
        if events.dim() == 2:
            if not events.shape[0]:
                return BatchStep(self._base[:0], self._base[:0])
            return self._step_rounds(events)
        e_max = self._w - 2
        # Clamped so that the gather stays in the table whatever the ids; the ids' own
        # min/max, read with the cells', reject an out-of-range id before anything changes.
        idx = events.clamp(-1, e_max)
        idx += self._base  # in place: a step allocates no more tensors than it must
        packed = self._packed.index_select(0, idx)
        ev_lo, ev_hi, lo, hi = _host(torch.stack((*events.aminmax(), *packed.aminmax())))
        m = self.machine
        if ev_lo < -1 or ev_hi > e_max:
            self._refuse_bad_ids(events)
        if _obs.recorder() is not None or m.sinks:
            self._observe([self._base], [events], [packed], rejected=lo < 0)
        if lo < 0:
            self._reject(self._base, events, packed)
        self._base = packed & _BASE_MASK
        if not hi >> _NEWLY_SHIFT:
            return BatchStep(events[:0], events[:0])
        return self._finish(packed)

    def _step_rounds(self, events: torch.Tensor) -> BatchStep:
        """`step` of a (rounds, n) tensor: see `step`."""
        e_max = self._w - 2
        base = self._base
        bases, packs = [], []
        for ev in events.clamp(-1, e_max):
            packed = self._packed.index_select(0, ev + base)
            bases.append(base)
            packs.append(packed)
            # A rejected cell (negative) keeps the row where it was: the step is refused
            # below, and the gathers of later rounds stay in the table meanwhile.
            base = torch.where(packed < 0, base, packed & _BASE_MASK)
        ev_lo, ev_hi, lo, hi = _host(torch.stack((*events.aminmax(),
                                                  *torch.stack(packs).aminmax())))
        m = self.machine
        if ev_lo < -1 or ev_hi > e_max:
            self._refuse_bad_ids(events.reshape(-1))
        if _obs.recorder() is not None or m.sinks:
            self._observe(bases, list(events), packs, rejected=lo < 0)
        if lo < 0:
            for b, ev, packed in zip(bases, events, packs, strict=True):
                if _host((packed < 0).any()):
                    self._reject(b, ev, packed)
        self._base = base
        if not hi >> _NEWLY_SHIFT:
            return BatchStep(self._base[:0], self._base[:0])
        # A row turns terminal in one round at most (a terminal state has no way out):
        # its cell of that round says which plan releases it.
        newly = packs[0]
        for packed in packs[1:]:
            newly = torch.where((packed >> _NEWLY_SHIFT) & 1 == 1, packed, newly)
        return self._finish(newly)

    def _finish(self, packed: torch.Tensor) -> BatchStep:
        terminal = ((packed >> _NEWLY_SHIFT) & 1).nonzero().squeeze(1)
        result = BatchStep(terminal, (packed.index_select(0, terminal) >> _PLAN_SHIFT) - 1)
        if self._plans:
            self._run_plans(result)
        return result

    def _refuse_bad_ids(self, events: torch.Tensor) -> None:
        flat = _host(((events < -1) | (events > self._w - 2)).nonzero()[0, 0])
        i = flat % self.n
        raise IndexError(
            f"machine {self.machine.name!r}: event id {_host(events[flat])} at instance {i} "
            "is out of range; use Batch.event_ids() or -1 for no event")

    def _reject(self, base: torch.Tensor, events: torch.Tensor, packed: torch.Tensor) -> None:
        m = self.machine
        i = _host((packed < 0).nonzero()[0, 0])
        s, e, p = _host(torch.stack(((base[i] - 1) // self._w, events[i], packed[i])))
        reason = ("the declaration makes it an error here" if p == -1 else
                  "the cell is guarded, and guards run only on scalar instances: fire "
                  "this event on an Instance")
        raise TransitionNotAllowed(m.name, m.states[s], m.event_names[e], reason,
                                   instance=i)

    def _observe(self, bases: list[torch.Tensor], events: list[torch.Tensor],
                 packs: list[torch.Tensor], rejected: bool) -> None:
        """Count (and hand the sinks) the decisions of one step's rounds, in order."""
        m = self.machine
        base, ev, packed = torch.cat(bases), torch.cat(events), torch.cat(packs)
        # A rejected step changes nothing: the only decisions made are the errors that
        # rejected it; every other row's transition never happened.
        made = packed < 0 if rejected else ev >= 0
        # Cells not made are counted in cell 0 (no event), which is skipped: no nonzero.
        idx = torch.where(made, base + ev, 0)
        counts = _host(torch.bincount(idx, minlength=self._packed.numel()))
        by_cell: Counter[tuple[int, int, int]] = Counter()
        decision = self._decision
        for flat, count in enumerate(counts):
            if not count:
                continue
            s, e = divmod(flat, self._w)
            if e == 0:
                continue
            # A batch rejects a guarded cell without running its guards: no alternative.
            k = -1 if decision[flat] == GUARDED else 0
            by_cell[(s, e - 1, k)] += count
            if decision[flat] == IGNORED:
                m.stats.ignored[(m.states[s], m.event_names[e - 1])] += count
        rec = _obs.recorder()
        if rec is not None and by_cell:
            rec.record_counts(m, by_cell)
        if m.sinks:
            rows = made.nonzero().squeeze(1)
            states = _host(torch.div(base.index_select(0, rows) - 1, self._w,
                                     rounding_mode="floor"))
            evs = _host(ev.index_select(0, rows))
            codes = _host(packed.index_select(0, rows))
            n = self.n
            for flat_i, s, e, p in zip(_host(rows), states, evs, codes, strict=True):
                i = flat_i % n
                t = ((p & _BASE_MASK) - 1) // self._w if p >= 0 else s
                d = decision[s * self._w + e + 1]
                plan_id = (p >> _PLAN_SHIFT) - 1
                r = _obs.TransitionRecord(
                    m.name, i, m.states[s], m.event_names[e], m.states[t],
                    DECISIONS[d] if p >= 0 else "error",
                    m.plan_names[plan_id] if plan_id >= 0 else None, time.monotonic())
                for sink in m.sinks:
                    sink(r)

    def _run_plans(self, result: BatchStep) -> None:
        m = self.machine
        reports: list[PlanReport] = []
        for name, rows in result.by_plan(m).items():
            plan = self._plans.get(name)
            if plan is None:  # an edge without a plan: nothing to run
                continue
            report = PlanReport(m.name, self, name)
            with release_context(m.name, self, None, name, "*", "*", m.ledger,
                                 rows) as ctx:
                plan.run_actions(ctx, report)
            m.stats.plans_run[name] += int(rows.numel())
            reports.append(report)
        errors = [er for r in reports for er in r.errors]
        if errors:
            m.stats.effect_errors += len(errors)
            fatal = [er for er in errors if not er.best_effort]
            if fatal:
                raise ReleaseFailed(f"machine {m.name!r}: {len(fatal)} batched plan "
                                    "step(s) raised; every other step and plan ran",
                                    list(fatal), result)

    def recycle(self, rows: torch.Tensor) -> None:
        """Start new instances in `rows`, which must be terminal or still initial.

        A scheduler reuses the row of a finished request for the next one (the row is
        its request slot); a row whose instance is still live is refused, so a reset
        can never skip a release.
        """
        m = self.machine
        states = torch.div(self._base.index_select(0, rows) - 1, self._w, rounding_mode="floor")
        ok = self._terminal[states] | (states == m.initial)
        if not bool(ok.all()):
            bad = int((~ok).nonzero()[0])
            i = int(rows[bad])
            raise TransitionNotAllowed(
                m.name, m.states[int(states[bad])], "<recycle>",
                "only a terminal (or still initial) row can start a new instance; "
                "finish or abort the live one first", instance=i)
        self._base.index_fill_(0, rows, m.initial * self._w + 1)

    def count(self, state: str) -> int:
        """How many instances are in `state`."""
        return int((self.states == self.machine.state_id(state)).sum())
