"""`terminus bench metrics`: what mounting `terminus.metrics` costs `fire()`, and a scrape.

Figures (JSON keys): `fire_ns` (ns per `Instance.fire` on the engine benchmark's
declaration: `unmounted`, a machine never mounted; `mounted`, the same machine while
`terminus.metrics` counts its decisions; `after_unmount`; `other_machine_mounted`, an
unmounted machine while another one is mounted; `noop_sink`, the machine with a sink
that does nothing: what observing costs the engine itself), `mounted_overhead_ns`,
`batch_step_ns_per_instance` (`unmounted`, `mounted`: a batched step of `batch_size`
instances, whose sink sees one record per row), `scrape_ms` (one `generate_latest` of the
registry) and `live_instances`.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from prometheus_client import CollectorRegistry, generate_latest

from terminus.fsm import Machine
from terminus.fsm.bench import batch_step_ns, bench_spec, terminus_fire_ns

from . import Metrics


def _fire_ns(m: Machine, n: int, rounds: int) -> float:
    """ns per fire() on `n` instances of `m`, as `terminus bench engine` times it."""
    return terminus_fire_ns(n, rounds, m)


def _batch_ns(m: Machine, n: int, reps: int) -> float:
    """ns per instance of a batched step of `m`, as `terminus bench engine` times it."""
    return batch_step_ns(n, reps, m)


def _noop_sink_ns(m: Machine, n: int, rounds: int) -> float:
    """fire() with a sink that does nothing: the engine's own cost of observing."""

    def sink(record: Any) -> None:
        pass

    m.add_sink(sink)
    try:
        return _fire_ns(m, n, rounds)
    finally:
        m.remove_sink(sink)


def run(quick: bool = False) -> dict[str, Any]:
    """Every figure once; `quick` shrinks sizes for a smoke test."""
    n = 10_000 if quick else 100_000
    rounds = 4 if quick else 20
    batch_n = 1_000 if quick else 10_000
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        watched = bench_spec().build()
        other = bench_spec().build()
        unmounted = _fire_ns(watched, n, rounds)
        noop = _noop_sink_ns(watched, n, rounds)
        batch_unmounted = _batch_ns(watched, batch_n, 2 if quick else 10)
        registry = CollectorRegistry()
        metrics = Metrics(registry).watch_machine(watched)
        try:
            mounted = _fire_ns(watched, n, rounds)
            other_mounted = _fire_ns(other, n, rounds)
            batch_mounted = _batch_ns(watched, batch_n, 2 if quick else 10)
            t0 = time.perf_counter_ns()
            generate_latest(registry)
            scrape = (time.perf_counter_ns() - t0) / 1e6
        finally:
            metrics.unmount()
        after = _fire_ns(watched, n, rounds)
    finally:
        torch.set_num_threads(threads)
    return {
        "live_instances": n,
        "batch_size": batch_n,
        "fire_ns": {"unmounted": unmounted, "mounted": mounted, "after_unmount": after,
                    "other_machine_mounted": other_mounted, "noop_sink": noop},
        "mounted_overhead_ns": mounted - unmounted,
        "batch_step_ns_per_instance": {"unmounted": batch_unmounted,
                                       "mounted": batch_mounted},
        "scrape_ms": scrape,
    }


def table(r: dict[str, Any]) -> list[tuple[str, str]]:
    """Rows (figure, value) for the printed table."""
    f, b = r["fire_ns"], r["batch_step_ns_per_instance"]
    n = r["live_instances"]
    return [
        (f"fire(), never mounted, {n:,} live", f"{f['unmounted']:.0f} ns"),
        ("fire(), metrics mounted on the machine", f"{f['mounted']:.0f} ns"),
        ("fire(), a sink that does nothing (the engine's share)", f"{f['noop_sink']:.0f} ns"),
        ("fire(), after unmount", f"{f['after_unmount']:.0f} ns"),
        ("fire(), another machine while one is mounted", f"{f['other_machine_mounted']:.0f} ns"),
        ("cost of mounting, per fire()", f"{r['mounted_overhead_ns']:.0f} ns"),
        (f"batched step, {r['batch_size']:,} instances, unmounted / mounted",
         f"{b['unmounted']:.1f} / {b['mounted']:.0f} ns/inst"),
        ("one scrape (generate_latest)", f"{r['scrape_ms']:.2f} ms"),
    ]
