"""`terminus bench batch`: one `Batch.step` of 1,000,000 instances, on the CPU or a GPU.

Figures (JSON keys): `instances`, `device`, `device_name`, `step_us` (µs per step whose
events the batch reads back once: the min/max of ids and cells), `quiet_step_us` (the
same step told its event ids, `step(known=)`: nothing read back), `step_ns_per_instance`
and `quiet_step_ns_per_instance`. Every row takes an event each step (`Resume`, then
`Yield`: waiting and running in turn, no row ends). On a GPU each timed step ends with
`torch.cuda.synchronize()`, so a figure is the time until the device finished, not the
time to queue kernels; on the CPU it is the benchmark thread's CPU time, one torch
thread. Each figure is the median of the timed steps (after a warm-up).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from .bench import Resume, Yield, bench_spec


def _device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"unknown device {device!r} ({e}); use cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: torch.cuda.is_available() is false here; "
                         "run on a machine with a GPU, or use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: this benchmark runs on cpu or cuda only")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def run(quick: bool = False, device: str = "cpu") -> dict[str, Any]:
    """Time `Batch.step` of 1M instances (100k with `quick`) on `device`."""
    dev = _device(device)
    n = 100_000 if quick else 1_000_000
    reps = 5 if quick else 50
    m = bench_spec().build()
    b = m.batch(n, dev)
    resume = torch.full((n,), m.event_id(Resume), dtype=torch.int64, device=dev)
    yld = torch.full((n,), m.event_id(Yield), dtype=torch.int64, device=dev)
    known = {m.event_id(Resume), m.event_id(Yield)}
    cuda = dev.type == "cuda"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def timed(step: Callable[[torch.Tensor], object]) -> float:
        times = []
        for i in range(reps + 3):
            for ev in (resume, yld):
                if cuda:
                    torch.cuda.synchronize(dev)
                    t0 = time.perf_counter_ns()
                    step(ev)
                    torch.cuda.synchronize(dev)
                    dt = time.perf_counter_ns() - t0
                else:
                    t0 = time.thread_time_ns()
                    step(ev)
                    dt = time.thread_time_ns() - t0
                if i >= 3:
                    times.append(dt / 1e3)
        return statistics.median(times)

    try:
        read = timed(b.step)
        quiet = timed(lambda ev: b.step(ev, known=known))
        b.check()
    finally:
        torch.set_num_threads(threads)
    return {
        "instances": n,
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "step_us": read,
        "quiet_step_us": quiet,
        "step_ns_per_instance": read * 1e3 / n,
        "quiet_step_ns_per_instance": quiet * 1e3 / n,
    }


def table(r: dict[str, Any]) -> list[tuple[str, str]]:
    """Rows of (figure, value) for printing `run`'s result."""
    where = r["device_name"] if r["device"] != "cpu" else "cpu, 1 torch thread"
    n = r["instances"]
    return [
        ("device", where),
        (f"Batch.step, {n:,} instances (one read back)",
         f"{r['step_us']:.1f} us ({r['step_ns_per_instance']:.2f} ns/inst)"),
        (f"Batch.step, {n:,} instances, quiet (known=, no read back)",
         f"{r['quiet_step_us']:.1f} us ({r['quiet_step_ns_per_instance']:.2f} ns/inst)"),
    ]
