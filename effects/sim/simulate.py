"""`terminus simulate`: the reference serving loop on a workload, with a leak audit.

    terminus simulate                         # the embedded default workload
    terminus simulate --requests 100000 --json out.json
    terminus simulate --baseline naive        # the seeds' pre-fix logic, side by side

Prints requests by terminal state, transitions fired, effects run, peak pool usage, the
leak audit (one number per resource; all zero when nothing leaked) and throughput.
Bad input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
from collections import Counter
from collections.abc import Iterator, Mapping
from time import monotonic
from typing import TYPE_CHECKING, Any

import msgspec

from terminus.fsm.cli import CliError, parser, process_ends, write_json

from .workload import FAULT_KINDS, WorkloadConfig, generate

if TYPE_CHECKING:
    from .serving import PartsFactory

__all__ = ["main", "run_simulation"]

_FULL_GC_EVERY = 100
"""Middle-generation collections per full collection during a run (`collector_for_run`)."""


@contextlib.contextmanager
def collector_for_run() -> Iterator[None]:
    """The collector's settings for one run of the serving loop (`run_simulation`,
    `terminus bench e2e`), restored after it.

    What exists before the run (torch, the workload, the loop's pools) is not garbage
    during it: frozen, the collector's full passes scan only what the run made. Those
    passes still scan all of that, more at each (the requests' outputs and records stay
    until the summary), for little garbage (cycles that outlived two younger
    collections): one per 100 middle-generation collections (about 60k requests)
    instead of per 10 (young cycles are collected as before).
    """
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(thresholds[0], thresholds[1], max(thresholds[2], _FULL_GC_EVERY))
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


class _Counting:
    """A recorder counting transitions (decisions that moved an instance: not ignores,
    not errors) per machine name, attached only for the run. Each machine's cells are
    read once into a table of flags (a row per state, a column per event, an entry per
    alternative) kept with its count: a decision then costs one lookup and an add."""

    def __init__(self) -> None:
        # machine -> (flags, [count])
        self._by: dict[Any, tuple[tuple[tuple[tuple[bool, ...], ...], ...], list[int]]] = {}

    def _table(self, machine: Any) -> tuple[tuple[tuple[tuple[bool, ...], ...], ...],
                                            list[int]]:
        t = tuple(tuple(tuple(a.decision == 0 for a in alts) for alts in row)
                  for row in machine.cells)
        entry = self._by[machine] = (t, [0])
        return entry

    def cell_counter(self, machine: Any, source: int, event: int, alt: int) -> list[int]:
        """The counter a compiled cell adds 1 to instead of calling `record` (see
        `observe.Recorder`): the machine's count for a transition, a scratch slot
        nobody reads for an ignore."""
        t, c = self._by.get(machine) or self._table(machine)
        return c if t[source][event][alt] else [0]

    def record(self, machine: Any, source: int, event: int, alt: int) -> None:
        if alt >= 0:
            entry = self._by.get(machine) or self._table(machine)
            if entry[0][source][event][alt]:
                entry[1][0] += 1

    def record_counts(self, machine: Any, counts: Mapping[tuple[int, int, int], int]) -> None:
        t, c = self._by.get(machine) or self._table(machine)
        for (s, e, k), n in counts.items():
            if k >= 0 and t[s][e][k]:
                c[0] += n

    @property
    def transitions(self) -> Counter[str]:
        """Transitions by machine name (bound copies of one machine add up)."""
        out: Counter[str] = Counter()
        for m, (_, c) in self._by.items():
            if c[0]:
                out[m.name] += c[0]
        return out


class _TraceWriter:
    """Every transition record to a file: JSON lines, or for a .msgpack path each record
    as a 4-byte big-endian length followed by its msgpack encoding."""

    def __init__(self, path: str) -> None:
        self.msgpack = path.endswith((".msgpack", ".mpk"))
        self.f = open(path, "wb")  # noqa: SIM115 - closed by close()
        self.enc = msgspec.msgpack.Encoder() if self.msgpack else msgspec.json.Encoder()
        self.records = 0

    def __call__(self, record: Any) -> None:
        data = self.enc.encode(record)
        if self.msgpack:  # length-prefixed, so a reader can split the stream
            self.f.write(len(data).to_bytes(4, "big"))
            self.f.write(data)
        else:
            self.f.write(data)
            self.f.write(b"\n")
        self.records += 1

    def close(self) -> None:
        self.f.close()


def _check_device(device: str) -> None:
    """Refuse a device the run cannot use (one line naming what to pass instead)."""
    if device == "cpu":
        return  # always there: no need to import torch (and time it here) to say so
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise CliError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CliError(f"device {device!r} is not available here (no CUDA); use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise CliError(f"device {device!r} is not supported; use cpu, cuda or cuda:N")


def _check_writable(path: str | None, what: str) -> None:
    if path is None:
        return
    if os.path.isdir(path):
        raise CliError(f"cannot write {what} to {path!r}: it is a directory; give a file "
                       "path in it")
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d) or not os.access(d, os.W_OK) or (
            os.path.exists(path) and not os.access(path, os.W_OK)):
        raise CliError(f"cannot write {what} to {path!r}: its folder does not exist or is "
                       "not writable")


def watch_loop(metrics: Any, loop: Any) -> None:
    """Mount `terminus.metrics.Metrics` on a serving loop's machines, ledgers, pools and
    LoRA registry (pool names `scheduler.kv`, `disagg.metadata`, `prefetch.host.rank0`...)."""
    metrics.watch_machine(*loop.machines())
    metrics.watch_lora("sim", loop.registry)
    for name in ("kv", "table", "mamba"):
        metrics.watch_pool(f"scheduler.{name}", getattr(loop.pools, name))
    for name, pool in loop.disagg.pools.pools().items():
        metrics.watch_pool(f"disagg.{name}", pool)
    for site in loop.prefetch.sites:
        metrics.watch_pool(f"prefetch.host.rank{site.rank}", site.host)
    # Ledgers: only the machines' parts keep them (the naive baseline has none).
    for name, owner in (("tokenizer", loop.parts), ("disagg", getattr(loop.disagg, "engine",
                                                                      None)),
                        *((f"prefetch.rank{s.rank}", s) for s in loop.prefetch.sites)):
        ledger = getattr(owner, "ledger", None)
        if ledger is not None:
            metrics.watch_ledger(name, ledger)


def run_simulation(wcfg: WorkloadConfig, *, device: str = "cpu",
                   parts: PartsFactory | None = None, trace: Any = None,
                   progress: Any = None, page_size: int = 16,
                   metrics: Any = None) -> dict[str, Any]:
    """Run one workload through the serving loop; the summary dict.

    `parts`: `serving.machine_parts` (the default: the declared machines) or
    `naive.naive_parts` (the seeds' pre-fix logic). `page_size`: KV tokens per page of
    the scheduler's and the disaggregated-prefill server's KV pools (16 by default;
    1 is token granularity). `metrics`, a `terminus.metrics.Metrics`, is mounted on the
    loop before it runs (see `watch_loop`); the caller serves it and unmounts it.
    """
    import torch

    from terminus.fsm import observe

    from .serving import ServingLoop, SimConfig, machine_parts

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tensors here are small: threads only add contention
    try:  # (the audits' too: starting the pool's threads for them costs more than they do)
        workload = generate(wcfg)
        cfg = SimConfig(device=device, chunk_size=wcfg.chunk_size, page_size=page_size)
        loop = ServingLoop(workload, cfg, parts=parts or machine_parts,
                           adapters=wcfg.adapters, trace=trace, progress=progress)
        if metrics is not None:
            watch_loop(metrics, loop)
        # A machine may outlive the loop (the running batch's is the process's SEQUENCE,
        # whose stats every batch of it adds to): count this run's plans only.
        plans_before = [sum(m.stats.plans_run.values()) for m in loop.machines()]
        counter = _Counting()
        prev = observe.set_recorder(counter)
        with collector_for_run():
            try:
                asyncio.run(loop.run())
            finally:
                observe.set_recorder(prev)
        prefix_cache = loop.prefix_cache()
        leaks = loop.leaks()
    finally:
        torch.set_num_threads(threads)
    effects = sum(sum(m.stats.plans_run.values()) for m in loop.machines()) - sum(plans_before)
    return {
        "loop": loop.parts.loop,
        "requests": len(workload),
        "page_size": page_size,
        "seconds": loop.seconds,
        "steps": loop.steps,
        "requests_per_second": len(workload) / loop.seconds if loop.seconds else 0.0,
        "terminal_states": dict(sorted(loop.terminal_states().items())),
        "child_terminal_states": dict(sorted(loop.child_terminal_states().items())),
        "max_streams_per_request": loop.max_streams_per_request(),
        "transitions": sum(counter.transitions.values()),
        "transitions_by_machine": dict(sorted(counter.transitions.items())),
        "effects": effects,
        "peak": loop.peaks(),
        "prefix_cache": prefix_cache,
        "leaks": leaks,
        "pool_violations": list(loop.violations),
        "faults_by_kind": dict(sorted(Counter(
            FAULT_KINDS[s.fault] for s in workload if s.fault).items())),
        "faults_fired": loop.faults_fired(),
    }


def _table(result: dict[str, Any], baseline: dict[str, Any] | None) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="terminus simulate", header_style="bold")
    t.add_column("")
    t.add_column("machines", justify="right")
    if baseline is not None:
        t.add_column("naive baseline", justify="right")

    def row(label: str, get: Any, style: str | None = None) -> None:
        cells = [label, str(get(result))]
        if baseline is not None:
            cells.append(str(get(baseline)))
        t.add_row(*cells, style=style)

    row("requests", lambda r: f"{r['requests']:,}")
    states = sorted(set(result["terminal_states"]) | set(
        baseline["terminal_states"] if baseline else ()))
    for s in states:
        row(f"  ended {s}", lambda r, s=s: f"{r['terminal_states'].get(s, 0):,}")
    children = sorted(set(result["child_terminal_states"]) | set(
        baseline["child_terminal_states"] if baseline else ()))
    row("sampling children", lambda r: f"{sum(r['child_terminal_states'].values()):,}")
    for s in children:
        row(f"  child ended {s}", lambda r, s=s: f"{r['child_terminal_states'].get(s, 0):,}")
    # The naive loop has no declared machines of its own: nothing to count there.
    row("transitions fired", lambda r: "n/a" if r["loop"] == "naive" else
        f"{r['transitions']:,}")
    row("release plans run", lambda r: "n/a" if r["loop"] == "naive" else
        f"{r['effects']:,}")
    for k in result["peak"]:
        row(f"peak {k.replace('_', ' ')}", lambda r, k=k: f"{r['peak'].get(k, 0):,}")
    row("prefix cache hit rate", lambda r: f"{r['prefix_cache']['hit_rate']:.1%}")
    row("prefix cache tokens evicted", lambda r: f"{r['prefix_cache']['evicted_tokens']:,}")
    row("prefix cache peak cached tokens",
        lambda r: f"{r['prefix_cache']['peak_cached_tokens']:,}")
    row("prefix cache locked at end", lambda r: f"{r['prefix_cache']['locked_at_end']:,}")
    row("max terminal streams per request", lambda r: r["max_streams_per_request"])
    for k in result["leaks"]:
        row(f"leak: {k.replace('_', ' ')}", lambda r, k=k: f"{r['leaks'][k]:,}",
            style=None)
    row("seconds", lambda r: f"{r['seconds']:.2f}")
    row("requests / s", lambda r: f"{r['requests_per_second']:,.0f}")
    Console().print(t)
    leaked = {k: v for k, v in result["leaks"].items() if v}
    Console().print("[bold green]machines: no leak[/]" if not leaked else
                    f"[bold red]machines leaked: {leaked}[/]")
    for line in result.get("pool_violations", []):
        Console().print(f"[bold red]pool check: {line}[/]")


def main(argv: list[str]) -> int:
    """Entry point of `terminus simulate` (see the module docstring)."""
    d = WorkloadConfig()
    p = parser("terminus simulate",
               "Drive every machine on a workload through the reference serving loop "
               "and audit leaks.")
    p.add_argument("--requests", type=int, default=d.requests, metavar="N",
                   help=f"requests in the workload (default {d.requests})")
    p.add_argument("--seed", type=int, default=d.seed, metavar="S",
                   help=f"seed of the workload generator: the same seed and options give "
                        f"the same workload (default {d.seed})")
    p.add_argument("--abort-rate", type=float, default=d.abort_rate, metavar="P",
                   help=f"fraction of requests the client aborts, 0..1 (default "
                        f"{d.abort_rate})")
    p.add_argument("--fault-rate", type=float, default=d.fault_rate, metavar="P",
                   help=f"fraction of requests that hit a fault, at every call-site kind "
                        f"(transport, collective, registry, tokenizer, allocator, cache "
                        f"insert, stream) and in the scheduler, 0..1 (default "
                        f"{d.fault_rate})")
    p.add_argument("--n", type=int, default=3, metavar="N",
                   help="parallel samples of a sampling request (default 3)")
    p.add_argument("--disagg-fraction", type=float, default=d.disagg_fraction, metavar="P",
                   help=f"fraction of requests served by disaggregated prefill, 0..1 "
                        f"(default {d.disagg_fraction})")
    p.add_argument("--prefetch-fraction", type=float, default=d.prefetch_fraction,
                   metavar="P",
                   help=f"fraction of requests whose prefix is prefetched from storage "
                        f"into host pages on every rank, 0..1 (default "
                        f"{d.prefetch_fraction})")
    p.add_argument("--device", default="cpu",
                   help="torch device of the pools: cpu (default), cuda or cuda:N")
    p.add_argument("--page-size", type=int, default=16, metavar="T",
                   help="KV tokens per page (default 16, as deployments run pages above "
                        "1; 1 is token granularity); a power of two up to 1024")
    p.add_argument("--json", metavar="PATH", help="write the summary as JSON")
    p.add_argument("--trace", metavar="PATH",
                   help="write every transition (JSON lines; msgpack for .msgpack)")
    p.add_argument("--baseline", choices=["naive"],
                   help="also run the seeds' pre-fix logic on the same workload")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus metrics of the machines' run on "
                        "http://127.0.0.1:PORT/metrics while it runs (0: a free port; "
                        "needs the extra terminus-fsm[metrics])")
    p.add_argument("--scenario", choices=["disagg-seed", "prefix-lock-leak"],
                   help="instead of the workload, replay one seed's production case "
                        "(disagg-seed), or aborted turns that matched a cached prefix "
                        "(prefix-lock-leak), through the naive loop and the machines")
    a = p.parse_args(argv)
    if a.scenario == "disagg-seed":
        return _disagg_seed(a.seed, a.json)
    if a.scenario == "prefix-lock-leak":
        if not 1 <= a.page_size <= 64 or a.page_size & (a.page_size - 1):
            raise CliError(f"--page-size with --scenario prefix-lock-leak must be a power "
                           f"of two from 1 to 64, got {a.page_size}")
        return _prefix_lock_leak(a.page_size, a.json)
    wcfg = WorkloadConfig(requests=a.requests, seed=a.seed, abort_rate=a.abort_rate,
                          fault_rate=a.fault_rate, n=a.n,
                          disagg_fraction=a.disagg_fraction,
                          prefetch_fraction=a.prefetch_fraction)
    try:
        wcfg.validate()
    except ValueError as e:
        raise CliError(str(e)) from None
    _check_device(a.device)
    if not 1 <= a.page_size <= 1024 or a.page_size & (a.page_size - 1):
        raise CliError(f"--page-size must be a power of two from 1 to 1024, got "
                       f"{a.page_size}")
    _check_writable(a.json, "the summary")
    _check_writable(a.trace, "the trace")

    metrics = _serve_metrics(a.metrics_port) if a.metrics_port is not None else None
    trace = _TraceWriter(a.trace) if a.trace else None
    try:
        result = _run_with_progress(wcfg, a.device, "machines", trace, not a.no_progress,
                                    a.page_size, metrics)
    finally:
        if trace is not None:
            trace.close()
        if metrics is not None:
            metrics.unmount()
    if trace is not None:
        result["trace_records"] = trace.records
    baseline = None
    if a.baseline == "naive":
        baseline = _run_with_progress(wcfg, a.device, "naive", None, not a.no_progress,
                                      a.page_size)
        result["baseline"] = baseline
    if process_ends():
        # The `terminus` script: the process ends after the summary. Frozen, the runs'
        # garbage cycles are not what the next full collection scans (it came while the
        # table was printed: 0.4-0.7 s at 100k requests, for nothing the exit needs).
        gc.freeze()
    _table(result, baseline)
    if a.json:
        write_json(a.json, result)
    return 0


def _disagg_seed(seed: int, json_path: str | None) -> int:
    """The disaggregated-prefill seed's production case: a hybrid Mamba model, 16k-token
    chunks with overlap, aborts racing chunk results (seeds/disagg-prefill-abort-leak)."""
    from rich.console import Console
    from rich.table import Table

    from .scenarios import disagg_seed

    _check_writable(json_path, "the summary")
    kw: dict[str, Any] = {"requests": 4, "chunk_size": 16384, "mamba_per_request": 3}
    runs = [disagg_seed(naive, seed if seed else 19, **kw) for naive in (True, False)]
    t = Table(title="disaggregated-prefill seed: leak after aborts racing chunk results",
              header_style="bold")
    t.add_column("")
    for r in runs:
        t.add_column(r.loop, justify="right")
    for f in runs[0].__struct_fields__[2:]:
        t.add_row(f.replace("_", " "), *(str(getattr(r, f)) for r in runs))
    Console().print(t)
    if json_path:
        write_json(json_path, {r.loop: msgspec.to_builtins(r) for r in runs})
    return 0


def _prefix_lock_leak(page_size: int, json_path: str | None) -> int:
    """Aborted second turns that matched their first, cached turn: the naive abort path
    forgets the lock and the pool runs dry; the machines release it and keep evicting."""
    from rich.console import Console
    from rich.table import Table

    from .scenarios import prefix_lock_leak

    _check_writable(json_path, "the summary")
    runs = [prefix_lock_leak(naive, page_size=page_size) for naive in (True, False)]
    t = Table(title="prefix cache: a lock not released on abort", header_style="bold")
    t.add_column("")
    for r in runs:
        t.add_column(r.loop, justify="right")
    for f in runs[0].__struct_fields__[1:]:
        t.add_row(f.replace("_", " "), *(str(getattr(r, f)) for r in runs))
    t.add_row("pool exhausted", *(str(r.exhausted) for r in runs))
    Console().print(t)
    if json_path:
        write_json(json_path, {r.loop: {**msgspec.to_builtins(r), "exhausted": r.exhausted}
                               for r in runs})
    return 0


def _serve_metrics(port: int) -> Any:
    import sys

    try:
        from terminus.metrics import Metrics
    except ImportError as e:
        raise CliError(f"--metrics-port: {e}") from None
    from prometheus_client import CollectorRegistry

    if not 0 <= port <= 65535:
        raise CliError(f"--metrics-port must be between 0 and 65535, got {port}")
    metrics = Metrics(CollectorRegistry())
    try:
        bound = metrics.serve(port)
    except OSError as e:
        metrics.unmount()
        raise CliError(f"--metrics-port {port}: cannot listen on 127.0.0.1:{port}: "
                       f"{e.strerror or e}") from None
    print(f"terminus simulate: metrics on http://127.0.0.1:{bound}/metrics",
          file=sys.stderr, flush=True)
    return metrics


def _run_with_progress(wcfg: WorkloadConfig, device: str, loop: str, trace: Any,
                       show: bool, page_size: int = 16,
                       metrics: Any = None) -> dict[str, Any]:
    parts: PartsFactory
    if loop == "naive":  # (imported only when asked for)
        from .naive import naive_parts as parts
    else:
        from .serving import machine_parts as parts
    if not show:
        return run_simulation(wcfg, device=device, parts=parts, trace=trace,
                              page_size=page_size, metrics=metrics)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    label = "naive baseline" if loop == "naive" else "machines"
    # Refreshed by `advance` below at most every 0.1 s (no refresh thread of its own,
    # which redrew it 10 times a second besides, taking the GIL from the loop).
    with Progress("[progress.description]{task.description}", BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), transient=True,
                  auto_refresh=False) as bar:
        task = bar.add_task(f"simulating ({label})", total=wcfg.requests)
        last = [monotonic()]
        arrived = [0]  # requests arrived since the bar last moved

        def advance(n: int) -> None:
            # The bar moves when it is redrawn, by what arrived since (no rich call at
            # every step between two redraws: nobody sees the count in between).
            arrived[0] += n
            now = monotonic()
            if now - last[0] > 0.1:
                last[0] = now
                bar.advance(task, arrived[0])
                arrived[0] = 0
                bar.refresh()

        result = run_simulation(wcfg, device=device, parts=parts, trace=trace,
                                progress=advance, page_size=page_size, metrics=metrics)
        bar.advance(task, arrived[0])  # (the last arrivals: the bar ends at the total)
        return result
