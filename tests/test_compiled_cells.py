"""Guarded cells and plans with actions, which the engine compiles when nobody observes
(`fsm.machine._compile_guarded`, `_compile_plan`): what they must keep of the general
path (`Machine._step`, `Ledger._run_steps`), on both engine paths."""

from __future__ import annotations

from typing import Any

import pytest

from terminus.fsm import (
    IGNORE,
    Action,
    Ledger,
    Plan,
    Release,
    ReleaseFailed,
    ReleaseOutsideTerminal,
    Spec,
    TransitionNotAllowed,
    go,
    release_effect,
)
from tests.engine_paths import engine_path  # noqa: F401  (a fixture)
from tests.lifecycle import EVENTS, GUARDS, LIFECYCLE, TABLE, Abort, Chunk, Finish, Job, Start

pytestmark = pytest.mark.usefixtures("engine_path")


@release_effect
def free_kv(ctx, handle):
    ctx.resources.free(handle.value)


def machine(kv, table=None, guards=None, **plans):
    """LIFECYCLE (or a variant of its table and guards) bound over a kv ledger."""
    ledger = Ledger({"kv": free_kv, "meta": free_kv}, resources=kv)
    default = {"release_aborted": Plan(Release("kv")), "release_finished": Plan(Release("kv"))}
    default.update(plans)
    spec = LIFECYCLE.spec if table is None else Spec(
        "variant", states=LIFECYCLE.spec.states, events=EVENTS, table=table,
        guards=guards or GUARDS)
    return spec.build().bind(default, ledger), ledger


def variant(**cells: Any) -> dict[str, dict[Any, Any]]:
    t = {k: dict(v) for k, v in TABLE.items()}
    for state, row in cells.items():
        t[state].update(row)
    return t


def test_the_first_alternative_that_holds_is_taken_and_none_holding_changes_nothing(kv):
    table = variant(prefilling={Chunk: [go("decoding", when="last_chunk"),
                                        go("finished", when="chunks_in_flight",
                                           plan="release_finished")]})
    m, ledger = machine(kv, table)
    job = Job(m, "r")
    ledger.acquire(job, "kv", kv.alloc(4))
    job.fire(Start())
    with pytest.raises(TransitionNotAllowed,
                       match=r"no guard held \(last_chunk, chunks_in_flight\)"):
        job.fire(Chunk(last=False))
    assert job.state == "prefilling" and not job.busy and ledger.count() == 1
    job.in_flight = 1
    report = job.fire(Chunk(last=False))  # the second alternative: a terminal edge
    assert job.state == "finished" and report is not None and report.plan == "release_finished"
    assert m.stats.plans_run == {"release_finished": 1}
    ledger.assert_empty()


def test_a_guarded_alternative_that_ignores_is_counted(kv):
    table = variant(prefilling={Chunk: [go("decoding", when="last_chunk"), IGNORE]})
    m, ledger = machine(kv, table)
    job = Job(m, "r")
    job.fire(Start())
    assert job.fire(Chunk(last=False)) is None and job.state == "prefilling"
    assert m.stats.ignored[("prefilling", "Chunk")] == 1
    job.fire(Chunk(last=True))
    assert job.state == "decoding"
    job.fire(Abort())
    ledger.assert_empty()


def test_an_event_a_guard_fires_at_its_instance_runs_after_the_step(kv):
    seen: list[str] = []

    def last_chunk(inst, ev):
        seen.append(inst.state)
        if ev.last and len(seen) == 1:
            inst.fire(Abort())  # queued: the instance is busy while its guards run
        return bool(ev.last)

    m, ledger = machine(kv, variant(), {**GUARDS, "last_chunk": last_chunk})
    job = Job(m, "r")
    h = ledger.acquire(job, "kv", kv.alloc(4))
    job.fire(Start())
    job.fire(Chunk(last=True))  # decoding, then the queued Abort: aborted
    assert seen == ["prefilling"] and job.state == "aborted" and not job.busy
    assert h.released and m.stats.plans_run == {"release_aborted": 1}
    ledger.assert_empty()


def test_a_guard_that_raises_changes_nothing(kv):
    def last_chunk(inst, ev):
        raise RuntimeError("guard broke")

    m, ledger = machine(kv, variant(), {**GUARDS, "last_chunk": last_chunk})
    job = Job(m, "r")
    job.fire(Start())
    with pytest.raises(RuntimeError, match="guard broke"):
        job.fire(Chunk(last=True))
    assert job.state == "prefilling" and not job.busy
    job.fire(Abort())
    ledger.assert_empty()


def test_a_guard_that_fires_at_its_instance_then_raises_runs_the_queued_event_first(kv):
    def chunks_in_flight(inst, ev):
        inst.fire(Chunk(last=True))  # queued behind the guard; it runs before the error
        raise RuntimeError("guard broke")

    m, ledger = machine(kv, variant(), {**GUARDS, "chunks_in_flight": chunks_in_flight})
    job = Job(m, "r")
    h = ledger.acquire(job, "kv", kv.alloc(4))
    job.fire(Start())
    with pytest.raises(RuntimeError, match="guard broke"):
        job.fire(Abort())  # prefilling: a guard, then an unguarded terminal alternative
    assert job.state == "decoding" and not job.busy and not h.released
    assert m.stats.plans_run == {}
    job.fire(Abort())
    assert job.state == "aborted" and h.released
    ledger.assert_empty()


def test_a_guard_result_whose_truth_raises_is_the_guards_error_and_runs_what_it_fired(kv):
    class Ambiguous:  # like a numpy array of two elements: no truth value
        def __bool__(self):
            raise ValueError("the truth value of this result is ambiguous")

    def chunks_in_flight(inst, ev):
        inst.fire(Chunk(last=True))  # queued behind the guard, as above
        return Ambiguous()

    m, ledger = machine(kv, variant(), {**GUARDS, "chunks_in_flight": chunks_in_flight})
    job = Job(m, "r")
    h = ledger.acquire(job, "kv", kv.alloc(4))
    job.fire(Start())
    with pytest.raises(ValueError, match="ambiguous"):
        job.fire(Abort())  # the guard's result raises when tested, on every path
    assert job.state == "decoding" and not job.busy and not h.released
    job.fire(Abort())
    assert job.state == "aborted" and h.released
    ledger.assert_empty()


def test_a_plan_with_actions_runs_every_step_in_order_inside_a_context_dead_after(kv):
    log: list[Any] = []
    kept = []

    @release_effect
    def notify(ctx):
        kept.append(ctx)
        log.append(("notify", ctx.live, ctx.source, ctx.target, ctx.plan))

    @release_effect
    def broken(ctx):
        log.append("broken")
        raise RuntimeError("peer is gone")

    @release_effect
    def own_free(ctx, handle):
        log.append(("kv", handle.value.numel()))
        ctx.resources.free(handle.value)

    plan = Plan(Action(notify), Action(broken, best_effort=True), Release("kv", own_free),
                Action(notify))
    m, ledger = machine(kv, release_aborted=plan)
    job = Job(m, "r")
    meta = ledger.acquire(job, "meta", kv.alloc(2))
    h = ledger.acquire(job, "kv", kv.alloc(4))
    job.fire(Start())
    report = job.fire(Abort())
    assert log == [("notify", True, "prefilling", "aborted", "release_aborted"), "broken",
                   ("kv", 4), ("notify", True, "prefilling", "aborted", "release_aborted")]
    # The kv step released only its kind; the handle no step named went after the last.
    assert report.released == [h, meta] and h.released and meta.released
    assert [(e.step, e.best_effort) for e in report.errors] == [("broken", True)]
    assert ledger.errors == report.errors and m.stats.effect_errors == 1
    assert not kept[0].live and not kept[1].live
    with pytest.raises(ReleaseOutsideTerminal):
        notify(kept[0])
    ledger.assert_empty()


def test_a_failing_action_raises_after_every_step_ran(kv):
    @release_effect
    def broken(ctx):
        raise RuntimeError("not best effort")

    m, ledger = machine(kv, release_aborted=Plan(Action(broken), Release("kv")))
    job = Job(m, "r")
    h = ledger.acquire(job, "kv", kv.alloc(4))
    with pytest.raises(ReleaseFailed) as info:
        job.fire(Abort())
    assert info.value.report.released == [h] and h.released and job.state == "aborted"
    assert not job.busy
    ledger.assert_empty()


def test_a_handle_an_action_acquires_for_its_instance_is_the_plan_s(kv):
    @release_effect
    def grab(ctx):
        ctx.ledger.acquire(ctx.instance, "kv", ctx.resources.alloc(2))

    m, ledger = machine(kv, release_aborted=Plan(Action(grab), Release("kv")))
    job = Job(m, "r")
    first = ledger.acquire(job, "kv", kv.alloc(4))
    report = job.fire(Abort())
    assert len(report.released) == 2 and report.released[0] is first
    assert ledger.late_released == 0 and ledger.released == 2
    ledger.assert_empty()


def test_events_an_action_fires_at_its_instance_run_after_the_plan(kv):
    order: list[str] = []

    @release_effect
    def refire(ctx):
        order.append("action")
        assert ctx.instance.busy
        ctx.instance.fire(Finish())  # queued: ignored in 'aborted' after the plan
        ctx.instance.fire(Start())  # queued: an error there, raised after the plan

    m, ledger = machine(kv, release_aborted=Plan(Action(refire), Release("kv")))
    job = Job(m, "r")
    h = ledger.acquire(job, "kv", kv.alloc(4))
    with pytest.raises(TransitionNotAllowed, match="'Start' is not allowed in state 'aborted'"):
        job.fire(Abort())
    assert order == ["action"] and h.released and not job.busy
    assert m.stats.ignored[("aborted", "Finish")] == 1
    assert m.stats.plans_run == {"release_aborted": 1}
    ledger.assert_empty()


def test_a_step_of_another_kind_skips_the_one_handle_and_its_own_step_reports_its_error(kv):
    log: list[str] = []

    @release_effect
    def note(ctx):
        log.append("note")

    @release_effect
    def free_then_fail(ctx, handle):
        ctx.resources.free(handle.value)
        log.append("kv")
        raise RuntimeError("free reported a failure")

    plan = Plan(Release("meta"), Action(note), Release("kv", free_then_fail), Action(note))
    m, ledger = machine(kv, release_aborted=plan)
    job = Job(m, "r")
    h = ledger.acquire(job, "kv", kv.alloc(4))
    with pytest.raises(ReleaseFailed) as info:
        job.fire(Abort())
    assert log == ["note", "kv", "note"] and h.released and job.state == "aborted"
    report = info.value.report
    assert report.released == [h]
    assert [(e.step, e.best_effort) for e in report.errors] == [
        ("release kv via free_then_fail", False)]
    assert ledger.errors == report.errors and not job.busy
    ledger.assert_empty()


def test_a_cell_of_three_alternatives_takes_the_first_that_holds_and_queues_what_guards_fire(kv):
    fired: list[Any] = []

    def in_flight(inst, ev):
        if fired:
            inst.fire(fired.pop())  # queued behind the guards; runs after the step
        if inst.in_flight < 0:
            raise RuntimeError("negative in-flight count")
        return inst.in_flight > 0

    table = variant(prefilling={Chunk: [go("decoding", when="last_chunk"),
                                        go("draining", when="in_flight"),
                                        go("prefilling")]})
    m, ledger = machine(kv, table, {**GUARDS, "in_flight": in_flight})
    job = Job(m, "r")
    h = ledger.acquire(job, "kv", kv.alloc(4))
    job.fire(Start())
    assert job.fire(Chunk(last=False)) is None and job.state == "prefilling"  # the fallback
    job.in_flight = -1
    fired.append(Start())  # fired by the guard before it raises: still handled, first
    with pytest.raises(RuntimeError, match="negative in-flight"):
        job.fire(Chunk(last=False))
    assert job.state == "prefilling" and not job.busy
    assert m.stats.ignored[("prefilling", "Start")] == 1
    with pytest.raises(RuntimeError, match="negative in-flight"):  # nothing queued
        job.fire(Chunk(last=False))
    assert job.state == "prefilling" and not job.busy
    job.in_flight = 1
    fired.append(Abort())  # fired by the guard: handled once the step is done
    job.fire(Chunk(last=False))  # in flight: draining, then the queued Abort
    assert job.state == "draining" and not job.busy and not h.released
    assert m.stats.ignored[("draining", "Abort")] == 1
    job.in_flight = 0
    job.fire(Chunk(last=True))  # the drain ends: aborted, its plan runs
    assert job.state == "aborted" and h.released
    assert m.stats.plans_run == {"release_aborted": 1}
    ledger.assert_empty()


def test_a_recorded_guarded_cell_records_the_alternative_it_took(kv):
    from terminus.fsm import observe

    seen: list[tuple[str, str, int]] = []

    class Recorder:
        def record(self, machine, source, event, alt):
            seen.append((machine.states[source], machine.event_names[event], alt))

        def record_counts(self, machine, counts):
            pass

    m, ledger = machine(kv)
    prev = observe.set_recorder(Recorder())
    try:
        job = Job(m, "r")
        h = ledger.acquire(job, "kv", kv.alloc(4))
        job.fire(Start())
        job.fire(Chunk(last=False))  # the fallback: alternative 1
        job.in_flight = 1
        job.fire(Abort())  # chunks in flight: alternative 0, draining
        job.fire(Chunk(last=True))  # draining ends: aborted, its plan runs
    finally:
        observe.set_recorder(prev)
    assert seen == [("queued", "Start", 0), ("prefilling", "Chunk", 1),
                    ("prefilling", "Abort", 0), ("draining", "Chunk", 0)]
    assert job.state == "aborted" and h.released
    ledger.assert_empty()
