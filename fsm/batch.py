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
add, one gather, one min/max reduction (its min rejects bad pairs, its max says
whether anyone became terminal) and one mask; only a step in which some instance
became terminal pays for a nonzero, whose releases the caller does in one batched
call per plan.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from . import observe as _obs
from .errors import ReleaseFailed, TransitionNotAllowed
from .plan import _ENGINE, EffectError, ReleaseContext, _require_effect
from .spec import DECISIONS, GUARDED, IGNORED

if TYPE_CHECKING:
    from .machine import Machine

_NEWLY_SHIFT = 40
_PLAN_SHIFT = 41
_BASE_MASK = (1 << _NEWLY_SHIFT) - 1


def _min_max(t: torch.Tensor) -> tuple[int, int]:
    """(min, max) of `t` with one host read ((0, 0) when empty)."""
    if not t.numel():
        return 0, 0
    lo, hi = torch.stack(t.aminmax()).tolist()
    return lo, hi


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

    def by_plan(self, machine: Machine) -> dict[str, torch.Tensor]:
        """Newly-terminal indices grouped by plan name (edges without one under '')."""
        out: dict[str, torch.Tensor] = {}
        for pid in torch.unique(self.plan_ids).tolist():
            name = machine.plan_names[pid] if pid >= 0 else ""
            out[name] = self.terminal[self.plan_ids == pid]
        return out


class Batch:
    """`n` instances of one machine on `device`, all starting in the initial state.

    `plans` maps plan names to batched release effects `fn(ctx, indices)` (decorated
    with `@release_effect`), run with a live ReleaseContext once per plan per step for
    all the instances that took an edge running that plan.
    """

    def __init__(self, machine: Machine, n: int, device: str | torch.device = "cpu",
                 plans: Mapping[str, Any] | None = None) -> None:
        self.machine = machine
        self.device = torch.device(device)
        self.n = n
        self._plans = dict(plans or {})
        for name, fn in self._plans.items():
            if name not in machine.plan_names:
                raise KeyError(f"machine {machine.name!r} runs no plan {name!r}; its plans: "
                               f"{', '.join(machine.plan_names) or 'none'}")
            _require_effect(fn, f"batched plan {name!r}")
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
        self._decision = dec.reshape(-1)
        self._base = torch.full((n,), machine.initial * W + 1, dtype=torch.int64,
                                device=self.device)

    @property
    def states(self) -> torch.Tensor:
        """The state id of every instance (int64, on the batch's device)."""
        return torch.div(self._base - 1, self._w, rounding_mode="floor")

    def event_ids(self, events: list[type | None]) -> torch.Tensor:
        """Event classes (None for no event) as the int64 tensor `step()` takes."""
        m = self.machine
        return torch.tensor([-1 if e is None else m.event_id(e) for e in events],
                            dtype=torch.int64, device=self.device)

    def step(self, events: torch.Tensor) -> BatchStep:
        """Deliver `events[i]` (an event id, -1 for none) to instance i, all at once.

        Rejects the whole step, changing nothing, when any instance's (state, event)
        pair is an error or guarded, naming the first such instance. Ignored events are
        counted in `machine.stats.ignored` only while a recorder or sink observes the
        machine (counting them costs a bincount per step).
        """
        lo, hi = _min_max(events)
        if lo < -1 or hi >= self._w - 1:
            bad = int(((events < -1) | (events >= self._w - 1)).nonzero()[0])
            raise IndexError(
                f"machine {self.machine.name!r}: event id {int(events[bad])} at instance "
                f"{bad} is out of range; use Batch.event_ids() or -1 for no event")
        idx = self._base + events
        packed = self._packed.index_select(0, idx)
        lo, hi = _min_max(packed)
        if _obs.recorder() is not None or self.machine._sinks:
            self._observe(idx, events, packed, rejected=lo < 0)
        if lo < 0:
            self._reject(events, packed)
        if hi >> _NEWLY_SHIFT:
            terminal = ((packed >> _NEWLY_SHIFT) & 1).nonzero().squeeze(1)
            plan_ids = (packed[terminal] >> _PLAN_SHIFT) - 1
        else:
            terminal = plan_ids = torch.empty(0, dtype=torch.int64, device=self.device)
        self._base = packed & _BASE_MASK
        result = BatchStep(terminal, plan_ids)
        if self._plans and terminal.numel():
            self._run_plans(result)
        return result

    def _reject(self, events: torch.Tensor, packed: torch.Tensor) -> None:
        m = self.machine
        i = int((packed < 0).nonzero()[0])
        s, e = int(self.states[i]), int(events[i])
        reason = ("the declaration makes it an error here" if int(packed[i]) == -1 else
                  "the cell is guarded, and guards run only on scalar instances: fire "
                  "this event on an Instance")
        raise TransitionNotAllowed(m.name, m.states[s], m.event_names[e], reason,
                                   instance=i)

    def _observe(self, idx: torch.Tensor, events: torch.Tensor, packed: torch.Tensor,
                 rejected: bool) -> None:
        m = self.machine
        # A rejected step changes nothing: the only decisions made are the errors that
        # rejected it; every other row's transition never happened.
        made = packed < 0 if rejected else events >= 0
        counts = torch.bincount(idx[made].cpu(), minlength=self._packed.numel())
        nz = counts.nonzero().squeeze(1).tolist()
        by_cell: Counter[tuple[int, int, int]] = Counter()
        for flat in nz:
            s, e = divmod(flat, self._w)
            if e == 0:
                continue
            # A batch rejects a guarded cell without running its guards: no alternative.
            k = -1 if self._decision[flat] == GUARDED else 0
            by_cell[(s, e - 1, k)] += int(counts[flat])
            if self._decision[flat] == IGNORED:
                m.stats.ignored[(m.states[s], m.event_names[e - 1])] += int(counts[flat])
        rec = _obs.recorder()
        if rec is not None and by_cell:
            rec.record_counts(m, by_cell)
        if m._sinks:
            import time

            states = self.states
            for i in made.nonzero().squeeze(1).tolist():
                s, e = int(states[i]), int(events[i])
                p = int(packed[i])
                t = ((p & _BASE_MASK) - 1) // self._w if p >= 0 else s
                d = int(self._decision[s * self._w + e + 1])
                plan_id = (p >> _PLAN_SHIFT) - 1
                r = _obs.TransitionRecord(
                    m.name, i, m.states[s], m.event_names[e], m.states[t],
                    DECISIONS[d] if p >= 0 else "error",
                    m.plan_names[plan_id] if plan_id >= 0 else None, time.monotonic())
                for sink in m._sinks:
                    sink(r)

    def _run_plans(self, result: BatchStep) -> None:
        m = self.machine
        errors: list[Exception] = []
        for name, idx in result.by_plan(m).items():
            fn = self._plans.get(name)
            if fn is None:  # an edge without a plan: nothing to run
                continue
            ctx = ReleaseContext(_ENGINE, m.name, self, None, name, "*", "*", m.ledger)
            try:
                fn(ctx, idx)
            except Exception as e:  # every plan still runs: its rows are terminal now
                errors.append(EffectError(m.name, name, getattr(fn, "__name__", name),
                                          False, e))
            finally:
                ctx._live = False
            m.stats.plans_run[name] += int(idx.numel())
        if errors:
            m.stats.effect_errors += len(errors)
            raise ReleaseFailed(f"machine {m.name!r}: {len(errors)} batched plan(s) raised; "
                                "every other plan ran", errors, result)

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
