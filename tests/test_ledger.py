"""The ownership ledger: one owner per handle, transfers, observers, late acquires (I6),
exactly one release."""

from __future__ import annotations

import pytest

from terminus.fsm import (
    Action,
    DoubleRelease,
    Ledger,
    OwnershipError,
    Plan,
    Release,
    release_effect,
)
from terminus.kernels import TokenKVAllocator
from tests.engine_paths import engine_path  # noqa: F401  (a fixture)
from tests.lifecycle import LIFECYCLE, Abort, Chunk, Finish, Start

pytestmark = pytest.mark.usefixtures("engine_path")


@release_effect
def free_kv(ctx, handle):
    ctx.resources.free(handle.value)


@pytest.fixture
def kv():
    pool = TokenKVAllocator(128, strict=True)
    yield pool
    pool.assert_full()


@pytest.fixture
def ledger(kv):
    led = Ledger({"kv": free_kv}, resources=kv)
    yield led
    led.assert_empty()


def bound(ledger):
    return LIFECYCLE.bind({"release_aborted": Plan(Release("kv")),
                           "release_finished": Plan(Release("kv"))}, ledger)


def test_a_transferred_handle_is_released_by_its_new_owner_only(kv, ledger):
    m = bound(ledger)
    parent, child = m.create("parent"), m.create("child")
    h = ledger.acquire(parent, "kv", kv.alloc(8))
    ledger.transfer(h, to=child)
    assert h.owner is child
    assert ledger.owned(parent) == [] and ledger.owned(child) == [h]
    report = parent.fire(Abort())
    assert report.released == []
    assert kv.available == kv.capacity - 8
    report = child.fire(Abort())
    assert report.released == [h] and h.released


def test_an_observer_never_owns_and_its_terminal_releases_nothing(kv, ledger):
    m = bound(ledger)
    owner, warmup = m.create("child"), m.create("warmup")
    h = ledger.acquire(owner, "kv", kv.alloc(4))
    ledger.observe(h, warmup)
    assert ledger.observers(h) == [warmup]
    assert warmup.fire(Abort()).released == []
    assert not h.released
    with pytest.raises(OwnershipError, match="owns"):
        ledger.observe(h, owner)
    owner.fire(Abort())
    assert h.released and ledger.observers(h) == []


def test_a_handle_acquired_after_its_owner_became_terminal_is_released_at_once(kv, ledger):
    m = bound(ledger)
    job = m.create("r1")
    job.fire(Abort())  # the abort won the race against the acquire
    h = ledger.acquire(job, "kv", kv.alloc(16))
    assert h.released
    assert ledger.late_released == 1
    assert kv.available == kv.capacity


def test_a_transfer_to_a_terminal_instance_releases_at_once(kv, ledger):
    m = bound(ledger)
    parent, child = m.create("p"), m.create("c")
    h = ledger.acquire(parent, "kv", kv.alloc(4))
    child.fire(Abort())
    ledger.transfer(h, to=child)
    assert h.released and ledger.late_released == 1
    parent.fire(Abort())


def test_outstanding_lists_every_unreleased_handle_by_owner(kv, ledger):
    m = bound(ledger)
    a, b = m.create("a"), m.create("b")
    ha = ledger.acquire(a, "kv", kv.alloc(2))
    hb1 = ledger.acquire(b, "kv", kv.alloc(2))
    hb2 = ledger.acquire(b, "kv", kv.alloc(2))
    assert ledger.outstanding() == {a: [ha], b: [hb1, hb2]}
    assert ledger.count("kv") == 3
    with pytest.raises(AssertionError, match="unreleased handles"):
        ledger.assert_empty()
    a.fire(Abort())
    b.fire(Start())
    b.fire(Chunk(last=True))
    b.fire(Finish())
    assert ledger.outstanding() == {}


def test_a_second_release_of_a_handle_raises(kv, ledger):
    m = bound(ledger)
    job = m.create("r1")
    h = ledger.acquire(job, "kv", kv.alloc(2))
    job.fire(Abort())
    with pytest.raises(DoubleRelease, match=r"Handle#\d+\(kv, released\) was already released"):
        ledger._mark_released(h)
    with pytest.raises(OwnershipError, match="already released"):
        ledger.transfer(h, to=m.create("other"))


def test_acquiring_a_kind_without_a_releaser_is_refused_before_it_is_owned(kv, ledger):
    job = bound(ledger).create("r1")
    with pytest.raises(OwnershipError, match="no releaser registered for handle kind 'mamba'"):
        ledger.acquire(job, "mamba", 3)
    assert ledger.outstanding() == {}


def test_a_releaser_must_be_a_release_effect():
    with pytest.raises(TypeError, match=r"decorate it with @terminus\.fsm\.release_effect"):
        Ledger({"kv": lambda ctx, h: None})


def test_a_handle_acquired_after_the_plan_ran_but_while_events_drain_is_released(kv, ledger):
    from terminus.fsm import Action

    @release_effect
    def echo_abort(ctx):
        ctx.instance.fire(Abort())  # queued: handled after the plan, while still busy

    m = LIFECYCLE.bind({"release_aborted": Plan(Action(echo_abort), Release("kv")),
                        "release_finished": Plan(Release("kv"))}, ledger)
    job = m.create("r1")
    late = []

    def acquire_while_draining(record):
        if record.event == "Abort" and record.decision == "ignore":
            late.append(ledger.acquire(job, "kv", kv.alloc(4)))

    m.add_sink(acquire_while_draining)
    job.fire(Abort())
    assert len(late) == 1 and late[0].released
    assert ledger.late_released == 1


def test_a_sink_that_raises_does_not_skip_the_terminal_plan(kv, ledger):
    m = bound(ledger)
    inst = m.create("r")
    ledger.acquire(inst, "kv", kv.alloc(8))

    def broken_sink(record):
        raise RuntimeError("trace backend down")

    m.add_sink(broken_sink)
    try:
        with pytest.raises(RuntimeError, match="trace backend down"):
            inst.fire(Abort())
    finally:
        m.remove_sink(broken_sink)
    assert inst.state == "aborted"
    assert ledger.owned(inst) == [] and kv.available == kv.capacity


def test_a_ledger_refuses_an_owner_bound_to_another_ledger(kv, ledger):
    other = Ledger({"kv": free_kv}, resources=kv)
    foreign = bound(other).create("foreign")
    unbound = LIFECYCLE.create("unbound")
    pages = kv.alloc(4)
    for owner in (foreign, unbound):
        with pytest.raises(OwnershipError, match="not bound to this ledger"):
            ledger.acquire(owner, "kv", pages)
    h = ledger.acquire(bound(ledger).create("mine"), "kv", pages)
    with pytest.raises(OwnershipError, match="not bound to this ledger"):
        ledger.transfer(h, to=foreign)
    assert h.owner.fire(Abort()).released == [h]
    other.assert_empty()


def test_binding_a_release_step_without_a_ledger_is_refused():
    from terminus.fsm import InvalidDefinition

    with pytest.raises(InvalidDefinition, match="has no ledger"):
        LIFECYCLE.bind({"release_aborted": Plan(Release("kv", free_kv)),
                        "release_finished": Plan()})


def test_a_release_that_hands_a_sibling_handle_on_does_not_abort_the_plan(kv, ledger):
    # The first release effect transfers the instance's other handle to a peer: the
    # plan must skip it (not release it for the wrong owner, not raise DoubleRelease)
    # and still run its later steps.
    m = bound(ledger)
    peer = m.create("peer")
    streamed = []

    @release_effect
    def free_and_hand_on(ctx, handle):
        ctx.resources.free(handle.value)
        for other in ledger.owned(ctx.instance, "kv"):
            ledger.transfer(other, to=peer)

    @release_effect
    def stream(ctx):
        streamed.append(ctx.instance.key)

    m2 = LIFECYCLE.bind({
        "release_aborted": Plan(Release("kv", free_and_hand_on), Action(stream)),
        "release_finished": Plan(Release("kv"))}, ledger)
    inst = m2.create("r")
    first = ledger.acquire(inst, "kv", kv.alloc(4))
    second = ledger.acquire(inst, "kv", kv.alloc(4))
    report = inst.fire(Abort())
    assert report.released == [first] and report.ok
    assert streamed == ["r"]
    assert second.owner is peer and not second.released
    assert peer.fire(Abort()).released == [second]


def test_fire_returns_the_report_even_when_a_plan_refires_the_same_event_object(kv, ledger):
    abort = Abort()

    @release_effect
    def free_and_echo(ctx, handle):
        ctx.resources.free(handle.value)
        ctx.instance.fire(abort)  # absorbed by the terminal state

    m = LIFECYCLE.bind({"release_aborted": Plan(Release("kv", free_and_echo)),
                        "release_finished": Plan(Release("kv"))}, ledger)
    inst = m.create("r")
    h = ledger.acquire(inst, "kv", kv.alloc(4))
    report = inst.fire(abort)
    assert report is not None and report.released == [h]


def test_an_async_release_step_without_a_running_loop_is_reported_not_lost(kv, ledger):
    @release_effect
    async def late(ctx):
        return None

    m = LIFECYCLE.bind({"release_aborted": Plan(Release("kv"),
                                                Action(late, best_effort=True)),
                        "release_finished": Plan(Release("kv"))}, ledger)
    inst = m.create("r")
    ledger.acquire(inst, "kv", kv.alloc(4))
    report = inst.fire(Abort())
    assert ledger.pending == 0 and report.tasks == []
    assert len(report.errors) == 1
    assert "needs a running event loop" in str(report.errors[0])
    ledger.errors.clear()


class _Proxy:
    """An owner that is not an `fsm.Instance`: the `Owner` protocol (machine, state,
    terminal) over an instance it stands for."""

    def __init__(self, inst):
        self.inst = inst

    @property
    def machine(self):
        return self.inst.machine

    @property
    def state(self):
        return self.inst.state

    @property
    def terminal(self):
        return self.inst.terminal

    def __repr__(self):
        return f"<proxy of {self.inst!r}>"


def test_an_owner_that_is_not_an_instance_owns_transfers_and_is_released_late(kv, ledger):
    m = bound(ledger)
    job, other = m.create("job"), m.create("other")
    proxy = _Proxy(job)
    a = ledger.acquire(proxy, "kv", kv.alloc(4))
    b = ledger.acquire(proxy, "kv", kv.alloc(2))
    mine = ledger.acquire(other, "kv", kv.alloc(1))
    assert ledger.owned(proxy) == [a, b] and ledger.owned(job) == []
    assert ledger.count() == 3 and ledger.outstanding() == {proxy: [a, b], other: [mine]}
    ledger.transfer(a, to=other)  # out of the dict, into an instance's slot
    assert ledger.owned(proxy) == [b] and ledger.owned(other) == [mine, a]
    ledger.transfer(mine, to=proxy)  # and back
    assert ledger.owned(proxy) == [b, mine] and ledger.owned(other) == [a]
    ledger.transfer(b, to=other)
    ledger.transfer(mine, to=other)  # the proxy owns nothing now: no dict entry left
    assert ledger.owned(proxy) == [] and not ledger._owned
    assert other.fire(Abort()).released == [a, b, mine]
    job.fire(Abort())  # the proxy's instance is terminal: a handle for it is released
    late = ledger.acquire(proxy, "kv", kv.alloc(3))  # at once
    assert late.released and ledger.late_released == 1
    assert ledger.count() == 0 and ledger.outstanding() == {}


def test_released_handles_are_dropped_from_the_ledger_walk_as_it_grows(kv, ledger):
    m = LIFECYCLE.bind({"release_aborted": Plan(Release("kv")),
                        "release_finished": Plan(Release("kv"))}, ledger, partial=True)
    kept = m.create("kept")
    first = ledger.acquire(kept, "kv", kv.alloc(1))
    for i in range(5000):  # more than a compaction's minimum (4096)
        inst = m.create(i)
        ledger.acquire(inst, "kv", kv.alloc(1))
        inst.fire(Abort())
    assert len(ledger._all) < 5000  # compacted: released handles are not kept
    assert ledger.count() == 1 and ledger.outstanding() == {kept: [first]}
    assert ledger.released == 5000
    kept.fire(Abort())


def test_a_walk_of_the_handles_that_acquires_on_the_way_sees_every_one_live_at_its_start():
    """Acquiring compacts the ledger's list of handles once it doubles; a walk begun
    before (`outstanding`, `assert_empty` and the audits walk it) goes on over the list
    it started on, as the Python core's compaction (a new list) has it, so it sees every
    handle live at its start, not only those the compaction kept in front."""
    from terminus.fsm.ledger import _COMPACT_MIN

    pool = TokenKVAllocator(4 * _COMPACT_MIN, strict=True)
    led = Ledger({"kv": free_kv}, resources=pool)
    m = bound(led)
    jobs = [m.create(i) for i in range(_COMPACT_MIN - 1)]
    for j in jobs:
        led.acquire(j, "kv", pool.alloc(1))
    for j in jobs[: len(jobs) // 2]:
        j.fire(Abort())  # released: compaction will drop them
    live = [h for h in led._all if not h.released]
    walk = led._iter()
    seen = [next(walk)]
    more = [m.create(f"x{i}") for i in range(8)]
    for j in more:  # the list reaches its compaction mark meanwhile
        led.acquire(j, "kv", pool.alloc(1))
    assert len(led._all) < _COMPACT_MIN  # it was compacted
    seen += list(walk)
    # every handle live at its start, in order; then those acquired before the compaction
    assert seen[: len(live)] == live and len(live) == len(jobs) - len(jobs) // 2
    assert all(h.owner in more for h in seen[len(live):])
    for j in jobs[len(jobs) // 2:] + more:
        j.fire(Abort())
    led.assert_empty()
    pool.assert_full()


def test_a_released_handle_forgets_its_owner_so_the_ledger_keeps_no_terminal_instance():
    """The ledger's list of every handle is compacted only as it doubles: a released
    handle still pointing at its owner kept a terminal request (its prompt, its tokens)
    alive for thousands of acquires. Marked released, a handle lets go of its owner, on
    every release path: a lone handle, several of a kind, the sweep of a kind no step
    named, a late acquire (I6), and an owner the ledger keeps in its own table."""
    import sys

    from terminus.fsm import PlanReport
    from terminus.fsm.plan import release_context

    seen = []

    @release_effect
    def slot(ctx, handle):  # what a releaser sees: released, no owner, the instance in ctx
        seen.append((handle.released, handle.owner, ctx.instance is handle_owner[0]))

    @release_effect
    def note(ctx):
        pass

    handle_owner = [None]
    led = Ledger({"slot": slot, "other": slot})
    m = LIFECYCLE.bind({"release_aborted": Plan(Release("slot")),
                        "release_finished": Plan(Release("slot"))}, led)
    # (a plan of several steps compiles each `Release` step on its own)
    m2 = LIFECYCLE.bind({"release_aborted": Plan(Action(note), Release("slot")),
                         "release_finished": Plan(Release("slot"))}, led)
    for mach, kinds in ((m, ["slot"]), (m, ["slot", "slot", "slot"]), (m, ["other"]),
                        (m, ["slot", "other"]), (m2, ["slot"]), (m2, ["slot", "slot"])):
        inst = mach.create(tuple(kinds))
        handle_owner[0] = inst
        refs = sys.getrefcount(inst)
        handles = [led.acquire(inst, k, i) for i, k in enumerate(kinds)]
        assert sys.getrefcount(inst) == refs + len(kinds)  # each handle holds its owner
        seen.clear()
        assert inst.fire(Abort()).released == handles
        assert sys.getrefcount(inst) == refs, kinds
        assert all(h.released and h.owner is None for h in handles)
        assert seen == [(True, None, True)] * len(kinds)
        # a late acquire (its owner already terminal) is released at once, as forgotten
        late = led.acquire(inst, "slot", 7)
        assert late.released and late.owner is None and sys.getrefcount(inst) == refs

    class Outside:  # an owner that is no instance: the ledger keeps its handles itself
        machine, state, terminal = m, "queued", False

    out = Outside()
    handle_owner[0] = out
    h = led.acquire(out, "slot", 9)
    seen.clear()
    with release_context(m.name, out, None, "p", "queued", "aborted", led) as ctx:
        led.run_plan(ctx, Plan(Release("slot")), PlanReport(m.name, out, "p"))
    assert h.released and h.owner is None and seen == [(True, None, True)]
    led.assert_empty()
