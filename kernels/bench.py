"""``terminus bench kernels``: release costs of the KV allocator, with and without bitmap.

Every figure is the median of a few runs, each on a fresh pool (setup untimed), with
torch single-threaded. The double-free bitmap is on unless a figure says otherwise, and
each timed region includes folding its frees into the bitmap, so nothing is deferred
past the clock. For comparison, a concatenating allocator (``free`` = ``torch.cat`` onto
the whole free list, as SGLang's ``TokenToKVPoolAllocator`` does) runs the same frees.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

import torch

from kernels.batched import release_batch
from kernels.kv import TokenKVAllocator
from kernels.req_table import ReqToTokenTable

__all__ = ["run", "table"]


class _ConcatAllocator:
    """The concatenating design, for comparison only: free copies the whole free list."""

    def __init__(self, size: int) -> None:
        self.free_pages = torch.arange(1, size + 1, dtype=torch.int64)
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


def _median_ms(setup: Callable[[], Callable[[], object]], reps: int, warmup: int = 2) -> float:
    """Median wall time of ``reps`` timed calls; each call's untimed ``setup`` refills the pool.

    The pools persist across calls (as in a serving loop), so the first ``warmup`` calls,
    which pay page faults of fresh buffers, are discarded.
    """
    times = []
    enabled = gc.isenabled()
    try:
        for i in range(warmup + reps):
            body = setup()
            gc.disable()  # a collection of the setup's garbage is not a release cost
            t0 = time.perf_counter()
            body()
            t1 = time.perf_counter()
            if enabled:
                gc.enable()
            if i >= warmup:
                times.append((t1 - t0) * 1e3)
    finally:
        if enabled:
            gc.enable()
    return statistics.median(times)


def run(quick: bool = False) -> dict:
    """Run the kernel benchmark; returns the JSON object (see ``table`` for the figures)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(quick)
    finally:
        torch.set_num_threads(threads)


def _run(quick: bool) -> dict:
    size = 1 << 16 if quick else 1 << 20
    n_req, tokens = (100, 64) if quick else (1000, 64)
    reps = 2 if quick else 21
    gen = torch.Generator().manual_seed(0)
    mixed_lengths = torch.randint(1, 2 * tokens, (n_req,), generator=gen, dtype=torch.int32)

    def requests(kv: TokenKVAllocator, lengths: list[int]) -> list[torch.Tensor]:
        out = []
        for n in lengths:
            got = kv.alloc(n)
            assert got is not None
            out.append(got)
        return out

    def per_request(detect: bool) -> Callable[[], Callable[[], object]]:
        kv = TokenKVAllocator(size, detect=detect)

        def setup() -> Callable[[], object]:
            reqs = requests(kv, [tokens] * n_req)

            def body() -> None:
                for r in reqs:
                    kv.free(r)
                kv._free._sync()  # the bitmap is up to date inside the timed region

            return body

        return setup

    def free_group() -> Callable[[], Callable[[], object]]:
        kv = TokenKVAllocator(size)

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

    def batched(detect: bool, lengths: list[int]) -> Callable[[], Callable[[], object]]:
        kv = TokenKVAllocator(size, detect=detect)
        tab = ReqToTokenTable(n_req, max(lengths), kv.device)

        def setup() -> Callable[[], object]:
            slots = tab.alloc(n_req)
            assert slots is not None
            for s, r in zip(slots.tolist(), requests(kv, lengths), strict=True):
                tab.write(s, 0, r)

            def body() -> None:
                release_batch(slots, tab, kv)
                kv._free._sync()

            return body

        return setup

    def concat(group: bool) -> Callable[[], Callable[[], object]]:
        kv = _ConcatAllocator(size)

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

    def alloc_loop() -> Callable[[], Callable[[], object]]:
        kv = TokenKVAllocator(size)
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
    release = {
        "per_request": _median_ms(per_request(True), reps),
        "free_group": _median_ms(free_group(), reps),
        "batched": _median_ms(batched(True, uniform), reps),
        "batched_mixed_lengths": _median_ms(batched(True, mixed), reps),
    }
    no_bitmap = {
        "per_request": _median_ms(per_request(False), reps),
        "batched": _median_ms(batched(False, uniform), reps),
        "batched_mixed_lengths": _median_ms(batched(False, mixed), reps),
    }
    baseline = {
        "per_request": _median_ms(concat(False), max(1, reps // 4), warmup=1),
        "free_group": _median_ms(concat(True), reps),
    }
    alloc_ms = _median_ms(alloc_loop(), reps)

    def pct(on: float, off: float) -> float:
        return (on - off) / off * 100.0

    return {
        "pool_slots": size,
        "requests": n_req,
        "tokens_per_request": tokens,
        "mixed_lengths_total_tokens": int(mixed_lengths.sum()),
        "threads": 1,
        "release_ms": release,
        "release_ms_no_bitmap": no_bitmap,
        "baseline_concat_release_ms": baseline,
        "speedup_vs_concat": {
            "per_request": baseline["per_request"] / release["per_request"],
            "free_group": baseline["free_group"] / release["free_group"],
        },
        "bitmap_overhead_pct": pct(release["batched"], no_bitmap["batched"]),
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
        ("batched release without bitmap", f"{off['batched']:.3f} ms"),
        ("bitmap overhead, batched release", f"{result['bitmap_overhead_pct']:.1f} %"),
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
    ]
