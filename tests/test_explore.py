"""The generic explorer (`terminus.fsm.explore`) on toy models whose answers are known."""

from __future__ import annotations

from typing import Any

import pytest

from terminus.fsm.explore import (
    ReplayError,
    Step,
    explore,
    mermaid,
    parse_steps,
    replay,
)


class Counters:
    """`n` actors, each increments its own counter `k` times; actor 0 may also take a
    shared lock and release it. With `bug`, actor 1 releases the lock without taking it
    once actor 0 finished (the release is then a second release)."""

    def __init__(self, n: int = 2, k: int = 2, bug: bool = False) -> None:
        self.name = "counters"
        self.actors = tuple(f"a{i}" for i in range(n))
        self.n, self.k, self.bug = n, k, bug
        self.built = 0

    def build(self) -> World:
        self.built += 1
        return World(self)


class World:
    def __init__(self, sc: Counters) -> None:
        self.sc = sc
        self.c = [0] * sc.n
        self.lock = 0  # 0 free, 1 held by a0, 2 released by a0
        self.double = 0

    def enabled(self) -> list[Step]:
        out = []
        for i in range(self.sc.n):
            if self.c[i] < self.sc.k:
                out.append(Step(f"a{i}", f"inc {self.c[i]}", frozenset({f"c{i}"})))
        if self.lock == 0:
            out.append(Step("a0", "lock", frozenset({"lock"}), to="a1"))
        elif self.lock == 1:
            out.append(Step("a0", "unlock", frozenset({"lock"})))
        if self.sc.bug and self.lock == 2 and self.c[1] == self.sc.k and not self.double:
            out.append(Step("a1", "unlock", frozenset({"lock"})))
        return out

    def fire(self, step: Step) -> None:
        if step.name.startswith("inc"):
            self.c[int(step.actor[1:])] += 1
        elif step.name == "lock":
            self.lock = 1
        elif step.actor == "a0":
            self.lock = 2
        else:
            self.double += 1

    def key(self) -> Any:
        return (tuple(self.c), self.lock, self.double)

    def check(self) -> list[tuple[str, str]]:
        return [("double-release", "a1 unlocked a lock it never held")] if self.double else []

    def check_final(self) -> list[tuple[str, str]]:
        return [] if self.lock == 2 else [("lock-held", f"lock state {self.lock}")]


def test_dedup_visits_each_world_once() -> None:
    # Worlds: c0 in 0..2, c1 in 0..2, lock in 0..2 -> 27 distinct; many more orderings.
    r = explore(Counters(n=2, k=2))
    assert r.states == 27
    assert r.exhaustive
    assert r.violations == []
    assert r.quiescent == 1


def test_reduction_keeps_every_world_and_fires_fewer_steps() -> None:
    full = explore(Counters(n=3, k=2), reduction=False)
    red = explore(Counters(n=3, k=2), reduction=True)
    assert red.states == full.states == 3 * 3 * 3 * 3
    assert red.transitions < full.transitions


def test_reduction_finds_the_same_bug_as_the_full_search() -> None:
    full = explore(Counters(n=3, k=2, bug=True), reduction=False)
    red = explore(Counters(n=3, k=2, bug=True), reduction=True)
    assert {v.invariant for v in full.violations} == {"double-release"}
    assert {v.invariant for v in red.violations} == {"double-release"}
    assert red.states == full.states


def test_counterexample_is_a_shortest_one() -> None:
    # The bug needs a0: lock, unlock and a1: inc twice, then a1: unlock: five steps, in
    # any order that keeps lock before unlock; the depth-first search first meets a
    # longer path (it increments a0 too), the shortening finds five.
    r = explore(Counters(n=2, k=2, bug=True))
    (v,) = r.violations
    assert v.invariant == "double-release"
    assert len(v.steps) == 5
    assert v.labels[-1] == "a1: unlock"
    unshortened = explore(Counters(n=2, k=2, bug=True), shorten=False)
    assert len(unshortened.violations[0].steps) >= len(v.steps)


def test_quiescence_invariant_reported_at_quiescence() -> None:
    class NoUnlock(Counters):
        def build(self) -> World:
            w = super().build()
            w.enabled = lambda: [s for s in World.enabled(w) if s.name != "unlock"]  # type: ignore[method-assign]
            return w

    r = explore(NoUnlock(n=1, k=1))
    (v,) = r.violations
    assert v.invariant == "lock-held" and v.final
    # Quiescence needs the increment too: two steps, in either order.
    assert sorted(v.labels) == ["a0: inc 0", "a0: lock"]


def test_bound_cuts_the_search_and_says_so() -> None:
    r = explore(Counters(n=2, k=2), bound=2)
    assert not r.exhaustive
    assert r.max_depth == 2


def test_replay_reports_the_broken_invariant_and_refuses_a_step_not_enabled() -> None:
    sc = Counters(n=2, k=2, bug=True)
    v = explore(sc).violations[0]
    rows = replay(sc, v.labels)
    assert [s.label for s, _ in rows] == v.labels
    assert rows[-1][1] == [("double-release", "a1 unlocked a lock it never held")]
    assert all(not bad for _, bad in rows[:-1])
    with pytest.raises(ReplayError, match=r"step 1 'a1: unlock' is not enabled"):
        replay(sc, ["a1: unlock"])


def test_parse_steps_reads_json_and_numbered_text() -> None:
    assert parse_steps('{"steps": ["a0: lock", "a1: inc 0"]}') == ["a0: lock", "a1: inc 0"]
    text = "  1. a0: lock\n  2. a1: inc 0   # why\n  => double-release: x\n"
    assert parse_steps(text) == ["a0: lock", "a1: inc 0"]
    with pytest.raises(ReplayError, match="steps"):
        parse_steps('{"steps": 3}')


def test_mermaid_has_one_lifeline_per_actor_and_numbered_messages() -> None:
    steps = [Step("a0", "lock", to="a1"), Step("a1", "unlock")]
    text = mermaid(("a0", "a1"), steps, title="t", broke="double-release: x")
    lines = text.splitlines()
    assert lines[0] == "sequenceDiagram"
    assert "autonumber" in text
    assert [ln.strip() for ln in lines if "participant" in ln] == [
        "participant a0 as a0", "participant a1 as a1"]
    assert "a0->>a1: lock" in text and "a1->>a1: unlock" in text
    assert text.rstrip().endswith("Note over a0,a1: double-release: x")


def test_independence_is_by_actor_and_footprint() -> None:
    a = Step("x", "s", frozenset({"p"}))
    assert a.independent(Step("y", "t", frozenset({"q"})))
    assert not a.independent(Step("y", "t", frozenset({"p"})))
    assert not a.independent(Step("x", "t", frozenset({"q"})))
    assert not a.independent(Step("y", "t", None))


def test_check_independence_catches_a_footprint_that_lies() -> None:
    class Liar(Counters):
        """a0's increments secretly double a1's counter too: declared independent."""

        def build(self) -> World:
            w = super().build()
            fire = w.fire

            def fire2(step: Step) -> None:
                fire(step)
                if step.actor == "a0" and step.name.startswith("inc"):
                    w.c[1] = min(self.k, w.c[1] * 2)
            w.fire = fire2  # type: ignore[method-assign]
            return w

    from terminus.fsm.explore import check_independence

    assert check_independence(Counters(n=2, k=2)) == []
    problems = check_independence(Liar(n=2, k=2))
    assert problems and "do not commute" in problems[0]


def test_readme_scenario_example_runs(capsys) -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = text[text.index("### Writing a scenario"):]
    code = section[section.index("```python") + len("```python"):]
    code = code[:code.index("```")]
    exec(compile(code, "README.md (Writing a scenario)", "exec"), {})
    out = capsys.readouterr().out
    assert out.startswith("sequenceDiagram") and "b->>b: give back" in out
