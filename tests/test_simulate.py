"""`terminus simulate`: the reference serving loop drives every machine on a workload
with zero leaks, the naive baseline shows the seeds' leaks, and bad input is one line."""

from __future__ import annotations

import hashlib
import json
import random
import sys
from collections import Counter

import msgspec
import pytest

from terminus.effects.sim.naive import naive_parts
from terminus.effects.sim.simulate import main, run_simulation
from terminus.effects.sim.workload import WorkloadConfig, generate, prompt_tokens, reply_tokens
from terminus.fsm import TransitionRecord


@pytest.fixture(scope="module")
def small_runs():
    cfg = WorkloadConfig(requests=600, seed=6, abort_rate=0.3, fault_rate=0.1, n=3)
    return run_simulation(cfg), run_simulation(cfg, parts=naive_parts)


def test_the_machines_leak_nothing_and_stream_once_per_request(small_runs):
    machines, _ = small_runs
    assert machines["leaks"] == dict.fromkeys(machines["leaks"], 0)
    assert machines["max_streams_per_request"] == 1
    states = machines["terminal_states"]
    # Every kind of ending the workload provokes is reached.
    for s in ("finished", "aborted", "rejected", "errored", "dispatch_failed", "succeeded",
              "bootstrap_failed"):
        assert states.get(s, 0) > 0, s
    assert machines["transitions"] > machines["requests"]
    assert machines["effects"] > 0


@pytest.mark.parametrize("which", [0, 1], ids=["machines", "naive"])
def test_terminal_states_count_one_outcome_per_client_request(small_runs, which):
    r = small_runs[which]
    assert sum(r["terminal_states"].values()) == r["requests"] == 600
    # Sampling groups (n=3) that fanned out count once, as fanned_out; their children
    # are counted apart, one outcome each.
    children = r["child_terminal_states"]
    assert r["terminal_states"]["fanned_out"] > 0
    assert sum(children.values()) >= 3 * r["terminal_states"]["fanned_out"] - 3 * (
        r["terminal_states"].get("no_output", 0))
    assert children.get("finished", 0) > 0
    if which == 0:  # the machines: every client request streamed exactly one outcome
        assert "no_output" not in r["terminal_states"]
        assert sum(children.values()) == 3 * r["terminal_states"]["fanned_out"]


def test_the_naive_baseline_shows_each_seeds_leak_on_the_same_workload(small_runs):
    machines, naive = small_runs
    leaks = naive["leaks"]
    assert leaks["kv_tokens"] > 0 and leaks["mamba_slots"] > 0  # disagg / scheduler seed
    assert leaks["request_slots"] > 0
    assert leaks["lora_underflows"] > 0  # LoRA seed: warm-ups release what they don't own
    assert leaks["lora_refs"] > 0  # ...and an abort that overtakes an acquire orphans it
    assert leaks["collective_deadlocks"] > 0  # prefetch seed: ranks skip the barrier
    assert naive["requests"] == machines["requests"]
    # The classic prefix-cache leak: an aborted sequence dropped without its release
    # keeps its lock, so the prefix it matched can never be evicted.
    assert naive["prefix_cache"]["locked_at_end"] > 0
    assert naive["prefix_cache"]["pages_by_holder"]["requests"] > 0


def test_the_prefix_cache_hits_evicts_under_pressure_and_ends_unlocked(small_runs):
    machines, _ = small_runs
    pc = machines["prefix_cache"]
    assert 0 < pc["hit_rate"] < 1 and pc["hit_tokens"] > 0
    assert pc["peak_cached_tokens"] >= pc["inserted_tokens"] - pc["evicted_tokens"] > 0
    assert pc["duplicate_tokens"] > 0  # shared system prompts were inserted again
    assert pc["locked_at_end"] == 0
    pages = pc["pages_by_holder"]
    assert pages["cache_locked"] == 0 and pages["requests"] == 0
    assert pages["free"] + pages["cache_evictable"] == pages["capacity"]


def test_the_workload_is_the_same_for_the_same_options():
    cfg = WorkloadConfig(requests=200, seed=7)
    assert generate(cfg) == generate(cfg)
    assert generate(cfg) != generate(WorkloadConfig(requests=200, seed=8))


def test_the_generators_int_draws_are_random_randranges():
    # `generate` draws its ints with `_below` (no randint / choice frames): the same
    # values and the same generator state as Random.randrange / randint / choice, so
    # the workloads of a seed stay what they were.
    from terminus.effects.sim.workload import _below

    for seed in range(4):
        ours, theirs = random.Random(seed), random.Random(seed)
        for n in (1, 2, 3, 7, 8, 13, 41, 305, 1 << 20, (1 << 40) + 3):
            for _ in range(40):
                assert _below(ours.getrandbits, n) == theirs.randrange(n)
                assert 16 + _below(ours.getrandbits, 305) == theirs.randint(16, 320)
                seq = ("a", "b", "c")
                assert seq[_below(ours.getrandbits, 3)] == theirs.choice(seq)
                assert ours.random() == theirs.random()
        assert ours.getstate() == theirs.getstate()
    with pytest.raises(ValueError, match="empty range"):
        _below(random.Random(0).getrandbits, 0)
    with pytest.raises(ValueError, match="empty range"):
        generate(WorkloadConfig(requests=3, max_new_tokens=0))
    with pytest.raises(ValueError, match="adapters is empty; name at least one adapter"):
        generate(WorkloadConfig(requests=3, lora_fraction=0.5, adapters=()))
    assert generate(WorkloadConfig(requests=3, lora_fraction=0.0, adapters=()))


def test_a_run_leaves_the_collector_and_torch_threads_as_it_found_them():
    import gc

    import torch

    thresholds, threads = gc.get_threshold(), torch.get_num_threads()
    frozen = gc.get_freeze_count()
    r = run_simulation(WorkloadConfig(requests=40, seed=3))
    assert sum(r["terminal_states"].values()) == 40
    assert gc.get_threshold() == thresholds and gc.get_freeze_count() == frozen
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize("ends", [False, True], ids=["main()", "the terminus script"])
def test_the_command_freezes_its_heap_after_its_runs_only_when_the_process_ends(
        ends, monkeypatch, tmp_path):
    # From the `terminus` script (`console()`: the process ends after the command), the
    # runs' garbage is frozen before the summary, so no full collection scans it for a
    # process about to exit; `main()` called in-process leaves the collector alone.
    import gc

    from terminus.effects.sim import simulate as sim_mod
    from terminus.fsm import cli

    seen: list[str] = []
    real_freeze, real_run, real_table = gc.freeze, sim_mod.run_simulation, sim_mod._table
    monkeypatch.setattr(cli, "_process_ends", ends)
    monkeypatch.setattr(gc, "freeze", lambda: (seen.append("freeze"), real_freeze()))
    monkeypatch.setattr(sim_mod, "run_simulation",
                        lambda *a, **k: (seen.append("run"), real_run(*a, **k))[1])
    monkeypatch.setattr(sim_mod, "_table", lambda *a: (seen.append("table"), real_table(*a)))
    frozen = gc.get_freeze_count()
    try:
        assert main(["--requests", "30", "--no-progress", "--baseline", "naive",
                     "--json", str(tmp_path / "s.json")]) == 0
        # each run freezes and unfreezes around its loop (collector_for_run); then,
        # only when the process ends, the heap is frozen before the summary
        assert seen == ["run", "freeze", "run", "freeze", *(["freeze"] if ends else []),
                        "table"]
        assert (gc.get_freeze_count() > frozen) == ends
    finally:
        gc.unfreeze()  # this test process goes on


def test_token_ids_are_the_seeded_draws_of_their_segments():
    # The ids are defined as the key's SHAKE-128 digest of 2 * n bytes, read as
    # native-order 16-bit words, each mod 32000 plus 1: the table lookup must give
    # exactly those (a workload's prompts would otherwise change with the implementation).
    def reference(key: str, n: int) -> list[int]:
        raw = hashlib.shake_128(key.encode()).digest(2 * n)
        return [int.from_bytes(raw[i:i + 2], sys.byteorder) % 32000 + 1
                for i in range(0, 2 * n, 2)]

    cfg = WorkloadConfig(requests=300, seed=5)
    specs = generate(cfg)
    conv = next(s for s in specs if s.conv >= 0 and len(s.history) > 2)
    own = next(s for s in specs if s.conv < 0 and s.system >= 0)
    expected = reference(f"5/system/{own.system}", own.system_len)
    expected += reference(f"5/{own.rid}", own.prompt_len - own.system_len)
    assert prompt_tokens(own, 5) == expected
    assert reply_tokens(own, 7, 5) == reference(f"5/{own.rid}/reply", 7)
    expected = reference(f"5/system/{conv.system}", conv.system_len) if conv.system >= 0 \
        else []
    for j, n in enumerate(conv.history):
        expected += reference(f"5/conv/{conv.conv}/{j}", n)
    assert prompt_tokens(conv, 5) == expected and len(expected) == conv.prompt_len
    # Odd lengths take the high half of the last 32-bit word: still the same draws.
    assert reply_tokens(conv, 5, 5) == reference(f"5/conv/{conv.conv}/{len(conv.history)}", 5)
    assert reply_tokens(conv, 0, 5) == []


def test_simulate_writes_the_documented_json_and_a_trace(tmp_path, capsys):
    out, trace = tmp_path / "sim.json", tmp_path / "trace.jsonl"
    assert main(["--requests", "150", "--seed", "2", "--no-progress", "--json", str(out),
                 "--trace", str(trace), "--baseline", "naive"]) == 0
    r = json.loads(out.read_text())
    for key in ("loop", "requests", "seconds", "steps", "requests_per_second",
                "terminal_states", "child_terminal_states", "max_streams_per_request",
                "transitions", "transitions_by_machine", "effects", "peak", "leaks",
                "baseline"):
        assert key in r
    assert r["requests"] == 150 and set(r["leaks"].values()) == {0}
    assert sum(r["terminal_states"].values()) == 150
    assert r["baseline"]["requests"] == 150 and r["baseline"]["loop"] == "naive"
    assert sum(r["baseline"]["terminal_states"].values()) == 150
    lines = trace.read_bytes().splitlines()
    assert len(lines) == r["trace_records"] > 0
    rec = msgspec.json.decode(lines[0], type=TransitionRecord)
    assert rec.decision in ("transition", "ignore", "error")
    printed = capsys.readouterr().out
    assert "leak: kv tokens" in printed
    assert "sampling children" in printed and "child ended finished" in printed


def test_a_msgpack_trace_is_length_prefixed_transition_records(tmp_path):
    trace = tmp_path / "t.msgpack"
    assert main(["--requests", "40", "--no-progress", "--trace", str(trace)]) == 0
    dec = msgspec.msgpack.Decoder(TransitionRecord)
    data, records = trace.read_bytes(), []
    while data:
        n = int.from_bytes(data[:4], "big")
        records.append(dec.decode(data[4:4 + n]))
        data = data[4 + n:]
    assert records and {r.machine for r in records} >= {"request", "sequence"}


@pytest.mark.parametrize("args, message", [
    (["--abort-rate", "-0.5"], "--abort-rate must be between 0 and 1, got -0.5"),
    (["--fault-rate", "2"], "--fault-rate must be between 0 and 1, got 2.0"),
    (["--requests", "-3"], "--requests must be >= 0, got -3"),
    (["--n", "0"], "--n (parallel samples) must be >= 1, got 0"),
    (["--device", "quantum"], "unknown device 'quantum'"),
    (["--json", "/no/such/dir/x.json"], "cannot write the summary to '/no/such/dir/x.json'"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["--baseline", "clever"], "argument --baseline: invalid choice: 'clever'"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    from terminus.fsm.cli import main as terminus

    assert terminus(["simulate", *args]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_the_disagg_seed_scenario_reproduces_the_production_deficit(tmp_path):
    out = tmp_path / "seed.json"
    assert main(["--scenario", "disagg-seed", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["naive"]["kv_tokens_leaked"] == 16384 and r["naive"]["mamba_states_leaked"] == 3
    assert r["machines"]["kv_tokens_leaked"] == 0 and r["machines"]["mamba_states_leaked"] == 0


@pytest.mark.parametrize("flag, what", [("--trace", "the trace"), ("--json", "the summary")])
def test_an_output_path_that_is_a_directory_is_refused_before_the_run(
        flag, what, tmp_path, capsys, monkeypatch):
    from terminus.effects.sim import simulate
    from terminus.fsm.cli import main as terminus

    def never(*a, **k):
        raise AssertionError("the simulation ran before the output path was checked")

    monkeypatch.setattr(simulate, "run_simulation", never)
    assert terminus(["simulate", flag, str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"cannot write {what} to {str(tmp_path)!r}: it is a directory" in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_the_leak_audit_runs_the_pools_own_checks_not_only_the_counts():
    import asyncio

    from terminus.effects.sim.serving import ServingLoop

    loop = ServingLoop(generate(WorkloadConfig(requests=40, seed=5)))
    asyncio.run(loop.run())
    assert loop.leaks() == dict.fromkeys(loop.leaks(), 0)
    kv = loop.pools.kv  # the simulator's pools are not strict: a double free is recorded
    a = kv.alloc(2)
    kv.free(a[:1])
    kv.free(a[:1])  # a double free of a[0] balances the leak of a[1]: the counts read zero
    leaks = loop.leaks()
    assert leaks["kv_tokens"] == 0 and leaks["pool_violations"] == 1
    assert loop.violations[0].startswith("scheduler kv: ")
    assert "double free" in loop.violations[0] and str(int(a[0])) in loop.violations[0]
    kv.clear()  # the deliberate corruption wiped
    loop.pools.assert_full()


def test_fault_rate_injects_faults_at_every_call_site_kind_and_leaks_nothing():
    from terminus.effects.callsites import KINDS

    cfg = WorkloadConfig(requests=400, seed=2, abort_rate=0.3, fault_rate=0.6, n=3)
    result = run_simulation(cfg)
    assert set(result["faults_by_kind"]) >= set(KINDS)
    fired = result["faults_fired"]
    for kind in ("allocator", "cache_insert", "collective", "stream", "transport"):
        assert fired[kind] > 0, (kind, fired)
    assert result["leaks"] == dict.fromkeys(result["leaks"], 0)
    assert result["max_streams_per_request"] == 1
@pytest.mark.parametrize("page_size", [1, 16])
def test_simulate_leaks_nothing_with_pages_of_1_and_of_16_tokens(tmp_path, page_size):
    out = tmp_path / "sim.json"
    assert main(["--requests", "300", "--seed", "5", "--abort-rate", "0.4", "--fault-rate",
                 "0.2", "--no-progress", "--page-size", str(page_size),
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["page_size"] == page_size
    assert set(r["leaks"].values()) == {0} and r["max_streams_per_request"] == 1
    assert r["peak"]["kv_tokens"] % page_size == 0  # whole pages, both servers


@pytest.mark.parametrize("bad", ["0", "12", "2048"])
def test_a_page_size_that_is_not_a_power_of_two_up_to_1024_is_one_line(capsys, bad):
    from terminus.fsm.cli import main as terminus

    assert terminus(["simulate", "--page-size", bad]) == 2
    err = capsys.readouterr().err
    assert err == ("terminus simulate: --page-size must be a power of two from 1 to 1024, "
                   f"got {bad}\n")


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_prefix_lock_leak_scenario_exhausts_the_naive_pool_only(tmp_path, page_size):
    out = tmp_path / "lock.json"
    assert main(["--scenario", "prefix-lock-leak", "--page-size", str(page_size),
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    naive, machines = r["naive"], r["machines"]
    assert naive["exhausted"] and naive["refused"] > 0
    assert naive["locked_at_end"] == naive["kv_tokens_leaked"] == naive["kv_tokens"]
    assert not machines["exhausted"] and machines["refused"] == 0
    assert machines["aborted"] == machines["conversations"]
    assert machines["evicted_tokens"] > 0
    assert machines["locked_at_end"] == machines["kv_tokens_leaked"] == 0


def test_transitions_fired_agree_with_a_trace_of_every_decision():
    # The counting recorder reads each machine's cells into a table once; every
    # decision traced as a transition must be counted, per machine, and nothing else.
    traced: Counter[str] = Counter()

    def sink(record):
        if record.decision == "transition":
            traced[record.machine] += 1

    r = run_simulation(WorkloadConfig(requests=300, seed=4, n=3), trace=sink)
    assert r["transitions_by_machine"] == dict(sorted(traced.items()))
    assert r["transitions"] == sum(traced.values()) > r["requests"]
    assert not any(r["leaks"].values())


def test_a_second_run_in_one_process_reports_its_own_effects():
    # The running batch's machine is the process's SEQUENCE, whose stats every batch of
    # it adds to: each run's summary counts the plans that run ran, not the process's.
    cfg = WorkloadConfig(requests=150, seed=8, n=3)
    first, second = run_simulation(cfg), run_simulation(cfg)
    assert first["effects"] > 0
    for key in ("effects", "transitions", "terminal_states", "peak", "leaks"):
        assert first[key] == second[key], key
    assert first["leaks"] == dict.fromkeys(first["leaks"], 0)  # pools full, LoRA 0


def test_the_progress_bar_moves_at_its_redraws_and_ends_at_the_total(monkeypatch):
    # The bar is advanced only when it is redrawn (by what arrived since), then once
    # more after the run: its count ends at the workload's size, with fewer calls than
    # the run has steps.
    import rich.progress

    from terminus.effects.sim import simulate as sim

    clock = [0.0]

    def monotonic() -> float:
        clock[0] += 0.04  # a redraw every third step
        return clock[0]

    calls: list[float] = []
    advance = rich.progress.Progress.advance
    monkeypatch.setattr(rich.progress.Progress, "advance",
                        lambda self, task, n=1: (calls.append(n), advance(self, task, n)))
    monkeypatch.setattr(sim, "monotonic", monotonic)
    result = sim._run_with_progress(WorkloadConfig(requests=120, seed=3), "cpu", "machines",
                                    None, True)
    assert sum(calls) == result["requests"] == 120
    assert 1 < len(calls) < result["steps"]
