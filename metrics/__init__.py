"""Prometheus metrics for operators: what the machines, ledgers, pools and LoRA registries do.

Opt-in. A serving engine mounts it on the objects it already has; nothing here runs
until then, and a machine nobody mounted keeps its fast table::

    from terminus.metrics import mount

    metrics = mount(machines=[requests, sampling],           # bound fsm.Machine objects
                    ledgers={"tokenizer": ledger},
                    pools={"kv": kv_allocator, "req_slots": table},
                    lora={"adapters": lora_registry})
    metrics.serve(9400)             # or let the engine's own /metrics endpoint show them
    ...
    metrics.unmount()

Series (every label value comes from a declaration or from a name given here, never
from a request id, so the number of series is bounded):

    terminus_transitions_total{machine, source, event, target}      counter
    terminus_events_ignored_total{machine, state, event}            counter
    terminus_events_refused_total{machine, state, event}            counter
    terminus_plans_run_total{machine, plan}                         counter
    terminus_plan_errors_total{machine}                             counter
    terminus_ledger_handles_outstanding{ledger, kind}               gauge
    terminus_ledger_handles_released_total{ledger}                  counter
    terminus_ledger_late_released_total{ledger}                     counter
    terminus_pool_available{pool}                                   gauge
    terminus_pool_capacity{pool}, terminus_pool_in_use{pool}        gauges (when known)
    terminus_lora_references{registry, adapter}                     gauge

Transitions, ignored and refused events are counted by a sink on each mounted machine
(`Machine.add_sink`), from the moment it is mounted; plans and plan errors are the
counters the engine keeps anyway, read at scrape time, less what they held when the
machine was mounted (a machine may have run plans before: every `Batch` of the
process's `SEQUENCE` adds to its counts), and so also from that moment; the ledger's
totals are its own counters, read at scrape time; gauges are read at scrape time too.
Only `terminus.fsm` is imported: pools are anything with `available_size()` (or
`available`) and optionally `capacity`, LoRA registries anything with
`counts() -> {adapter id: references}`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

try:
    from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
except ImportError as e:  # pragma: no cover - the extra is installed in the test env
    raise ImportError(
        "terminus.metrics needs prometheus-client; install the extra: "
        "pip install 'terminus-fsm[metrics]'") from e

from terminus.fsm import Machine, TransitionRecord

__all__ = ["Metrics", "mount"]

_RETRIES = 8


_NOTHING_HELD: tuple[dict[str, int], int] = ({}, 0)


class Metrics:
    """A Prometheus collector over mounted machines, ledgers, pools and LoRA registries.

    Args:
        registry: the `prometheus_client` registry to register in (default: the global
            `prometheus_client.REGISTRY`, which an engine's /metrics endpoint serves).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = REGISTRY if registry is None else registry
        self._machines: dict[int, Machine] = {}
        # Per machine: its plans run and plan errors when it was mounted.
        self._plans_at: dict[int, tuple[dict[str, int], int]] = {}
        self._decisions: defaultdict[tuple[str, str, str, str, str], int] = defaultdict(int)
        self._ledgers: dict[str, Any] = {}
        self._kinds: dict[str, set[str]] = {}
        self._pools: dict[str, Any] = {}
        self._lora: dict[str, Any] = {}
        self._server: Any = None
        self._thread: Any = None
        try:
            self.registry.register(self)
        except ValueError:
            raise ValueError(
                "terminus metrics are already mounted on this registry (their series "
                "would be duplicated); unmount() those first, or pass another "
                "registry=") from None
        self._mounted = True

    # -- what to watch -------------------------------------------------------------------

    def watch_machine(self, *machines: Machine) -> Metrics:
        """Count every decision of these (bound) machine objects from now on."""
        for m in machines:
            if not isinstance(m, Machine):
                raise TypeError(f"watch_machine() takes built fsm.Machine objects, got "
                                f"{type(m).__name__}; mount the bound machine your "
                                "instances run on")
            if id(m) not in self._machines:
                # (what it held first: a scrape in another thread reads `_machines`)
                self._plans_at[id(m)] = (dict(m.stats.plans_run), m.stats.effect_errors)
                self._machines[id(m)] = m
                m.add_sink(self._sink)
        return self

    def watch_ledger(self, name: str, ledger: Any) -> Metrics:
        """Report the handles `ledger` (an `fsm.Ledger`) holds, by kind, under `name`."""
        if not callable(getattr(ledger, "outstanding", None)):
            raise TypeError(f"ledger {name!r} has no outstanding(); pass an fsm.Ledger")
        self._ledgers[name] = ledger
        self._kinds.setdefault(name, set())
        return self

    def watch_pool(self, name: str, pool: Any) -> Metrics:
        """Report `pool`'s free units (`available_size()` or `available`) under `name`."""
        if _available(pool) is None:
            raise TypeError(f"pool {name!r} ({type(pool).__name__}) has neither "
                            "available_size() nor available; metrics cannot read it")
        self._pools[name] = pool
        return self

    def watch_lora(self, name: str, registry: Any) -> Metrics:
        """Report `registry.counts()` (adapter id -> references held) under `name`."""
        if not callable(getattr(registry, "counts", None)):
            raise TypeError(f"LoRA registry {name!r} ({type(registry).__name__}) has no "
                            "counts() -> {adapter id: references}")
        self._lora[name] = registry
        return self

    # -- serving and unmounting ------------------------------------------------------------

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve this registry over HTTP on `addr:port` (0: a free port); returns the port."""
        if self._server is not None:
            raise RuntimeError("these metrics are already served; unmount() first")
        self._server, self._thread = start_http_server(port, addr, registry=self.registry)
        return int(self._server.server_port)

    def unmount(self) -> None:
        """Detach every sink, stop serving, and leave the registry. Idempotent."""
        for m in self._machines.values():
            m.remove_sink(self._sink)
        self._machines.clear()
        self._plans_at.clear()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()
            self._server = self._thread = None
        if self._mounted:
            self.registry.unregister(self)
            self._mounted = False

    # -- the fire path's only cost while mounted ------------------------------------------

    def _sink(self, r: TransitionRecord) -> None:
        self._decisions[(r.machine, r.source, r.event, r.target, r.decision)] += 1

    # -- prometheus_client's Collector ---------------------------------------------------

    def describe(self) -> Iterable[Metric]:
        """The families (without samples), so a registry can check for duplicates."""
        return list(self._families())

    def collect(self) -> Iterable[Metric]:
        """Every family with its samples, read now."""
        fams = self._families()
        tr, ign, ref, plans, perr, out, rel, late, avail, cap, used, lora = fams
        for (machine, src, ev, dst, dec), n in self._decisions.copy().items():
            if dec == "transition":
                tr.add_metric([machine, src, ev, dst], n)
            elif dec == "ignore":
                ign.add_metric([machine, src, ev], n)
            else:
                ref.add_metric([machine, src, ev], n)
        runs: Counter[tuple[str, str]] = Counter()
        errs: Counter[str] = Counter()
        for key, m in list(self._machines.items()):
            # (`unmount` may have forgotten it since: then nothing held before is known)
            runs_at, errs_at = self._plans_at.get(key, _NOTHING_HELD)
            for plan, n in dict(m.stats.plans_run).items():
                runs[(m.name, plan)] += n - runs_at.get(plan, 0)
            errs[m.name] += m.stats.effect_errors - errs_at
        for (machine, plan), n in sorted(runs.items()):
            plans.add_metric([machine, plan], n)
        for machine, n in sorted(errs.items()):
            perr.add_metric([machine], n)
        for name, ledger in list(self._ledgers.items()):
            by_kind = _by_kind(ledger)
            if by_kind is not None:
                self._kinds[name].update(by_kind)
                for kind in sorted(self._kinds[name]):
                    out.add_metric([name, kind], by_kind.get(kind, 0))
            rel.add_metric([name], getattr(ledger, "released", 0))
            late.add_metric([name], getattr(ledger, "late_released", 0))
        for name, pool in list(self._pools.items()):
            a = _available(pool)
            if a is None:
                continue
            avail.add_metric([name], a)
            c = getattr(pool, "capacity", None)
            if isinstance(c, int):
                cap.add_metric([name], c)
                used.add_metric([name], c - a)
        for name, reg in list(self._lora.items()):
            for adapter, n in sorted(dict(reg.counts()).items(), key=lambda kv: str(kv[0])):
                lora.add_metric([name, str(adapter)], n)
        return fams

    @staticmethod
    def _families() -> list[Any]:
        c, g = CounterMetricFamily, GaugeMetricFamily
        return [
            c("terminus_transitions", "Transitions by machine, source state, event and "
              "target state (counted while mounted)",
              labels=["machine", "source", "event", "target"]),
            c("terminus_events_ignored", "Events a state absorbed as declared (IGNORE)",
              labels=["machine", "state", "event"]),
            c("terminus_events_refused", "Events refused: declared errors, or no guard held",
              labels=["machine", "state", "event"]),
            c("terminus_plans_run", "Release plans run by terminal transitions",
              labels=["machine", "plan"]),
            c("terminus_plan_errors", "Release-plan steps that raised (best-effort ones "
              "included)", labels=["machine"]),
            g("terminus_ledger_handles_outstanding", "Unreleased handles in a ledger, by "
              "kind", labels=["ledger", "kind"]),
            c("terminus_ledger_handles_released", "Handles a ledger released",
              labels=["ledger"]),
            c("terminus_ledger_late_released", "Handles released at once because their "
              "owner was already terminal (I6)", labels=["ledger"]),
            g("terminus_pool_available", "Units a pool can hand out now", labels=["pool"]),
            g("terminus_pool_capacity", "Units a pool hands out at most", labels=["pool"]),
            g("terminus_pool_in_use", "Units of a pool handed out (capacity - available)",
              labels=["pool"]),
            g("terminus_lora_references", "References a LoRA registry counts per adapter id",
              labels=["registry", "adapter"]),
        ]


def mount(*, machines: Iterable[Machine] = (), ledgers: Mapping[str, Any] | None = None,
          pools: Mapping[str, Any] | None = None, lora: Mapping[str, Any] | None = None,
          registry: CollectorRegistry | None = None) -> Metrics:
    """A `Metrics` registered in `registry` (default the global one), watching these."""
    m = Metrics(registry)
    try:
        m.watch_machine(*machines)
        for name, ledger in (ledgers or {}).items():
            m.watch_ledger(name, ledger)
        for name, pool in (pools or {}).items():
            m.watch_pool(name, pool)
        for name, reg in (lora or {}).items():
            m.watch_lora(name, reg)
    except BaseException:
        m.unmount()
        raise
    return m


def _available(pool: Any) -> int | None:
    fn = getattr(pool, "available_size", None)
    if callable(fn):
        return int(fn())
    a = getattr(pool, "available", None)
    return a if isinstance(a, int) else None


def _by_kind(ledger: Any) -> dict[str, int] | None:
    """Unreleased handles by kind; None when the ledger kept changing while read (the
    scrape runs on the server's thread while the engine's thread mutates it)."""
    for _ in range(_RETRIES):
        try:
            c: Counter[str] = Counter()
            for handles in list(ledger.outstanding().values()):
                for h in handles:
                    c[h.kind] += 1
            return dict(c)
        except RuntimeError:  # "dictionary changed size during iteration"
            continue
    return None

