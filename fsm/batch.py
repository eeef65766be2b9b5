"""Batched instances: a tensor of state ids stepped by one gather.

Each instance is stored as its row base `b = state * W + 1` (W = events + 2), so the
cell of (state, event) is `b + event` (event -1 means "no event": column 0; the last
column is the hidden "start anew" event of `step(reset=)`). One packed int64 table gives
everything a step needs from one gather:

    packed[b + e] =  next row base                   bits  0..39
                   | newly-terminal flag             bit   40
                   | (plan id + 1)                   bits 41..
                   or -1 (error) / -2 (guarded: not batchable), negative

Because the target of an unguarded cell depends only on (state, event), "became
terminal in this step" is a property of the cell and is precomputed. A step is one
clamp, one add, one gather, two min/max reductions (the ids' reject an id out of range;
the cells' min rejects bad pairs, their max says whether anyone became terminal) and
one mask. The four numbers are the step's only read back to the host (one device
synchronisation on CUDA); only a step in which some instance became terminal pays for a
nonzero and, when the batch has plans, one more read to group the rows by plan; the
plans' releases are one batched call per plan.

A *quiet* step reads nothing back. When the caller says which event ids the tensor
holds (`step(known=)`, Python ints it had before building the tensor) and every such
id's column is quiet (in no state a guarded cell or an edge into a terminal state), no
row can turn terminal or need a guard, so nothing has to be decided on the host: the
step is applied on the device, and whether any row hit an error cell is folded into a
sticky device flag. A step whose flag is set changes nothing (the rows keep their
states, by a `where` on the device), nor does any step after it, and the refusal is
raised (`TransitionNotAllowed`, naming the first refused instance, state and event) at
the next read: the next step that is not quiet, or `check()`. As the double-free bitmap
of the pools, the check is complete and the refusal exact; only its report waits for
the next read.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, Protocol, cast

import numpy as np
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
# Quiet steps kept for naming a deferred refusal; past this many (or this many ids), a
# quiet step first reads the flag (one read) so the evidence kept stays bounded.
_MAX_UNCHECKED_STEPS = 64
_MAX_UNCHECKED_IDS = 1 << 22


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
    @property
    def observed(self) -> bool: ...
    def event_id(self, event: type | str) -> int: ...
    def state_id(self, name: str) -> int: ...


_INT = {int}
_RESET = object()  # `step_runs`' own run of the reset rows
# `step_runs` of a step with a run of more than _NP_RUN rows keeps the rows' bases in a
# numpy copy of the batch's (not a list of every row's), and takes each run of more than
# _NP_VEC rows with a few numpy operations (a gather, a table lookup, one OR-reduction
# that tells a refused or a terminal cell, a scatter) instead of a few dozen opcodes a
# row: a scheduler's decode step is one run of a few hundred rows. None: never (tests
# set both low, to run every run through them).
_NP_RUN: int | None = 64
_NP_VEC = 32


def rounds_of(runs: Sequence[tuple[Sequence[int], int]]) -> list[dict[int, int]]:
    """`Batch.step_runs`' runs as `Batch.step_rows`' rounds: a row's j-th event in round j
    (its events in the order of the runs that name it)."""
    rounds: list[dict[int, int]] = []
    depth: dict[int, int] = {}
    for rows, e in runs:
        for r in rows:
            j = depth.get(r, 0)
            depth[r] = j + 1
            if j == len(rounds):
                rounds.append({})
            rounds[j][r] = e
    return rounds


class _CheckedRuns(list[tuple[list[int], int]]):
    """Runs (rows, event id) for `Batch.step` whose rows the caller made Python ints in
    0..n-1 already (`RunningBatch.queue` and `admit` do), with `reset`: the rows (ints,
    likewise) that start anew first. `step` hands them to `step_runs` without scanning
    each run's rows for their type and range again (a row twice in a run is still
    found: it takes two rounds, as `step_rows` decides); anything else is checked as
    for a plain list of runs.

    Private to the library: the rows are trusted (a -1 would step the last row), so
    only `RunningBatch`, whose `queue` and `admit` made every row an int of its batch,
    builds these; a caller's runs go through `step_runs`, which checks each of them."""

    __slots__ = ("reset",)

    def __init__(self, runs: Iterable[tuple[list[int], int]] = (),
                 reset: Sequence[int] = ()) -> None:
        super().__init__(runs)
        self.reset = reset


def dense_rounds(runs: Sequence[tuple[Sequence[int], int]], n: int) -> np.ndarray:
    """`rounds_of(runs)` as the dense (rounds, n) int64 array `Batch.step` takes (-1: no
    event), built by a fixed number of numpy calls whatever the number of rows: a row's
    j-th event (in the order of the runs that name it, a row named twice in one run
    taking both) lands in round j, as `rounds_of` puts it. The rows must be ints in
    0..n-1 (`RunningBatch.queue` checked them)."""
    rows: list[int] = []
    lens: list[int] = []
    for rs, _ in runs:
        rows += rs
        lens.append(len(rs))
    total = len(rows)
    if not total:
        return np.full((0, n), -1, dtype=np.int64)
    r = np.fromiter(rows, np.int64, total)
    e = np.repeat(np.array([ev for _, ev in runs], dtype=np.int64), lens)
    # Each occurrence's round = how many times its row occurred before it: a stable sort
    # by row keeps each row's occurrences in order; the rank is the distance from the
    # first one of its row.
    order = np.argsort(r, kind="stable")
    rs_sorted = r[order]
    first = np.empty(total, dtype=bool)
    first[0] = True
    np.not_equal(rs_sorted[1:], rs_sorted[:-1], out=first[1:])
    if first.all():  # no row takes two events (a plain decode step): one round
        host = np.full((1, n), -1, dtype=np.int64)
        host[0, r] = e
        return host
    pos = np.arange(total, dtype=np.int64)
    start = np.maximum.accumulate(pos * first)
    depth = np.empty(total, dtype=np.int64)
    depth[order] = pos - start
    host = np.full((int(depth.max()) + 1, n), -1, dtype=np.int64)
    host[depth, r] = e
    return host


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
        group in index order. One read back to the host (the rows' plan ids), whatever
        the number of plans; when they all run one plan (the common case) the group is
        `terminal` itself."""
        out: dict[str, torch.Tensor] = {}
        if not self.terminal.numel():
            return out
        names = ("", *machine.plan_names)
        pids: list[int] = _host(self.plan_ids)
        first = pids[0]
        if pids.count(first) == len(pids):
            out[names[first + 1]] = self.terminal
            return out
        groups: dict[int, list[int]] = {}
        for pos, pid in enumerate(pids):
            got = groups.get(pid)
            if got is None:
                groups[pid] = [pos]
            else:
                got.append(pos)
        dev = self.terminal.device
        for pid in sorted(groups):
            at = torch.tensor(groups[pid], dtype=torch.int64, device=dev)
            out[names[pid + 1]] = self.terminal.index_select(0, at)
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
        self._w = W = E + 2  # column 0: no event; 1..E: the events; E+1: start anew
        self._reset_id = E
        nxt = torch.empty((S, W), dtype=torch.int64)
        nxt[:, 0] = torch.arange(S)
        nxt[:, 1:E + 1] = torch.tensor(t.next, dtype=torch.int64).reshape(S, E)
        term = torch.tensor(t.terminal, dtype=torch.bool)
        # "Start anew" (recycle): a terminal or still-initial row goes to the initial
        # state; from any live state it is an error (a reset must never skip a release).
        restart = term.clone()
        restart[machine.initial] = True
        nxt[:, E + 1] = torch.where(restart, machine.initial, -1)
        tgt = nxt.clamp(min=0)
        newly = term[tgt] & ~term[:, None] & (nxt >= 0)
        plan = torch.full((S, W), -1, dtype=torch.int64)
        plan[:, 1:E + 1] = torch.tensor(t.plan, dtype=torch.int64).reshape(S, E)
        packed = (tgt * W + 1) | (newly.to(torch.int64) << _NEWLY_SHIFT) | (
            (plan + 1) << _PLAN_SHIFT)
        packed = torch.where(nxt < 0, nxt, packed)
        dec = torch.full((S, W), IGNORED, dtype=torch.int64)
        dec[:, 1:E + 1] = torch.tensor(t.decision, dtype=torch.int64).reshape(S, E)
        # A column is quiet when no state's cell is guarded or enters a terminal state:
        # a step of quiet ids needs nothing decided on the host (see the module doc).
        loud = (newly | (dec == GUARDED)).any(0).tolist()
        self._quiet = frozenset(e for e in range(E) if not loud[e + 1])
        """Event ids whose columns are quiet: a step of only these (told by `known=`)
        reads nothing back."""
        self._packed = packed.reshape(-1).to(self.device)
        self._packed_list: list[int] = packed.reshape(-1).tolist()
        """The table on the host, for `step_rows` (a CPU batch stepped row by row)."""
        self._terminal = term.to(self.device)
        self._decision: list[int] = dec.reshape(-1).tolist()
        # Per flat cell, what `_record` counts: the recorder's (state, event, alternative)
        # key (a batch rejects a guarded cell without running its guards: alternative
        # -1) and, for an ignored cell, its `stats.ignored` key; None for column 0 (no
        # event) and the hidden "start anew" column.
        self._cell_keys: list[tuple[int, int, int] | None] = []
        self._cell_ignored: list[tuple[str, str] | None] = []
        for flat, d in enumerate(self._decision):
            s, e = divmod(flat, W)
            real = 0 < e < W - 1
            self._cell_keys.append((s, e - 1, -1 if d == GUARDED else 0) if real else None)
            self._cell_ignored.append((machine.states[s], machine.event_names[e - 1])
                                      if real and d == IGNORED else None)
        self._base = torch.full((n,), machine.initial * W + 1, dtype=torch.int64,
                                device=self.device)
        self._empty = self._base[:0]
        # Deferred refusals (see the module docstring): the sticky flag of the quiet
        # steps not read yet, and each such step's gather indices, to name the refusal.
        self._bad: torch.Tensor | None = None
        # Per quiet step not read yet: (its ids out of range? a 0-d flag on the device;
        # the events as given; the cell indices of each round).
        self._log: list[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]] = []
        self._log_ids = 0

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
                            f"ids (one per instance, -1 for none), a list of rounds "
                            f"{{row: id}} or a list of runs (rows, id); got "
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

    @property
    def quiet_ids(self) -> frozenset[int]:
        """The event ids whose every cell is an ignore, an error or a transition into a
        live state: a step of only these (said by `step(known=)`) reads nothing back."""
        return self._quiet

    @property
    def unchecked(self) -> int:
        """Quiet steps since the last read (0: every step so far is known to be
        applied); `check()` reads them."""
        return len(self._log)

    def step(self, events: torch.Tensor | Sequence[Mapping[int, int]]
             | Sequence[tuple[Sequence[int], int]],
             known: Collection[int] | None = None,
             reset: torch.Tensor | None = None) -> BatchStep:
        """Deliver `events[i]` (an event id, -1 for none) to instance i, all at once.

        `events` may also be a list of rounds, each a dict of {row: event id} (rows
        absent take none), on a CPU batch: the same step decided on the host, see
        `step_rows`; or a list of runs, each a (rows, event id) tuple, a row taking its
        events in the order of the runs that name it: see `step_runs`.
        `RunningBatch` hands its runs (rows it made ints of the batch, with their reset
        rows) as a private `_CheckedRuns`: `step_runs` of them, without a second scan.

        `events` may also be a (rounds, n) tensor: `events[j, i]` is the j-th event
        instance i takes in this step (-1 for none), so one call delivers a scheduler
        step in which a row takes several events in order (a chunk result, then the
        next launch) and different rows take different events. The rounds are gathered
        one after the other on the device; the step still reads back one set of
        numbers, runs each plan once for all the rows that turned terminal in any round
        and is rejected as a whole.

        `reset`: int64 rows that start a new instance before their events (what
        `recycle` does, in the same step: an admission is a reset and the first event);
        each must be terminal or still initial, else the step is refused.

        `known`: the event ids `events` holds (besides -1), as the caller knew them
        before building the tensor. When each is in `quiet_ids` (no terminal edge, no
        guard in its column) and no recorder or sink observes the machine, the step
        reads nothing back: an error cell still refuses the whole step, on the device,
        and is raised at the next read (see the module docstring). Give every id the
        tensor holds: one outside `known` that turns a row terminal refuses the step.

        Rejects the whole step, changing nothing, when any instance's event id is out of
        range (IndexError) or its (state, event) pair is an error or guarded
        (TransitionNotAllowed), naming the first such instance. A step that is not quiet
        reads one set of numbers back from the device; only newly-terminal rows cost
        more (their indices, and one read to group them by plan). Ignored events are
        counted in `machine.stats.ignored` only while a recorder or sink observes the
        machine (counting them costs a bincount per step).
        """
        if events.__class__ is _CheckedRuns:  # RunningBatch's runs: `step_runs`
            if reset is not None:
                raise ValueError(f"machine {self.machine.name!r}: _CheckedRuns carry their "
                                 "reset rows (_CheckedRuns(runs, reset=...)); pass no reset=")
            runs = cast("_CheckedRuns", events)
            return self._step_runs(runs, runs.reset, True)
        if isinstance(events, (list, tuple)) and events and all(
                isinstance(rd, Mapping) for rd in events):  # rounds by row: `step_rows`
            rows = self._check_rows(reset, "reset").tolist() if reset is not None else ()
            return self.step_rows(cast("Sequence[Mapping[int, int]]", events), rows)
        if isinstance(events, list) and events and all(
                isinstance(run, tuple) and len(run) == 2 for run in events):  # `step_runs`
            rows = self._check_rows(reset, "reset").tolist() if reset is not None else ()
            return self.step_runs(cast("list[tuple[Sequence[int], int]]", events), rows)
        self._check_events(events)
        assert isinstance(events, torch.Tensor)  # _check_events refused anything else
        if not self.n:
            return BatchStep(events.reshape(-1), events.reshape(-1))
        e_max = self._w - 3
        quiet = known is not None and self._known_quiet(known)
        rounds: list[torch.Tensor]
        if events.dim() == 2:
            if not events.shape[0] and reset is None:
                return BatchStep(self._empty, self._empty)
            rounds = list(events.clamp(-1, e_max))
        else:
            rounds = [events.clamp(-1, e_max)]
        if reset is not None:
            reset = self._check_rows(reset, "reset")
            if reset.numel():
                r0 = torch.full((self.n,), -1, dtype=torch.int64, device=self.device)
                rounds.insert(0, r0.index_fill_(0, reset, self._reset_id))
        if not rounds:
            return BatchStep(self._empty, self._empty)
        m = self.machine
        observed = m.observed
        if quiet and not observed:
            return self._step_quiet(rounds, events)
        base = self._base
        bases, packs = [], []
        last = len(rounds) - 1
        for j, ev in enumerate(rounds):
            # In place: the rounds are our clamped copies (an event is idx - base again).
            packed = self._packed.index_select(0, ev.add_(base))
            bases.append(base)
            packs.append(packed)
            # A rejected cell (negative) keeps the row where it was: the step is refused
            # below, and the gathers of later rounds stay in the table meanwhile.
            base = (packed & _BASE_MASK) if j == last else torch.where(
                packed < 0, base, packed & _BASE_MASK)
        cells = packs[0] if len(packs) == 1 else torch.cat(packs)
        reads = [*events.aminmax(), *cells.aminmax()]
        if self._bad is not None:
            reads.append(self._bad.long())
        got = _host(torch.stack(reads))
        if len(got) == 5:
            if got[4]:
                self._raise_deferred()
            self._clear_deferred()
        ev_lo, ev_hi, lo, hi = got[:4]
        if ev_lo < -1 or ev_hi > e_max:
            self._refuse_bad_ids(events.reshape(-1))
        if observed or lo < 0:
            rounds = [idx.sub_(b) for idx, b in zip(rounds, bases, strict=True)]
        if observed:
            self._observe(bases, rounds, packs, rejected=lo < 0)
        if lo < 0:
            for b, ev, packed in zip(bases, rounds, packs, strict=True):
                if len(packs) == 1 or _host((packed < 0).any()):
                    self._reject(b, ev, packed)
        self._base = base
        if not hi >> _NEWLY_SHIFT:
            return BatchStep(self._empty, self._empty)
        # A row turns terminal in one round at most (a terminal state has no way out):
        # its cell of that round says which plan releases it.
        newly = packs[0]
        for packed in packs[1:]:
            newly = torch.where((packed >> _NEWLY_SHIFT) & 1 == 1, packed, newly)
        return self._finish(newly)

    def step_rows(self, rounds: Sequence[Mapping[int, int]],
                  reset: Sequence[int] = ()) -> BatchStep:
        """`step` for a CPU batch, with the events given per row: round j delivers
        `rounds[j][row]` (an event id; rows absent take none), after the rows in `reset`
        start anew. The same step as `step` of the dense (rounds, n) tensor, decided on
        the host: a scheduler step names a few rows of many, and each torch call costs
        microseconds of fixed cost where a Python lookup costs tens of nanoseconds.

        The same checks and outcome: an id out of range (IndexError) or an error or
        guarded cell (TransitionNotAllowed, naming the first refused instance of the
        first round with one) refuses the whole step, changing nothing; decisions are
        counted and handed to sinks as `step` does; each plan runs once for the rows that
        turned terminal. Quiet steps not read yet are read first. A batch on another
        device takes `step` (a tensor built on the host would be copied there anyway).
        """
        m = self.machine
        if self.device.type != "cpu":
            raise ValueError(f"machine {m.name!r}: step_rows steps a CPU batch; this one is "
                             f"on {self.device}; build the events tensor and call step()")
        if self._bad is not None:
            self.check()
        n, e_max = self.n, self._w - 3
        plan: list[Mapping[int, int]] = list(rounds)
        if reset:
            plan.insert(0, dict.fromkeys(reset, self._reset_id))
        # Bad ids first, as `step` does: the first in (round, row) order is named.
        for j, rd in enumerate(plan):
            for r, e in rd.items():
                if not (isinstance(r, int) and 0 <= r < n):
                    if not isinstance(r, int):
                        raise TypeError(f"machine {m.name!r}: row {r!r} is a "
                                        f"{type(r).__name__}, not an int; pass rows as "
                                        "Python ints (rows.tolist(), int(r))")
                    raise IndexError(f"machine {m.name!r}: row {r!r} is out of range "
                                     f"0..{n - 1}; pass the rows of this batch")
                if not (-1 <= e <= e_max or (j == 0 and reset and e == self._reset_id)):
                    bad = min(q for q, x in rd.items() if not -1 <= x <= e_max)
                    raise IndexError(
                        f"machine {m.name!r}: event id {rd[bad]} at instance {bad} is out "
                        "of range; use Batch.event_ids() or -1 for no event")
        base_np = self._base.numpy()
        table = self._packed_list
        work: list[int] = base_np.tolist()  # every row's base, as the rounds move them
        cur: dict[int, int] = {}  # the rows moved: written back unless refused
        observed = m.observed
        sinks = bool(m.sinks)
        cells: list[int] = []  # every cell made, in order (counted when observed)
        bad_cells: list[int] = []  # the refused ones
        made: list[tuple[int, int, int, int]] = []  # (row, base, event, cell), for sinks
        refused: tuple[int, int, int, int] | None = None
        newly: list[tuple[int, int]] = []
        for rd in plan:
            first_bad: tuple[int, int, int, int] | None = None
            for r in sorted(rd):
                e = rd[r]
                if e < 0:
                    continue
                b = work[r]
                p = table[b + e]
                if observed:
                    cells.append(b + e)
                    if sinks:
                        made.append((r, b, e, p))
                if p < 0:
                    bad_cells.append(b + e)
                    if first_bad is None:
                        first_bad = (r, b, e, p)
                    continue  # a refused cell keeps the row where it was
                cur[r] = work[r] = p & _BASE_MASK
                if p >> _NEWLY_SHIFT & 1:
                    newly.append((r, (p >> _PLAN_SHIFT) - 1))
            if refused is None:
                refused = first_bad
        w = self._w
        if observed:
            # A refused step changes nothing: the only decisions made are its errors.
            self._record(Counter(bad_cells if refused is not None else cells).items())
            if sinks:
                kept = [x for x in made if x[3] < 0] if refused is not None else made
                self._to_sinks([(r, (b - 1) // w, e, p) for r, b, e, p in kept])
        if refused is not None:
            r, b, e, p = refused
            raise self._refusal(r, (b - 1) // w, e, p)
        if cur:
            base_np[list(cur)] = list(cur.values())
        return self._retire_rows(newly)

    def step_runs(self, runs: Sequence[tuple[Sequence[int], int]],
                  reset: Sequence[int] = ()) -> BatchStep:
        """`step_rows` with the events given as runs: `runs[k] = (rows, e)` delivers the
        event id `e` to each of `rows` (Python ints; -1: none), and a row takes its
        events in the order of the runs that name it (its j-th event in round j of
        `step_rows`), after the rows in `reset` start anew. A scheduler queues one event
        class for many rows at a time: a run is checked as a whole (C builtins over its
        list), then its rows' cells are looked up by two list comprehensions, with no
        per-row bookkeeping of rounds (about a fifth less time than queueing rounds and
        `step_rows` on the simulator's steps).

        The same step as `step_rows` of those rounds: states, terminal rows and plan
        ids, plans run, recorder and ignored counts. A step that is refused, or that
        names a row out of range, an id out of range or one row twice in a run, or
        whose machine has sinks (records in round order), is `step_rows` of those rounds
        itself: the same error naming the same instance, the same records, nothing
        changed. `runs` may be any iterable of pairs (it is read once, into a list, when
        it is not a list or tuple).
        """
        if runs.__class__ is not list and runs.__class__ is not tuple:
            runs = list(runs)  # a generator's runs: the step reads them more than once
        return Batch._step_runs(self, runs, reset, False)

    def _step_runs(self, runs: Sequence[tuple[Sequence[int], int]], reset: Sequence[int],
                   rows_checked: bool) -> BatchStep:
        """`step_runs`; `rows_checked`: the caller made every row of `runs` and `reset` a
        Python int in 0..n-1 already (`RunningBatch.queue` and `admit` do), so a run's
        rows are not checked for that again (a row twice in a run still is: it takes
        two rounds, as `step_rows` decides)."""
        m = self.machine
        if self.device.type != "cpu":
            raise ValueError(f"machine {m.name!r}: step_runs steps a CPU batch; this one is "
                             f"on {self.device}; build the events tensor and call step()")
        if m.sinks:
            return self._runs_by_rounds(runs, reset)
        if self._bad is not None:
            self.check()
        table = self._packed_list
        base_np = self._base.numpy()
        if _NP_RUN is not None:
            try:
                big = any(len(rows) > _NP_RUN for rows, _ in runs)
            except TypeError:  # not runs of rows: named by the loop below
                big = False
            if big:
                return self._step_runs_np(runs, reset, rows_checked, base_np)
        work: list[int] = base_np.tolist()  # every row's base, as the runs move them
        cells: list[int] = []  # every cell made (counted when observed)
        newly: list[tuple[int, int]] = []
        todo: Iterable[tuple[Sequence[int], Any]] = runs
        if reset:
            todo = [(reset, _RESET), *runs]
        for rows, e in todo:
            try:
                k = len(rows)
            except TypeError:  # not a list of rows: named by _runs_by_rounds
                return self._runs_by_rounds(runs, reset)
            if not k:
                continue
            e = self._run_event(rows, e, k, rows_checked)
            if e is None:  # unusual: step_rows' to refuse or decide, changing nothing
                return self._runs_by_rounds(runs, reset)
            if e < 0:
                continue
            if k == 1:  # one row (common): no comprehension (a frame each) to run
                r = rows[0]
                c = work[r] + e
                p = table[c]
                if p < 0:  # refused: step_rows names it and records the errors
                    return self._runs_by_rounds(runs, reset)
                work[r] = p & _BASE_MASK
                cells.append(c)
                if p >> _NEWLY_SHIFT & 1:
                    newly.append((r, (p >> _PLAN_SHIFT) - 1))
                continue
            # (map over operator.itemgetter and list.__setitem__ runs fewer opcodes
            # but takes longer: a slot wrapper's call per row costs more than a
            # comprehension's loop.)
            made = [work[r] + e for r in rows]
            packs = [table[c] for c in made]
            lo, hi = min(packs), max(packs)
            if lo < 0:  # refused: step_rows names it and records the errors
                return self._runs_by_rounds(runs, reset)
            for r, p in zip(rows, packs, strict=True):
                work[r] = p & _BASE_MASK
            cells += made
            if hi >> _NEWLY_SHIFT:
                newly += [(r, (p >> _PLAN_SHIFT) - 1) for r, p in zip(rows, packs, strict=True)
                          if p >> _NEWLY_SHIFT & 1]
        if m.observed and cells:
            self._record(Counter(cells).items())
        if cells:
            base_np[:] = work
        # A row turns terminal once in a step at most (a terminal state has no way out).
        return self._retire_rows(newly)

    def _run_event(self, rows: Sequence[int], e: Any, k: int,
                   rows_checked: bool) -> int | None:
        """The event id a run of `k` (> 0) `rows` delivers (-1: none; `_RESET`: the
        reset event's), or None for anything unusual (an id or a row out of range, a row
        twice, rows that are not plain ints; `rows_checked`: the caller made the rows
        ints in range), which `step_rows` is to refuse or decide (`_runs_by_rounds`)."""
        if e.__class__ is not int or not -1 <= e <= self._w - 3:
            if e is not _RESET:
                return None
            e = self._reset_id
        if (not rows_checked and (set(map(type, rows)) != _INT or min(rows) < 0
                                  or max(rows) >= self.n)) or len(set(rows)) != k:
            return None
        return e

    def _step_runs_np(self, runs: Sequence[tuple[Sequence[int], int]], reset: Sequence[int],
                      rows_checked: bool, base_np: np.ndarray) -> BatchStep:
        """`_step_runs` of a step with a long run (see `_NP_RUN`): the same checks, cells,
        terminal rows and refusals, the rows' bases moved in a numpy copy of the batch's
        (a long run's with numpy operations, a short run's row by row), written back
        once the whole step is decided."""
        m = self.machine
        table = self._packed_list
        table_np = self._packed.numpy()  # (a CPU batch: the same table as the list)
        work = base_np.copy()
        cells: list[int] = []
        newly: list[tuple[int, int]] = []
        todo: Iterable[tuple[Sequence[int], Any]] = runs
        if reset:
            todo = [(reset, _RESET), *runs]
        for rows, e in todo:
            try:
                k = len(rows)
            except TypeError:
                return self._runs_by_rounds(runs, reset)
            if not k:
                continue
            e = self._run_event(rows, e, k, rows_checked)
            if e is None:  # unusual: step_rows' to refuse or decide, changing nothing
                return self._runs_by_rounds(runs, reset)
            if e < 0:
                continue
            if k <= _NP_VEC:
                for r in rows:
                    c = work.item(r) + e
                    p = table[c]
                    if p < 0:  # refused: step_rows names it and records the errors
                        return self._runs_by_rounds(runs, reset)
                    work[r] = p & _BASE_MASK
                    cells.append(c)
                    if p >> _NEWLY_SHIFT & 1:
                        newly.append((r, (p >> _PLAN_SHIFT) - 1))
                continue
            at = np.array(rows, dtype=np.int64)  # distinct rows in range (checked above)
            made = work[at]
            made += e
            packs = table_np[made]
            # One reduction tells both: a refused cell is negative (its sign bit set in
            # the OR), a terminal one has its newly bit set.
            acc = int(np.bitwise_or.reduce(packs))
            if acc < 0:  # refused: step_rows names it and records the errors
                return self._runs_by_rounds(runs, reset)
            work[at] = packs & _BASE_MASK
            cells += made.tolist()
            if acc >> _NEWLY_SHIFT & 1:
                hit = np.flatnonzero((packs >> _NEWLY_SHIFT) & 1)
                newly += zip(at[hit].tolist(), ((packs[hit] >> _PLAN_SHIFT) - 1).tolist(),
                             strict=True)
        if m.observed and cells:
            self._record(Counter(cells).items())
        if cells:
            base_np[:] = work
        return self._retire_rows(newly)

    def _runs_by_rounds(self, runs: Sequence[tuple[Sequence[int], int]],
                        reset: Sequence[int]) -> BatchStep:
        """`step_rows` of the runs' rounds, once each run is checked for its shape: the
        rows a sequence of ints, the event an int id (a bad one would fail inside with
        Python's bare TypeError, naming neither the run nor what to pass)."""
        m = self.machine
        for k, run in enumerate(runs):
            rows, e = run
            ok_rows = not isinstance(rows, (str, bytes, Mapping)) and hasattr(
                rows, "__iter__") and all(isinstance(r, int) for r in rows)
            if not ok_rows or not isinstance(e, int):
                raise TypeError(
                    f"machine {m.name!r}: Batch.step_runs takes runs (rows, event id): "
                    f"run {k} is {run!r}; rows are a list of row ints and the event an "
                    "id from Batch.event_id(...) or machine.event_id(Cls) (-1 for none)")
        return self.step_rows(rounds_of(runs), reset)

    def _retire_rows(self, newly: list[tuple[int, int]]) -> BatchStep:
        """The outcome of a host-decided step whose rows `newly` (row, plan id) turned
        terminal (sorted here, in place, into row order): each plan run once for its
        rows."""
        if not newly:
            return BatchStep(self._empty, self._empty)
        m = self.machine
        newly.sort()
        rows = np.array([r for r, _ in newly], dtype=np.int64)
        pids = np.array([q for _, q in newly], dtype=np.int64)
        result = BatchStep(torch.from_numpy(rows), torch.from_numpy(pids))
        if self._plans:
            # The rows by plan (each group in row order), as `BatchStep.by_plan` makes.
            names = ("", *m.plan_names)
            groups: dict[int, list[int]] = {}
            for r, q in newly:
                groups.setdefault(q, []).append(r)
            self._run_plans(result, {
                names[q + 1]: result.terminal if len(g) == len(newly) else
                torch.from_numpy(np.array(g, dtype=np.int64))
                for q, g in sorted(groups.items())})
        return result

    def _known_quiet(self, known: Collection[int]) -> bool:
        """Whether `known` (the ids a step's tensor holds) are all quiet; an id out of
        range is refused here, before anything is built."""
        quiet = self._quiet
        e_max = self._w - 3
        ok = True
        for e in known:
            if e == -1:
                continue
            if not (isinstance(e, int) and -1 <= e <= e_max):
                raise IndexError(
                    f"machine {self.machine.name!r}: known= holds event id {e!r}, out of "
                    f"range -1..{e_max}; pass the ids the events tensor holds")
            if e not in quiet:
                ok = False
        return ok

    def _check_rows(self, rows: Any, what: str) -> torch.Tensor:
        if not isinstance(rows, torch.Tensor) or rows.dtype != torch.int64 \
                or rows.dim() != 1 or rows.device != self.device:
            raise ValueError(
                f"machine {self.machine.name!r}: {what}= takes a 1-D int64 tensor of row "
                f"indices on {self.device}, got {rows!r}; build it with torch.tensor(rows, "
                "dtype=torch.int64)")
        return rows

    def _step_quiet(self, rounds: list[torch.Tensor], events: torch.Tensor) -> BatchStep:
        """A step no row can leave quiet (see `step`): applied on the device with no read;
        an error cell or an event id out of range (`events`, before the rounds were
        clamped) sets the sticky flag, and a flagged step changes nothing."""
        if len(self._log) >= _MAX_UNCHECKED_STEPS or self._log_ids >= _MAX_UNCHECKED_IDS:
            self.check()  # bound the evidence kept: one read every so many quiet steps
        base = self._base
        idxs = []
        packs = []
        top = self._packed.numel() - 1
        for j, ev in enumerate(rounds):
            idx = ev.add_(base)  # the round's ids are ours (clamped copies): in place
            if j:
                idx.clamp_(0, top)  # after a bad cell the base is junk: stay in the table
            packed = self._packed.index_select(0, idx)
            idxs.append(idx)
            packs.append(packed)
            base = packed & _BASE_MASK
        cells = packs[0] if len(packs) == 1 else torch.cat(packs)
        # An error or guarded cell is negative; an edge into a terminal state (an id
        # outside `known`) has bit 40 or above: either refuses the step.
        lo, hi = cells.aminmax()  # one pass, nothing as large as the step allocated
        ev_lo, ev_hi = events.aminmax()
        bad_ids = ev_lo.lt(-1).logical_or_(ev_hi.gt(self._w - 3))
        bad = lo.lt(0).logical_or_(hi.ge(1 << _NEWLY_SHIFT)).logical_or_(bad_ids)
        if self._bad is not None:
            bad = bad.logical_or_(self._bad)
        self._base = torch.where(bad, self._base, base)
        self._bad = bad
        self._log.append((bad_ids, events, idxs))
        self._log_ids += sum(i.numel() for i in idxs)
        return BatchStep(self._empty, self._empty)

    def check(self) -> None:
        """Read the quiet steps' sticky flag (one read; none when there is none): raise
        the deferred `TransitionNotAllowed` of the first refused one. The batch is as it
        was before that step (no later step changed anything), and usable again."""
        if self._bad is None:
            return
        if _host(self._bad):
            self._raise_deferred()
        self._clear_deferred()

    def _clear_deferred(self) -> None:
        self._bad = None
        self._log = []
        self._log_ids = 0

    def _raise_deferred(self) -> None:
        """Name the first refused quiet step's first bad cell, then forget the log."""
        m = self.machine
        log, later = self._log, 0
        self._clear_deferred()
        for k, (bad_ids, events, idxs) in enumerate(log):
            if _host(bad_ids):
                later = len(log) - k - 1
                try:
                    self._refuse_bad_ids(events.reshape(-1))
                except IndexError as e:
                    raise IndexError(
                        f"{e} (a quiet step, refused on the device and reported at this "
                        f"read; it and the {later} quiet step(s) after it changed nothing)"
                    ) from None
            for idx in idxs:
                packed = self._packed.index_select(0, idx)
                bad = (packed >> _NEWLY_SHIFT) != 0
                if not _host(bad.any()):
                    continue
                i = _host(bad.nonzero()[0, 0])
                cell, p = _host(torch.stack((idx[i], packed[i])))
                s, col = divmod(cell, self._w)
                later = len(log) - k - 1
                event = "<recycle>" if col == self._w - 1 else m.event_names[col - 1]
                if p == -1 and col == self._w - 1:
                    why = ("only a terminal (or still initial) row can start a new "
                           "instance; finish or abort the live one first")
                elif p == -1:
                    why = "the declaration makes it an error here"
                elif p == -2:
                    why = "the cell is guarded, and guards run only on scalar instances"
                else:
                    why = ("the step's known= ids cannot turn a row terminal, yet this "
                           "cell does: pass every event id the tensor holds")
                raise TransitionNotAllowed(
                    m.name, m.states[s], event,
                    f"{why} (a quiet step, refused on the device and reported at this "
                    f"read; it and the {later} quiet step(s) after it changed nothing)",
                    instance=i)
        raise AssertionError("the refusal flag was set but no refused cell was found")

    def _finish(self, packed: torch.Tensor) -> BatchStep:
        terminal = ((packed >> _NEWLY_SHIFT) & 1).nonzero().squeeze(1)
        result = BatchStep(terminal, (packed.index_select(0, terminal) >> _PLAN_SHIFT) - 1)
        if self._plans:
            self._run_plans(result)
        return result

    def _refuse_bad_ids(self, events: torch.Tensor) -> None:
        flat = _host(((events < -1) | (events > self._w - 3)).nonzero()[0, 0])
        i = flat % self.n
        raise IndexError(
            f"machine {self.machine.name!r}: event id {_host(events[flat])} at instance {i} "
            "is out of range; use Batch.event_ids() or -1 for no event")

    def _reject(self, base: torch.Tensor, events: torch.Tensor, packed: torch.Tensor) -> None:
        i = _host((packed < 0).nonzero()[0, 0])
        s, e, p = _host(torch.stack(((base[i] - 1) // self._w, events[i], packed[i])))
        raise self._refusal(i, s, e, p)

    def _refusal(self, i: int, s: int, e: int, p: int) -> TransitionNotAllowed:
        """The error for instance `i` in state `s` refused event id `e` (cell code `p`:
        -1 an error cell, else a guarded one; `e` the reset id: a live row restarted)."""
        m = self.machine
        if e == self._reset_id:
            return TransitionNotAllowed(
                m.name, m.states[s], "<recycle>",
                "only a terminal (or still initial) row can start a new instance; "
                "finish or abort the live one first", instance=i)
        reason = ("the declaration makes it an error here" if p == -1 else
                  "the cell is guarded, and guards run only on scalar instances: fire "
                  "this event on an Instance")
        return TransitionNotAllowed(m.name, m.states[s], m.event_names[e], reason,
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
        self._record(enumerate(counts))
        if m.sinks:
            rows = made.nonzero().squeeze(1)
            states = _host(torch.div(base.index_select(0, rows) - 1, self._w,
                                     rounding_mode="floor"))
            evs = _host(ev.index_select(0, rows))
            codes = _host(packed.index_select(0, rows))
            n = self.n
            self._to_sinks([(flat_i % n, s, e, p) for flat_i, s, e, p in
                            zip(_host(rows), states, evs, codes, strict=True)])

    def _record(self, counts: Iterable[tuple[int, int]]) -> None:
        """Count decisions, given as (flat cell, count): the recorder's counts per cell
        and `stats.ignored` (cell 0, no event, and the hidden "start anew" column are
        skipped)."""
        m = self.machine
        # Each flat cell has its own key (see `_cell_keys`): a plain dict sums nothing.
        by_cell: dict[tuple[int, int, int], int] = {}
        keys, ignored = self._cell_keys, self._cell_ignored
        for flat, count in counts:
            if not count:
                continue
            key = keys[flat]
            if key is None:  # no event, or the hidden "start anew"
                continue
            by_cell[key] = count
            what = ignored[flat]
            if what is not None:
                m.stats.ignored[what] += count
        rec = _obs.recorder()
        if rec is not None and by_cell:
            rec.record_counts(m, by_cell)

    def _to_sinks(self, made: list[tuple[int, int, int, int]]) -> None:
        """Hand the sinks a record of each (instance, state, event, cell) made, in order
        (the hidden "start anew" event is not a transition of the declaration)."""
        m = self.machine
        decision = self._decision
        for i, s, e, p in made:
            if e == self._reset_id:
                continue
            t = ((p & _BASE_MASK) - 1) // self._w if p >= 0 else s
            d = decision[s * self._w + e + 1]
            plan_id = (p >> _PLAN_SHIFT) - 1
            r = _obs.TransitionRecord(
                m.name, i, m.states[s], m.event_names[e], m.states[t],
                DECISIONS[d] if p >= 0 else "error",
                m.plan_names[plan_id] if plan_id >= 0 else None, time.monotonic())
            for sink in m.sinks:
                sink(r)

    def _run_plans(self, result: BatchStep,
                   by_plan: dict[str, torch.Tensor] | None = None) -> None:
        m = self.machine
        reports: list[PlanReport] = []
        if by_plan is None:
            by_plan = result.by_plan(m)
        for name, rows in by_plan.items():
            plan = self._plans.get(name)
            if plan is None:  # an edge without a plan: nothing to run
                continue
            report = PlanReport(m.name, self, name)
            with release_context(m.name, self, None, name, "*", "*", m.ledger,
                                 rows) as ctx:
                plan.run_actions(ctx, report)
            m.stats._plans_run[name] += int(rows.numel())  # (the property folds first)
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
        can never skip a release. A quiet step's deferred refusal is raised first
        (`check()`), with nothing recycled.
        """
        if self._bad is not None:
            self.check()
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
