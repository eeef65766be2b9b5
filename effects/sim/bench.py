"""`terminus bench e2e`: what the lifecycle engine costs a serving loop, per request.

Runs one workload through the reference serving loop twice, with the declared machines
and with the naive pre-fix logic, and times every call into the pools (alloc, free,
prefetch, batched release) so that allocator work can be taken out:

    lifecycle µs/request = (loop seconds - seconds inside pool calls) / requests

The difference between the two is the engine's overhead per request. Both runs share
the simulator's workload generator, tokenizer fake and scheduler skeleton, so the
difference is the machines (events, tables, ledger, plans) against dicts and flags.
Each run starts as `terminus simulate`'s does (and as a serving engine does after its
warm-up, SGLang's `gc.freeze` included): what exists before it is collected once and
frozen, and full collections come at simulate's interval (`collector_for_run`), for
both loops alike.
JSON keys: `requests`, `us_per_request` (`machines`, `naive`), `allocator_us_per_request`
(`machines`, `naive`), `lifecycle_us_per_request` (`machines`, `naive`),
`lifecycle_overhead_us_per_request`.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import time
from typing import Any

import torch

from . import workload as workload_mod
from .naive import naive_parts
from .serving import ServingLoop, SimConfig, machine_parts
from .simulate import collector_for_run
from .workload import WorkloadConfig, generate

_POOL_METHODS = ("alloc", "free", "prefetch", "lock", "unlock")


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


def _pools_of(loop: ServingLoop) -> list[Any]:
    p = loop.pools
    out = [p.kv, p.mamba, p.table]
    d = loop.disagg.pools
    out += [d.kv, d.mamba, d.table, d.metadata, d.host]
    out += [s.host for s in loop.prefetch.sites]
    return out


def _run(workload: list[Any], naive: bool) -> tuple[float, float]:
    # The workload's memoised prompt pieces start empty for each loop: made by the
    # first loop, they would be the second loop's for free.
    workload_mod._segment.cache_clear()
    workload_mod._prompt.cache_clear()
    loop = ServingLoop(workload, SimConfig(), parts=naive_parts if naive else machine_parts)
    clock = _PoolClock()
    for pool in _pools_of(loop):
        clock.wrap(pool)
    gc.collect()  # the previous run's garbage is not this one's to collect
    with collector_for_run():
        asyncio.run(loop.run())
    leaks = loop.leaks()
    if not naive and any(leaks.values()):
        raise AssertionError(f"the machines leaked during the benchmark: {leaks}")
    return loop.seconds, clock.seconds


def run(quick: bool = False) -> dict[str, Any]:
    """Both loops on one workload; see the module docstring for the keys."""
    n = 1000 if quick else 10_000
    workload = generate(WorkloadConfig(requests=n, seed=11, n=3))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _run(workload[: min(200, n)], False)  # warm up imports and caches
        m_total, m_pool = _run(workload, False)
        n_total, n_pool = _run(workload, True)
    finally:
        torch.set_num_threads(threads)
    us = 1e6 / n
    m_life, n_life = (m_total - m_pool) * us, (n_total - n_pool) * us
    return {
        "requests": n,
        "us_per_request": {"machines": m_total * us, "naive": n_total * us},
        "allocator_us_per_request": {"machines": m_pool * us, "naive": n_pool * us},
        "lifecycle_us_per_request": {"machines": m_life, "naive": n_life},
        "lifecycle_overhead_us_per_request": m_life - n_life,
    }


def table(r: dict[str, Any]) -> list[tuple[str, str]]:
    """Rows (figure, value) for the printed table."""
    u, a, life = (r["us_per_request"], r["allocator_us_per_request"],
                  r["lifecycle_us_per_request"])
    return [
        (f"end to end, machines ({r['requests']:,} requests)", f"{u['machines']:.0f} µs/req"),
        ("end to end, naive loop", f"{u['naive']:.0f} µs/req"),
        ("  of which pool calls, machines / naive",
         f"{a['machines']:.0f} / {a['naive']:.0f} µs/req"),
        ("lifecycle (no allocator), machines", f"{life['machines']:.0f} µs/req"),
        ("lifecycle (no allocator), naive", f"{life['naive']:.0f} µs/req"),
        ("engine overhead vs naive", f"{r['lifecycle_overhead_us_per_request']:+.0f} µs/req"),
    ]
