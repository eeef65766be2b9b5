"""A terminal edge whose plan releases one handle: what the compiled path
(`fsm.machine._compile_terminal`) must keep of the general one, on both engine paths."""

from __future__ import annotations

import functools

import pytest

from terminus.fsm import (
    Action,
    Ledger,
    Plan,
    Release,
    ReleaseFailed,
    ReleaseOutsideTerminal,
    TransitionNotAllowed,
    release_effect,
)
from terminus.fsm.plan import unwrapped
from tests.engine_paths import engine_path  # noqa: F401  (a fixture)
from tests.lifecycle import LIFECYCLE, Abort, Start

pytestmark = pytest.mark.usefixtures("engine_path")


def make(kv, releaser, **plans):
    ledger = Ledger({"kv": releaser}, resources=kv)
    default = {"release_aborted": Plan(Release("kv")), "release_finished": Plan(Release("kv"))}
    default.update(plans)
    return LIFECYCLE.bind(default, ledger), ledger


def test_events_a_releaser_fires_at_its_own_instance_run_after_its_plan(kv):
    order: list[str] = []

    @release_effect
    def free(ctx, handle):
        order.append("release")
        assert ctx.instance.busy
        ctx.instance.fire(Abort())  # queued: ignored in 'aborted' after the plan
        ctx.instance.fire(Start())  # queued: an error there, raised after the plan
        ctx.resources.free(handle.value)
        order.append("freed")

    m, ledger = make(kv, free)
    job = m.create("r")
    h = ledger.acquire(job, "kv", kv.alloc(4))
    with pytest.raises(TransitionNotAllowed, match="'Start' is not allowed in state 'aborted'"):
        job.fire(Abort())
    assert order == ["release", "freed"] and h.released and not job.busy
    assert m.stats.ignored[("aborted", "Abort")] == 1
    assert m.stats.plans_run == {"release_aborted": 1}
    ledger.assert_empty()


def test_a_failing_releaser_is_reported_its_handle_counted_released_and_the_context_dies(kv):
    kept = []

    @release_effect
    def free(ctx, handle):
        kept.append(ctx)
        ctx.resources.free(handle.value)
        raise RuntimeError("pool said no")

    m, ledger = make(kv, free)
    job = m.create("r")
    h = ledger.acquire(job, "kv", kv.alloc(4))
    with pytest.raises(ReleaseFailed) as info:
        job.fire(Abort())
    report = info.value.report
    assert report.released == [h] and h.released and ledger.released == 1
    assert [(e.step, e.best_effort) for e in report.errors] == [("release kv", False)]
    assert ledger.errors == report.errors and m.stats.effect_errors == 1
    assert not kept[0].live and not job.busy and job.state == "aborted"
    with pytest.raises(ReleaseOutsideTerminal):
        free(kept[0], h)  # the wrapper still refuses a context kept past its plan
    ledger.assert_empty()


def test_a_handle_acquired_by_a_releaser_for_its_own_instance_is_the_plan_s(kv):
    grabbed = []

    @release_effect
    def free(ctx, handle):
        ctx.resources.free(handle.value)
        if not grabbed:
            grabbed.append(ctx.ledger.acquire(ctx.instance, "kv", ctx.resources.alloc(2)))

    m, ledger = make(kv, free)
    job = m.create("r")
    first = ledger.acquire(job, "kv", kv.alloc(4))
    report = job.fire(Abort())
    assert report.released == [first, *grabbed] and grabbed[0].released
    assert ledger.late_released == 0 and ledger.released == 2
    ledger.assert_empty()


def test_the_step_naming_the_handle_s_kind_releases_it_with_its_own_function(kv):
    calls: list[str] = []

    @release_effect
    def default(ctx, handle):
        calls.append("default")
        ctx.resources.free(handle.value)

    @release_effect
    def own(ctx, handle):
        calls.append(f"own {ctx.plan} {ctx.source}->{ctx.target}")
        ctx.resources.free(handle.value)

    m, ledger = make(kv, default, release_aborted=Plan(Release("meta_unused", own),
                                                       Release("kv", own)))
    job = m.create("r")
    ledger.acquire(job, "kv", kv.alloc(4))
    report = job.fire(Abort())
    assert calls == ["own release_aborted queued->aborted"] and report.ok
    ledger.assert_empty()


def test_a_decorator_around_a_release_effect_is_never_skipped(kv):
    seen: list[str] = []

    def logged(fn):
        @functools.wraps(fn)  # copies the release effect's attributes, its raw pair too
        def wrapper(ctx, handle):
            seen.append("wrapper")
            return fn(ctx, handle)
        return wrapper

    @logged
    @release_effect
    def free(ctx, handle):
        seen.append("effect")
        ctx.resources.free(handle.value)

    assert unwrapped(free) is free  # the engine calls what it was given
    m, ledger = make(kv, free)
    job = m.create("r")
    ledger.acquire(job, "kv", kv.alloc(4))
    job.fire(Abort())
    assert seen == ["wrapper", "effect"]
    ledger.assert_empty()


def test_plan_runs_are_counted_per_plan_and_a_read_sees_every_run_so_far(kv):
    @release_effect
    def free(ctx, handle):
        ctx.resources.free(handle.value)

    m, ledger = make(kv, free)
    jobs = [m.create(i) for i in range(3)]
    for j in jobs:
        ledger.acquire(j, "kv", kv.alloc(1))
    jobs[0].fire(Abort())
    assert m.stats.plans_run == {"release_aborted": 1}
    jobs[1].fire(Abort())
    jobs[2].fire(Abort())
    assert m.stats.plans_run == {"release_aborted": 3}
    m.stats.plans_run["release_aborted"] += 2  # what a batched step does with its rows
    assert m.stats.plans_run == {"release_aborted": 5}
    ledger.assert_empty()


def test_an_instance_that_owns_nothing_runs_its_plan_as_a_counted_empty_report(kv):
    calls = []

    @release_effect
    def free(ctx, handle):
        calls.append(handle)
        ctx.resources.free(handle.value)

    m, ledger = make(kv, free)
    bare, owner = m.create("bare"), m.create("owner")
    ledger.acquire(owner, "kv", kv.alloc(2))
    report = bare.fire(Abort())
    assert report is not None and report.plan == "release_aborted" and report.instance is bare
    assert report.released == [] and report.ok and report.tasks == []
    assert bare.state == "aborted" and not bare.busy and calls == []
    assert m.stats.plans_run == {"release_aborted": 1} and ledger.released == 0
    assert bare.fire(Abort()) is None  # terminal: ignored, no second run
    owner.fire(Abort())
    assert len(calls) == 1 and m.stats.plans_run == {"release_aborted": 2}
    assert ledger.released == 1
    ledger.assert_empty()


def test_a_recorder_that_raises_on_a_terminal_edge_does_not_skip_its_plan(kv):
    from terminus.fsm import observe

    @release_effect
    def free(ctx, handle):
        ctx.resources.free(handle.value)

    class Raising:
        def __init__(self):
            self.seen = []

        def record(self, machine, source, event, alt):
            self.seen.append((machine.states[source], machine.event_names[event], alt))
            if machine.states[source] == "queued" and machine.event_names[event] == "Abort":
                raise RuntimeError("recorder broke")

        def record_counts(self, machine, counts):
            pass

    m, ledger = make(kv, free)
    job, other = m.create("r"), m.create("s")
    h = ledger.acquire(job, "kv", kv.alloc(4))
    ledger.acquire(other, "kv", kv.alloc(2))
    rec = Raising()
    prev = observe.set_recorder(rec)
    try:
        with pytest.raises(RuntimeError, match="recorder broke"):
            job.fire(Abort())
        other.fire(Start())  # recorded plain transition
        report = other.fire(Abort())  # recorded terminal edge, from 'prefilling'
    finally:
        observe.set_recorder(prev)
    assert h.released and job.state == "aborted" and not job.busy
    assert report.ok and len(report.released) == 1
    assert rec.seen == [("queued", "Abort", 0), ("queued", "Start", 0),
                        ("prefilling", "Abort", 1)]
    assert m.stats.plans_run == {"release_aborted": 2}
    ledger.assert_empty()


def test_a_handle_given_after_the_releaser_queued_an_event_is_still_the_plan_s(kv):
    grabbed = []

    @release_effect
    def free(ctx, handle):
        ctx.resources.free(handle.value)
        if not grabbed:
            ctx.instance.fire(Abort())  # queued behind the running step
            grabbed.append(ctx.ledger.acquire(ctx.instance, "kv", ctx.resources.alloc(2)))

    m, ledger = make(kv, free)
    job = m.create("r")
    first = ledger.acquire(job, "kv", kv.alloc(4))
    report = job.fire(Abort())
    assert report.released == [first, *grabbed] and ledger.late_released == 0
    assert m.stats.ignored[("aborted", "Abort")] == 1 and not job.busy
    late = ledger.acquire(job, "kv", kv.alloc(1))  # after the step: released at once
    assert late.released and ledger.late_released == 1
    ledger.assert_empty()


def test_a_context_kept_past_its_plan_stays_dead_through_later_plans_on_its_edge(kv):
    """A compiled cell reuses a dead context only when nobody kept it: one an effect kept
    is never handed to a later plan, so it cannot come back to life (I1)."""
    seen: list[tuple[int, object, object]] = []
    kept = []

    @release_effect
    def free(ctx, handle):
        seen.append((id(ctx), ctx.instance, ctx.event))
        assert ctx.live
        if handle.value[0] == kept_page[0]:
            kept.append(ctx)
        ctx.resources.free(handle.value)

    m, ledger = make(kv, free)
    jobs = [m.create(i) for i in range(4)]
    handles = [ledger.acquire(j, "kv", kv.alloc(2)) for j in jobs]
    kept_page = handles[1].value
    events = [Abort() for _ in jobs]
    for j, e in zip(jobs, events, strict=True):
        j.fire(e)
        assert not j.busy and j.state == "aborted"
    assert [(inst, ev) for _, inst, ev in seen] == list(zip(jobs, events, strict=True))
    assert len(kept) == 1 and kept[0].instance is jobs[1] and not kept[0].live
    assert id(kept[0]) not in {i for i, _, _ in seen[2:]}  # never handed out again
    with pytest.raises(ReleaseOutsideTerminal):
        free(kept[0], handles[1])
    assert all(h.released for h in handles) and m.stats.plans_run == {"release_aborted": 4}
    ledger.assert_empty()


def test_a_plan_run_inside_a_releaser_on_the_same_edge_gets_its_own_context(kv):
    """An effect that fires another instance's terminal event on the same edge: the inner
    plan opens its own context, and the outer one is live until its own plan ends."""
    contexts = []

    @release_effect
    def free(ctx, handle):
        contexts.append(ctx)
        ctx.resources.free(handle.value)
        if ctx.instance is outer:
            inner.fire(Abort())
            assert ctx.live and not contexts[1].live and contexts[1] is not ctx
        # what a releaser holds in a local is dropped with its frame

    m, ledger = make(kv, free)
    outer, inner = m.create("outer"), m.create("inner")
    ledger.acquire(outer, "kv", kv.alloc(2))
    ledger.acquire(inner, "kv", kv.alloc(2))
    outer.fire(Abort())
    assert [c.instance for c in contexts] == [outer, inner]
    assert not any(c.live for c in contexts)
    assert outer.state == inner.state == "aborted" and m.stats.plans_run == {"release_aborted": 2}
    ledger.assert_empty()


def test_runs_and_releases_are_counted_exactly_across_machines_sharing_a_ledger(kv):
    """The compiled one-handle path counts in a small int of its own and adds it to the
    ledger's and the machine's counters when they are read: every read is exact, on
    either side of the point (200) where it adds them itself."""
    reads = []

    @release_effect
    def free(ctx, handle):
        ctx.resources.free(handle.value)
        reads.append(ctx.ledger.released)  # a read from inside a plan

    ledger = Ledger({"kv": free}, resources=kv)
    plans = {"release_aborted": Plan(Release("kv")), "release_finished": Plan(Release("kv"))}
    a, b = LIFECYCLE.bind(plans, ledger), LIFECYCLE.bind(plans, ledger)
    done = 0
    for n in (3, 250, 1, 198):
        for m in (a, b):
            for _ in range(n):
                job = m.create()
                ledger.acquire(job, "kv", kv.alloc(1))
                job.fire(Abort())
            done += n
            assert ledger.released == done and m.stats.plans_run["release_aborted"] == n
            m.stats.plans_run.clear()
    assert reads == list(range(1, done + 1))
    assert a.stats.plans_run == b.stats.plans_run == {}
    ledger.assert_empty()


def test_a_context_whose_releaser_raised_is_never_reused_while_a_traceback_holds_it(kv):
    """The error a failing releaser raised keeps its frames (and the context in them)
    through the report: that context stays dead, the next plan gets another."""
    contexts = []

    @release_effect
    def free(ctx, handle):
        contexts.append(id(ctx))
        ctx.resources.free(handle.value)
        if len(contexts) == 1:
            raise RuntimeError("first one fails")

    m, ledger = make(kv, free)
    jobs = [m.create(i) for i in range(2)]
    for j in jobs:
        ledger.acquire(j, "kv", kv.alloc(1))
    with pytest.raises(ReleaseFailed) as info:
        jobs[0].fire(Abort())
    tb = info.value.report.errors[0].error.__traceback__
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    held = [v for f in frames for v in f.f_locals.values() if type(v).__name__ == "ReleaseContext"]
    assert held and not any(c.live for c in held)
    jobs[1].fire(Abort())
    assert contexts[1] not in {id(c) for c in held} and not any(c.live for c in held)
    assert all(j.state == "aborted" for j in jobs)
    ledger.assert_empty()


def test_what_an_effect_rebinds_on_its_context_does_not_reach_the_next_plan(kv):
    """`target` and `ledger` are stored when a context is made for its edge, and a
    compiled cell reuses a dead context nobody kept: one whose effect rebound either is
    not reused, so every plan reads its own edge's terminal state and ledger."""
    seen = []

    @release_effect
    def free(ctx, handle):
        seen.append((ctx.target, ctx.ledger is ledger))
        ctx.resources.free(handle.value)
        ctx.target, ctx.ledger = "bogus", None  # an effect's own business, not the next plan's

    m, ledger = make(kv, free)
    jobs = [m.create(i) for i in range(3)]
    for j in jobs:
        ledger.acquire(j, "kv", kv.alloc(2))
        j.fire(Abort())
    assert seen == [("aborted", True)] * 3
    assert [j.state for j in jobs] == ["aborted"] * 3
    ledger.assert_empty()
    kv.assert_full()


def test_an_instance_is_neither_copied_nor_pickled(kv):
    """A copy would share the handles its original owns (each released once, by its one
    owner): refused with a TypeError that says what to do, in both cores, changing nothing."""
    import copy
    import pickle

    @release_effect
    def free(ctx, handle):
        ctx.resources.free(handle.value)

    m, ledger = make(kv, free)
    job = m.create("r")
    h = ledger.acquire(job, "kv", kv.alloc(2))
    for attempt in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match=r"cannot be copied or pickled: a copy would share "
                                            r"the handles.*make a new instance"):
            attempt(job)
    assert ledger.owned(job) == [h] and job.state == "queued"
    job.fire(Abort())
    ledger.assert_empty()
    kv.assert_full()


def test_a_step_error_whose_str_raises_still_lets_every_later_step_run(kv):
    """The report names each step's error with its text; an error whose `str()` itself
    raises is named without it, and the plan's later steps (the handle's release) run."""
    class Unprintable(RuntimeError):
        def __str__(self):
            raise ValueError("no text")

    @release_effect
    def broken(ctx):
        raise Unprintable()

    @release_effect
    def free(ctx, handle):
        ctx.resources.free(handle.value)

    m, ledger = make(kv, free, release_aborted=Plan(Action(broken), Release("kv")))
    job = m.create("r")
    h = ledger.acquire(job, "kv", kv.alloc(2))
    with pytest.raises(ReleaseFailed) as failed:
        job.fire(Abort())
    err = failed.value.exceptions[0]
    assert err.step == "broken" and isinstance(err.error, Unprintable)
    assert "raised Unprintable: <Unprintable object: its str() raised>" in str(err)
    assert h.released and job.state == "aborted" and not job.busy
    ledger.assert_empty()
    kv.assert_full()
