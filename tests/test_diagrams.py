"""Diagrams: the extracted data (what the picture shows), the renderers, `terminus diagrams`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from machines import JOB, JOB_SPEC, TOGGLE

from terminus.fsm import cli, diagram
from terminus.fsm.diagram import Absorbed, Edge, Marks, dot, extract, files, mermaid, svg
from terminus.fsm.oracle import transitions_machine


def _edge_set(d: diagram.MachineDiagram) -> set[tuple[str, str, str, str | None]]:
    return {(e.source, e.event, e.target, e.guard) for e in d.edges}


def test_extract_lists_every_declared_edge_with_its_guard_and_plan() -> None:
    d = extract(JOB)
    assert d.name == "job" and d.initial == "queued"
    assert d.edges == (
        Edge("queued", "Start", 0, "running", None, None, False),
        Edge("queued", "Abort", 0, "aborted", None, "release_aborted", True),
        Edge("running", "Progress", 0, "done", "last", "release_done", True),
        Edge("running", "Progress", 1, "running", None, None, False, otherwise=True),
        Edge("running", "Abort", 0, "draining", "in_flight", None, False),
        Edge("running", "Abort", 1, "aborted", None, "release_aborted", True, otherwise=True),
        Edge("running", "Poke", 0, "draining", "in_flight", None, False),
        Edge("draining", "Progress", 0, "aborted", "last", "release_aborted", True),
    )
    assert all(e.plan is not None for e in d.edges if e.terminal)
    assert d.plans == ("release_aborted", "release_done")


def test_extract_flags_states_and_lists_ignores_and_errors_per_state() -> None:
    st = {s.name: s for s in extract(JOB).states}
    assert [n for n, s in st.items() if s.terminal] == ["done", "aborted"]
    assert [n for n, s in st.items() if s.initial] == ["queued"]
    assert st["queued"].ignored == (Absorbed("Poke"),)
    assert st["queued"].errors == (Absorbed("Progress"),)
    assert st["running"].errors == (Absorbed("Poke", otherwise=True, implicit=True),)
    assert st["draining"].ignored[0] == Absorbed("Progress", otherwise=True)
    assert len(st["done"].ignored) == len(JOB.events) and not st["done"].errors
    assert st["aborted"].errors == (Absorbed("Start"),)


def test_extract_agrees_with_the_transitions_declaration() -> None:
    tm = transitions_machine(JOB)
    edges, internal = set(), set()
    for trigger, ev in tm.events.items():
        for source, ts in ev.transitions.items():
            for t in ts:
                guard = t.conditions[0].func.__name__ if t.conditions else None
                if t.dest is None:
                    internal.add((source, trigger))
                else:
                    edges.add((source, trigger, t.dest, guard))
    d = extract(JOB)
    assert edges == _edge_set(d)
    assert internal == {(s.name, a.event) for s in d.states for a in s.ignored}
    assert {s.name for s in d.states if s.terminal} == {
        name for name, s in tm.states.items() if s.final}


def test_bound_copies_extract_to_the_same_data() -> None:
    assert extract(JOB.bind(partial=True)) == extract(JOB) == extract(JOB_SPEC.build())


def test_mermaid_shows_terminals_plans_guards_and_lists_ignores_as_notes() -> None:
    text = mermaid(extract(JOB))
    lines = text.splitlines()
    assert lines[:4] == ["---", "title: job", "---", "stateDiagram-v2"]
    assert "    [*] --> queued" in lines
    assert "    running --> done : Progress [last] / release_done" in lines
    assert "    running --> aborted : Abort [else] / release_aborted" in lines
    assert "    done --> [*]" in lines and "    aborted --> [*]" in lines
    assert "    class done,aborted terminal" in lines
    assert "        ignores: Progress (else), Abort, Poke" in lines
    assert "        errors: Poke (no guard held)" in lines
    assert "        ignores: every event" in lines
    # Ignores are notes, not self-loops: the only self-loop is the declared transition.
    loops = [ln for ln in lines if " --> " in ln and ln.split()[0] == ln.split()[2]]
    assert loops == ["    running --> running : Progress [else]"]


def test_mermaid_gives_reserved_state_names_safe_ids() -> None:
    from terminus.fsm import ANY, IGNORE, Event, Spec, State, go

    class Tick(Event):
        pass

    m = Spec("reserved", states=(State("state", initial=True), State("end", terminal=True)),
             events=(Tick,), table={"state": {Tick: go("end", plan="p")},
                                    "end": {ANY: IGNORE}}).build()
    lines = mermaid(extract(m)).splitlines()
    assert '    state "state" as s0' in lines and '    state "end" as s1' in lines
    assert "    s0 --> s1 : Tick / p" in lines


def test_dot_marks_terminal_states_and_colours_edges_by_coverage() -> None:
    d = extract(JOB)
    src = dot(d)
    assert '"done" [label="done\\nignores: every event", peripheries=2' in src
    assert '"queued" -> "aborted" [label="Abort / release_aborted", penwidth=1.6];' in src
    marks = Marks(edges=frozenset({("queued", "Start", 0)}),
                  pairs=frozenset({("queued", ev) for ev in d.events}))
    cov = dot(d, marks)
    assert '"queued" -> "running" [label="Start", color="#1a7f1a"];' in cov
    assert '"running" -> "draining" [label="Abort [in_flight]", color="#b00020", ' \
           'style=dashed];' in cov
    assert 'fillcolor="#c8f0c8"' in cov  # queued: every event exercised


def test_mermaid_coverage_overlay_classes_states_and_labels_untaken_edges() -> None:
    d = extract(JOB)
    marks = Marks(edges=frozenset({("queued", "Start", 0)}),
                  pairs=frozenset({("queued", ev) for ev in d.events} | {("running", "Start")}))
    lines = mermaid(d, marks).splitlines()
    assert "    queued --> running : Start" in lines
    assert "    queued --> aborted : Abort / release_aborted (never)" in lines
    assert "    class queued covered" in lines
    assert "    class running partial" in lines
    assert "    class draining,done,aborted uncovered" in lines


def test_svg_is_deterministic_and_stamped_with_its_source_digest() -> None:
    src = dot(extract(JOB))
    a, b = svg(src), svg(src)
    assert a == b
    assert b"Generated by graphviz" not in a
    assert b"<!-- terminus-dot-sha256: " in a
    assert diagram.same_file("job.svg", a.replace(b"<svg width", b"<svg  width"), a)
    assert not diagram.same_file("job.svg", svg(dot(extract(TOGGLE))), a)


def test_files_are_byte_identical_across_runs_and_indexed_by_the_readme() -> None:
    one = files([extract(TOGGLE), extract(JOB)])
    two = files([extract(JOB), extract(TOGGLE)])
    assert one == two
    assert sorted(one) == ["README.md", "job.mmd", "job.svg", "toggle.mmd", "toggle.svg"]
    readme = one["README.md"].decode()
    assert "| [job](#job) |  | 5 | 2 | 8 | 20 | [job.mmd](job.mmd), [job.svg](job.svg) |" \
        in readme
    assert readme.count("```mermaid") == 2
    assert one["job.mmd"].decode().rstrip("\n") in readme
    assert "No machines are registered yet." in files([])["README.md"].decode()


def _run(*args: str) -> int:
    return cli.main(["diagrams", *args])


def test_cli_writes_then_check_passes_and_names_stale_missing_and_extra_files(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "dg"
    args = ("--machines", "machines:JOB", "--machines", "machines:TOGGLE", "--out", str(out))
    assert _run(*args) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md", "job.mmd", "job.svg", "toggle.mmd", "toggle.svg"]
    assert _run(*args, "--check") == 0
    capsys.readouterr()
    (out / "job.mmd").write_text("stateDiagram-v2\n")
    (out / "toggle.svg").unlink()
    (out / "gone.mmd").write_text("old\n")
    assert _run(*args, "--check") == 1
    err = capsys.readouterr().err
    assert f"stale: {out / 'job.mmd'}" in err
    assert f"missing: {out / 'toggle.svg'}" in err
    assert f"extra (no such machine): {out / 'gone.mmd'}" in err
    assert "3 file(s)" in err
    assert f"run `terminus diagrams --out {out} --machines machines:JOB --machines " \
           "machines:TOGGLE` and commit" in err
    assert _run(*args) == 0
    assert not (out / "gone.mmd").exists()
    assert _run(*args, "--check") == 0


def test_cli_check_fails_when_a_declaration_changes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert _run("--machines", "machines:JOB", "--out", str(out)) == 0
    # The same machine name, one event fewer: the committed files are now stale.
    (tmp_path / "job_v2.py").write_text(
        "from machines import JOB_SPEC\nfrom terminus.fsm import Spec\n"
        "JOB = Spec('job', states=JOB_SPEC.states, events=JOB_SPEC.events[:3],\n"
        "           table={k: {e: c for e, c in r.items() if getattr(e, '__name__', '') "
        "!= 'Poke'} for k, r in JOB_SPEC.table.items()},\n"
        "           guards=JOB_SPEC.guards).build()\n")
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        capsys.readouterr()
        assert _run("--machines", "job_v2:JOB", "--out", str(out), "--check") == 1
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("job_v2", None)
    printed = capsys.readouterr()
    stale = printed.out + printed.err
    assert f"stale: {out / 'job.mmd'}" in stale and f"stale: {out / 'job.svg'}" in stale


@pytest.mark.parametrize(("spec", "message"), [
    ("machines", r"'machines' is not MODULE:ATTR"),
    ("no_such_module:X", r"cannot import module 'no_such_module'"),
    ("machines:NOPE", r"module 'machines' has no attribute 'NOPE'"),
    ("machines:JOB_SPEC", r"is a Spec, not a built fsm.Machine \(call .build\(\) on the Spec\)"),
])
def test_cli_names_a_bad_machine_reference(spec: str, message: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert _run("--machines", spec, "--out", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.startswith("terminus diagrams: ")
    assert re.search(message, err)
    assert list(tmp_path.iterdir()) == []


def test_two_different_machines_with_one_name_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "twin_job.py").write_text(
        "from machines import JOB_SPEC\nfrom terminus.fsm import Spec\n"
        "TWIN = Spec('job', states=JOB_SPEC.states, events=JOB_SPEC.events[:3],\n"
        "            table={k: {e: c for e, c in r.items() if getattr(e, '__name__', '') "
        "!= 'Poke'} for k, r in JOB_SPEC.table.items()},\n"
        "            guards=JOB_SPEC.guards).build()\n")
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        assert _run("--machines", "machines:JOB", "--machines", "twin_job:TWIN",
                    "--out", str(tmp_path / "out")) == 2
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("twin_job", None)
    assert "two different machines are named 'job'" in capsys.readouterr().err


def test_a_states_doc_is_drawn_in_both_renderers() -> None:
    from terminus.fsm import ANY, IGNORE, Event, Spec, State, go

    class Tick(Event):
        pass

    m = Spec("documented", states=(
        State("waiting", initial=True, doc="queued; no pages held yet"),
        State("gone", terminal=True, doc="released")),
        events=(Tick,), table={"waiting": {Tick: go("gone", plan="p")},
                               "gone": {ANY: IGNORE}}).build()
    d = extract(m)
    lines = mermaid(d).splitlines()
    # A Mermaid description ends at ';', so the doc is drawn with a comma there.
    assert "    waiting : queued, no pages held yet" in lines
    assert "    gone : released" in lines
    assert '"waiting" [label="waiting\\nqueued; no pages held yet", ' in dot(d)


def test_hide_errors_leaves_out_the_error_lists_only() -> None:
    d = extract(JOB)
    shown, hidden = mermaid(d), mermaid(d, errors=False)
    assert "errors: Poke (no guard held)" in shown and "errors:" not in hidden
    assert "ignores: Progress (else), Abort, Poke" in hidden
    assert "errors:" in dot(d) and "errors:" not in dot(d, errors=False)
    assert [ln for ln in shown.splitlines() if "-->" in ln] == \
        [ln for ln in hidden.splitlines() if "-->" in ln]


def test_terminal_states_entered_are_reached_not_uncovered() -> None:
    d = extract(JOB)
    marks = Marks(edges=frozenset({("queued", "Abort", 0)}),
                  pairs=frozenset({("queued", "Abort")}))
    kinds = {st.name: diagram.state_coverage(d, st, marks) for st in d.states}
    assert kinds == {"queued": "partial", "running": "uncovered", "draining": "uncovered",
                     "done": "uncovered", "aborted": "reached"}
    assert "    class aborted reached" in mermaid(d, marks).splitlines()
    assert 'fillcolor="#cfe3fa"' in dot(d, marks)


def test_the_readme_in_a_custom_out_says_where_the_machines_came_from(
        tmp_path: Path) -> None:
    out = tmp_path / "custom"
    assert _run("--machines", "machines:JOB", "--out", str(out), "--hide-errors") == 0
    readme = (out / "README.md").read_text()
    assert readme.startswith(
        f"# State diagrams\n\nGenerated by `terminus diagrams --out {out} --machines "
        "machines:JOB --hide-errors` from the machines named on the command line "
        "(`--machines machines:JOB`); do not edit.")
    assert "| [job](#job) | `machines:JOB` | 5 |" in readme
    assert "its error events are left out: `--hide-errors`" in readme
    assert "errors:" not in (out / "job.mmd").read_text()
    assert _run("--machines", "machines:JOB", "--out", str(out), "--hide-errors",
                "--check") == 0
    # Drawn from the entry points instead, it names the distribution that registered them.
    from terminus.fsm.discover import describe

    assert describe() == ("the machines registered in the entry-point group "
                          "`terminus.machines` by `terminus-fsm`")
