"""A plan's last step releases what its instance still owns by the kinds' default
releasers; a default releaser may give the instance a new handle meanwhile (it is the
plan's: the instance is busy), and that one is released too, by another pass, on every
path a terminal step takes (the one-handle path, an unrolled plan with actions, the
general path a sink forces). A releaser that gives one every time is stopped after
`ledger._SWEEPS` passes: what is left stays owned and the plan reports an error naming
it (I3: a plan never forgets a handle silently)."""

from __future__ import annotations

from typing import Any

import pytest

from terminus.fsm import Action, Ledger, Plan, Release, ReleaseFailed, release_effect
from terminus.fsm.ledger import _SWEEPS
from terminus.kernels import TokenKVAllocator
from tests.lifecycle import LIFECYCLE, Abort, Job

PLANS = {
    "release steps only": lambda: Plan(Release("a")),
    "with an action": lambda: Plan(Action(release_effect(lambda ctx: None)), Release("a")),
    "nothing named": lambda: Plan(Action(release_effect(lambda ctx: None))),
}


def _setup(plan: Plan, gives: int, observed: bool) -> tuple[Any, ...]:
    """A job owning one "a" handle; releasing an "a" gives the instance being released a
    new "b" handle, `gives` times in all."""
    kv = TokenKVAllocator(64, strict=True)
    left = [gives]
    log: list[str] = []

    @release_effect
    def free_a(ctx: Any, h: Any) -> None:
        log.append("a")
        ctx.resources.free(h.value)
        if left[0] > 0:
            left[0] -= 1
            ctx.ledger.acquire(ctx.instance, "a" if left[0] % 2 else "b",
                               ctx.resources.alloc(1))

    @release_effect
    def free_b(ctx: Any, h: Any) -> None:
        log.append("b")
        ctx.resources.free(h.value)
        if left[0] > 0:
            left[0] -= 1
            ctx.ledger.acquire(ctx.instance, "a", ctx.resources.alloc(1))

    ledger = Ledger({"a": free_a, "b": free_b}, resources=kv)
    m = LIFECYCLE.bind({"release_aborted": plan, "release_finished": Plan(Release("a"))},
                       ledger)
    if observed:
        m.add_sink(lambda record: None)
    job = Job(m, "r")
    ledger.acquire(job, "a", kv.alloc(2))
    return kv, ledger, job, left, log


@pytest.mark.parametrize("observed", [False, True], ids=["compiled", "general"])
@pytest.mark.parametrize("shape", sorted(PLANS))
@pytest.mark.parametrize("gives", [1, 3, _SWEEPS - 1])
def test_a_handle_a_default_releaser_gives_the_instance_is_released_by_the_plan(
        shape, observed, gives):
    kv, ledger, job, left, log = _setup(PLANS[shape](), gives, observed)
    report = job.fire(Abort())
    assert job.state == "aborted"
    assert ledger.owned(job) == []
    assert len(report.released) == gives + 1 == len(log)
    assert report.errors == []
    assert left == [0]
    ledger.assert_empty()
    kv.assert_full()


@pytest.mark.parametrize("observed", [False, True], ids=["compiled", "general"])
@pytest.mark.parametrize("shape", sorted(PLANS))
def test_a_releaser_that_always_gives_a_new_handle_is_stopped_and_named(shape, observed):
    kv, ledger, job, left, log = _setup(PLANS[shape](), 10_000, observed)
    with pytest.raises(ReleaseFailed) as e:
        job.fire(Abort())
    err = e.value.report.errors
    assert [x.step for x in err] == ["release what no step named"]
    assert f"after {_SWEEPS} passes" in str(err[0])
    assert "a new handle each time" in str(err[0])
    assert job.state == "aborted"
    (h,) = ledger.owned(job)  # what is left stays owned: the leak audit shows it
    assert 10_000 - left[0] == len(log)  # each release gave one: bounded, not endless
    assert len(log) <= _SWEEPS + 1
    # Clean up: stop giving, and release the leftover as a late acquire would be.
    left[0] = 0
    ledger._release_late(h)
    ledger.assert_empty()
    kv.assert_full()
