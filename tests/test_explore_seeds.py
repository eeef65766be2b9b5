"""The seed scenarios of `terminus explore` on the real drivers, and the naive baselines.

Every world a scenario explores ends with its own quiescence checks (pools full, LoRA
counters zero, every request terminal), so each test here that finds no violation has
checked those in every quiescent world.
"""

from __future__ import annotations

import json

import pytest

from terminus.effects.sim.explore import SCENARIOS, main, scenario
from terminus.fsm.explore import explore, mermaid, replay


@pytest.mark.parametrize("name", ["lora", "disagg", "prefetch-2"])
def test_machines_break_no_invariant_in_any_ordering(name: str) -> None:
    r = explore(scenario(name))
    assert r.exhaustive
    assert r.violations == [], "\n".join(v.numbered() for v in r.violations)
    assert r.states > 100 and r.quiescent > 0


def _old_abandon_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    # The plan main had before abandoned chunks handed their pages to the request:
    # an abandoned chunk frees its own pages at once.
    from terminus.effects import disagg
    from terminus.fsm import Plan, Release

    monkeypatch.setitem(disagg.CHUNK_PLANS, "release_abandoned", Plan(Release("kv")))


def test_disagg_explorer_finds_the_abandoned_chunk_hole_on_the_old_plan(monkeypatch) -> None:
    # The hole the explorer found before the fix: abort with chunks 0 and 1 in flight,
    # then chunk 0's result frees the pages chunk 1 still attends over.
    _old_abandon_plan(monkeypatch)
    r = explore(scenario("disagg"))
    assert [v.invariant for v in r.violations] == ["freed-while-read"]
    assert r.violations[0].labels[-2:] == ["client: abort", "scheduler: result of chunk 0"]
    # The same steps on today's plan break nothing.
    monkeypatch.undo()
    assert all(not bad for _, bad in replay(scenario("disagg"), r.violations[0].labels))


_TO_TRANSFER = ["sender: bootstrap succeeds", "scheduler: launch chunk 0",
                "scheduler: launch chunk 1", "scheduler: result of chunk 0",
                "scheduler: launch chunk 2", "scheduler: result of chunk 1",
                "scheduler: result of chunk 2"]


@pytest.mark.parametrize(("before", "end"), [
    ([], "sender: confirms it stopped"),
    ([], "clock: sender deadline passes"),
    (["sender: its abort will raise"], "sender: transfer done"),
    (["sender: its abort will raise"], "sender: transfer fails"),
    (["sender: its abort will raise"], "clock: sender deadline passes"),
])
def test_disagg_abort_during_the_transfer_waits_for_the_sender(before: list[str],
                                                               end: str) -> None:
    sc = scenario("disagg")
    rows = replay(sc, [*before, *_TO_TRANSFER, "client: abort", end])
    assert all(not bad for _, bad in rows), rows
    w = sc.build()
    for label in before + _TO_TRANSFER:
        w.fire(next(s for s in w.enabled() if s.label == label))
    w.fire(next(s for s in w.enabled() if s.label == "client: abort"))
    # Aborted mid-transfer: the KV stays while the sender may still read it.
    assert w.eng.req(w.RID).state == "awaiting_sender"
    assert w.pools.kv.capacity - w.pools.kv.available == w.CHUNK * w.CHUNKS
    labels = {s.label for s in w.enabled()}
    assert end in labels and "scheduler: launch chunk 0" not in labels
    w.fire(next(s for s in w.enabled() if s.label == end))
    assert w.eng.req(w.RID).state == "aborted"
    assert w.check() == [] and w.check_final() == []
    assert [o.outcome for o in w.sink.outputs] == ["aborted"]
    w.eng.finish()  # pools full, ledger empty


@pytest.mark.parametrize(("name", "expect"), [
    ("lora", {"pool-ledger", "double-release", "lora-counters-zero"}),
    ("disagg", {"pool-ledger", "freed-while-read", "pools-full"}),
    ("prefetch-2", {"rank-waiting-forever", "freed-while-read"}),
])
def test_naive_baseline_yields_short_counterexamples(name: str, expect: set[str]) -> None:
    sc = scenario(name, naive=True)
    r = explore(sc)
    found = {v.invariant: v for v in r.violations}
    assert expect <= set(found)
    for v in r.violations:
        assert 1 <= len(v.steps) <= 6, v.numbered()
        # The counterexample replays to the same broken invariant.
        rows = replay(sc, v.labels)
        assert v.invariant in {inv for inv, _ in rows[-1][1]}
        assert "sequenceDiagram" in mermaid(sc.actors, v.steps, broke=v.invariant)


def test_naive_lora_counterexample_is_the_parent_that_remembers_one_reference() -> None:
    r = explore(scenario("lora", naive=True))
    v = next(v for v in r.violations if v.invariant == "pool-ledger")
    assert v.labels == ["registry: acquire of g returns"]
    assert "counts 2" in v.detail


def test_naive_lora_abort_racing_the_acquire_leaves_a_counter_up() -> None:
    r = explore(scenario("lora", naive=True))
    v = next(v for v in r.violations if v.invariant == "lora-counters-zero")
    assert v.final
    i = v.labels.index("client: abort r")
    assert v.labels[i + 1] == "registry: acquire of r returns"


def test_naive_disagg_counterexample_is_the_dropped_middle_chunk() -> None:
    r = explore(scenario("disagg", naive=True))
    v = next(v for v in r.violations if v.invariant == "pool-ledger")
    assert v.labels == ["sender: bootstrap succeeds", "scheduler: launch chunk 0",
                        "client: abort", "scheduler: result of chunk 0"]


@pytest.mark.parametrize("name", ["disagg", "prefetch-2", "lora"])
def test_reduction_finds_what_the_full_search_finds_on_the_naive_baselines(name: str) -> None:
    sc = scenario(name, naive=True)
    full = explore(sc, reduction=False)
    red = explore(sc, reduction=True)
    assert {v.invariant for v in red.violations} == {v.invariant for v in full.violations}
    assert [len(v.steps) for v in red.violations] == [len(v.steps) for v in full.violations]
    assert red.states == full.states
    assert red.transitions <= full.transitions


def test_cli_writes_the_report_and_exits_by_what_it_found(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    assert main(["--scenario", "prefetch-2", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())["scenarios"]["prefetch-2"]
    assert rep["exhaustive"] is True and rep["violations"] == []
    assert rep["states"] > 0 and rep["interleavings"] > 0 and rep["seconds"] >= 0
    assert "worlds/s" in capsys.readouterr().out

    assert main(["--scenario", "prefetch-2", "--baseline", "naive", "--json", str(out),
                 "--out", str(tmp_path / "cex")]) == 0
    rep = json.loads(out.read_text())["scenarios"]["prefetch-2"]
    invs = {v["invariant"] for v in rep["violations"]}
    assert "rank-waiting-forever" in invs
    v = next(v for v in rep["violations"] if v["invariant"] == "rank-waiting-forever")
    assert all(isinstance(s, str) for s in v["steps"])
    mmd = (tmp_path / "cex" / "prefetch-2-naive-rank-waiting-forever.mmd").read_text()
    assert mmd.startswith("sequenceDiagram")
    replay_file = tmp_path / "cex" / "prefetch-2-naive-rank-waiting-forever.json"
    capsys.readouterr()
    assert main(["--scenario", "prefetch-2", "--baseline", "naive",
                 "--replay", str(replay_file)]) == 0
    assert "=> rank-waiting-forever" in capsys.readouterr().out
    # The same steps on the machines break nothing: the replay says so and exits 0.
    assert main(["--scenario", "prefetch-2", "--replay", str(replay_file)]) == 0
    assert "no invariant broken" in capsys.readouterr().out


def test_cli_exits_1_when_the_machines_break_an_invariant(tmp_path, monkeypatch) -> None:
    _old_abandon_plan(monkeypatch)
    out = tmp_path / "r.json"
    assert main(["--scenario", "disagg", "--json", str(out)]) == 1
    rep = json.loads(out.read_text())["scenarios"]["disagg"]
    assert [v["invariant"] for v in rep["violations"]] == ["freed-while-read"]


def test_cli_bound_cuts_and_reports_not_exhaustive(tmp_path) -> None:
    out = tmp_path / "r.json"
    assert main(["--scenario", "lora", "--bound", "3", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["scenarios"]["lora"]["exhaustive"] is False


def test_every_shipped_scenario_is_listed_with_its_actors() -> None:
    assert {"lora", "disagg", "prefetch-2", "prefetch-3", "prefetch-4"} <= set(SCENARIOS)
    for sc in SCENARIOS.values():
        assert sc.actors and sc.doc
    with pytest.raises(ValueError, match="unknown scenario 'nope'; scenarios: lora"):
        scenario("nope")


@pytest.mark.parametrize("name", ["lora", "disagg", "prefetch-2", "prefetch-3"])
@pytest.mark.parametrize("naive", [False, True])
def test_declared_footprints_commute(name: str, naive: bool) -> None:
    from terminus.fsm.explore import check_independence

    assert check_independence(scenario(name, naive), max_worlds=60) == []


def test_cli_replay_of_a_step_not_enabled_is_one_line_exit_2(tmp_path, capsys) -> None:
    from terminus.fsm.cli import main as terminus

    f = tmp_path / "cex.txt"
    f.write_text("1. client: abort\n2. rank 7: handle abort\n")
    assert terminus(["explore", "--scenario", "prefetch-2", "--replay", str(f)]) == 2
    err = capsys.readouterr().err
    assert "step 2 'rank 7: handle abort' is not enabled" in err
    assert terminus(["explore", "--replay", str(f)]) == 2
    assert "--replay needs exactly one --scenario" in capsys.readouterr().err
    assert terminus(["explore", "--bound", "0"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["prefetch-3", "prefetch-4"])
def test_larger_prefetch_scenarios_machines_exhaustive_naive_deadlocks(name: str) -> None:
    # The CI run of the larger shipped scenarios (`terminus explore --scenario NAME`).
    r = explore(scenario(name))
    assert r.exhaustive
    assert r.violations == [], "\n".join(v.numbered() for v in r.violations)
    naive = explore(scenario(name, naive=True))
    assert {"rank-waiting-forever", "freed-while-read"} <= {v.invariant
                                                            for v in naive.violations}
