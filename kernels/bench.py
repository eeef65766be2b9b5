"""``terminus bench kernels``: release costs of the KV allocator, with and without bitmap.

Every figure is the median of many timed calls (``release_ms_min`` holds the minimum), with
torch single-threaded. ``run(device=...)`` puts every pool on that device; on a GPU each
timed call ends with ``torch.cuda.synchronize()``, so a figure is the wall time until the
device finished, not the time to queue kernels. The double-free bitmap is on unless a
figure says otherwise, and each timed region includes folding its frees into the bitmaps
(the KV pool's and the request table's), so nothing is deferred past the clock. For
comparison, a concatenating allocator (``free`` = ``torch.cat`` onto the whole free list,
as SGLang's ``TokenToKVPoolAllocator`` does) runs the same frees.

What is *not* charged to a release is the setup's own debris: the untimed setup (1,000
allocations and table writes) leaves thousands of small freed blocks behind, and both
Python's garbage collector and glibc's ``malloc`` (which consolidates its fast bins at the
next large request) would otherwise bill them to whichever timed call comes next: up to
0.7 ms on a 0.2 ms release. So the collector is off inside the timed region and the heap
is settled (one large allocation) before the clock starts. The variants that are compared
with each other (bitmap on and off) are measured interleaved, call by call, so that load
from other processes on the machine falls on both alike.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

import torch

from terminus.kernels import bench_radix
from terminus.kernels.batched import release_batch
from terminus.kernels.kv import TokenKVAllocator
from terminus.kernels.req_table import ReqToTokenTable

__all__ = ["run", "table"]


class _ConcatAllocator:
    """The concatenating design, for comparison only: free copies the whole free list."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.free_pages = torch.arange(1, size + 1, dtype=torch.int64, device=device)
        self.group: list[torch.Tensor] | None = None

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > self.free_pages.numel():
            return None
        out = self.free_pages[:n]
        self.free_pages = self.free_pages[n:]
        return out

    def free(self, idx: torch.Tensor) -> None:
        if self.group is not None:
            self.group.append(idx)
        else:
            self.free_pages = torch.cat((self.free_pages, idx))

    def free_group_begin(self) -> None:
        self.group = []

    def free_group_end(self) -> None:
        group, self.group = self.group, None
        if group:
            self.free(torch.cat(group))


def _settle() -> None:
    """Make glibc consolidate the blocks the setup freed now, not inside the timed call.

    A request of a large-bin size makes ``malloc`` consolidate every fast-bin chunk first;
    after a setup of thousands of small tensor frees that costs 0.1-0.7 ms, which the next
    large allocation (the release's gather) would otherwise pay.
    """
    torch.empty(1 << 16, dtype=torch.uint8)


Setup = Callable[[], Callable[[], object]]


def _no_wait() -> None:
    pass


def _timed(
    setups: dict[str, Setup], reps: int, warmup: int = 2, wait: Callable[[], None] = _no_wait
) -> dict[str, list[float]]:
    """Wall times (ms) of ``reps`` calls per variant, the variants interleaved call by call.

    Each call's untimed ``setup`` refills its pool. The pools persist across calls (as in a
    serving loop), so the first ``warmup`` calls, which pay page faults of fresh buffers,
    are discarded. ``wait`` blocks until the device has finished queued work (a no-op on
    CPU); it runs before the clock starts and before it stops.
    """
    times: dict[str, list[float]] = {name: [] for name in setups}
    enabled = gc.isenabled()
    try:
        for i in range(warmup + reps):
            for name, setup in setups.items():
                body = setup()
                _settle()
                wait()
                gc.disable()  # a collection of the setup's garbage is not a release cost
                t0 = time.perf_counter_ns()
                body()
                wait()
                t1 = time.perf_counter_ns()
                if enabled:
                    gc.enable()
                if i >= warmup:
                    times[name].append((t1 - t0) / 1e6)
    finally:
        if enabled:
            gc.enable()
    return times


def run(quick: bool = False, device: str = "cpu") -> dict:
    """Run the kernel benchmark on ``device``; returns the JSON object (see ``table``).

    Raises ValueError naming the device when torch cannot use it here.
    """
    dev = _usable_device(device)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = _run(quick, dev)
        out["radix"] = bench_radix.run(quick)  # the prefix tree: Python on the host
        return out
    finally:
        torch.set_num_threads(threads)


def _usable_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"unknown device {device!r} ({e}); use cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device {device!r}: torch.cuda.is_available() is false here; "
            "run on a machine with a GPU, or use --device cpu"
        )
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: this benchmark runs on cpu or cuda only")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(
            f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) here"
        )
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _run(quick: bool, dev: torch.device) -> dict:
    wait = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else _no_wait

    def median_ms(setup: Setup, reps: int, warmup: int = 2) -> float:
        return statistics.median(_timed({"x": setup}, reps, warmup, wait)["x"])

    size = 1 << 16 if quick else 1 << 20
    n_req, tokens = (100, 64) if quick else (1000, 64)
    reps = 2 if quick else 41
    gen = torch.Generator().manual_seed(0)
    mixed_lengths = torch.randint(1, 2 * tokens, (n_req,), generator=gen, dtype=torch.int32)

    def requests(kv: TokenKVAllocator, lengths: list[int]) -> list[torch.Tensor]:
        out = []
        for n in lengths:
            got = kv.alloc(n)
            assert got is not None
            out.append(got)
        return out

    def per_request(detect: bool) -> Setup:
        kv = TokenKVAllocator(size, device=dev, detect=detect)

        def setup() -> Callable[[], object]:
            reqs = requests(kv, [tokens] * n_req)

            def body() -> None:
                for r in reqs:
                    kv.free(r)
                kv._free._sync()  # the bitmap is up to date inside the timed region

            return body

        return setup

    def free_group() -> Setup:
        kv = TokenKVAllocator(size, device=dev)

        def setup() -> Callable[[], object]:
            reqs = requests(kv, [tokens] * n_req)

            def body() -> None:
                kv.free_group_begin()
                for r in reqs:
                    kv.free(r)
                kv.free_group_end()
                kv._free._sync()

            return body

        return setup

    def batched(detect: bool, lengths: list[int]) -> Setup:
        kv = TokenKVAllocator(size, device=dev, detect=detect)
        tab = ReqToTokenTable(n_req, max(lengths), kv.device)

        def setup() -> Callable[[], object]:
            slots = tab.alloc(n_req)
            assert slots is not None
            for s, r in zip(slots.tolist(), requests(kv, lengths), strict=True):
                tab.write(s, 0, r)

            def body() -> None:
                release_batch(slots, tab, kv)
                kv._free._sync()  # both bitmaps up to date inside the timed region
                tab._free._sync()

            return body

        return setup

    def concat(group: bool) -> Setup:
        kv = _ConcatAllocator(size, dev)

        def setup() -> Callable[[], object]:
            reqs = [kv.alloc(tokens) for _ in range(n_req)]

            def body() -> None:
                if group:
                    kv.free_group_begin()
                for r in reqs:
                    assert r is not None
                    kv.free(r)
                if group:
                    kv.free_group_end()

            return body

        return setup

    def alloc_loop() -> Setup:
        kv = TokenKVAllocator(size, device=dev)
        held: list[torch.Tensor] = []

        def setup() -> Callable[[], object]:
            kv.free_group_begin()
            for r in held:
                kv.free(r)
            kv.free_group_end()

            def body() -> None:
                held[:] = requests(kv, [tokens] * n_req)

            return body

        return setup

    uniform = [tokens] * n_req
    mixed = mixed_lengths.tolist()
    # Each figure and its no-bitmap twin are timed interleaved (see the module docstring).
    times = _timed(
        {
            "per_request": per_request(True),
            "per_request_off": per_request(False),
        },
        reps,
        wait=wait,
    )
    times |= _timed(
        {
            "batched": batched(True, uniform),
            "batched_off": batched(False, uniform),
            "batched_mixed_lengths": batched(True, mixed),
            "batched_mixed_lengths_off": batched(False, mixed),
            "free_group": free_group(),
        },
        reps,
        wait=wait,
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    release = {k: med[k] for k in ("per_request", "free_group", "batched", "batched_mixed_lengths")}
    no_bitmap = {k: med[k + "_off"] for k in ("per_request", "batched", "batched_mixed_lengths")}
    baseline = {
        "per_request": median_ms(concat(False), max(1, reps // 4), warmup=1),
        "free_group": median_ms(concat(True), reps),
    }
    alloc_ms = median_ms(alloc_loop(), reps)

    def pct(on: float, off: float) -> float:
        return (on - off) / off * 100.0

    return {
        "pool_slots": size,
        "requests": n_req,
        "tokens_per_request": tokens,
        "mixed_lengths_total_tokens": int(mixed_lengths.sum()),
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "threads": 1,
        "release_ms": release,
        "release_ms_no_bitmap": no_bitmap,
        "release_ms_min": {k: min(times[k]) for k in release},
        "release_ms_no_bitmap_min": {k: min(times[k + "_off"]) for k in no_bitmap},
        "timed_calls": reps,
        "baseline_concat_release_ms": baseline,
        "speedup_vs_concat": {
            "per_request": baseline["per_request"] / release["per_request"],
            "free_group": baseline["free_group"] / release["free_group"],
        },
        "bitmap_overhead_pct": pct(release["batched"], no_bitmap["batched"]),
        "bitmap_cost_us": (release["batched"] - no_bitmap["batched"]) * 1e3,
        "bitmap_overhead_pct_mixed_lengths": pct(
            release["batched_mixed_lengths"], no_bitmap["batched_mixed_lengths"]
        ),
        "bitmap_overhead_pct_per_request": pct(release["per_request"], no_bitmap["per_request"]),
        "alloc_per_s": n_req / alloc_ms * 1e3,
        "free_per_s": n_req / release["per_request"] * 1e3,
        "alloc_tokens_per_s": n_req * tokens / alloc_ms * 1e3,
        "free_tokens_per_s": n_req * tokens / release["per_request"] * 1e3,
    }


def table(result: dict) -> list[tuple[str, str]]:
    """Rows of (figure, value with unit) for printing ``run``'s result."""
    n, t = result["requests"], result["tokens_per_request"]
    r, off, base = (
        result["release_ms"],
        result["release_ms_no_bitmap"],
        result["baseline_concat_release_ms"],
    )
    what = f"release {n} x {t} tokens, {result['pool_slots']:,}-slot pool"
    return [
        ("device", result["device_name"] if result["device"] != "cpu" else "cpu, 1 torch thread"),
        (f"{what}: one free per request", f"{r['per_request']:.3f} ms"),
        (f"{what}: free group", f"{r['free_group']:.3f} ms"),
        (f"{what}: batched release", f"{r['batched']:.3f} ms"),
        ("batched release, mixed lengths (1..127)", f"{r['batched_mixed_lengths']:.3f} ms"),
        ("concatenating allocator: one free per request", f"{base['per_request']:.3f} ms"),
        ("concatenating allocator: free group", f"{base['free_group']:.3f} ms"),
        (
            "speedup vs concatenating, per request",
            f"{result['speedup_vs_concat']['per_request']:.0f}x",
        ),
        (
            "speedup vs concatenating, free group",
            f"{result['speedup_vs_concat']['free_group']:.1f}x",
        ),
        ("per-request vs batched release", f"{r['per_request'] / r['batched']:.1f}x"),
        ("batched release without bitmap", f"{off['batched']:.3f} ms"),
        (
            "bitmap overhead, batched release",
            f"{result['bitmap_overhead_pct']:.1f} % ({result['bitmap_cost_us']:.0f} us)",
        ),
        (
            "bitmap overhead, batched, mixed lengths",
            f"{result['bitmap_overhead_pct_mixed_lengths']:.1f} %",
        ),
        (
            "bitmap overhead, per-request frees",
            f"{result['bitmap_overhead_pct_per_request']:.1f} %",
        ),
        (
            "alloc throughput",
            f"{result['alloc_per_s']:,.0f} allocs/s ({result['alloc_tokens_per_s']:,.0f} tokens/s)",
        ),
        (
            "free throughput",
            f"{result['free_per_s']:,.0f} frees/s ({result['free_tokens_per_s']:,.0f} tokens/s)",
        ),
    ] + (bench_radix.rows(result["radix"]) if "radix" in result else [])
