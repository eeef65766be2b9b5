"""`terminus bench e2e`: what the lifecycle engine costs a serving loop, per request.

Runs one workload through the reference serving loop with the declared machines and
with the naive pre-fix logic, in rounds of one run each (seven rounds, the loops
alternating which goes first; one with `--quick`), and times every call into the pools (alloc, free,
prefetch, batched release) so that allocator work can be taken out:

    lifecycle µs/request = (loop seconds - seconds inside pool calls) / requests

The difference between the two is the engine's overhead per request: the median of
the rounds' differences (each figure the median of its runs). Both runs share
the simulator's workload generator, tokenizer fake and scheduler skeleton, so the
difference is the machines (events, tables, ledger, plans) against dicts and flags.
Each run starts as `terminus simulate`'s does (and as a serving engine does after its
warm-up, SGLang's `gc.freeze` included): what exists before it is collected once and
frozen, and full collections come at simulate's interval (`collector_for_run`), for
both loops alike.
The seconds inside the cyclic collector's passes are added up too (a `gc.callbacks`
hook, installed for the run only): they stay in both lifecycle figures, as they are
the loops' own cost (more container objects made and kept, more and longer passes),
and are shown beside them, with the passes counted by generation.
JSON keys: `requests`, `us_per_request` (`machines`, `naive`), `allocator_us_per_request`
(`machines`, `naive`), `lifecycle_us_per_request` (`machines`, `naive`),
`lifecycle_overhead_us_per_request` (the median over the rounds), `rounds`,
`lifecycle_overhead_us_per_round` (each round's difference, in order),
`collector_us_per_request` (`machines`, `naive`: the median over the rounds of the
seconds inside collector passes), `collections` (`machines`, `naive`: the passes of
one run by generation, young, middle, full; the first round's).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import time
from collections.abc import Callable
from statistics import median
from typing import Any, TypeVar

import torch

from . import workload as workload_mod
from .naive import naive_parts
from .serving import PartsFactory, ServingLoop, SimConfig, machine_parts
from .simulate import collector_for_run
from .workload import WorkloadConfig, generate

_POOL_METHODS = ("alloc", "free", "prefetch", "lock", "unlock")
_LOOPS = (("machines", False), ("naive", True))  # (JSON key, `naive`)
K = TypeVar("K")
R = TypeVar("R")


class _PoolClock:
    """Wraps pool methods on instances to add up the seconds spent inside them."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.depth = 0

    def wrap(self, obj: Any) -> None:
        # A pool seen through a fault-injection proxy: the method is read from the pool
        # itself and set through the proxy (which sets it on the pool and forgets its own
        # wrappers), so a call goes proxy -> clock -> pool once. Read through the proxy,
        # the proxy's wrapper would be wrapped again: every call recorded twice, and
        # the outer proxy layer charged to the lifecycle.
        target = getattr(obj, "__wrapped__", obj)
        for name in _POOL_METHODS:
            fn = getattr(target, name, None)
            if fn is not None and callable(fn):
                setattr(obj, name, self._timed(fn))

    def _timed(self, fn: Any) -> Any:
        @functools.wraps(fn)
        def timed(*a: Any, **kw: Any) -> Any:
            if self.depth:  # a pool calling another pool: count the outer call only
                return fn(*a, **kw)
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0
                self.depth -= 1

        return timed


class _CollectorClock:
    """A `gc.callbacks` hook adding up the seconds inside the collector's passes and
    counting them by generation."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.collections[info["generation"]] += 1


def _pools_of(loop: ServingLoop) -> list[Any]:
    p = loop.pools
    out = [p.kv, p.mamba, p.table]
    d = loop.disagg.pools
    out += [d.kv, d.mamba, d.table, d.metadata, d.host]
    out += [s.host for s in loop.prefetch.sites]
    return out


def _run(workload: list[Any], naive: bool,
         parts: PartsFactory | None = None) -> tuple[float, float, float, list[int]]:
    """One loop over `workload`: its seconds, those inside pool calls, those inside the
    collector's passes, and the passes by generation. `parts`: the loop's parts
    (`terminus bench e2e-parts`' mixes), checked for leaks by their own `leaks()`;
    by default the machines' or, with `naive`, the naive baseline's."""
    # The workload's memoised prompt pieces start empty for each loop: made by the
    # first loop, they would be the second loop's for free.
    workload_mod._segment.cache_clear()
    workload_mod._prompt.cache_clear()
    loop = ServingLoop(workload, SimConfig(),
                       parts=parts or (naive_parts if naive else machine_parts))
    clock = _PoolClock()
    for pool in _pools_of(loop):
        clock.wrap(pool)
    gc.collect()  # the previous run's garbage is not this one's to collect
    collector = _CollectorClock()
    gc.callbacks.append(collector)
    try:
        with collector_for_run():
            asyncio.run(loop.run())
    finally:
        gc.callbacks.remove(collector)
    leaks = loop.parts.leaks() if parts is not None else loop.leaks()
    if (parts is not None or not naive) and any(leaks.values()):
        raise AssertionError(f"the machines leaked during the benchmark: {leaks}")
    return loop.seconds, clock.seconds, collector.seconds, collector.collections


def sizes(quick: bool, rounds: int | None) -> tuple[int, int]:
    """(requests, rounds) of a run: 10,000 requests in 7 rounds, 1,000 in one with
    `quick`; `rounds` given is checked (ValueError below 1)."""
    rounds = (1 if quick else 7) if rounds is None else rounds
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    return (1000 if quick else 10_000), rounds


def in_rounds(workload: list[Any], runs: list[tuple[K, Callable[[list[Any]], R]]],
              rounds: int) -> dict[K, list[R]]:
    """Each of `runs` (key, fn of a workload) over `workload` once a round, in order,
    the order reversed every other round, after one warm-up run each of the first 200
    requests (imports and caches warmed for every run alike); one torch thread
    meanwhile. Each key's results, in round order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out: dict[K, list[R]] = {k: [] for k, _ in runs}
    try:
        for _, fn in runs:
            fn(workload[:200])
        for i in range(rounds):
            for k, fn in (runs if i % 2 == 0 else runs[::-1]):
                out[k].append(fn(workload))
    finally:
        torch.set_num_threads(threads)
    return out


def run(quick: bool = False, rounds: int | None = None) -> dict[str, Any]:
    """Both loops on one workload; see the module docstring for the keys.

    `rounds` pairs of runs (7 by default, 1 with `quick`), the two loops alternating
    which goes first; each figure is the median over the rounds, and the overhead the
    median of the rounds' differences (a difference of two runs moments apart, so a
    host that speeds up or slows down between rounds moves both of its terms). Seven,
    not three: on a shared 2-core host one run of either loop moves by 15-25 % from one
    run to the next, so one round's difference spans about -30..+35 µs for an overhead
    of ~10; three invocations minutes apart gave medians of three rounds of +9.9, -17.2
    and +31.9 µs, and of seven rounds +11.4, +9.9 and +10.4 µs.
    """
    n, rounds = sizes(quick, rounds)
    workload = generate(WorkloadConfig(requests=n, seed=11, n=3))
    runs = in_rounds(workload, [(naive, functools.partial(_run, naive=naive))
                                for naive in (False, True)], rounds)
    us = 1e6 / n
    life = {k: [(r[0] - r[1]) * us for r in v] for k, v in runs.items()}
    diffs = [m - v for m, v in zip(life[False], life[True], strict=True)]
    return {
        "requests": n,
        "rounds": rounds,
        "us_per_request": {k: median([r[0] * us for r in runs[v]]) for k, v in _LOOPS},
        "allocator_us_per_request": {k: median([r[1] * us for r in runs[v]])
                                     for k, v in _LOOPS},
        "lifecycle_us_per_request": {"machines": median(life[False]),
                                     "naive": median(life[True])},
        "lifecycle_overhead_us_per_request": median(diffs),
        "lifecycle_overhead_us_per_round": diffs,
        "collector_us_per_request": {k: median([r[2] * us for r in runs[v]])
                                     for k, v in _LOOPS},
        "collections": {k: runs[v][0][3] for k, v in _LOOPS},
    }


def table(r: dict[str, Any]) -> list[tuple[str, str]]:
    """Rows (figure, value) for the printed table."""
    u, a, life = (r["us_per_request"], r["allocator_us_per_request"],
                  r["lifecycle_us_per_request"])
    gc_us, n = r["collector_us_per_request"], r["collections"]
    return [
        (f"end to end, machines ({r['requests']:,} requests)", f"{u['machines']:.0f} µs/req"),
        ("end to end, naive loop", f"{u['naive']:.0f} µs/req"),
        ("  of which pool calls, machines / naive",
         f"{a['machines']:.0f} / {a['naive']:.0f} µs/req"),
        ("lifecycle (no allocator), machines", f"{life['machines']:.0f} µs/req"),
        ("lifecycle (no allocator), naive", f"{life['naive']:.0f} µs/req"),
        ("  of which collector passes, machines / naive",
         f"{gc_us['machines']:.1f} / {gc_us['naive']:.1f} µs/req"),
        ("  passes (young · middle · full), machines / naive",
         " / ".join(" · ".join(map(str, n[k])) for k in ("machines", "naive"))),
        ("engine overhead vs naive" + (f" (median of {r['rounds']} rounds)"
                                       if r["rounds"] > 1 else ""),
         f"{r['lifecycle_overhead_us_per_request']:+.0f} µs/req"),
        *([("  each round", " / ".join(f"{d:+.0f}" for d in r["lifecycle_overhead_us_per_round"])
            + " µs/req")] if r["rounds"] > 1 else []),
    ]
