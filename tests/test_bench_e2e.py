"""`terminus bench e2e`: rounds of both loops, medians, and its refusals."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from statistics import median

import pytest

from terminus.effects.sanitize import sanitizing
from terminus.effects.sim import bench


@pytest.fixture(autouse=True)
def _as_benchmarked() -> Iterator[None]:
    # The suite's leak sanitizer audits every pool after every driver call (by design):
    # a benchmark runs as a serving engine does, without it.
    with sanitizing(False):
        yield


def test_rounds_report_the_median_of_their_differences() -> None:
    r = bench.run(quick=True, rounds=2)
    assert r["requests"] == 1000 and r["rounds"] == 2
    per = r["lifecycle_overhead_us_per_round"]
    assert len(per) == 2
    assert r["lifecycle_overhead_us_per_request"] == pytest.approx(median(per))
    for key in ("us_per_request", "allocator_us_per_request", "lifecycle_us_per_request"):
        assert set(r[key]) == {"machines", "naive"}
        assert all(v > 0 for v in r[key].values())
    # Pool time is part of the end-to-end time, never more than it.
    assert all(r["allocator_us_per_request"][k] < r["us_per_request"][k]
               for k in ("machines", "naive"))
    # The collector's passes: counted by generation (1,000 requests make young passes
    # in both loops), timed, and part of the run's time, never more than it.
    assert set(r["collector_us_per_request"]) == set(r["collections"]) == {"machines", "naive"}
    for k in ("machines", "naive"):
        young, middle, full = r["collections"][k]
        assert young > 0 and young >= middle >= 0 and full >= 0
        assert 0 < r["collector_us_per_request"][k] < r["us_per_request"][k]
    rows = dict(bench.table(r))
    assert rows["engine overhead vs naive (median of 2 rounds)"].endswith("µs/req")
    assert rows["  passes (young · middle · full), machines / naive"].count("·") == 4
    assert rows["  each round"].count("/") == 2  # "a / b µs/req"


def test_one_round_is_its_own_difference() -> None:
    r = bench.run(quick=True)
    assert r["rounds"] == 1
    life = r["lifecycle_us_per_request"]
    assert r["lifecycle_overhead_us_per_request"] == pytest.approx(life["machines"] - life["naive"])
    assert r["lifecycle_overhead_us_per_round"] == [r["lifecycle_overhead_us_per_request"]]
    assert "engine overhead vs naive" in dict(bench.table(r))


def test_the_collector_hook_is_removed_after_each_run_even_one_that_raises(monkeypatch) -> None:
    before = list(gc.callbacks)
    bench._run(bench.generate(bench.WorkloadConfig(requests=50, seed=3)), naive=True)
    assert gc.callbacks == before

    def boom(self: object) -> None:
        raise RuntimeError("the loop failed")

    monkeypatch.setattr(bench.ServingLoop, "run", boom)
    with pytest.raises(RuntimeError, match="the loop failed"):
        bench._run(bench.generate(bench.WorkloadConfig(requests=50, seed=3)), naive=True)
    assert gc.callbacks == before


def test_no_rounds_is_refused() -> None:
    with pytest.raises(ValueError, match="rounds must be at least 1, got 0"):
        bench.run(quick=True, rounds=0)
