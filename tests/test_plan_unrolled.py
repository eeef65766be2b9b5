"""A plan with actions runs as one function made for it (`fsm.machine._compile_plan`:
its steps unrolled from `_PLAN_BODY`, `_ACTION_STEP`, `_RELEASE_STEP`). Differential:
on random plans and ownerships it does what the general path (`Machine._step`,
`Ledger._run_steps`, taken while a sink observes the machine) does, step for step."""

from __future__ import annotations

import random
from typing import Any

import pytest

from terminus.fsm import Action, Ledger, Plan, Release, ReleaseFailed, release_effect
from terminus.kernels import TokenKVAllocator
from tests.lifecycle import LIFECYCLE, Abort, Chunk, Finish, Job, Start

KINDS = ("a", "b", "c")


def _sink(record: Any) -> None:
    """A sink: while one observes the machine, every step takes the general path."""


def _plan(rng: random.Random, log: list[Any]) -> Plan:
    """A random plan: Release steps (the default releaser, or their own function, which
    may raise) and Actions that log, raise, or give the instance one more handle."""

    @release_effect
    def own(ctx: Any, handle: Any) -> None:
        log.append(("own", handle.kind, handle.value.numel()))
        ctx.resources.free(handle.value)
        if handle.value.numel() == 3:
            raise RuntimeError(f"own release of {handle.kind} failed")

    def action(i: int, what: str) -> Any:
        @release_effect
        def act(ctx: Any) -> None:
            log.append(("action", i, what, ctx.live, ctx.target))
            if what == "raise":
                raise RuntimeError(f"action {i} failed")
            if what == "acquire":
                ctx.ledger.acquire(ctx.instance, rng.choice(KINDS), ctx.resources.alloc(1))

        act.__name__ = f"act{i}"
        return act

    steps: list[Any] = []
    for i in range(rng.randint(1, 6)):
        if rng.random() < 0.5:
            kind = rng.choice(KINDS)
            steps.append(Release(kind, own) if rng.random() < 0.3 else Release(kind))
        else:
            what = rng.choice(("log", "log", "raise", "acquire"))
            steps.append(Action(action(i, what), best_effort=rng.random() < 0.5))
    if not any(type(s) is Action for s in steps):
        steps.append(Action(action(99, "log")))
    return Plan(*steps)


def _run(seed: int, observed: bool) -> tuple[Any, ...]:
    rng = random.Random(seed)
    kv = TokenKVAllocator(64, strict=True)
    log: list[Any] = []

    def releaser(kind: str) -> Any:
        @release_effect
        def free(ctx: Any, handle: Any) -> None:
            log.append(("default", kind, handle.value.numel()))
            ctx.resources.free(handle.value)

        return free

    ledger = Ledger({k: releaser(k) for k in KINDS}, resources=kv)
    plan = _plan(rng, log)
    m = LIFECYCLE.bind({"release_aborted": plan, "release_finished": Plan(Release("a"))},
                       ledger)
    if observed:
        m.add_sink(_sink)
    job = Job(m, "r")
    for _ in range(rng.choice((0, 1, 1, 2, 4))):
        ledger.acquire(job, rng.choice(KINDS), kv.alloc(rng.randint(1, 4)))
    try:
        report = job.fire(Abort())
        raised = None
    except ReleaseFailed as e:
        report, raised = e.report, str(e)
    out = (log, [(h.kind, h.value.numel()) for h in report.released],
           [(e.step, e.best_effort) for e in report.errors], raised, job.state,
           dict(m.stats.plans_run), ledger.released, ledger.late_released)
    ledger.assert_empty()
    kv.assert_full()
    return out


@pytest.mark.parametrize("seed", range(60))
def test_an_unrolled_plan_does_what_the_general_path_does(seed):
    compiled = _run(seed, observed=False)
    general = _run(seed, observed=True)
    assert compiled == general
    assert compiled[4] == "aborted"


@release_effect
def drop(ctx: Any, handle: Any) -> None:
    """A releaser that does nothing (the naming tests look at the compiled code)."""


@release_effect
def note(ctx: Any) -> None:
    """An action that does nothing."""


@pytest.mark.python_core
@pytest.mark.usefixtures("unobserved")
def test_the_unrolled_function_is_named_after_its_plan():
    ledger = Ledger(dict.fromkeys(KINDS, drop))

    m = LIFECYCLE.bind({"release_aborted": Plan(Release("a"), Action(note), Release("b")),
                        "release_finished": Plan(Release("a"))}, ledger)
    job = Job(m, "r")
    report = job.fire(Abort())
    assert report.plan == "release_aborted" and not report.released
    cells = [f for f in m._on if f is not None and getattr(f, "__code__", None) is not None]
    files = {f.__code__.co_filename for f in cells}
    assert "<plan lifecycle:release_aborted DAD>" in files
    ledger.assert_empty()


@pytest.mark.python_core
@pytest.mark.usefixtures("unobserved")
def test_plans_of_one_shape_share_one_compiled_template_and_keep_their_names():
    from terminus.fsm import machine as engine

    ledger = Ledger(dict.fromkeys(KINDS, drop))
    shape = Plan(Release("a"), Action(note))
    m = LIFECYCLE.bind({"release_aborted": shape, "release_finished": shape}, ledger)
    before = engine._plan_code.cache_info()
    for name, event in (("aborted", Abort()), ("finished", None)):
        job = Job(m, name)
        if event is None:
            job.fire(Start())
            job.fire(Chunk(last=True))
            job.fire(Finish())
            assert job.state == "finished"
        else:
            job.fire(event)
    after = engine._plan_code.cache_info()
    assert after.misses - before.misses <= 1 and after.hits - before.hits >= 1
    files = {f.__code__.co_filename for f in m._on
             if f is not None and getattr(f, "__code__", None) is not None}
    assert {"<plan lifecycle:release_aborted DA>", "<plan lifecycle:release_finished DA>"} <= files
    ledger.assert_empty()


@pytest.mark.python_core
@pytest.mark.usefixtures("unobserved")
def test_a_traceback_through_an_unrolled_plan_shows_the_plans_lines():
    import traceback

    @release_effect
    def broken(ctx: Any) -> None:
        raise RuntimeError("the effect failed")

    ledger = Ledger(dict.fromkeys(KINDS, drop))
    m = LIFECYCLE.bind({"release_aborted": Plan(Action(broken), Release("a")),
                        "release_finished": Plan(Release("a"))}, ledger)
    job = Job(m, "r")
    with pytest.raises(ReleaseFailed) as failed:
        job.fire(Abort())
    text = "".join(traceback.format_exception(failed.value))
    assert 'File "<plan lifecycle:release_aborted AD>"' in text
    assert "res = fn0(ctx)" in text  # the plan's own line, not a blank
    ledger.assert_empty()
