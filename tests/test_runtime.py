"""Firing events: table lookups, ignores, errors, exactly-once terminal plans,
run-to-completion, the release capability, best-effort steps and traces."""

from __future__ import annotations

import asyncio
import gc
import re

import pytest

from terminus.fsm import (
    Action,
    EffectError,
    InvalidDefinition,
    Ledger,
    Plan,
    Release,
    ReleaseContext,
    ReleaseFailed,
    ReleaseOutsideTerminal,
    TransitionNotAllowed,
    UnknownEvent,
    observe,
    release_effect,
)
from terminus.kernels import MetadataSlots, TokenKVAllocator
from tests.engine_paths import engine_path  # noqa: F401  (a fixture)
from tests.lifecycle import LIFECYCLE, Abort, Chunk, Finish, Job, Start

pytestmark = pytest.mark.usefixtures("engine_path")


class World:
    """Real pools behind a ledger, and a record of what each effect did."""

    def __init__(self) -> None:
        self.kv = TokenKVAllocator(256, device="cpu", strict=True)
        self.meta = MetadataSlots(8)
        self.log: list[tuple[str, object]] = []
        self.streamed: dict[object, int] = {}
        self.fail_notify = False
        self.ledger = Ledger({"kv": free_kv, "meta": free_meta}, resources=self)

    def bind(self, **plans: Plan):
        default = {
            "release_aborted": Plan(Action(notify_peer, best_effort=True), Release("meta"),
                                    Release("kv"), Action(stream)),
            "release_finished": Plan(Release("kv"), Release("meta"), Action(stream)),
        }
        default.update(plans)
        return LIFECYCLE.bind(default, self.ledger)

    def admit(self, m, key: str, tokens: int = 16) -> Job:
        job = Job(m, key)
        self.ledger.acquire(job, "kv", self.kv.alloc(tokens))
        self.ledger.acquire(job, "meta", self.meta.alloc())
        return job

    def assert_full(self) -> None:
        self.kv.assert_full()
        self.meta.assert_full()
        self.ledger.assert_empty()


@release_effect
def free_kv(ctx: ReleaseContext, handle) -> None:
    ctx.resources.kv.free(handle.value)
    ctx.resources.log.append(("kv", ctx.instance.key))


@release_effect
def free_meta(ctx: ReleaseContext, handle) -> None:
    ctx.resources.meta.free(handle.value)
    ctx.resources.log.append(("meta", ctx.instance.key))


@release_effect
def notify_peer(ctx: ReleaseContext) -> None:
    ctx.resources.log.append(("notify", ctx.instance.key))
    if ctx.resources.fail_notify:
        raise ConnectionError("peer closed the connection")


@release_effect
def stream(ctx: ReleaseContext) -> None:
    w = ctx.resources
    w.streamed[ctx.instance.key] = w.streamed.get(ctx.instance.key, 0) + 1
    w.log.append(("stream", ctx.target))


@pytest.fixture
def world():
    w = World()
    yield w
    w.assert_full()


def test_a_plain_transition_changes_state_and_returns_nothing(world):
    job = world.admit(world.bind(), "r1")
    assert job.state == "queued" and not job.terminal
    assert job.fire(Start()) is None
    assert job.state == "prefilling"
    job.fire(Abort())


def test_guards_pick_the_first_alternative_that_holds(world):
    m = world.bind()
    job = world.admit(m, "r1")
    job.fire(Start())
    job.fire(Chunk(last=False))
    assert job.state == "prefilling"
    job.fire(Chunk(last=True))
    assert job.state == "decoding"
    job.fire(Finish())


def test_an_ignored_event_changes_nothing_and_is_counted(world):
    m = world.bind()
    job = world.admit(m, "r1")
    job.fire(Start())
    assert job.fire(Start()) is None
    assert job.state == "prefilling"
    assert m.stats.ignored[("prefilling", "Start")] == 1
    job.fire(Abort())


def test_an_error_event_raises_with_machine_state_and_event(world):
    job = world.admit(world.bind(), "r1")
    with pytest.raises(TransitionNotAllowed) as info:
        job.fire(Finish())
    e = info.value
    assert (e.machine, e.state, e.event, e.instance) == ("lifecycle", "queued", "Finish", "r1")
    assert str(e) == ("machine 'lifecycle' (instance 'r1'): event 'Finish' is not allowed in "
                      "state 'queued': the declaration makes it an error here")
    assert job.state == "queued"
    job.fire(Abort())


def test_an_object_that_is_not_an_event_of_the_machine_raises_unknown_event(world):
    job = world.admit(world.bind(), "r1")
    with pytest.raises(UnknownEvent, match="'str' is not an event of this machine; fire one "
                       "of Start, Chunk, Finish, Abort"):
        job.fire("Abort")
    job.fire(Abort())


def test_the_terminal_plan_releases_what_the_instance_owns_in_plan_order(world):
    job = world.admit(world.bind(), "r1")
    job.fire(Start())
    report = job.fire(Abort())
    assert report is not None and report.ok and report.plan == "release_aborted"
    assert [h.kind for h in report.released] == ["meta", "kv"]
    assert world.log == [("notify", "r1"), ("meta", "r1"), ("kv", "r1"),
                         ("stream", "aborted")]
    assert job.terminal and job.state == "aborted"


def test_abort_echo_after_finish_releases_nothing(world):
    m = world.bind()
    job = world.admit(m, "r1")
    for ev in (Start(), Chunk(last=True), Finish()):
        job.fire(ev)
    before = list(world.log)
    assert job.fire(Abort()) is None
    assert job.fire(Finish()) is None
    assert world.log == before
    assert world.streamed == {"r1": 1}
    assert m.stats.plans_run == {"release_finished": 1}
    assert m.stats.ignored[("finished", "Abort")] == 1


def test_a_terminal_instance_rejects_what_is_declared_an_error_there(world):
    job = world.admit(world.bind(), "r1")
    job.fire(Abort())
    with pytest.raises(TransitionNotAllowed, match="'Start' is not allowed in state 'aborted'"):
        job.fire(Start())
    assert world.streamed == {"r1": 1}


def test_a_guarded_pair_with_no_guard_holding_is_an_error(world):
    from terminus.fsm import Spec, go
    from tests.lifecycle import EVENTS, GUARDS, TABLE
    t = {k: dict(v) for k, v in TABLE.items()}
    t["prefilling"][Chunk] = [go("decoding", when="last_chunk")]
    m = Spec("strict", states=LIFECYCLE.spec.states, events=EVENTS, table=t,
             guards=GUARDS).build()
    job = m.create("x")
    job.fire(Start())
    with pytest.raises(TransitionNotAllowed, match=r"no guard held \(last_chunk\)"):
        job.fire(Chunk(last=False))
    assert job.state == "prefilling"


def test_a_release_effect_called_outside_a_terminal_transition_raises(world):
    with pytest.raises(ReleaseOutsideTerminal, match="release effect 'stream' was called "
                       "outside a terminal transition"):
        stream(None)
    with pytest.raises(ReleaseOutsideTerminal):
        ReleaseContext(object(), "m", None, None, "p", "a", "b", None)


def test_a_context_kept_after_its_plan_cannot_run_effects_later(world):
    kept: list[ReleaseContext] = []

    @release_effect
    def keep(ctx):
        kept.append(ctx)

    m = world.bind(release_aborted=Plan(Action(keep)))
    job = world.admit(m, "r1")
    job.fire(Abort())
    assert not kept[0].live
    with pytest.raises(ReleaseOutsideTerminal):
        stream(kept[0])
    assert world.streamed == {}


def test_a_failing_best_effort_step_is_recorded_and_the_rest_still_runs(world):
    world.fail_notify = True
    m = world.bind()
    job = world.admit(m, "r1")
    report = job.fire(Abort())
    assert [type(e) for e in report.errors] == [EffectError]
    err = report.errors[0]
    assert err.best_effort and err.step == "notify_peer"
    assert isinstance(err.error, ConnectionError)
    assert "best-effort step 'notify_peer' raised ConnectionError" in str(err)
    assert world.log[1:] == [("meta", "r1"), ("kv", "r1"), ("stream", "aborted")]
    assert world.ledger.errors == [err]
    assert m.stats.effect_errors == 1


def test_a_failing_local_step_raises_after_every_other_step_ran(world):
    @release_effect
    def broken_meta(ctx, handle):
        raise RuntimeError("metadata pool is gone")

    m = world.bind(release_aborted=Plan(Release("meta", broken_meta), Release("kv"),
                                        Action(stream)))
    job = world.admit(m, "r1")
    meta = world.ledger.owned(job, "meta")[0].value
    with pytest.raises(ReleaseFailed) as info:
        job.fire(Abort())
    group = info.value
    assert [e.step for e in group.exceptions] == ["release meta via broken_meta"]
    assert group.report.plan == "release_aborted"
    assert world.streamed == {"r1": 1}  # stream ran after the failing step
    assert job.terminal
    world.meta.free(meta)  # the broken effect did not; put it back for the fixture


def test_handles_a_plan_does_not_name_are_released_by_their_kind_default(world):
    m = world.bind(release_finished=Plan(Action(stream)))
    job = world.admit(m, "r1")
    for ev in (Start(), Chunk(last=True)):
        job.fire(ev)
    report = job.fire(Finish())
    assert sorted(h.kind for h in report.released) == ["kv", "meta"]
    assert world.log[0] == ("stream", "finished")


def test_an_event_fired_while_a_plan_runs_is_queued_and_handled_after_it(world):
    order: list[str] = []

    @release_effect
    def reenter(ctx):
        order.append("plan start")
        ctx.instance.fire(Abort())  # must not re-enter the running plan
        ctx.instance.fire(Start())  # an error in 'aborted', raised after the plan
        order.append("plan end")

    m = world.bind(release_aborted=Plan(Action(reenter)))
    job = world.admit(m, "r1")
    with pytest.raises(TransitionNotAllowed, match="'Start' is not allowed in state 'aborted'"):
        job.fire(Abort())
    assert order == ["plan start", "plan end"]
    assert m.stats.plans_run["release_aborted"] == 1
    assert m.stats.ignored[("aborted", "Abort")] == 1
    assert not job.busy


def test_an_async_release_step_stays_referenced_until_it_finishes(world):
    done: list[str] = []

    @release_effect
    def free_kv_async(ctx, handle):
        kv = ctx.resources.kv

        async def later():
            await asyncio.sleep(0.01)
            kv.free(handle.value)
            done.append("kv")

        return later()

    async def main():
        m = world.bind(release_aborted=Plan(Release("kv", free_kv_async)))
        job = world.admit(m, "r1")
        report = job.fire(Abort())
        assert len(report.tasks) == 1 and world.ledger.pending == 1
        del report
        gc.collect()
        assert world.ledger.pending == 1
        assert await world.ledger.drain() == []
        assert world.ledger.pending == 0

    asyncio.run(main())
    assert done == ["kv"]


def test_a_failing_async_step_is_recorded_on_the_ledger(world):
    @release_effect
    def free_then_fail(ctx, handle):
        kv = ctx.resources.kv

        async def later():
            kv.free(handle.value)
            raise TimeoutError("registry did not answer")

        return later()

    async def main():
        m = world.bind(release_aborted=Plan(Release("kv", free_then_fail)))
        job = world.admit(m, "r1")
        job.fire(Abort())
        errors = await world.ledger.drain()
        assert [type(e.error) for e in errors] == [TimeoutError]

    asyncio.run(main())


def test_a_trace_sink_sees_every_decision_and_costs_nothing_once_removed(world):
    # Detach a coverage recorder (pytest --fsm-coverage) for this test: otherwise the
    # machine stays on its observed path whether or not the sink's removal restored it.
    prev = observe.set_recorder(None)
    try:
        _sink_then_removed(world)
    finally:
        observe.set_recorder(prev)


def _sink_then_removed(world):
    records = []
    m = world.bind()
    m.add_sink(records.append)
    job = world.admit(m, "r1")
    job.fire(Start())
    job.fire(Start())
    with pytest.raises(TransitionNotAllowed):
        job.fire(Finish())
    job.fire(Abort())
    assert [(r.source, r.event, r.target, r.decision, r.plan) for r in records] == [
        ("queued", "Start", "prefilling", "transition", None),
        ("prefilling", "Start", "prefilling", "ignore", None),
        ("prefilling", "Finish", "prefilling", "error", None),
        ("prefilling", "Abort", "aborted", "transition", "release_aborted"),
    ]
    assert all(r.machine == "lifecycle" and r.instance == "r1" for r in records)
    m.remove_sink(records.append)
    assert m._rows is m._fast_rows and not m._observed  # back on the fast table
    job2 = world.admit(m, "r2")
    job2.fire(Start())
    job2.fire(Abort())
    assert len(records) == 4


def test_trace_records_encode_as_msgpack_and_json(world):
    import msgspec

    records = []
    m = world.bind()
    m.add_sink(records.append)
    job = world.admit(m, "r1")
    job.fire(Abort())
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(records[0]),
                                  type=type(records[0])) == records[0]
    assert b'"decision":"transition"' in msgspec.json.encode(records[0])


def test_an_unbound_machine_refuses_a_planned_edge_naming_the_plan_and_changes_nothing():
    from terminus.fsm import PlanNotBound

    job = LIFECYCLE.create("r1")
    with pytest.raises(PlanNotBound, match=re.escape(
            "machine 'lifecycle', state 'queued', event 'Abort': this edge runs release "
            "plan 'release_aborted', but the machine was never bound to an implementation "
            "of it, so its terminal transition would release nothing; fire on "
            "machine.bind(plans={'release_aborted': Plan(...), ...}, ledger=...); for a "
            "declaration-only use (an oracle, a table test) bind(partial=True) runs "
            "missing plans as empty ones")) as info:
        job.fire(Abort())
    assert info.value.plan == "release_aborted"
    assert job.state == "queued" and not job.busy
    job.fire(Start())  # a plain edge still fires
    assert job.state == "prefilling"


def test_binding_with_partial_runs_missing_plans_as_empty_ones():
    m = LIFECYCLE.bind(partial=True)
    job = m.create("r1")
    report = job.fire(Abort())
    assert report is not None and report.released == [] and report.plan == "release_aborted"
    assert m.stats.plans_run == {"release_aborted": 1}
    with pytest.raises(InvalidDefinition, match="plans 'release_aborted', 'release_finished' "
                       r"have no implementation; pass plans=\{'release_aborted': Plan"):
        LIFECYCLE.bind()


def test_instances_are_small():
    import sys

    # Five slots: machine, state, queue, key, and what it owns (`ledger.Holder._owns`,
    # which saves the ledger a dict entry per owner: 72 + 80 B for an instance and its
    # handle where it was 64 + 124 B).
    assert sys.getsizeof(LIFECYCLE.create()) <= 72
