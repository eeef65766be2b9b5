"""The engine's compiled core (`fsm/_engine.c`) and the switch between it and the Python.

The compiled core is the Python's common case in C: instances' slots and `fire`, the
machine's slots `fire` reads, the ledger's `acquire` / `transfer` / `owned` for the
engine's instances, and each terminal edge's plan run (`PlanCell`). The Python stays the
reference; the differential tests elsewhere (`test_plan_unrolled`, `test_plan_several_handles`,
`test_compiled_cells`: the compiled cells against the general path, which is Python in
both cores) run in both, and so does the suite's engine part (`make test` runs it again with
`TERMINUS_PURE_PYTHON=1`). Here: what only the compiled core can get wrong (references
leaked or dropped, a context reused while someone holds it, a plan cell re-entered), the
switch itself, and one whole simulation giving the same summary in both cores.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest

from terminus.fsm import (
    Action,
    Ledger,
    Plan,
    Release,
    ReleaseFailed,
    ReleaseOutsideTerminal,
    _core,
    release_effect,
)
from terminus.fsm.ledger import Holder
from terminus.kernels import TokenKVAllocator
from tests.lifecycle import LIFECYCLE, Abort, Chunk, Finish, Job, Start

compiled = pytest.mark.skipif(_core.C is None, reason="the compiled core is not in use")

KINDS = ("a", "b")


def _world(plans: dict[str, Plan] | None = None, log: list[Any] | None = None) -> Any:
    kv = TokenKVAllocator(64, strict=True)
    seen = log if log is not None else []

    def releaser(kind: str) -> Any:
        @release_effect
        def free(ctx: Any, handle: Any) -> None:
            seen.append((kind, int(handle.value.numel())))
            ctx.resources.free(handle.value)

        return free

    ledger = Ledger({k: releaser(k) for k in KINDS}, resources=kv)
    m = LIFECYCLE.bind(plans or {"release_aborted": Plan(Release("a")),
                                 "release_finished": Plan(Release("a"), Release("b"))},
                       ledger)
    return kv, ledger, m


def test_ci_runs_the_compiled_core():
    """Where CI builds the package, the compiled core must be what runs (a build that
    failed quietly would leave the engine several times slower, every test still green)."""
    if os.environ.get("TERMINUS_REQUIRE_COMPILED") != "1":
        pytest.skip("TERMINUS_REQUIRE_COMPILED=1 is set where the core must be built (CI)")
    if os.environ.get(_core.PURE_ENV, "") not in ("", "0"):
        pytest.skip(f"{_core.PURE_ENV} asks for the Python core")
    assert _core.C is not None, "terminus.fsm._engine was not built, or is stale"
    assert Holder is _core.C.Holder


def test_the_environment_switch_runs_the_python_alone():
    code = ("from terminus.fsm import _core, ledger, machine; "
            "print(_core.C is None, ledger.Holder.__module__, "
            "type(machine.Instance.fire).__name__)")
    env = dict(os.environ, **{_core.PURE_ENV: "1"})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["True", "terminus.fsm.ledger", "function"]


@compiled
def test_a_build_older_than_its_source_is_not_used(tmp_path):
    newer = tmp_path / "_engine.c"
    newer.write_text("/* edited after the build */\n")
    later = Path(_core.C.__file__).stat().st_mtime + 60
    os.utime(newer, (later, later))
    with pytest.warns(RuntimeWarning, match="older than fsm/_engine.c.*make setup"):
        assert _core.load(newer) is None
    os.utime(newer, (later - 120, later - 120))
    assert _core.load(newer) is _core.C


@compiled
def test_instances_fire_acquire_and_release_through_the_compiled_core():
    kv, ledger, m = _world()
    job = Job(m, "r")
    assert type(job).__mro__[-2] is _core.C.Holder
    assert type(m).__mro__[-2] is _core.C.MachineCore
    assert type(ledger).__mro__[-2] is _core.C.LedgerCore
    h = ledger.acquire(job, "a", kv.alloc(2))
    assert job._owns is h and ledger.owned(job) == [h] and ledger.owned(job, "b") == []
    job.fire(Start())
    report = job.fire(Abort())
    assert job.state == "aborted" and report.released == [h] and h.released
    assert m.stats.plans_run == {"release_aborted": 1}
    ledger.assert_empty()
    kv.assert_full()


@compiled
@pytest.mark.usefixtures("unobserved")
def test_a_terminal_cell_is_a_plan_cell_named_after_its_plan():
    kv, ledger, m = _world()
    job = Job(m, "r")
    ledger.acquire(job, "a", kv.alloc(1))
    job.fire(Abort())
    cells = [c for c in m._on if type(c) is _core.C.PlanCell]
    assert [repr(c) for c in cells] == ["<compiled plan lifecycle:release_aborted, 1 steps>"]
    ledger.assert_empty()
    kv.assert_full()


def test_references_are_neither_leaked_nor_dropped():
    """Every object the core passes through (events, kinds, values, effects, the ledger,
    the machine) has as many references after a thousand lifecycles as before: a missing
    decref would add one each time, an extra one would free something still in use."""
    log: list[Any] = []

    @release_effect
    def act(ctx: Any) -> None:
        log.append(ctx.event)

    freed: list[Any] = []
    kv, ledger, m = _world({"release_aborted": Plan(Action(act), Release("a")),
                            "release_finished": Plan(Release("b"), Action(act))}, freed)
    start, abort, finish, chunk = Start(), Abort(), Finish(), Chunk(last=True)
    kind_a, kind_b = "a", "b"
    watched = (start, abort, finish, chunk, kind_a, kind_b, ledger, m, act, kv, Job)

    def lifecycles(n: int) -> None:
        for i in range(n):
            job = Job(m, i)
            ledger.acquire(job, kind_a, kv.alloc(1))
            if i % 2:
                job.fire(start)
                job.fire(chunk)
                other = Job(m, -i)
                h = ledger.acquire(other, kind_b, kv.alloc(1))
                ledger.transfer(h, job)
                assert [x.kind for x in ledger.owned(job)] == ["a", "b"]
                other.fire(abort)
                job.fire(finish)
            else:
                job.fire(abort)
                job.fire(abort)  # an ignore: the terminal state absorbs it
        log.clear()
        freed.clear()
        ledger._compact()  # (released handles are dropped from `_all`)

    lifecycles(50)  # warm: what is made once (compiled cells, caches) is made
    gc.collect()
    before = [sys.getrefcount(o) for o in watched]
    lifecycles(1000)
    gc.collect()
    assert [sys.getrefcount(o) for o in watched] == before
    ledger.assert_empty()
    kv.assert_full()


def test_an_instance_its_handles_and_its_report_are_freed_once_dropped():
    class Weak(Job):
        __slots__ = ("__weakref__",)

    kv, ledger, m = _world()
    job = Weak(m, "r")
    h = ledger.acquire(job, "a", kv.alloc(1))
    report = job.fire(Abort())
    assert report.instance is job
    ref = weakref.ref(job)
    assert h.owner is None and h in ledger._all  # (released, not compacted away yet)
    del job, report
    # Freed at once, by its reference count: no handle in the ledger's list, nor the
    # context the cell keeps for its next plan, holds it.
    assert ref() is None
    kv.assert_full()


@compiled
def test_a_transfer_out_of_an_instance_in_its_own_plan_is_made_in_c():
    """A group hands its references to its children inside its terminal plan: the
    compiled transfer makes that move itself, with no call of the Python's (which it
    used to hand every transfer out of a terminal owner)."""
    kv, ledger, _ = _world()

    @release_effect
    def hand_over(ctx: Any) -> None:
        for h in ledger.owned(ctx.instance, "a"):
            ledger.transfer(h, child)

    m = LIFECYCLE.bind({"release_aborted": Plan(Action(hand_over), Release("a")),
                        "release_finished": Plan(Release("a"))}, ledger)
    child = Job(m, "child")
    group = Job(m, "group")
    handles = [ledger.acquire(group, "a", kv.alloc(2)) for _ in range(2)]
    calls = []
    python_transfer = ledger._transfer_py
    ledger._transfer_py = lambda *a: calls.append(a) or python_transfer(*a)
    assert group.fire(Abort()).released == []  # (nothing left for its Release step)
    assert calls == [] and ledger.owned(child) == handles
    assert all(h.owner is child and not h.released for h in handles)
    assert child.fire(Abort()).released == handles
    ledger.assert_empty()
    kv.assert_full()


@compiled
def test_a_released_handle_leaves_the_collector_only_when_it_holds_nothing_cyclic():
    """Released, a handle holds its kind, its value and a number: with an int value it
    can be in no cycle and is untracked, as msgspec leaves such a struct; with a tensor
    (or any object the collector tracks) it stays tracked, and a value assigned later
    tracks it again."""
    kv = TokenKVAllocator(64, strict=True)

    @release_effect
    def free(ctx: Any, handle: Any) -> None:
        kv.free(handle.value)

    @release_effect
    def forget(ctx: Any, handle: Any) -> None:
        pass

    ledger = Ledger({"a": free, "b": forget})
    m = LIFECYCLE.bind({"release_aborted": Plan(Release("a")),
                        "release_finished": Plan(Release("a"))}, ledger)
    job, other = Job(m, "r"), Job(m, "s")
    pages = ledger.acquire(job, "a", kv.alloc(1))
    slot = ledger.acquire(other, "b", 3)
    assert gc.is_tracked(pages) and gc.is_tracked(slot)  # each holds its owner
    job.fire(Abort())
    other.fire(Abort())
    assert pages.owner is None and slot.owner is None
    assert gc.is_tracked(pages) and not gc.is_tracked(slot)
    slot.value = [slot]  # a cycle through it: the collector must see it again
    assert gc.is_tracked(slot)
    ledger.assert_empty()
    kv.assert_full()


def test_a_context_an_effect_kept_is_never_reused_nor_live_again():
    kept: list[Any] = []

    @release_effect
    def keep(ctx: Any) -> None:
        kept.append(ctx)

    kv, ledger, m = _world({"release_aborted": Plan(Action(keep), Release("a")),
                            "release_finished": Plan(Release("a"))})
    for i in range(3):
        job = Job(m, i)
        ledger.acquire(job, "a", kv.alloc(1))
        job.fire(Abort())
    assert len({id(c) for c in kept}) == 3 and not any(c.live for c in kept)
    with pytest.raises(ReleaseOutsideTerminal):
        keep(kept[0])
    kv.assert_full()


def test_an_effect_that_ends_another_instance_through_the_same_cell_runs_both_plans():
    """A plan's effect fires the same terminal edge of another instance (the cell runs
    inside itself): each plan runs in a live context of its own, each report is its
    own, and both contexts are dead after."""
    seen: list[Any] = []
    others: list[Any] = []

    @release_effect
    def end_the_other(ctx: Any) -> None:
        seen.append((ctx.instance.key, ctx.live))
        if others:
            other = others.pop()
            inner = other.fire(Abort())
            seen.append(("inner", inner.instance.key, [x.kind for x in inner.released]))
        seen.append((ctx.instance.key, ctx.live))

    kv, ledger, m = _world({"release_aborted": Plan(Action(end_the_other), Release("a")),
                            "release_finished": Plan(Release("a"))})
    Job(m, "warm").fire(Abort())  # the cell now keeps a spare context: the outer plan's
    seen.clear()
    outer, other = Job(m, "outer"), Job(m, "other")
    ledger.acquire(outer, "a", kv.alloc(1))
    ledger.acquire(other, "a", kv.alloc(2))
    others.append(other)
    report = outer.fire(Abort())
    assert seen == [("outer", True), ("other", True), ("other", True),
                    ("inner", "other", ["a"]), ("outer", True)]
    assert report.instance is outer and [x.kind for x in report.released] == ["a"]
    assert outer.state == other.state == "aborted" and not outer.busy and not other.busy
    assert m.stats.plans_run == {"release_aborted": 3}
    ledger.assert_empty()
    kv.assert_full()


def test_a_step_that_fails_is_reported_with_its_own_traceback():
    @release_effect
    def broken(ctx: Any) -> None:
        raise RuntimeError("the effect failed")

    kv, ledger, m = _world({"release_aborted": Plan(Action(broken), Release("a")),
                            "release_finished": Plan(Release("a"))})
    job = Job(m, "r")
    ledger.acquire(job, "a", kv.alloc(1))
    with pytest.raises(ReleaseFailed) as failed:
        job.fire(Abort())
    err = failed.value.exceptions[0]
    assert (err.machine, err.plan, err.step) == ("lifecycle", "release_aborted", "broken")
    tb = err.error.__traceback__
    assert tb is not None
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert tb.tb_frame.f_code.co_name == "broken"  # where it raised
    assert job.state == "aborted" and not job.busy  # every other step ran
    kv.assert_full()


def test_bad_arguments_are_type_errors_that_name_what_was_wrong():
    kv, ledger, m = _world()
    job = Job(m, "r")
    with pytest.raises(TypeError):
        job.fire()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        job.fire(Abort(), Abort())  # type: ignore[call-arg]
    if _core.C is not None:  # the compiled base's own __init__, without a machine
        with pytest.raises(TypeError, match="missing required argument 'machine'"):
            _core.C.Holder.__init__(job)
    assert job.state == "queued" and ledger.owned(job) == []  # nothing changed
    h = ledger.acquire(job, kind="a", value=kv.alloc(1))  # keywords: the Python's path
    assert ledger.owned(owner=job, kind="a") == [h]
    job.fire(Abort())
    ledger.assert_empty()
    kv.assert_full()


def _summary(env: dict[str, str], args: list[str], out: Path) -> dict[str, Any]:
    subprocess.run([sys.executable, "-m", "terminus.fsm", "simulate", "--no-progress",
                    "--json", str(out), *args], env=env, check=True,
                   capture_output=True)
    r = json.loads(out.read_text())
    for timing in ("seconds", "requests_per_second"):
        r.pop(timing)
        r.get("baseline", {}).pop(timing, None)
    return r


@compiled
@pytest.mark.slow
@pytest.mark.parametrize("args", [["--requests", "2000"],
                                  ["--requests", "1000", "--page-size", "1", "--seed", "3"]])
def test_a_simulation_gives_the_same_summary_in_both_cores(args, tmp_path):
    """Every figure of `terminus simulate`'s summary (transitions by machine, plans,
    terminal states, prefix-cache counts, leaks) is the same with the compiled core and
    with the Python alone: one run of each, the same workload."""
    from terminus.effects.sanitize import ENV as SANITIZE_ENV

    # (the sanitizer off, as a serving engine runs: this compares the engines' decisions)
    env = dict(os.environ, **{_core.PURE_ENV: "0", SANITIZE_ENV: "0"})
    both = _summary(env, args, tmp_path / "c.json")
    pure = _summary(dict(env, **{_core.PURE_ENV: "1"}), args, tmp_path / "py.json")
    assert both == pure
    assert sum(both["leaks"].values()) == 0 and both["transitions"] > 10_000
