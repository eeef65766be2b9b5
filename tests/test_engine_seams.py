"""The engine's public seams: the ledger runs a plan over what an instance owns, one
release context, one graph traversal, batched plans as `Plan` objects."""

from __future__ import annotations

import re

import pytest
import torch

from terminus.fsm import (
    Action,
    Ledger,
    Plan,
    PlanReport,
    Release,
    ReleaseFailed,
    ReleaseOutsideTerminal,
    release_effect,
)
from terminus.fsm.bench import Finish, Resume, bench_spec
from terminus.fsm.graph import invert, reachable, shortest_routes
from terminus.fsm.plan import release_context
from terminus.kernels import TokenKVAllocator
from tests.engine_paths import engine_path  # noqa: F401  (a fixture)
from tests.lifecycle import LIFECYCLE, Abort, Job

pytestmark = pytest.mark.usefixtures("engine_path")


def test_shortest_routes_are_bfs_ordered_and_break_ties_by_edge_order():
    edges = {0: [("a", 1), ("b", 2)], 1: [("c", 3)], 2: [("d", 3)], 3: []}
    routes = shortest_routes([0], lambda n: edges[n])
    assert routes == {0: (), 1: ("a",), 2: ("b",), 3: ("a", "c")}
    assert list(routes) == [0, 1, 2, 3]
    succ = [{1, 2}, {3}, {3}, set()]
    assert reachable([3], invert(succ).__getitem__) == {0, 1, 2, 3}
    assert reachable([1], succ.__getitem__) == {1, 3}


def test_the_ledger_runs_a_plan_over_what_the_instance_owns_and_only_inside_a_live_context():
    kv = TokenKVAllocator(32, device="cpu", strict=True)
    log = []

    @release_effect
    def free_kv(ctx, handle):
        log.append(("kv", int(handle.value.numel())))
        kv.free(handle.value)

    @release_effect
    def stream(ctx):
        log.append(("stream", ctx.instance.key))

    ledger = Ledger({"kv": free_kv})
    assert ledger.kinds == frozenset({"kv"})
    m = LIFECYCLE.bind({"release_aborted": Plan(Action(stream), Release("kv")),
                        "release_finished": Plan(Release("kv"))}, ledger)
    job = Job(m, "r1")
    ledger.acquire(job, "kv", kv.alloc(4))
    ledger.acquire(job, "kv", kv.alloc(2))
    report = job.fire(Abort())
    assert log == [("stream", "r1"), ("kv", 4), ("kv", 2)]
    assert [h.kind for h in report.released] == ["kv", "kv"]
    # Outside the engine's context (or with a context kept past its plan) it refuses.
    with release_context(m.name, job, None, "p", "queued", "aborted", ledger) as ctx:
        pass
    with pytest.raises(ReleaseOutsideTerminal, match=re.escape(
            "release effect \"Ledger.run_plan('p')\" was called outside a terminal "
            "transition")):
        ledger.run_plan(ctx, Plan(Release("kv")), PlanReport(m.name, job, "p"))
    kv.assert_full()
    ledger.assert_empty()


def test_the_release_context_is_dead_after_its_block_even_when_the_block_raised():
    with pytest.raises(KeyError), release_context("m", None, None, "p", "a", "b", None) as ctx:
        assert ctx.live
        raise KeyError("boom")
    assert not ctx.live


def _bench_batch(n, plans):
    m = bench_spec().build()
    return m, m.batch(n, plans=plans)


def test_a_batched_plan_is_a_plan_of_actions_each_run_once_with_the_rows():
    calls = []

    @release_effect
    def first(ctx):
        calls.append(("first", ctx.plan, ctx.rows.tolist()))

    @release_effect
    def second(ctx):
        calls.append(("second", ctx.plan, ctx.rows.tolist()))
        raise ConnectionError("stream closed")

    @release_effect
    def third(ctx):
        calls.append(("third", ctx.plan, ctx.rows.tolist()))

    m, b = _bench_batch(4, {"release": Plan(Action(first), Action(second, best_effort=True),
                                            Action(third))})
    fin = m.event_id(Finish)
    step = b.step(torch.tensor([fin, -1, fin, -1]))
    assert step.terminal.tolist() == [0, 2]
    assert calls == [("first", "release", [0, 2]), ("second", "release", [0, 2]),
                     ("third", "release", [0, 2])]
    assert m.stats.plans_run["release"] == 2 and m.stats.effect_errors == 1


def test_a_failing_batched_step_raises_after_every_step_ran():
    ran = []

    @release_effect
    def boom(ctx):
        raise ValueError("pool refused")

    @release_effect
    def after(ctx):
        ran.append(ctx.rows.tolist())

    m, b = _bench_batch(2, {"release": Plan(Action(boom), Action(after))})
    with pytest.raises(ReleaseFailed, match="1 batched plan step") as info:
        b.step(torch.tensor([m.event_id(Finish), m.event_id(Resume)]))
    assert [type(e.error) for e in info.value.exceptions] == [ValueError]
    assert ran == [[0]] and b.count("finished") == 1


def test_a_bare_batched_effect_is_still_a_one_step_plan():
    seen = []

    @release_effect
    def release_rows(ctx, rows):
        seen.append(rows.tolist())

    _, b = _bench_batch(3, {"release": release_rows})
    b.step(b.event_ids([None, Finish, None]))
    assert seen == [[1]]


def test_a_batched_plan_with_a_release_step_is_refused_saying_why():
    with pytest.raises(TypeError, match=re.escape(
            "machine 'bench_request': batched plan 'release' has a Release('kv') step; "
            "batch rows own no ledger handles (a row's resources live in pool tensors "
            "indexed by the row), so release them in an Action over ctx.rows: "
            "Plan(Action(release_rows))")):
        _bench_batch(2, {"release": Plan(Release("kv"))})


def test_the_engine_benchmark_reports_the_ledger_figures_under_their_json_keys():
    from terminus.fsm import bench

    r = bench.ledger_figures(quick=True)
    assert set(r) == {"acquire_us", "acquire_us_by_outstanding", "terminal_fire_us",
                      "bytes_per_handle"}
    assert set(r["acquire_us_by_outstanding"]) == {"10000", "50000"}
    assert r["acquire_us"] == r["acquire_us_by_outstanding"]["50000"] > 0
    assert r["terminal_fire_us"] > 0 and 0 < r["bytes_per_handle"] < 1000
