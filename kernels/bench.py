"""``terminus bench kernels``: release costs of the KV allocator, with and without bitmap.

Every figure is the median of many timed calls (``release_ms_min`` holds the minimum), with
torch single-threaded, except ``release_small_batch_ms.threads_default``: a step's worth of
terminal requests released with the thread count torch had when ``run`` was called (the
caller's default), beside the same release with one thread, to show whether any op goes
parallel on small tensors (see README, "OpenMP on small tensors").

``run(device=...)`` puts every pool on that device; on a GPU each timed call ends with
``torch.cuda.synchronize()``, so a figure is the wall time until the device finished, not
the time to queue kernels. The double-free bitmap is on unless a figure says otherwise,
and each timed region includes folding its frees into the bitmaps (the KV pool's and the
request table's), so nothing is deferred past the clock. For comparison, a concatenating
allocator (``free`` = ``torch.cat`` onto the whole free list, as SGLang's
``TokenToKVPoolAllocator`` does) runs the same frees.

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

import asyncio
import gc
import statistics
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from terminus.kernels.batched import release_batch, repeat_rows
from terminus.kernels.kv import TokenKVAllocator
from terminus.kernels.lora import LoRARegistry
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


class _SGLangShapedRWLock:
    """The shape of SGLang's asyncio reader-writer lock (``sglang.srt.utils.aio_rwlock``):
    one ``asyncio.Lock`` guarding the state, one ``Condition`` on it for waiters, writers
    queued ahead of new readers. Only what an uncontended round trip executes matters for
    the comparison, but waiting is kept so the stand-in is a working lock."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._cond = asyncio.Condition(self._lock)
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0

    async def read_acquire(self) -> None:
        async with self._lock:
            while self._writing or self._writers_waiting:
                await self._cond.wait()
            self._readers += 1

    async def read_release(self) -> None:
        async with self._lock:
            self._readers -= 1
            if not self._readers:
                self._cond.notify_all()

    async def write_acquire(self) -> None:
        async with self._lock:
            self._writers_waiting += 1
            try:
                while self._writing or self._readers:
                    await self._cond.wait()
                self._writing = True
            finally:
                self._writers_waiting -= 1

    async def write_release(self) -> None:
        async with self._lock:
            self._writing = False
            self._cond.notify_all()


class _SGLangShapedCounter:
    """SGLang's ``ConcurrentCounter`` shape: an int behind an ``asyncio.Condition``, every
    change made under it, waiters notified unless the caller says not to."""

    def __init__(self) -> None:
        self.value = 0
        self._cond = asyncio.Condition()

    async def add(self, k: int, notify: bool = True) -> None:
        async with self._cond:
            self.value += k
            if notify:
                self._cond.notify_all()


class _SGLangShapedRegistry:
    """A stand-in with the shape of SGLang's ``LoRARegistry.acquire``/``release``
    (``sglang/srt/lora/lora_registry.py``), for comparison only: acquire takes the
    writer lock for the lookup (an LRU ``OrderedDict``, moved to the end on each
    lookup), then increments the id's counter under the counter's condition without
    notifying; release takes the reader lock and decrements under the condition,
    notifying waiters. One name or a list (a list's counters updated concurrently with
    ``asyncio.gather``, as SGLang does)."""

    def __init__(self) -> None:
        self._lock = _SGLangShapedRWLock()
        self._lru: OrderedDict[str, str] = OrderedDict()
        self._counters: dict[str, _SGLangShapedCounter] = {}

    def register(self, name: str) -> str:
        lora_id = f"{name}-{len(self._lru)}"
        self._lru[name] = lora_id
        self._counters[lora_id] = _SGLangShapedCounter()
        return lora_id

    def _lookup(self, name: str) -> str:
        lora_id = self._lru.get(name)
        if lora_id is None:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        self._lru.move_to_end(name)
        return lora_id

    async def acquire(self, names: str | list[str]) -> Any:
        await self._lock.write_acquire()
        try:
            if isinstance(names, str):
                ids: Any = self._lookup(names)
            else:
                ids = [self._lookup(n) for n in names]
        finally:
            await self._lock.write_release()
        if isinstance(ids, str):
            await self._counters[ids].add(1, notify=False)
        else:
            await asyncio.gather(*(self._counters[i].add(1, notify=False) for i in ids))
        return ids

    async def release(self, ids: Any) -> None:
        await self._lock.read_acquire()
        try:
            if isinstance(ids, str):
                await self._counters[ids].add(-1)
            else:
                await asyncio.gather(*(self._counters[i].add(-1) for i in ids))
        finally:
            await self._lock.read_release()


def _lora_figures(quick: bool) -> dict[str, float]:
    """Acquire + release round trips (µs each) of our registry and the SGLang-shaped one.

    One name, and a list of 8 (a parallel-sampling group's shape), each acquired and
    released again by one coroutine in a running event loop, the registries interleaved
    round by round. Every round of every variant lasts about ``round_ns`` (its count of
    round trips is calibrated first), so that preemption by other processes falls on
    each alike. Each figure is the median over rounds of the wall time per round trip;
    ``*_cpu_us`` figures are the same rounds' thread CPU time, which load from other
    processes on the machine does not inflate.
    """
    rounds, round_ns = (3, 100_000) if quick else (41, 1_000_000)

    async def main() -> dict[str, float]:
        ours = LoRARegistry()
        theirs = _SGLangShapedRegistry()
        await ours.register("a")
        theirs.register("a")
        group = ["a"] * 8

        async def ours_one(n: int) -> None:
            acquire, release = ours.acquire, ours.release
            for _ in range(n):
                await release(await acquire("a"))

        async def ours_nowait(n: int) -> None:
            acquire, release = ours.acquire, ours.release_nowait
            for _ in range(n):
                release(await acquire("a"))

        async def ours_group(n: int) -> None:
            acquire, release = ours.acquire, ours.release
            for _ in range(n):
                await release(await acquire(group))

        async def theirs_one(n: int) -> None:
            acquire, release = theirs.acquire, theirs.release
            for _ in range(n):
                await release(await acquire("a"))

        async def theirs_group(n: int) -> None:
            acquire, release = theirs.acquire, theirs.release
            for _ in range(n):
                await release(await acquire(group))

        loops: dict[str, Callable[[int], Awaitable[None]]] = {
            "lora_roundtrip": ours_one,
            "lora_roundtrip_nowait": ours_nowait,
            "lora_roundtrip_group8": ours_group,
            "sglang_lora_roundtrip": theirs_one,
            "sglang_lora_roundtrip_group8": theirs_group,
        }
        count: dict[str, int] = {}
        for k, loop in loops.items():  # calibration, which also warms each loop up
            c0 = time.thread_time_ns()
            await loop(100)
            count[k] = max(10, round(100 * round_ns / max(1, time.thread_time_ns() - c0)))
        wall: dict[str, list[float]] = {k: [] for k in loops}
        cpu: dict[str, list[float]] = {k: [] for k in loops}
        for _ in range(rounds):
            for k, loop in loops.items():
                n = count[k]
                w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                await loop(n)
                w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
                wall[k].append((w1 - w0) / n / 1e3)
                cpu[k].append((c1 - c0) / n / 1e3)
        ours.assert_full()
        out = {f"{k}_us": statistics.median(v) for k, v in wall.items()}
        out |= {f"{k}_cpu_us": statistics.median(v) for k, v in cpu.items()}
        return out

    enabled = gc.isenabled()
    gc.disable()  # no collection of other work's garbage inside a round
    try:
        return asyncio.run(main())
    finally:
        if enabled:
            gc.enable()


def _expand_rows(counts: torch.Tensor, reps: int, default_threads: int) -> dict:
    """µs per call (median and mean) of ``torch.repeat_interleave(counts)`` and of
    ``repeat_rows(counts)``, one torch thread and the caller's default, interleaved.

    ``repeat_interleave`` opens an OpenMP region for two rows or more (a grain of one row);
    this is the figure that shows what that costs with the default thread count."""
    calls = {
        "repeat_interleave": lambda: torch.repeat_interleave(counts),
        "repeat_rows": lambda: repeat_rows(counts),
    }
    times: dict[str, list[float]] = {}
    for _ in range(reps):
        for threads, label in ((1, "threads_1"), (default_threads, "threads_default")):
            torch.set_num_threads(threads)
            for name, call in calls.items():
                t0 = time.perf_counter_ns()
                for _ in range(10):
                    call()
                times.setdefault(f"{name}.{label}", []).append((time.perf_counter_ns() - t0) / 1e4)
    torch.set_num_threads(1)
    return {
        k: {"median": statistics.median(v), "mean": statistics.fmean(v)} for k, v in times.items()
    }


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
        return _run(quick, dev, threads)
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


def _run(quick: bool, dev: torch.device, default_threads: int) -> dict:
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

    def small_batch(threads: int) -> Setup:
        # A step's worth of terminal requests (mixed lengths), with ``threads`` torch
        # threads: the caller's default count shows whether an op goes parallel on it.
        kv = TokenKVAllocator(1 << 16, device=dev)
        lengths = mixed_lengths[:small_rows].tolist()
        tab = ReqToTokenTable(small_rows, max(lengths), kv.device)

        def setup() -> Callable[[], object]:
            torch.set_num_threads(threads)
            slots = tab.alloc(small_rows)
            assert slots is not None
            for s, r in zip(slots.tolist(), requests(kv, lengths), strict=True):
                tab.write(s, 0, r)

            def body() -> None:
                release_batch(slots, tab, kv)
                kv._free._sync()
                tab._free._sync()

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
    small_rows = min(200, n_req)
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
    small = _timed(
        {"threads_1": small_batch(1), "threads_default": small_batch(default_threads)},
        reps,
        wait=wait,
    )
    expand = _expand_rows(mixed_lengths[:small_rows], reps, default_threads)
    torch.set_num_threads(1)
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

    lora = _lora_figures(quick)
    return {
        "pool_slots": size,
        "requests": n_req,
        "tokens_per_request": tokens,
        "mixed_lengths_total_tokens": int(mixed_lengths.sum()),
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "threads": 1,
        "default_threads": default_threads,
        "release_small_batch_ms": {k: statistics.median(v) for k, v in small.items()},
        "release_small_batch_ms_mean": {k: statistics.fmean(v) for k, v in small.items()},
        "small_batch_rows": small_rows,
        "expand_rows_us": expand,
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
        **lora,
        "lora_speedup_vs_sglang": lora["sglang_lora_roundtrip_us"] / lora["lora_roundtrip_us"],
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
    sm, sm_mean = result["release_small_batch_ms"], result["release_small_batch_ms_mean"]
    ex = result["expand_rows_us"]
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
        (
            f"release {result['small_batch_rows']} rows, mixed lengths: 1 torch thread / "
            f"default ({result['default_threads']}), median (mean)",
            f"{sm['threads_1']:.3f} ({sm_mean['threads_1']:.3f}) / "
            f"{sm['threads_default']:.3f} ({sm_mean['threads_default']:.3f}) ms",
        ),
        (
            f"row of each token, {result['small_batch_rows']} rows: repeat_interleave, "
            f"1 thread / default, mean",
            f"{ex['repeat_interleave.threads_1']['mean']:.1f} / "
            f"{ex['repeat_interleave.threads_default']['mean']:.1f} us",
        ),
        (
            f"row of each token, {result['small_batch_rows']} rows: repeat_rows, "
            f"1 thread / default, mean",
            f"{ex['repeat_rows.threads_1']['mean']:.1f} / "
            f"{ex['repeat_rows.threads_default']['mean']:.1f} us",
        ),
        (
            "LoRA acquire + release, one name: ours / SGLang-shaped",
            f"{result['lora_roundtrip_us']:.2f} / {result['sglang_lora_roundtrip_us']:.2f} us "
            f"({result['lora_speedup_vs_sglang']:.1f}x)",
        ),
        (
            "LoRA acquire + release_nowait, one name",
            f"{result['lora_roundtrip_nowait_us']:.2f} us",
        ),
        (
            "LoRA acquire + release, 8 names: ours / SGLang-shaped",
            f"{result['lora_roundtrip_group8_us']:.2f} / "
            f"{result['sglang_lora_roundtrip_group8_us']:.2f} us",
        ),
        (
            "LoRA round trip, thread CPU time: ours / SGLang-shaped",
            f"{result['lora_roundtrip_cpu_us']:.2f} / "
            f"{result['sglang_lora_roundtrip_cpu_us']:.2f} us",
        ),
    ]
