"""Release plans and their steps, read from outside: the context a step runs in, what a
failing step's error carries, how a step's result is handled, and the messages of
refused declarations.

Written against the survivors of `make mutants` (README, "Test strength"): each test
states a behaviour that a plausible slip in `fsm/plan.py` would break.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import warnings
from typing import Any

import pytest

from terminus.fsm import (
    Action,
    Ledger,
    Plan,
    Release,
    ReleaseContext,
    ReleaseFailed,
    ReleaseOutsideTerminal,
    release_effect,
)
from terminus.kernels import TokenKVAllocator
from tests.engine_paths import engine_path  # noqa: F401  (a fixture)
from tests.lifecycle import LIFECYCLE, Abort, Start

pytestmark = pytest.mark.usefixtures("engine_path")


class Pools:
    def __init__(self) -> None:
        self.kv = TokenKVAllocator(64, strict=True)


@release_effect
def free_kv(ctx, handle):
    ctx.resources.kv.free(handle.value)


@pytest.fixture
def pools():
    p = Pools()
    yield p
    p.kv.assert_full()


@pytest.fixture
def ledger(pools):
    led = Ledger({"kv": free_kv}, resources=pools)
    yield led
    led.assert_empty()


def bind(ledger, aborted: Plan) -> Any:
    return LIFECYCLE.bind({"release_aborted": aborted, "release_finished": Plan()}, ledger)


# -- the context a step runs in ------------------------------------------------------


def test_a_step_sees_the_machine_event_plan_and_edge_of_its_terminal_transition(pools,
                                                                                 ledger):
    seen: list[tuple[Any, ...]] = []
    kept: list[ReleaseContext] = []

    @release_effect
    def record(ctx):
        seen.append((ctx.machine, ctx.instance, ctx.event, ctx.plan, ctx.source, ctx.target,
                     ctx.ledger, ctx.resources, ctx.rows, ctx.live))
        kept.append(ctx)

    m = bind(ledger, Plan(Action(record)))
    job = m.create("r")
    job.fire(Start())
    abort = Abort()
    job.fire(abort)
    assert seen == [("lifecycle", job, abort, "release_aborted", "prefilling", "aborted",
                     ledger, pools, None, True)]
    assert kept[0].live is False
    assert repr(kept[0]) == ("ReleaseContext(lifecycle:prefilling->aborted, "
                             "plan='release_aborted', live=False)")


def test_a_release_context_cannot_be_made_outside_the_engine():
    with pytest.raises(ReleaseOutsideTerminal) as info:
        ReleaseContext(object(), "lifecycle", None, None, "p", "a", "b", None)
    assert info.value.effect == "ReleaseContext()"


# -- a failing step: what its error carries ------------------------------------------


def test_a_failing_step_error_names_machine_plan_and_step_and_chains_the_cause(pools,
                                                                              ledger):
    boom = RuntimeError("stream closed")

    @release_effect
    def stream(ctx):
        raise boom

    m = bind(ledger, Plan(Action(stream)))
    job = m.create("r")
    with pytest.raises(ReleaseFailed) as info:
        job.fire(Abort())
    (err,) = info.value.exceptions
    assert (err.machine, err.plan, err.step, err.best_effort, err.error) == (
        "lifecycle", "release_aborted", "stream", False, boom)
    assert err.__cause__ is boom
    assert str(err) == ("machine 'lifecycle', plan 'release_aborted': step 'stream' raised "
                        "RuntimeError: stream closed")
    ledger.errors.clear()


def test_a_failing_default_release_step_is_named_after_its_kind(pools, ledger):
    @release_effect
    def broken(ctx, handle):
        ctx.resources.kv.free(handle.value)
        raise RuntimeError("gone")

    failing = Ledger({"kv": broken}, resources=pools)
    m = bind(failing, Plan(Release("kv")))
    job = m.create("r")
    failing.acquire(job, "kv", pools.kv.alloc(2))
    with pytest.raises(ReleaseFailed) as info:
        job.fire(Abort())
    assert [e.step for e in info.value.exceptions] == ["release kv"]
    failing.assert_empty()


def test_a_failing_action_of_a_machine_without_a_ledger_is_named_after_the_action():
    @release_effect
    def notify(ctx):
        raise ConnectionError("peer gone")

    m = LIFECYCLE.bind({"release_aborted": Plan(Action(notify, best_effort=True)),
                        "release_finished": Plan()})
    report = m.create("r").fire(Abort())
    assert [(e.step, e.best_effort) for e in report.errors] == [("notify", True)]
    assert "best-effort step 'notify' raised ConnectionError: peer gone" in str(
        report.errors[0])


def _actions_log(through_wrappers: bool, closing: int | None, dead: bool) -> tuple[Any, ...]:
    """A plan of Actions on a machine without a ledger, run by `Plan.run_actions` with
    the functions its @release_effect wraps (the fast way) or, `through_wrappers`, with
    the wrappers themselves (the old way, each checking the context); `closing` is the
    step that closes the context on the way out, `dead` runs the plan over a context
    that is already closed."""
    log: list[Any] = []

    def step(i: int) -> Any:
        @release_effect
        def act(ctx: Any) -> Any:
            log.append((i, ctx.live, ctx.instance.key, type(ctx.event).__name__))
            if i == 2:
                raise RuntimeError("step 2 failed")
            if i == closing:
                ctx.__exit__(None, None, None)
            return i

        act.__name__ = f"act{i}"
        return act

    plan = Plan(*(Action(step(i), best_effort=i == 2) for i in range(5)))
    if through_wrappers:
        for a in plan.steps:
            a._raw = a.fn  # as before: every step through its wrapper's check
    m = LIFECYCLE.bind({"release_aborted": plan, "release_finished": Plan()})
    job = m.create("r")
    if dead:
        from terminus.fsm.plan import PlanReport, release_context

        with release_context("lifecycle", job, Abort(), "release_aborted", "queued",
                             "aborted", None) as ctx:
            pass
        report = PlanReport("lifecycle", job, "release_aborted")
        plan.run_actions(ctx, report)
    else:
        try:
            report = job.fire(Abort())
        except ReleaseFailed as e:
            report = e.report
    return (log, [(e.step, e.best_effort, type(e.error).__name__) for e in report.errors],
            job.state)


@pytest.mark.parametrize("closing", [None, 0, 3])
@pytest.mark.parametrize("dead", [False, True])
def test_run_actions_calls_what_the_wrappers_wrap_only_while_the_context_is_live(
        closing, dead):
    fast = _actions_log(False, closing, dead)
    assert fast == _actions_log(True, closing, dead)
    log, errors, _ = fast
    if dead:  # every step refused, none ran
        assert log == [] and [e[2] for e in errors] == ["ReleaseOutsideTerminal"] * 5
    else:
        ran = 5 if closing is None else closing + 1  # the steps after it are refused
        assert [i for i, *_ in log] == list(range(ran))
        assert all(live for _, live, *_ in log)
        assert [e[0] for e in errors if e[2] == "ReleaseOutsideTerminal"] == [
            f"act{i}" for i in range(ran, 5)]
        assert (("act2", True, "RuntimeError") in errors) == (ran > 2)


# -- what a step returns -------------------------------------------------------------


def test_a_step_that_returns_a_plain_value_is_done(pools, ledger):
    @release_effect
    def free_and_count(ctx, handle):
        ctx.resources.kv.free(handle.value)
        return len(handle.value)  # not awaitable: nothing more to run

    m = bind(ledger, Plan(Release("kv", free_and_count)))
    job = m.create("r")
    ledger.acquire(job, "kv", pools.kv.alloc(3))
    report = job.fire(Abort())
    assert report.ok and report.tasks == []


def test_an_async_step_without_a_loop_is_reported_and_its_coroutine_closed(pools, ledger):
    @release_effect
    async def later(ctx):
        return None

    m = bind(ledger, Plan(Action(later, best_effort=True)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = m.create("r").fire(Abort())
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]
    (err,) = report.errors
    assert (err.machine, err.plan, err.step, err.best_effort) == (
        "lifecycle", "release_aborted", "later", True)
    assert str(err.error).endswith(
        ": an async release step needs a running event loop; fire the terminal event from "
        "a coroutine, or make the step sync")
    ledger.errors.clear()


def test_an_async_step_in_a_loop_is_listed_as_a_task_of_the_report(pools, ledger):
    done: list[str] = []

    @release_effect
    def free_later(ctx, handle):
        kv = ctx.resources.kv

        async def later():
            kv.free(handle.value)
            done.append("kv")

        return later()

    m = bind(ledger, Plan(Release("kv", free_later)))

    async def main():
        job = m.create("r")
        ledger.acquire(job, "kv", pools.kv.alloc(2))
        report = job.fire(Abort())
        assert len(report.tasks) == 1
        await asyncio.gather(*report.tasks)
        assert report.tasks[0].done()

    asyncio.run(main())
    assert done == ["kv"] and ledger.pending == 0


# -- refused declarations name what was wrong ----------------------------------------


def test_a_step_function_that_is_not_a_release_effect_is_refused_by_name():
    def stream(ctx):
        return None

    where = "test_a_step_function_that_is_not_a_release_effect_is_refused_by_name.<locals>"
    fix = ("is not a release effect; decorate it with @terminus.fsm.release_effect so it "
           "can only run inside a terminal transition")
    with pytest.raises(TypeError) as info:
        Action(stream)
    assert str(info.value) == f"Action step '{where}.stream' {fix}"
    with pytest.raises(TypeError) as info:
        Release("kv", stream)
    assert str(info.value) == f"Release('kv') step '{where}.stream' {fix}"
    partial = functools.partial(stream)  # a callable without a __qualname__: its repr
    with pytest.raises(TypeError) as info:
        Action(partial)
    assert str(info.value) == f"Action step {partial!r} {fix}"


def test_a_plan_step_that_is_neither_an_action_nor_a_release_is_refused():
    with pytest.raises(TypeError, match=r"^plan step 'kv' is neither an Action nor a Release$"):
        Plan("kv")  # type: ignore[arg-type]


def test_a_plan_s_repr_lists_its_steps_as_written():
    @release_effect
    def stream(ctx):
        return None

    plan = Plan(Action(stream, best_effort=True), Action(stream, name="stream again"),
                Release("kv"), Release("kv", free_kv))
    assert repr(plan) == ("Plan(Action(stream, best_effort), Action(stream again), "
                          "Release('kv'), Release('kv', free_kv))")
    assert [s.name for s in plan.steps] == ["stream", "stream again", "release kv",
                                            "release kv via free_kv"]
    assert plan.kinds == ("kv", "kv")


def test_a_step_is_best_effort_only_when_asked():
    @release_effect
    def stream(ctx):
        return None

    assert Release("kv").best_effort is False and Action(stream).best_effort is False
    assert Release("kv", best_effort=True).best_effort is True
