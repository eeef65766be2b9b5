"""`terminus bench e2e-parts`: the overhead split by part, its mixes and their refusals."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from statistics import median

import pytest

from terminus.effects.sanitize import sanitizing
from terminus.effects.sim import bench_parts
from terminus.effects.sim.bench_parts import mixed_parts
from terminus.effects.sim.naive import NaiveDisagg, NaivePrefetch, NaiveTokenizer
from terminus.effects.sim.serving import ServingLoop, SimConfig, SimDisagg, SimPrefetch
from terminus.effects.sim.workload import WorkloadConfig, generate
from terminus.effects.tokenizer import TokenizerSide


@pytest.fixture(autouse=True)
def _as_benchmarked() -> Iterator[None]:
    with sanitizing(False):
        yield


def _loop(*machine: str, requests: int = 300) -> ServingLoop:
    return ServingLoop(generate(WorkloadConfig(requests=requests, seed=5, n=3)), SimConfig(),
                       parts=mixed_parts(*machine))


@pytest.mark.parametrize(("machine", "tok", "dis", "pre"), [
    ((), NaiveTokenizer, NaiveDisagg, NaivePrefetch),
    (("disagg",), NaiveTokenizer, SimDisagg, NaivePrefetch),
    (("prefetch",), NaiveTokenizer, NaiveDisagg, SimPrefetch),
    (("tokenizer", "disagg"), TokenizerSide, SimDisagg, NaivePrefetch),
    (("tokenizer", "disagg", "prefetch"), TokenizerSide, SimDisagg, SimPrefetch),
])
def test_a_mix_runs_the_named_parts_as_machines_and_the_rest_naive(machine, tok, dis, pre):
    loop = _loop(*machine)
    parts = loop.parts
    assert type(parts.tokenizer) is tok
    assert type(parts.disagg) is dis
    assert type(parts.prefetch) is pre  # (NaivePrefetch is a SimPrefetch subclass)
    # The client-stream faults are the machines loop's, with the tokenizer's machines.
    assert parts.loop == ("machines" if "tokenizer" in machine else "naive")
    asyncio.run(loop.run())
    leaks = parts.leaks()
    # Each machine part reports its own leaks, every one zero; the naive parts none.
    assert {k.split()[0] for k in leaks} == set(machine)
    assert not any(leaks.values()), leaks
    if "tokenizer" in machine:
        # The whole loop's audit: with the tokenizer's machines the scheduler is the
        # machines' too, so its pools come back and the LoRA counters are zero (the naive
        # prefetch's host pages, deadlocks and its sites' ledger handles are the naive
        # part's; the machine parts' ledgers are counted by `parts.leaks()` above).
        audit = loop.leaks()
        assert {k: audit[k] for k in ("kv_tokens", "mamba_slots", "request_slots",
                                      "metadata_slots", "lora_refs", "lora_underflows",
                                      "missing_streams",
                                      "duplicate_streams", "pool_violations")} == dict.fromkeys(
            ("kv_tokens", "mamba_slots", "request_slots", "metadata_slots", "lora_refs",
             "lora_underflows", "missing_streams", "duplicate_streams",
             "pool_violations"), 0)
    machines = parts.machines()
    assert len(machines) == (2 * len(machine)
                             + (SimConfig().ranks - 2 if "prefetch" in machine else 0))
    # The loop drained: nothing live in any part.
    assert parts.disagg.idle and parts.settled


def test_the_naive_prefetch_deadlocks_where_the_mixed_machines_do_not() -> None:
    # The same workload: the naive ranks' local decision deadlocks some collective aborts;
    # the PREFETCH machines' reduction never does.
    naive, machine = _loop(), _loop("prefetch")
    asyncio.run(naive.run())
    asyncio.run(machine.run())
    assert naive.prefetch.aborts == machine.prefetch.aborts > 0
    assert naive.prefetch.deadlocks > 0 == machine.prefetch.deadlocks
    leaks = machine.parts.leaks()  # the prefetch machines' host pages and handles came back
    assert set(leaks) == {"prefetch host_pages", "prefetch prefetch_tokens",
                          "prefetch ledger_handles"} and not any(leaks.values()), leaks


def test_the_tokenizer_machines_alone_or_an_unknown_part_are_refused() -> None:
    with pytest.raises(ValueError, match=r"run with the disagg server's.*add 'disagg'"):
        _loop("tokenizer")
    with pytest.raises(ValueError, match=r"unknown part\(s\) \['kv'\]; parts: tokenizer, "
                                         "disagg, prefetch"):
        _loop("disagg", "kv")


def test_a_mix_whose_machine_part_leaks_fails_the_run(monkeypatch) -> None:
    # `_run` checks a mix's machine parts: a leak the disagg part reports stops it.
    monkeypatch.setattr(SimDisagg, "leaks", lambda self: {"kv_tokens": 3})
    with pytest.raises(AssertionError, match="'disagg kv_tokens': 3"):
        bench_parts._lifecycle_us(generate(WorkloadConfig(requests=50, seed=3)), "disagg")


def test_a_lora_reference_the_registry_still_counts_is_a_tokenizer_leak() -> None:
    loop = _loop("tokenizer", "disagg", requests=100)
    asyncio.run(loop.run())
    assert loop.parts.leaks()["tokenizer lora_refs"] == 0
    name = next(s.lora for s in loop.workload if s.lora is not None and s.fault is None)
    lora_id = asyncio.run(loop.registry.acquire(name))  # a reference nobody returns
    assert loop.parts.leaks()["tokenizer lora_refs"] == 1
    loop.registry.release_nowait(lora_id)
    assert loop.parts.leaks()["tokenizer lora_refs"] == 0
    loop.registry.assert_full()
    assert not any(loop.leaks()[k] for k in ("kv_tokens", "request_slots", "lora_refs"))


def test_rounds_split_the_overhead_by_part() -> None:
    r = bench_parts.run(quick=True, rounds=2)
    assert r["requests"] == 1000 and r["rounds"] == 2
    kinds = r["requests_by_kind"]
    assert sum(kinds.values()) == 1000 and all(v > 0 for v in kinds.values())
    life, over = r["lifecycle_us_per_request"], r["overhead_us_per_request"]
    assert set(life) == set(bench_parts.MIXES) and all(v > 0 for v in life.values())
    assert set(over) == set(bench_parts.MIXES) - {"naive"}
    per = r["overhead_by_part_us_per_round"]
    assert set(per) == set(r["overhead_by_part_us_per_request"]) == set(bench_parts.PARTS)
    for part, rounds in per.items():
        assert len(rounds) == 2
        assert r["overhead_by_part_us_per_request"][part] == pytest.approx(median(rounds))
    # The tokenizer's is tok+disagg's less disagg's, round by round.
    assert r["overhead_by_part_us_per_request"]["disagg"] == pytest.approx(over["disagg"])
    assert r["overhead_by_part_us_per_request"]["prefetch"] == pytest.approx(over["prefetch"])
    assert median(per["tokenizer"]) == pytest.approx(
        r["overhead_by_part_us_per_request"]["tokenizer"])
    # Per request of the part: scaled by the requests it serves.
    of = r["overhead_us_per_request_of_part"]
    assert of["disagg"] == pytest.approx(
        r["overhead_by_part_us_per_request"]["disagg"] * 1000 / kinds["disagg"])
    assert of["tokenizer"] == pytest.approx(
        r["overhead_by_part_us_per_request"]["tokenizer"] * 1000
        / (kinds["colocated"] + kinds["prefetch"]))
    rows = dict(bench_parts.table(r))
    assert rows["overhead: disagg part (median of 2 rounds)"].endswith(
        f"per disagg request ({kinds['disagg']:,})")
    assert rows["  sum of the parts / whole"].count("/") == 2


def test_no_rounds_is_refused() -> None:
    with pytest.raises(ValueError, match="rounds must be at least 1, got 0"):
        bench_parts.run(quick=True, rounds=0)


def test_it_is_a_registered_benchmark() -> None:
    from terminus.fsm.cli import _group

    assert _group("terminus.benchmarks")["e2e-parts"].value == "terminus.effects.sim.bench_parts"
