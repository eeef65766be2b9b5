"""The ledger's bookkeeping, read from outside: which handles an owner holds after
acquires and transfers, the release counters, the context and errors of a late release,
async release steps, and the messages of refused calls.

Written against the survivors of `make mutants` (README, "Test strength"): each test
states a behaviour that a plausible slip in `fsm/ledger.py` would break.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from terminus.fsm import (
    Action,
    EffectError,
    Handle,
    Ledger,
    OwnershipError,
    Plan,
    Release,
    ReleaseContext,
    ReleaseFailed,
    release_effect,
)
from terminus.kernels import MetadataSlots, TokenKVAllocator
from tests.engine_paths import engine_path  # noqa: F401  (a fixture)
from tests.lifecycle import LIFECYCLE, Abort

pytestmark = pytest.mark.usefixtures("engine_path")


@release_effect
def free_kv(ctx, handle):
    ctx.resources.kv.free(handle.value)


@release_effect
def free_meta(ctx, handle):
    ctx.resources.meta.free(handle.value)


class Pools:
    def __init__(self) -> None:
        self.kv = TokenKVAllocator(128, strict=True)
        self.meta = MetadataSlots(8)


@pytest.fixture
def pools():
    p = Pools()
    yield p
    p.kv.assert_full()
    p.meta.assert_full()


@pytest.fixture
def ledger(pools):
    led = Ledger({"kv": free_kv, "meta": free_meta}, resources=pools)
    yield led
    led.assert_empty()
    assert led.pending == 0


def bound(ledger, **plans: Plan):
    default = {"release_aborted": Plan(Release("kv")), "release_finished": Plan(Release("kv"))}
    default.update(plans)
    return LIFECYCLE.bind(default, ledger)


# -- who holds what ----------------------------------------------------------------


def test_an_owner_holds_every_handle_it_acquired_in_acquire_order(pools, ledger):
    job = bound(ledger).create("r")
    hs = [ledger.acquire(job, "kv", pools.kv.alloc(2)) for _ in range(4)]
    assert ledger.owned(job) == hs
    assert ledger.count() == 4 and ledger.count("kv") == 4 and ledger.count("meta") == 0
    assert job.fire(Abort()).released == hs
    assert ledger.released == 4


def test_a_transfer_adds_to_what_the_receiver_already_holds(pools, ledger):
    m = bound(ledger)
    giver, taker = m.create("giver"), m.create("taker")
    gifts = [ledger.acquire(giver, "kv", pools.kv.alloc(2)) for _ in range(3)]
    own = ledger.acquire(taker, "kv", pools.kv.alloc(2))
    ledger.transfer(gifts[0], to=taker)  # taker held one handle
    ledger.transfer(gifts[1], to=taker)  # taker held two
    assert ledger.owned(taker) == [own, gifts[0], gifts[1]]
    assert ledger.owned(giver) == [gifts[2]]
    assert giver.fire(Abort()).released == [gifts[2]]
    assert taker.fire(Abort()).released == [own, gifts[0], gifts[1]]


def test_a_transfer_out_of_three_leaves_the_other_two_owned(pools, ledger):
    m = bound(ledger)
    a, b = m.create("a"), m.create("b")
    hs = [ledger.acquire(a, "kv", pools.kv.alloc(2)) for _ in range(3)]
    ledger.transfer(hs[1], to=b)
    assert ledger.owned(a) == [hs[0], hs[2]] and ledger.owned(b) == [hs[1]]
    assert a.fire(Abort()).released == [hs[0], hs[2]]
    assert b.fire(Abort()).released == [hs[1]]


def test_owned_filters_by_kind_for_one_handle_and_for_several(pools, ledger):
    m = bound(ledger)
    one, two = m.create("one"), m.create("two")
    h1 = ledger.acquire(one, "kv", pools.kv.alloc(2))
    assert ledger.owned(one, "kv") == [h1] and ledger.owned(one, "meta") == []
    k = ledger.acquire(two, "kv", pools.kv.alloc(2))
    s = ledger.acquire(two, "meta", pools.meta.alloc())
    assert ledger.owned(two, "meta") == [s] and ledger.owned(two, "kv") == [k]
    assert ledger.count() == 3 and ledger.count("meta") == 1
    one.fire(Abort())
    two.fire(Abort())


def test_a_handle_the_ledger_never_issued_cannot_be_transferred(pools, ledger):
    m = bound(ledger)
    holder_of_one, holder_of_two, to = m.create("1"), m.create("2"), m.create("to")
    ledger.acquire(holder_of_one, "kv", pools.kv.alloc(2))
    for _ in range(2):
        ledger.acquire(holder_of_two, "kv", pools.kv.alloc(2))
    nobody = m.create("nobody")
    for owner in (holder_of_one, holder_of_two, nobody):
        forged = Handle("kv", [0], owner)
        with pytest.raises(OwnershipError,
                           match=r"Handle#\d+\(kv, owner=.*\) is not in the ledger"):
            ledger.transfer(forged, to=to)
    assert ledger.owned(to) == [] and ledger.count() == 3
    for job in (holder_of_one, holder_of_two):
        job.fire(Abort())


def test_a_handle_s_repr_names_its_owner_until_it_is_released(pools, ledger):
    job = bound(ledger).create("r7")
    h = ledger.acquire(job, "kv", pools.kv.alloc(2))
    assert repr(h) == f"Handle#{h.hid}(kv, owner={job!r})"
    job.fire(Abort())
    assert repr(h) == f"Handle#{h.hid}(kv, released)"


def test_assert_empty_lists_each_owner_with_its_handles_one_per_line(pools, ledger):
    m = bound(ledger)
    a, b = m.create("a"), m.create("b")
    ha = ledger.acquire(a, "kv", pools.kv.alloc(2))
    hb = [ledger.acquire(b, "kv", pools.kv.alloc(2)) for _ in range(2)]
    with pytest.raises(AssertionError) as info:
        ledger.assert_empty()
    assert str(info.value) == f"unreleased handles:\n  {a!r}: {[ha]!r}\n  {b!r}: {hb!r}"
    a.fire(Abort())
    b.fire(Abort())


# -- observers ---------------------------------------------------------------------


def test_releasing_an_observed_handle_forgets_its_observers_and_leaves_others(pools, ledger):
    m = bound(ledger)
    warmup = m.create("warmup")
    single, several = m.create("single"), m.create("several")
    lone = ledger.acquire(single, "kv", pools.kv.alloc(2))  # one handle: released inline
    first = ledger.acquire(several, "kv", pools.kv.alloc(2))
    watched = ledger.acquire(several, "kv", pools.kv.alloc(2))
    ledger.observe(watched, warmup)
    # releases of handles nobody observes, while another handle is observed
    assert single.fire(Abort()).released == [lone]
    assert ledger.observers(watched) == [warmup]
    assert several.fire(Abort()).released == [first, watched]
    assert ledger.observers(watched) == []
    assert ledger.released == 3


def test_releasing_a_lone_observed_handle_forgets_its_observers(pools, ledger):
    m = bound(ledger)
    warmup, owner = m.create("warmup"), m.create("owner")
    h = ledger.acquire(owner, "kv", pools.kv.alloc(2))
    ledger.observe(h, warmup)
    other = ledger.acquire(m.create("other"), "kv", pools.kv.alloc(2))
    ledger.observe(other, warmup)
    owner.fire(Abort())
    assert ledger.observers(h) == [] and ledger.observers(other) == [warmup]
    other.owner.fire(Abort())


# -- what a plan releases ----------------------------------------------------------


def test_a_release_step_of_one_kind_never_touches_a_lone_handle_of_another(pools, ledger):
    touched: list[Any] = []

    @release_effect
    def spy_meta(ctx, handle):
        touched.append(handle)
        ctx.resources.meta.free(handle.value)

    m = bound(ledger, release_aborted=Plan(Release("meta", spy_meta)))
    job = m.create("r")
    h = ledger.acquire(job, "kv", pools.kv.alloc(4))
    report = job.fire(Abort())
    assert touched == [] and report.released == [h]  # by the kv default, after the plan


def test_a_handle_acquired_for_an_instance_during_its_own_plan_is_the_plan_s(pools, ledger):
    grabbed: list[Handle] = []

    @release_effect
    def acquire_more(ctx):
        grabbed.append(ledger.acquire(ctx.instance, "kv", ctx.resources.kv.alloc(2)))

    m = bound(ledger, release_aborted=Plan(Action(acquire_more)))
    job = m.create("r")
    report = job.fire(Abort())
    assert report.released == grabbed and grabbed[0].released
    assert ledger.late_released == 0 and ledger.released == 1


def test_a_handle_transferred_to_an_instance_during_its_own_plan_is_the_plan_s(pools, ledger):
    m0 = bound(ledger)
    donor = m0.create("donor")
    gift = ledger.acquire(donor, "kv", pools.kv.alloc(2))

    @release_effect
    def take_gift(ctx):
        ledger.transfer(gift, to=ctx.instance)

    m = bound(ledger, release_aborted=Plan(Action(take_gift)))
    job = m.create("r")
    assert job.fire(Abort()).released == [gift]
    assert ledger.late_released == 0 and ledger.owned(donor) == []
    donor.fire(Abort())


def test_the_released_counter_counts_each_handle_once(pools, ledger):
    m = bound(ledger)
    assert ledger.released == 0 and ledger.late_released == 0
    a, b = m.create("a"), m.create("b")
    ledger.acquire(a, "kv", pools.kv.alloc(2))
    for _ in range(3):
        ledger.acquire(b, "kv", pools.kv.alloc(2))
    a.fire(Abort())
    assert ledger.released == 1
    b.fire(Abort())
    assert ledger.released == 4
    c = m.create("c")
    ledger.acquire(c, "kv", pools.kv.alloc(2))
    c.fire(Abort())  # one handle, released inline: counted like the others
    assert ledger.released == 5
    ledger.acquire(a, "kv", pools.kv.alloc(2))
    ledger.acquire(b, "kv", pools.kv.alloc(2))
    assert ledger.released == 7 and ledger.late_released == 2


# -- a failing release: what the error says ----------------------------------------


@release_effect
def broken_kv(ctx, handle):
    ctx.resources.kv.free(handle.value)
    raise RuntimeError("kv pool is gone")


@pytest.mark.parametrize("handles", [1, 2], ids=["one handle", "two handles"])
def test_a_failing_default_release_is_reported_as_a_plain_step_of_its_kind(pools, handles):
    ledger = Ledger({"kv": broken_kv}, resources=pools)
    m = LIFECYCLE.bind({"release_aborted": Plan(), "release_finished": Plan()}, ledger)
    job = m.create("r")
    for _ in range(handles):
        ledger.acquire(job, "kv", pools.kv.alloc(2))
    with pytest.raises(ReleaseFailed) as info:
        job.fire(Abort())
    errors = info.value.report.errors
    assert len(errors) == handles and ledger.errors == errors
    for err in errors:
        assert (err.machine, err.plan, err.step) == ("lifecycle", "release_aborted",
                                                     "release kv")
        assert err.best_effort is False
        assert str(err).startswith("machine 'lifecycle', plan 'release_aborted': step "
                                   "'release kv' raised RuntimeError: kv pool is gone")
    ledger.assert_empty()


@pytest.mark.parametrize("handles", [1, 2], ids=["one handle", "two handles"])
def test_a_failing_best_effort_release_step_is_reported_and_raises_nothing(pools, handles):
    ledger = Ledger({"kv": free_kv}, resources=pools)
    m = LIFECYCLE.bind({"release_aborted": Plan(Release("kv", broken_kv, best_effort=True)),
                        "release_finished": Plan()}, ledger)
    job = m.create("r")
    for _ in range(handles):
        ledger.acquire(job, "kv", pools.kv.alloc(2))
    report = job.fire(Abort())
    assert len(report.errors) == handles
    for err in report.errors:
        assert err.best_effort is True and err.step == "release kv via broken_kv"
        assert "best-effort step 'release kv via broken_kv' raised" in str(err)
    ledger.assert_empty()


# -- late releases (I6) --------------------------------------------------------------


def test_a_late_release_runs_in_a_context_naming_the_owner_and_its_terminal_state(pools):
    seen: list[tuple[Any, ...]] = []

    @release_effect
    def record_kv(ctx: ReleaseContext, handle):
        seen.append((ctx.machine, ctx.instance, ctx.event, ctx.plan, ctx.source, ctx.target,
                     ctx.ledger, ctx.resources, ctx.rows, ctx.live))
        ctx.resources.kv.free(handle.value)

    ledger = Ledger({"kv": record_kv}, resources=pools)
    job = bound(ledger).create("r")
    job.fire(Abort())
    ledger.acquire(job, "kv", pools.kv.alloc(2))
    assert seen == [("lifecycle", job, None, "<late acquire>", "aborted", "aborted",
                     ledger, pools, None, True)]
    ledger.assert_empty()


def test_a_failing_late_release_raises_its_error_and_records_it(pools):
    ledger = Ledger({"kv": broken_kv}, resources=pools)
    job = bound(ledger).create("r")
    job.fire(Abort())
    with pytest.raises(EffectError) as info:
        ledger.acquire(job, "kv", pools.kv.alloc(2))
    err = info.value
    assert (err.machine, err.plan, err.step) == ("lifecycle", "<late acquire>",
                                                 "release kv (late)")
    assert err.best_effort is False and isinstance(err.error, RuntimeError)
    assert ledger.errors == [err] and ledger.late_released == 1
    ledger.assert_empty()


# -- async release steps -----------------------------------------------------------


@release_effect
def free_kv_later_then_fail(ctx, handle):
    kv = ctx.resources.kv

    async def later():
        kv.free(handle.value)
        raise TimeoutError("registry did not answer")

    return later()


@release_effect
def fail_later(ctx):
    async def later():
        raise ConnectionError("peer gone")

    return later()


@pytest.mark.parametrize("handles", [1, 2], ids=["one handle", "two handles"])
def test_a_failing_async_release_is_recorded_with_its_machine_plan_and_step(pools, handles):
    ledger = Ledger({"kv": free_kv_later_then_fail}, resources=pools)
    m = LIFECYCLE.bind({"release_aborted": Plan(Action(fail_later, best_effort=True)),
                        "release_finished": Plan()}, ledger)

    async def main():
        job = m.create("r")
        for _ in range(handles):
            ledger.acquire(job, "kv", pools.kv.alloc(2))
        report = job.fire(Abort())
        assert len(report.tasks) == handles + 1 and ledger.pending == handles + 1
        return await ledger.drain()

    errors = asyncio.run(main())
    assert [(e.machine, e.plan, e.step, e.best_effort, type(e.error)) for e in errors] == (
        [("lifecycle", "release_aborted", "fail_later", True, ConnectionError)]
        + [("lifecycle", "release_aborted", "release kv", False, TimeoutError)] * handles)
    assert ledger.pending == 0
    ledger.assert_empty()


def test_an_async_release_step_with_a_chosen_name_is_recorded_under_that_name(pools):
    ledger = Ledger({"kv": free_kv}, resources=pools)
    m = LIFECYCLE.bind({"release_aborted": Plan(Release("kv", free_kv_later_then_fail)),
                        "release_finished": Plan()}, ledger)

    async def main():
        job = m.create("r")
        for _ in range(2):
            ledger.acquire(job, "kv", pools.kv.alloc(2))
        job.fire(Abort())
        return await ledger.drain()

    errors = asyncio.run(main())
    assert [(e.step, e.best_effort) for e in errors] == [
        ("release kv via free_kv_later_then_fail", False)] * 2
    ledger.assert_empty()


def test_a_cancelled_async_release_step_is_recorded_not_silent(pools):
    reported: list[dict[str, Any]] = []

    @release_effect
    def free_kv_after_a_wait(ctx, handle):
        kv = ctx.resources.kv

        async def later():
            try:
                await asyncio.sleep(3600)
            finally:
                kv.free(handle.value)  # a cancelled release still frees on its way out

        return later()

    ledger = Ledger({"kv": free_kv_after_a_wait}, resources=pools)
    m = LIFECYCLE.bind({"release_aborted": Plan(), "release_finished": Plan()}, ledger)

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, c: reported.append(c))
        job = m.create("r")
        ledger.acquire(job, "kv", pools.kv.alloc(2))
        (task,) = job.fire(Abort()).tasks
        await asyncio.sleep(0)
        task.cancel()
        await ledger.drain()
        assert task.cancelled()

    asyncio.run(main())
    (err,) = ledger.errors
    assert isinstance(err.error, asyncio.CancelledError)
    assert "was cancelled before it finished" in str(err.error)
    assert err.step == "release kv"
    assert ledger.pending == 0 and reported == []
    ledger.assert_empty()
    pools.kv.assert_full()  # this step freed on its way out; the error says to check


# -- refused calls name what was wrong and what to do --------------------------------


def test_a_refused_acquire_or_transfer_names_the_call_and_the_fix(pools, ledger):
    stranger = LIFECYCLE.create("stranger")  # bound to no ledger
    with pytest.raises(OwnershipError) as info:
        ledger.acquire(stranger, "kv", [0])
    assert str(info.value) == (
        f"cannot acquire for {stranger!r}: its machine 'lifecycle' is not bound to this "
        "ledger, so its terminal transition would never release the handle; bind the "
        "machine with ledger=<this ledger>")
    job = bound(ledger).create("r")
    h = ledger.acquire(job, "kv", pools.kv.alloc(2))
    with pytest.raises(OwnershipError, match=r"^cannot transfer to .*: its machine 'lifecycle'"):
        ledger.transfer(h, to=stranger)
    assert ledger.owned(job) == [h]
    job.fire(Abort())


def test_a_releaser_that_is_not_a_release_effect_is_refused_naming_its_kind():
    def plain(ctx, handle):
        return None

    with pytest.raises(TypeError,
                       match=r"^releaser for kind 'kv' .*plain' is not a release effect"):
        Ledger({"kv": plain})
    with pytest.raises(TypeError, match=r"^releaser for kind 'meta' "):
        Ledger().register_kind("meta", plain)
