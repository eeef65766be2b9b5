"""Release plans: ordered steps run by the engine on a transition into a terminal state.

A release effect is a function decorated with `@release_effect`. Its first argument
must be the `ReleaseContext` that the engine creates while it runs a terminal
transition and invalidates right after, so an effect cannot run anywhere else (I1)::

    @release_effect
    def free_kv(ctx, handle):
        ctx.resources.kv.free(handle.value)

    PLANS = {"release_aborted": Plan(
        Action(sender_abort, best_effort=True),   # I5: its failure never skips the rest
        Release("metadata"),                      # the kind's default releaser
        Release("kv", free_kv),
        Action(stream_abort),
    )}

`Release(kind)` runs once per handle of that kind that the instance owns at that moment
(never on "is this field None"); after the last step, handles the plan did not name are
released by their kind's default releaser, so a plan can order releases but cannot
forget one. Every step runs even when an earlier one raised; the errors are reported.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Awaitable, Callable
from operator import attrgetter
from typing import Any, TypeVar

import msgspec

from .errors import FsmError, ReleaseOutsideTerminal

F = TypeVar("F", bound=Callable[..., Any])


class _Edge:
    """What a release context says about its edge, shared by every plan run over it: the
    engine makes one per terminal edge at its first compiled run, so opening a context
    stores four fields (edge, live, event, instance), not ten."""

    __slots__ = ("_holds", "ledger", "machine", "plan", "rows", "source", "target")

    def __init__(self, machine: str, plan: str, source: str, target: str, ledger: Any,
                 rows: Any = None) -> None:
        self.machine = machine
        self.plan = plan
        self.source = source
        self.target = target
        self.ledger = ledger
        self.rows = rows
        # What `ReleaseContext.resources` reads `.resources` of (effects read it in every
        # step): the ledger, or a stand-in whose resources are None.
        self._holds = _NO_LEDGER if ledger is None else ledger


class _NoLedger:
    """`_Edge._holds` of an edge without a ledger."""

    __slots__ = ()
    resources = None


_NO_LEDGER = _NoLedger()


class ReleaseContext:
    """The capability to run release effects; created by the engine, live for one plan.

    Fields: `machine` (name), `instance`, `event` (the event that caused the terminal
    transition, None for a late release), `plan` (name), `source` and `target` (state
    names), `ledger` (the machine's `Ledger`, or None), `resources` (whatever the ledger
    was given, for effects), and `rows` (for a batched plan, the int64 indices of the
    rows that took an edge running it in this step; None for a scalar instance).

    Only the engine makes one, through `release_context()` (or, on its compiled
    terminal paths, `_made()` and the stores of `_open()` itself); calling the class
    raises `ReleaseOutsideTerminal`.
    """

    # What effects read in every step is a slot (the interpreter's quickest read:
    # `resources` stored when the context is opened, `target` and `ledger` when it is
    # made for its edge); the rest is read through C getters below.
    __slots__ = ("_edge", "_live", "event", "instance", "ledger", "resources", "target")

    _edge: _Edge
    _live: bool
    event: Any
    instance: Any
    ledger: Any
    """The machine's `Ledger`, or None."""
    resources: Any
    """The resources object given to the ledger (`Ledger(resources=...)`)."""
    target: str
    """The terminal state it entered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ReleaseOutsideTerminal("ReleaseContext()")

    # The other fields are read through C getters (`operator.attrgetter`): a getter of
    # this kind runs no Python frame, where a `def` property runs one per read.
    live = property(attrgetter("_live"),
                    doc="True while the engine is running the plan this context was made for.")
    machine = property(attrgetter("_edge.machine"), doc="The machine's name.")
    plan = property(attrgetter("_edge.plan"), doc="The plan's name.")
    source = property(attrgetter("_edge.source"),
                      doc="The state the terminal transition left.")
    rows = property(attrgetter("_edge.rows"),
                    doc="For a batched plan, the int64 indices of its rows in this step; "
                        "else None.")

    def __enter__(self) -> ReleaseContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self._live = False  # closed here, for every way a release block ends

    def __repr__(self) -> str:
        e = self._edge
        return (f"ReleaseContext({e.machine}:{e.source}->{e.target}, "
                f"plan={e.plan!r}, live={self._live})")


_new = object.__new__


def _made(edge: _Edge) -> ReleaseContext:
    """A new context over `edge`, not live (engine only): what it says of its edge is
    stored once; `_open` (or a compiled terminal step reusing it) opens it."""
    ctx: ReleaseContext = _new(ReleaseContext)
    ctx._edge = edge
    ctx.target = edge.target
    ctx.ledger = edge.ledger
    ctx._live = False
    return ctx


def _open(instance: Any, event: Any, edge: _Edge) -> ReleaseContext:
    """A live context over `edge` (engine only; the machine inlines these stores on its
    terminal fast path)."""
    ctx = _made(edge)
    ctx.resources = edge._holds.resources
    ctx._live = True
    ctx.instance = instance
    ctx.event = event
    return ctx


def release_context(machine: str, instance: Any, event: Any, plan: str, source: str,
                    target: str, ledger: Any, rows: Any = None) -> ReleaseContext:
    """The one place a `ReleaseContext` is opened (engine only); use it as
    `with release_context(...) as ctx:`.

    The machine (a terminal transition), the ledger (a late release) and a batch (a
    batched plan) run their release steps inside it; the context is dead once the block
    ends, whatever it raised (`ReleaseContext.__exit__`), so an effect that kept it
    cannot run later (I1).
    """
    return _open(instance, event, _Edge(machine, plan, source, target, ledger, rows))


def release_effect(fn: F) -> F:
    """Mark `fn(ctx, ...)` as a release effect: it runs only with a live ReleaseContext.

    Calling it with anything else raises `ReleaseOutsideTerminal` before `fn` runs.
    """

    @functools.wraps(fn)
    def guarded(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        if type(ctx) is not ReleaseContext or not ctx._live:
            raise ReleaseOutsideTerminal(getattr(fn, "__qualname__", repr(fn)))
        return fn(ctx, *args, **kwargs)

    guarded.__terminus_release__ = True  # type: ignore[attr-defined]
    # The engine, which holds the live context it just opened, calls `fn` itself
    # (`unwrapped`); the pair names this very wrapper, so another decorator that copied
    # the attribute with functools.wraps is never skipped.
    guarded.__terminus_raw__ = (guarded, fn)  # type: ignore[attr-defined]
    return guarded  # type: ignore[return-value]


def unwrapped(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The function a `@release_effect` wraps, for the engine to call inside a context it
    holds live; anything else (another decorator around it, a plain function) as is."""
    raw = getattr(fn, "__terminus_raw__", None)
    if type(raw) is tuple and len(raw) == 2 and raw[0] is fn:
        return raw[1]
    return fn


def is_release_effect(fn: Any) -> bool:
    """True for functions decorated with `@release_effect`."""
    return bool(getattr(fn, "__terminus_release__", False))


def require_effect(fn: Any, what: str) -> None:
    """Raise TypeError naming `what` unless `fn` is decorated with `@release_effect`."""
    if not is_release_effect(fn):
        raise TypeError(
            f"{what} {getattr(fn, '__qualname__', fn)!r} is not a release effect; "
            "decorate it with @terminus.fsm.release_effect so it can only run inside a terminal "
            "transition"
        )


class Action:
    """A plan step that runs `fn(ctx)` once (stream the terminal output, notify a peer).

    `best_effort=True` marks a step that talks to the outside (I5): when it raises, the
    error is recorded and the following steps still run.
    """

    __slots__ = ("_raw", "best_effort", "fn", "name")

    def __init__(self, fn: Callable[..., Any], *, best_effort: bool = False,
                 name: str | None = None) -> None:
        require_effect(fn, "Action step")
        self.fn = fn
        self._raw = unwrapped(fn)  # what `Plan.run_actions` calls inside a live context
        self.best_effort = best_effort
        self.name: str = name or str(getattr(fn, "__name__", "action"))

    def __repr__(self) -> str:
        return f"Action({self.name}{', best_effort' if self.best_effort else ''})"


class Release:
    """A plan step that releases every handle of `kind` the instance owns, in order.

    `fn(ctx, handle)` overrides the kind's default releaser for this plan (a successful
    request inserts its KV into the prefix cache; an aborted one frees it).
    """

    __slots__ = ("best_effort", "fn", "kind", "name")

    def __init__(self, kind: str, fn: Callable[..., Any] | None = None, *,
                 best_effort: bool = False) -> None:
        if fn is not None:
            require_effect(fn, f"Release({kind!r}) step")
        self.kind = kind
        self.fn = fn
        self.best_effort = best_effort
        self.name = f"release {kind}" + (f" via {fn.__name__}" if fn is not None else "")

    def __repr__(self) -> str:
        return f"Release({self.kind!r}{', ' + self.fn.__name__ if self.fn else ''})"


Step = Action | Release


class Plan:
    """An ordered list of steps; see the module docstring."""

    __slots__ = ("steps",)

    def __init__(self, *steps: Step) -> None:
        for s in steps:
            if not isinstance(s, (Action, Release)):
                raise TypeError(f"plan step {s!r} is neither an Action nor a Release")
        self.steps = steps

    def run_actions(self, ctx: ReleaseContext, report: PlanReport) -> None:
        """Run the plan's steps in order where no ledger is involved (a machine bound
        without one, a batched plan): every step is an `Action`, called `fn(ctx)`.

        A step whose turn comes while `ctx` is an engine context and live calls the
        function its `@release_effect` wraps (the wrapper's own check, done here per
        step); any other way it calls the wrapper, which refuses the context
        (`ReleaseOutsideTerminal`, reported against the step)."""
        engine = type(ctx) is ReleaseContext
        for step in self.steps:
            assert isinstance(step, Action), "Release steps need a ledger (Ledger.run_plan)"
            call_step(step._raw if engine and ctx._live else step.fn, (ctx,), report,
                      step.name, step.best_effort)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The handle kinds this plan releases explicitly, in order."""
        return tuple(s.kind for s in self.steps if isinstance(s, Release))

    def __repr__(self) -> str:
        return f"Plan{self.steps!r}"


EMPTY_PLAN = Plan()


class EffectError(FsmError):
    """A step of a release plan raised. `error` is what it raised (also `__cause__`)."""

    def __init__(self, machine: str, plan: str, step: str, best_effort: bool,
                 error: BaseException) -> None:
        self.machine = machine
        self.plan = plan
        self.step = step
        self.best_effort = best_effort
        self.error = error
        kind = "best-effort step" if best_effort else "step"
        try:
            text = str(error)
        except Exception:  # (an error whose str() raises must not stop the plan's steps)
            text = f"<{type(error).__name__} object: its str() raised>"
        super().__init__(
            f"machine {machine!r}, plan {plan!r}: {kind} {step!r} raised "
            f"{type(error).__name__}: {text}"
        )
        self.__cause__ = error


class PlanReport(msgspec.Struct, eq=False):
    """What one run of a release plan did: `released` (the `Handle`s it released, in
    order), `errors` (the step errors), `tasks` (async steps still running).

    A msgspec Struct: built in C, once per terminal transition. The three lists are
    made on first use (most plans release one handle, raise nothing and start no task:
    the engine builds the report with that handle bare, `_released`).
    """

    machine: str
    instance: Any
    plan: str
    _released: Any = None  # None, one Handle, or the list `released` returns
    _errors: list[EffectError] | None = None
    _tasks: list[asyncio.Future[Any]] | None = None

    @property
    def released(self) -> list[Any]:
        """The handles the plan released, in order."""
        released = self._released
        if released is None:
            released = self._released = []
        elif released.__class__ is not list:
            released = self._released = [released]
        return released

    @property
    def errors(self) -> list[EffectError]:
        """The errors of the steps that raised, in order."""
        errors = self._errors
        if errors is None:
            errors = self._errors = []
        return errors

    @property
    def tasks(self) -> list[asyncio.Future[Any]]:
        """The async steps started, as tasks on the running loop."""
        tasks = self._tasks
        if tasks is None:
            tasks = self._tasks = []
        return tasks

    @property
    def ok(self) -> bool:
        """True when no step raised (best-effort ones included)."""
        return not self._errors

    def __repr__(self) -> str:
        return (f"PlanReport({self.machine}:{self.plan}, released={len(self.released)}, "
                f"errors={len(self._errors or ())}, tasks={len(self._tasks or ())})")


def call_step(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    report: PlanReport,
    step: str,
    best_effort: bool,
) -> asyncio.Future[Any] | None:
    """Run one step and record its error. An async result becomes a task, listed in
    `report.tasks` and returned, for the caller (the ledger) to keep referenced."""
    try:
        res = fn(*args)
    except Exception as e:  # every step runs; the error is reported, never swallowed
        report.errors.append(EffectError(report.machine, report.plan, step, best_effort, e))
        return None
    if res is None:
        return None
    return step_result(res, report, step, best_effort)


def step_result(res: Any, report: PlanReport, step: str,
                best_effort: bool) -> asyncio.Future[Any] | None:
    """What a step returned (not None): an awaitable becomes a task on the running loop
    (listed in `report.tasks` and returned), anything else is ignored."""
    if not inspect.isawaitable(res):
        return None
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError as e:
        if inspect.iscoroutine(res):
            res.close()  # never awaited: say so here, not as a warning at collection
        report.errors.append(EffectError(
            report.machine, report.plan, step, best_effort,
            RuntimeError(f"{e}: an async release step needs a running event loop; fire "
                         "the terminal event from a coroutine, or make the step sync")))
        return None
    task = loop.create_task(_as_coro(res))
    report.tasks.append(task)
    return task


async def _as_coro(aw: Awaitable[Any]) -> Any:
    return await aw
