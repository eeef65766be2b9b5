"""`terminus bench engine`: the compiled engine against transitions, python-statemachine
and a bare dict table, on one declaration, in one run.

Figures (JSON keys): `fire_ns` ({terminus, transitions, statemachine, dict_table}, ns per
event at 100k live instances, 1k for the two libraries whose per-instance setup is
O(n)), `fire_ns_1k` (the same at 1k), `fire_ns_recorder_attached` (terminus with a
no-op recorder attached, to show what observation costs and that detaching it costs
nothing), `bytes_per_instance`, `create_us`, `create_us_1k`, `batch_step_ns_per_instance`
(100k instances, CPU) and `speedup_vs_transitions`.

The ledger figures are measured on the engine alone (a two-state machine whose terminal
edge runs one `Release("kv")` step, a no-op releaser, one handle per instance):
`acquire_us` (µs per `ledger.acquire` with the most handles outstanding, 200k; 50k with
`--quick`), `acquire_us_by_outstanding` (the same at each size, to show it is flat),
`terminal_fire_us` (µs per terminal `fire` that runs the plan and releases the handle)
and `bytes_per_handle` (traced memory per outstanding handle). Each timing is the best
of three runs, in CPU time of the benchmark's thread (`time.thread_time_ns`), so that
other processes on a shared machine do not inflate these sub-microsecond figures.
"""

from __future__ import annotations

import gc
import time
import tracemalloc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from . import observe
from .ledger import Ledger
from .plan import Plan, Release, release_effect
from .spec import ANY, IGNORE, Event, Spec, State, go

if TYPE_CHECKING:
    from .machine import Machine


class Tick(Event):
    """Advance a running request by one decode step."""


class Yield(Event):
    """Preempt: running -> waiting."""


class Resume(Event):
    """waiting -> running."""


class Finish(Event):
    """running -> finished (terminal)."""


def bench_spec() -> Spec:
    """The declaration every runtime in this benchmark runs."""
    return Spec(
        "bench_request",
        states=(State("waiting", initial=True), State("running"),
                State("finished", terminal=True)),
        events=(Tick, Yield, Resume, Finish),
        table={
            "waiting": {Resume: go("running"), Tick: IGNORE, Yield: IGNORE,
                        Finish: go("finished", plan="release")},
            "running": {Tick: go("running"), Yield: go("waiting"), Resume: IGNORE,
                        Finish: go("finished", plan="release")},
            "finished": {ANY: IGNORE},
        },
    )


# The workload: alternate preempt/resume, which changes the state at every event.
_CYCLE = (Resume(), Yield())


def _time_fire(fire: Callable[[Any, Any], Any], objs: list[Any], rounds: int) -> float:
    """ns per event, firing the cycle at every object in turn for `rounds` rounds."""
    ev = _CYCLE
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter_ns()
        for r in range(rounds):
            e = ev[r & 1]
            for o in objs:
                fire(o, e)
        dt = time.perf_counter_ns() - t0
    finally:
        gc.enable()
    return dt / (rounds * len(objs))


def _measure_create(make: Callable[[], Any], n: int) -> tuple[float, float]:
    """(µs per instance, bytes per instance); timed and traced in separate runs, since
    tracing allocations slows them down."""
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter_ns()
        objs = [make() for _ in range(n)]
        dt = time.perf_counter_ns() - t0
    finally:
        gc.enable()
    del objs
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    objs = [make() for _ in range(n)]
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    list_bytes = 8 * len(objs)  # the list's own slots are not the instances' cost
    return dt / n / 1000, (after - before - list_bytes) / n


def _terminus(n: int, rounds: int) -> dict[str, float]:
    m = bench_spec().build()
    create_us, nbytes = _measure_create(m.create, n)
    return {"fire_ns": terminus_fire_ns(n, rounds), "create_us": create_us, "bytes": nbytes}


def terminus_fire_ns(n: int, rounds: int, m: Machine | None = None) -> float:
    """ns per Instance.fire (the fast path), called directly as a user would."""
    m = m if m is not None else bench_spec().build()
    objs = [m.create() for _ in range(n)]
    ev = _CYCLE
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter_ns()
        for r in range(rounds):
            e = ev[r & 1]
            for o in objs:
                o.fire(e)
        dt = time.perf_counter_ns() - t0
    finally:
        gc.enable()
    return dt / (rounds * n)


class _NullRecorder:
    def record(self, machine: Any, source: int, event: int, alt: int) -> None:
        pass

    def record_counts(self, machine: Any, counts: Any) -> None:
        pass


def _dict_table(n: int, rounds: int) -> float:
    """A hand-written table: {state: {event class: next}} and a slotted object."""
    table = {0: {Resume: 1, Tick: 0, Yield: 0}, 1: {Tick: 1, Yield: 0, Resume: 1}}

    class Obj:
        __slots__ = ("s",)

        def __init__(self) -> None:
            self.s = 0

    objs = [Obj() for _ in range(n)]

    def fire(o: Obj, e: Any) -> None:
        o.s = table[o.s][e.__class__]

    return _time_fire(fire, objs, rounds)


def _transitions(n: int, rounds: int) -> float:
    from .oracle import transitions_machine

    tm = transitions_machine(bench_spec().build(), oracle=False)

    class Model:
        pass

    objs = [Model() for _ in range(n)]
    for o in objs:
        tm.add_model(o)
    names = {type(e): type(e).__name__ for e in _CYCLE}

    def fire(o: Any, e: Any) -> None:
        o.trigger(names[type(e)])

    return _time_fire(fire, objs, rounds)


def _statemachine(n: int, rounds: int) -> float | None:
    try:
        from statemachine import State as S
        from statemachine import StateMachine
    except ImportError:  # an optional comparison (test extra)
        return None

    class SM(StateMachine):
        waiting = S(initial=True)
        running = S()
        finished = S(final=True)
        Resume = waiting.to(running) | running.to.itself(internal=True)
        Yield = running.to(waiting) | waiting.to.itself(internal=True)
        Tick = running.to.itself() | waiting.to.itself(internal=True)
        Finish = waiting.to(finished) | running.to(finished)

    objs = [SM() for _ in range(n)]

    def fire(o: Any, e: Any) -> None:
        o.send(type(e).__name__)

    return _time_fire(fire, objs, rounds)


def batch_step_ns(n: int, reps: int, m: Machine | None = None) -> float:
    """ns per instance of one batched step of `n` instances (warmed up first)."""
    m = m if m is not None else bench_spec().build()
    b = m.batch(n, "cpu")
    resume = torch.full((n,), m.event_id(Resume), dtype=torch.int64)
    yld = torch.full((n,), m.event_id(Yield), dtype=torch.int64)
    for _ in range(5):
        b.step(resume)
        b.step(yld)
    t0 = time.perf_counter_ns()
    for _ in range(reps):
        b.step(resume)
        b.step(yld)
    return (time.perf_counter_ns() - t0) / (2 * reps * n)


class Done(Event):
    """The one event of the ledger benchmark's machine: live -> done (terminal)."""


@release_effect
def _release_nothing(ctx: Any, handle: Any) -> None:
    pass


def _ledger_machine() -> tuple[Machine, Ledger]:
    m = Spec("bench_handle", states=(State("live", initial=True), State("done", terminal=True)),
             events=(Done,), table={"live": {Done: go("done", plan="release")},
                                    "done": {ANY: IGNORE}}).build()
    ledger = Ledger({"kv": _release_nothing})
    return m.bind({"release": Plan(Release("kv"))}, ledger), ledger


def _timed(fn: Callable[[], None]) -> int:
    """CPU ns of this thread spent in `fn()` (garbage collection paused)."""
    gc.collect()
    gc.disable()
    try:
        t0 = time.thread_time_ns()
        fn()
        return time.thread_time_ns() - t0
    finally:
        gc.enable()


def _ledger_round(n: int) -> tuple[float, float]:
    """(µs per acquire, µs per terminal fire) with `n` handles outstanding."""
    m, ledger = _ledger_machine()
    insts = [m.create() for _ in range(n)]
    acquire = ledger.acquire
    done = Done()

    def acquire_all() -> None:
        for i in insts:
            acquire(i, "kv", 1)

    def fire_all() -> None:
        for i in insts:
            i.fire(done)

    t_acq = _timed(acquire_all)
    t_fire = _timed(fire_all)
    assert ledger.count() == 0 and m.stats.plans_run["release"] == n
    return t_acq / n / 1000, t_fire / n / 1000


def _bytes_per_handle(n: int) -> float:
    m, ledger = _ledger_machine()
    insts = [m.create() for _ in range(n)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in insts:
        ledger.acquire(i, "kv", 1)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / n


def ledger_figures(quick: bool = False) -> dict[str, Any]:
    """The ledger's figures (see the module docstring)."""
    sizes = (10_000, 50_000) if quick else (10_000, 200_000)
    by_n: dict[str, float] = {}
    fire = float("inf")
    for n in sizes:
        rounds = [_ledger_round(n) for _ in range(3)]
        by_n[str(n)] = min(a for a, _ in rounds)
        fire = min(fire, *(f for _, f in rounds))
    return {"acquire_us": by_n[str(sizes[-1])], "acquire_us_by_outstanding": by_n,
            "terminal_fire_us": fire, "bytes_per_handle": _bytes_per_handle(sizes[-1])}


def run(quick: bool = False) -> dict[str, Any]:
    """Run every figure once; `quick` shrinks sizes for a smoke test."""
    big = 10_000 if quick else 100_000
    small = 1_000
    rounds = 4 if quick else 20
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t_small = _terminus(small, rounds * 20)
        t_big = _terminus(big, rounds)
        # One machine, observed and then not: detaching must restore its fast path.
        watched = bench_spec().build()
        prev = observe.set_recorder(_NullRecorder())
        try:
            recorded = terminus_fire_ns(big, rounds, watched)
        finally:
            observe.set_recorder(prev)
        after_detach = terminus_fire_ns(big, rounds, watched)
        dict_small = _dict_table(small, rounds * 20)
        dict_big = _dict_table(big, rounds)
        tr = _transitions(small, max(2, rounds // 2))
        sm = _statemachine(small, max(2, rounds // 2))
        batch = batch_step_ns(big, 20 if quick else 100)
        ledger = ledger_figures(quick)
    finally:
        torch.set_num_threads(threads)
    fire_terminus = t_big["fire_ns"]
    return {
        "live_instances": big,
        "fire_ns": {"terminus": fire_terminus, "transitions": tr,
                    "statemachine": sm, "dict_table": dict_big},
        "fire_ns_1k": {"terminus": t_small["fire_ns"], "dict_table": dict_small},
        "fire_ns_recorder_attached": recorded,
        "fire_ns_after_detach": after_detach,
        "bytes_per_instance": t_big["bytes"],
        "bytes_per_instance_1k": t_small["bytes"],
        "create_us": t_big["create_us"],
        "create_us_1k": t_small["create_us"],
        "batch_step_ns_per_instance": batch,
        "speedup_vs_transitions": tr / fire_terminus,
        **ledger,
        "notes": "transitions and python-statemachine measured at 1k live instances: "
                 "transitions' add_model is O(n) per model",
    }


def table(r: dict[str, Any]) -> list[tuple[str, str]]:
    """Rows (figure, value) for the printed table."""
    f = r["fire_ns"]
    n = r["live_instances"]
    rows = [
        (f"fire(), terminus, {n:,} live", f"{f['terminus']:.0f} ns"),
        ("fire(), terminus, 1k live", f"{r['fire_ns_1k']['terminus']:.0f} ns"),
        ("fire(), terminus, recorder attached", f"{r['fire_ns_recorder_attached']:.0f} ns"),
        ("fire(), terminus, after detaching it", f"{r['fire_ns_after_detach']:.0f} ns"),
        ("fire(), transitions.Machine (1k live)", f"{f['transitions']:.0f} ns"),
    ]
    if f["statemachine"] is not None:
        rows.append(("fire(), python-statemachine (1k live)", f"{f['statemachine']:.0f} ns"))
    rows += [
        (f"fire(), dict table, {n:,} live", f"{f['dict_table']:.0f} ns"),
        ("speedup vs transitions", f"{r['speedup_vs_transitions']:.0f}x"),
        *([("speedup vs python-statemachine", f"{f['statemachine'] / f['terminus']:.0f}x")]
          if f["statemachine"] is not None else []),
        ("cost vs the bare dict table", f"{f['terminus'] / f['dict_table']:.2f}x"),
        (f"bytes per instance, {n:,} live", f"{r['bytes_per_instance']:.0f} B"),
        ("bytes per instance, 1k live", f"{r['bytes_per_instance_1k']:.0f} B"),
        (f"create, {n:,} live", f"{r['create_us']:.2f} µs"),
        ("create, 1k live", f"{r['create_us_1k']:.2f} µs"),
        (f"batched step, {n:,} instances, CPU", f"{r['batch_step_ns_per_instance']:.2f} ns/inst"),
        ("batched vs scalar, per instance",
         f"{f['terminus'] / r['batch_step_ns_per_instance']:.0f}x"),
        *[(f"ledger.acquire, {int(n):,} outstanding", f"{us:.2f} µs")
          for n, us in r["acquire_us_by_outstanding"].items()],
        ("terminal fire, one Release step", f"{r['terminal_fire_us']:.2f} µs"),
        ("bytes per handle", f"{r['bytes_per_handle']:.0f} B"),
    ]
    return rows
