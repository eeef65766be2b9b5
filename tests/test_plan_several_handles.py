"""A compiled plan over an instance that owns several handles: each `Release(kind)` step
releases the handles of its kind the instance owns at that moment (`Ledger._release_kind`:
one of the kind, several, none), and the plan's first inline release stores the report's
handle directly (`machine._REPORT_FIRST`). Differential, on random plans and ownerships
with several handles of a kind, observers, and release effects that move a handle to
another instance, give the instance a new one (an Action, a step's own function, or a
default releaser, which the final sweep also calls: released by its next pass,
`Ledger._sweep`), return a value, or raise: the compiled path does what the general
path (`Ledger._run_steps`, taken while a sink observes the machine) does, step for step."""

from __future__ import annotations

import random
from typing import Any

import pytest

from terminus.fsm import Action, Ledger, Plan, Release, ReleaseFailed, release_effect
from terminus.fsm.machine import _plan_source
from terminus.kernels import TokenKVAllocator
from tests.lifecycle import LIFECYCLE, Abort, Job

KINDS = ("a", "b", "c", "d")


def _sink(record: Any) -> None:
    """A sink: while one observes the machine, every step takes the general path."""


def _run(seed: int, observed: bool) -> tuple[Any, ...]:
    rng = random.Random(seed)
    kv = TokenKVAllocator(256, strict=True)
    log: list[Any] = []
    jobs: dict[str, Any] = {}

    def releaser(kind: str) -> Any:
        @release_effect
        def free(ctx: Any, handle: Any) -> Any:
            log.append(("default", kind, handle.value.numel()))
            ctx.resources.free(handle.value)
            what = rng.random()
            owned = ctx.ledger.owned(ctx.instance)
            if what < 0.15 and owned:  # move one of the others away: skipped later
                moved = rng.choice(owned)
                log.append(("moved", moved.kind, moved.value.numel()))
                ctx.ledger.transfer(moved, jobs["peer"])
            elif what < 0.22:
                raise RuntimeError(f"default release of {kind} failed")
            elif what < 0.3:
                return what  # a value (not awaitable): ignored, as on the general path
            elif what < 0.36:  # a new one, the plan's: a later step or sweep pass takes it
                ctx.ledger.acquire(ctx.instance, rng.choice(KINDS), ctx.resources.alloc(1))
            return None

        return free

    @release_effect
    def own(ctx: Any, handle: Any) -> None:
        log.append(("own", handle.kind, handle.value.numel()))
        ctx.resources.free(handle.value)
        if handle.value.numel() == 3:
            raise RuntimeError(f"own release of {handle.kind} failed")
        if rng.random() < 0.3:  # a new one, the plan's: a later step or the sweep takes it
            ctx.ledger.acquire(ctx.instance, rng.choice(KINDS), ctx.resources.alloc(1))

    def action(i: int) -> Any:
        @release_effect
        def act(ctx: Any) -> None:
            log.append(("action", i, [(h.kind, h.value.numel())
                                      for h in ctx.ledger.owned(ctx.instance)]))
            if rng.random() < 0.3:
                ctx.ledger.acquire(ctx.instance, rng.choice(KINDS), ctx.resources.alloc(2))

        act.__name__ = f"act{i}"
        return act

    steps: list[Any] = []
    for i in range(rng.randint(1, 8)):
        if rng.random() < 0.75:
            kind = rng.choice(KINDS)
            steps.append(Release(kind, own) if rng.random() < 0.25 else Release(kind))
        else:
            steps.append(Action(action(i), best_effort=rng.random() < 0.5))
    if not any(type(s) is Action for s in steps):
        steps.insert(rng.randint(0, len(steps)), Action(action(99)))
    ledger = Ledger({k: releaser(k) for k in KINDS}, resources=kv)
    m = LIFECYCLE.bind({"release_aborted": Plan(*steps),
                        "release_finished": Plan(Release("a"))}, ledger)
    if observed:
        m.add_sink(_sink)
    job, peer = Job(m, "r"), Job(m, "peer")
    jobs["peer"] = peer
    for _ in range(rng.choice((0, 1, 2, 3, 5, 7))):
        h = ledger.acquire(job, rng.choice(KINDS), kv.alloc(rng.randint(1, 4)))
        if rng.random() < 0.2:  # watched by the peer: forgotten when released
            ledger.observe(h, peer)
    try:
        report = job.fire(Abort())
        raised = None
    except ReleaseFailed as e:
        report, raised = e.report, str(e)
    out = (log, [(h.kind, h.value.numel()) for h in report.released],
           [(e.step, e.best_effort) for e in report.errors], raised, job.state,
           dict(m.stats.plans_run), ledger.released, ledger.late_released,
           [(h.kind, h.value.numel()) for h in ledger.owned(peer)], ledger.owned(job))
    try:  # what was moved to the peer goes with its own plan
        peer.fire(Abort())
    except ReleaseFailed:
        pass
    ledger.assert_empty()
    kv.assert_full()
    assert not ledger._observers
    return out


@pytest.mark.parametrize("seed", range(150))
def test_a_compiled_plan_over_several_handles_does_what_the_general_path_does(seed):
    compiled = _run(seed, observed=False)
    general = _run(seed, observed=True)
    assert compiled == general
    assert compiled[4] == "aborted"
    assert compiled[-1] == []  # the plan released (or moved) all it owned


@pytest.mark.python_core  # (it spies on the Python `Ledger._release_kind`)
def test_the_seeds_cover_one_several_and_none_of_a_kind():
    """The random plans above do reach each way a step finds its handles."""
    from terminus.fsm import ledger as L

    seen: set[str] = set()
    orig = L.Ledger._release_kind

    def spy(self: Any, ctx: Any, owner: Any, cur: Any, kind: Any, *rest: Any) -> None:
        n = sum(1 for h in cur if h.kind == kind)
        seen.add("sweep" if kind is None else "none" if n == 0 else "one" if n == 1
                 else "several")
        orig(self, ctx, owner, cur, kind, *rest)

    L.Ledger._release_kind = spy  # type: ignore[method-assign]
    try:
        for seed in range(150):
            _run(seed, observed=False)
    finally:
        L.Ledger._release_kind = orig  # type: ignore[method-assign]
    assert seen == {"sweep", "none", "one", "several"}


def test_only_the_first_release_block_of_a_plan_stores_the_report_directly():
    src = _plan_source("ADADRA")
    assert src.count("report._released = cur  # the plan's first release") == 1
    assert src.count("if report._released is None:") == 2  # the later two blocks
    first = src.index("kind1")
    assert src.index("the plan's first release") > first
    assert src.index("the plan's first release") < src.index("kind3")


@release_effect
def _count(ctx: Any, handle: Any) -> None:
    ctx.resources.append(handle.kind)


def test_a_report_lists_every_handle_a_plan_released_in_order():
    """The first release stored bare, the next ones appended (several of a kind, the
    one-handle inline block after them, the sweep)."""
    freed: list[str] = []
    ledger = Ledger({k: _count for k in KINDS}, resources=freed)

    @release_effect
    def note(ctx: Any) -> None:
        freed.append("note")

    m = LIFECYCLE.bind({"release_aborted": Plan(Release("b"), Action(note), Release("a")),
                        "release_finished": Plan(Release("a"))}, ledger)
    job = Job(m, "r")
    hs = [ledger.acquire(job, k, i) for i, k in enumerate("abbc")]
    report = job.fire(Abort())
    assert freed == ["b", "b", "note", "a", "c"]
    assert report.released == [hs[1], hs[2], hs[0], hs[3]]
    assert all(h.released for h in hs)
    ledger.assert_empty()
    # one handle: the first release block takes it inline, stored bare in the report
    job = Job(m, "s")
    h = ledger.acquire(job, "b", 9)
    assert job.fire(Abort()).released == [h]
    ledger.assert_empty()

