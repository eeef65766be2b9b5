"""`terminus.metrics`: Prometheus series of the machines, ledgers, pools and LoRA registry,
scraped over HTTP from 127.0.0.1 while the reference serving loop runs."""

from __future__ import annotations

import socket
import threading
import urllib.request
from typing import Any

import pytest

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from terminus.effects.sim.simulate import main as simulate_main  # noqa: E402
from terminus.effects.sim.simulate import run_simulation  # noqa: E402
from terminus.effects.sim.workload import WorkloadConfig  # noqa: E402
from terminus.fsm import (  # noqa: E402
    ANY,
    ERROR,
    IGNORE,
    Action,
    Event,
    Ledger,
    Plan,
    Spec,
    State,
    TransitionNotAllowed,
    go,
    release_effect,
)
from terminus.kernels import LoRARegistry, TokenKVAllocator  # noqa: E402
from terminus.metrics import Metrics, mount  # noqa: E402

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    """GET /metrics and parse it: {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: Samples, name: str, **match: str) -> float:
    return sum(v for (n, labels), v in samples.items() if n == name
               and all(dict(labels).get(k) == want for k, want in match.items()))


def series(samples: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def test_metrics_are_scraped_over_http_while_a_simulation_runs():
    cfg = WorkloadConfig(requests=400, seed=5, abort_rate=0.3, fault_rate=0.1)
    metrics = Metrics(CollectorRegistry())
    port = metrics.serve(0)
    paused, resume = threading.Event(), threading.Event()
    arrived = [0]
    result: list[Any] = []

    def progress(n: int) -> None:  # the loop's thread: hold it mid-run while we scrape
        arrived[0] += n
        if arrived[0] >= cfg.requests // 2 and not paused.is_set():
            paused.set()
            resume.wait(120)

    def run() -> None:
        try:
            result.append(run_simulation(cfg, progress=progress, metrics=metrics))
        except BaseException as e:
            result.append(e)
            paused.set()

    t = threading.Thread(target=run)
    t.start()
    try:
        assert paused.wait(300), "the simulation never reached half its arrivals"
        mid = scrape(port)
    finally:
        resume.set()
        t.join(600)
    try:
        assert result and isinstance(result[0], dict), result
        summary = result[0]
        final = scrape(port)
    finally:
        metrics.unmount()

    # Mid-run: the machines are working, and resources are held.
    assert 0 < total(mid, "terminus_transitions_total") < total(final,
                                                                 "terminus_transitions_total")
    assert total(mid, "terminus_pool_in_use") > 0
    # At the end the series agree with the simulation's own counts ...
    assert total(final, "terminus_transitions_total") == summary["transitions"]
    assert total(final, "terminus_plans_run_total") == summary["effects"]
    by_machine = summary["transitions_by_machine"]
    for machine, n in by_machine.items():
        assert total(final, "terminus_transitions_total", machine=machine) == n, machine
    assert total(final, "terminus_events_ignored_total") > 0  # abort echoes, late results
    assert total(final, "terminus_ledger_handles_released_total", ledger="tokenizer") > 0
    # ... and everything went back: pools full, no handle outstanding, LoRA counters zero.
    in_use = series(final, "terminus_pool_in_use")
    assert {dict(k)["pool"] for k in in_use} >= {
        "scheduler.kv", "scheduler.table", "scheduler.mamba", "disagg.kv", "disagg.metadata",
        "disagg.host", "prefetch.host.rank0"}
    assert set(in_use.values()) == {0}
    for labels, v in series(final, "terminus_pool_available").items():
        assert v == final[("terminus_pool_capacity", labels)], labels
    outstanding = series(final, "terminus_ledger_handles_outstanding")
    assert {dict(k)["kind"] for k in outstanding} >= {"lora", "kv"}
    assert set(outstanding.values()) == {0}
    lora = series(final, "terminus_lora_references")
    assert len(lora) == len(("sql-lora", "chat-lora", "code-lora"))
    assert set(lora.values()) == {0}
    assert summary["leaks"] == dict.fromkeys(summary["leaks"], 0)
    # Bounded labels: no request id anywhere, and no more transition series than edges.
    rids = {f"r{i}" for i in range(cfg.requests)}
    values = {v for (_, labels) in final for _, v in labels}
    assert not {v.split("-")[0] for v in values} & rids
    from terminus.fsm.discover import machines

    edges = sum(len(alts) for m in machines().values() for row in m.cells for alts in row)
    assert len(series(final, "terminus_transitions_total")) <= edges


class Go(Event): ...


class Stop(Event): ...


class Poke(Event): ...


@release_effect
def free_kv(ctx, handle):
    ctx.resources.free(handle.value)


@release_effect
def flaky_notify(ctx):
    raise ConnectionError("peer gone")


SPEC = Spec(
    "metrics_probe",
    states=(State("idle", initial=True), State("busy"), State("done", terminal=True)),
    events=(Go, Stop, Poke),
    table={
        "idle": {Go: go("busy"), Stop: go("done", plan="release"), Poke: ERROR},
        "busy": {Go: IGNORE, Stop: go("done", plan="release"), Poke: ERROR},
        "done": {ANY: IGNORE},
    },
)


def test_each_series_counts_what_the_machine_did_and_unmount_detaches():
    kv = TokenKVAllocator(64)
    ledger = Ledger({"kv": free_kv}, resources=kv)
    m = SPEC.build().bind({"release": Plan(Action(flaky_notify, best_effort=True))}, ledger)
    lora = LoRARegistry()
    reg = CollectorRegistry()
    metrics = mount(machines=[m], ledgers={"probe": ledger}, pools={"kv": kv},
                    lora={"main": lora}, registry=reg)
    port = metrics.serve(0)
    try:
        a = m.create("a")
        ledger.acquire(a, "kv", kv.alloc(8))
        a.fire(Go())
        a.fire(Go())  # ignored in busy
        with pytest.raises(TransitionNotAllowed):
            a.fire(Poke())  # refused
        held = scrape(port)
        assert held[("terminus_ledger_handles_outstanding",
                     (("kind", "kv"), ("ledger", "probe")))] == 1
        assert held[("terminus_pool_in_use", (("pool", "kv"),))] == 8
        report = a.fire(Stop())
        assert report is not None and len(report.errors) == 1  # best effort: recorded
        a.fire(Go())  # ignored in done
        s = scrape(port)
    finally:
        metrics.unmount()
    tr = series(s, "terminus_transitions_total")
    assert tr == {
        (("event", "Go"), ("machine", "metrics_probe"), ("source", "idle"),
         ("target", "busy")): 1,
        (("event", "Stop"), ("machine", "metrics_probe"), ("source", "busy"),
         ("target", "done")): 1,
    }
    assert series(s, "terminus_events_ignored_total") == {
        (("event", "Go"), ("machine", "metrics_probe"), ("state", "busy")): 1,
        (("event", "Go"), ("machine", "metrics_probe"), ("state", "done")): 1,
    }
    assert series(s, "terminus_events_refused_total") == {
        (("event", "Poke"), ("machine", "metrics_probe"), ("state", "busy")): 1}
    assert s[("terminus_plans_run_total", (("machine", "metrics_probe"),
                                           ("plan", "release")))] == 1
    assert s[("terminus_plan_errors_total", (("machine", "metrics_probe"),))] == 1
    assert s[("terminus_ledger_handles_outstanding",
              (("kind", "kv"), ("ledger", "probe")))] == 0
    assert s[("terminus_ledger_handles_released_total", (("ledger", "probe"),))] == 1
    assert s[("terminus_pool_in_use", (("pool", "kv"),))] == 0
    assert series(s, "terminus_lora_references") == {}
    # Unmounted: no sink left, so the machine is back on its fast table (unless the
    # coverage plugin's recorder observes every machine), and no series is served.
    from terminus.fsm import observe

    assert not m._sinks
    assert m._rows is (m._slow_rows if observe.recorder() is not None else m._fast_rows)
    assert b"terminus_" not in generate_latest(reg)
    with pytest.raises(OSError):
        scrape(port)
    metrics.unmount()  # idempotent
    kv.assert_full()
    lora.assert_full()


def collected(metrics: Metrics) -> Samples:
    """`metrics.collect()` as `scrape` gives it, without serving it."""
    return {(x.name, tuple(sorted(x.labels.items()))): x.value
            for f in metrics.collect() for x in f.samples}


def test_plans_and_plan_errors_count_from_the_moment_a_machine_is_mounted():
    # A machine that ran plans before it was mounted (a batch's machine is shared by
    # every batch of it) counts only the plans run since, like its transitions.
    kv = TokenKVAllocator(64)
    ledger = Ledger({"kv": free_kv}, resources=kv)
    m = SPEC.build().bind({"release": Plan(Action(flaky_notify, best_effort=True))}, ledger)
    early = m.create("early")
    early.fire(Go())
    assert early.fire(Stop()) is not None  # a plan run and a plan error, unmounted
    metrics = Metrics(CollectorRegistry()).watch_machine(m)
    try:
        s = collected(metrics)
        assert s[("terminus_plans_run_total", (("machine", "metrics_probe"),
                                               ("plan", "release")))] == 0
        assert s[("terminus_plan_errors_total", (("machine", "metrics_probe"),))] == 0
        later = m.create("later")
        later.fire(Go())
        later.fire(Stop())
        s = collected(metrics)
        assert s[("terminus_plans_run_total", (("machine", "metrics_probe"),
                                               ("plan", "release")))] == 1
        assert s[("terminus_plan_errors_total", (("machine", "metrics_probe"),))] == 1
        assert sum(m.stats.plans_run.values()) == 2  # the machine's own: both
    finally:
        metrics.unmount()
    ledger.assert_empty()
    kv.assert_full()


def test_a_scrape_between_unmounts_two_clears_reads_the_machine_without_a_key_error():
    # A scrape thread may read `_machines` after `unmount` forgot the machine's counts
    # held at the mount (or before `watch_machine` wrote them): it reports what it reads.
    kv = TokenKVAllocator(64)
    ledger = Ledger({"kv": free_kv}, resources=kv)
    m = SPEC.build().bind({"release": Plan(Action(flaky_notify, best_effort=True))}, ledger)
    metrics = Metrics(CollectorRegistry()).watch_machine(m)
    try:
        job = m.create("r")
        job.fire(Go())
        job.fire(Stop())  # one plan run since the mount
        metrics._plans_at.clear()  # unmount's second clear, run before its first
        s = collected(metrics)
        assert s[("terminus_plans_run_total", (("machine", "metrics_probe"),
                                               ("plan", "release")))] == 1
    finally:
        metrics.unmount()
    kv.assert_full()


def test_lora_references_are_reported_by_adapter_id():
    import asyncio

    lora = LoRARegistry()
    metrics = mount(lora={"main": lora}, registry=CollectorRegistry())
    port = metrics.serve(0)

    async def go() -> tuple[Samples, Samples]:
        sql = await lora.register("sql")
        await lora.register("chat")
        await lora.acquire(["sql", "sql"])
        held = scrape(port)
        await lora.release([sql, sql])
        return held, scrape(port)

    try:
        held, back = asyncio.run(go())
    finally:
        metrics.unmount()
    assert series(held, "terminus_lora_references") == {
        (("adapter", "1"), ("registry", "main")): 2, (("adapter", "2"), ("registry", "main")): 0}
    assert set(series(back, "terminus_lora_references").values()) == {0}
    lora.assert_full()


class _NoCount:
    pass


@pytest.mark.parametrize("call, message", [
    (lambda m: m.watch_machine(SPEC), "watch_machine() takes built fsm.Machine objects, got "
                                      "Spec"),
    (lambda m: m.watch_pool("p", _NoCount()), "pool 'p' (_NoCount) has neither "
                                              "available_size() nor available"),
    (lambda m: m.watch_lora("r", _NoCount()), "LoRA registry 'r' (_NoCount) has no counts()"),
    (lambda m: m.watch_ledger("l", _NoCount()), "ledger 'l' has no outstanding()"),
])
def test_what_metrics_cannot_read_is_refused_by_name(call, message):
    metrics = Metrics(CollectorRegistry())
    try:
        with pytest.raises(TypeError, match=message.replace("(", r"\(").replace(")", r"\)")):
            call(metrics)
    finally:
        metrics.unmount()


def test_two_mounts_on_one_registry_are_refused_until_the_first_unmounts():
    reg = CollectorRegistry()
    first = Metrics(reg)
    with pytest.raises(ValueError, match="already mounted on this registry"):
        Metrics(reg)
    first.unmount()
    Metrics(reg).unmount()


def test_simulate_metrics_port_serves_during_the_run_and_bad_ports_are_one_line(
        capsys, monkeypatch, tmp_path):
    import json
    import re

    out = tmp_path / "sim.json"

    import terminus.effects.sim.simulate as sim
    from terminus.fsm.cli import main as terminus

    # `terminus simulate --metrics-port 0`, held halfway through its arrivals while this
    # thread scrapes the port it printed.
    paused, resume = threading.Event(), threading.Event()
    arrived = [0]
    real = sim.run_simulation

    def progress(n: int) -> None:
        arrived[0] += n
        if arrived[0] >= 60 and not paused.is_set():
            paused.set()
            resume.wait(120)

    def held(wcfg: Any, **kw: Any) -> Any:
        return real(wcfg, **{**kw, "progress": progress})

    monkeypatch.setattr(sim, "run_simulation", held)
    rc: list[Any] = []

    def run() -> None:
        try:
            rc.append(simulate_main(["--requests", "120", "--no-progress",
                                     "--metrics-port", "0", "--json", str(out)]))
        except BaseException as e:
            rc.append(e)
        finally:
            paused.set()

    t = threading.Thread(target=run)
    t.start()
    try:
        assert paused.wait(300)
        err = capsys.readouterr().err
        m = re.match(r"terminus simulate: metrics on http://127\.0\.0\.1:(\d+)/metrics\n",
                     err)
        assert m, err
        mid = scrape(int(m.group(1)))
    finally:
        resume.set()
        t.join(600)
    assert rc == [0]
    assert total(mid, "terminus_transitions_total") > 0
    assert total(mid, "terminus_pool_capacity", pool="scheduler.kv") > 0
    with pytest.raises(OSError):  # the server stopped with the run
        scrape(int(m.group(1)))
    assert "leak: kv tokens" in capsys.readouterr().out
    leaks = json.loads(out.read_text())["leaks"]
    assert leaks == dict.fromkeys(leaks, 0)  # pools full, LoRA counters zero
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert terminus(["simulate", "--no-progress", "--metrics-port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"terminus simulate: --metrics-port {port}: cannot listen on "
                          f"127.0.0.1:{port}")
    assert err.count("\n") == 1
    assert terminus(["simulate", "--metrics-port", "70000"]) == 2
    assert "--metrics-port must be between 0 and 65535, got 70000" in capsys.readouterr().err


def test_bench_metrics_writes_its_documented_keys_and_unmounts(tmp_path):
    import json

    from terminus.fsm.cli import main as terminus

    out = tmp_path / "metrics.json"
    assert terminus(["bench", "metrics", "--quick", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r["fire_ns"]) == {"unmounted", "mounted", "noop_sink", "after_unmount",
                                 "other_machine_mounted"}
    assert all(v > 0 for v in r["fire_ns"].values())
    assert set(r["batch_step_ns_per_instance"]) == {"unmounted", "mounted"}
    assert r["scrape_ms"] > 0 and r["live_instances"] == 10_000 and r["batch_size"] == 1_000
    assert r["mounted_overhead_ns"] == r["fire_ns"]["mounted"] - r["fire_ns"]["unmounted"]
