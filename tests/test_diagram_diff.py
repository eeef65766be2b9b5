"""`terminus diagrams --diff REV`: a machine's declaration at a git revision, imported from
a temporary worktree, compared with the working tree."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from machines import JOB, JOB_SPEC

from terminus.fsm import cli
from terminus.fsm.diagram import extract
from terminus.fsm.diagram_diff import compare

# The states are made in a loop: only importing the module gives them, not reading it.
FLOW = '''
from terminus.fsm import ANY, ERROR, IGNORE, Event, Spec, State, go

class Next(Event):
    pass

class Cancel(Event):
    pass

STEPS = {steps}
names = [f"step{{i}}" for i in range(STEPS)]
table = {{n: {{Next: go(names[i + 1]) if i + 1 < STEPS else go("done", plan="{plan}"),
             Cancel: go("cancelled", plan="{cancel}")}}
         for i, n in enumerate(names)}}
table["done"] = {{ANY: IGNORE}}
table["cancelled"] = {{ANY: IGNORE, Next: ERROR}}
FLOW = Spec("flow", states=(*(State(n, initial=i == 0) for i, n in enumerate(names)),
                            State("done", terminal=True), State("cancelled", terminal=True)),
            events=(Next, Cancel), table=table).build()
'''


def _git(repo: Path, *args: str) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.invalid",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.invalid")
    return subprocess.run(["git", "-C", str(repo), *args], check=True, env=env,
                          capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A throwaway git repository with `flow.py` committed twice (4 then 3 steps), the
    working tree then edited to 2 steps with other plans."""
    repo = tmp_path / "proj"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "flow.py").write_text(FLOW.format(steps=4, plan="release_done",
                                              cancel="release_cancelled"))
    _git(repo, "add", "flow.py")
    _git(repo, "commit", "-qm", "four steps")
    (repo / "flow.py").write_text(FLOW.format(steps=3, plan="release_done",
                                              cancel="release_cancelled"))
    _git(repo, "commit", "-qam", "three steps")
    (repo / "flow.py").write_text(FLOW.format(steps=2, plan="release_finished",
                                              cancel="release_dropped"))
    monkeypatch.chdir(repo)
    monkeypatch.syspath_prepend(str(repo))
    sys.modules.pop("flow", None)
    yield repo
    sys.modules.pop("flow", None)
    sys.modules.pop("flow2", None)


def _diff(*args: str) -> int:
    return cli.main(["diagrams", "--machines", "flow:FLOW", "--diff", *args])


def test_diff_against_head_imports_the_committed_declaration_from_a_worktree(
        repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _diff("HEAD", "--out", str(repo / "dd")) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:11] == [
        "1 of 1 machine(s) changed since HEAD",
        "flow: 5 cell(s) changed, 1 edge(s) added, 3 edge(s) removed, 2 edge(s) changed",
        "  state removed: step2",
        "  ~ step0 --Cancel / release_dropped--> cancelled (was Cancel / release_cancelled)",
        "  + step1 --Next / release_finished--> done",
        "  ~ step1 --Cancel / release_dropped--> cancelled (was Cancel / release_cancelled)",
        "  - step1 --Next--> step2",
        "  - step2 --Next / release_done--> done",
        "  - step2 --Cancel / release_cancelled--> cancelled",
        "  cell (step0, Cancel): -> cancelled / release_cancelled => "
        "-> cancelled / release_dropped",
        "  cell (step1, Next): -> step2 => -> done / release_finished"]
    assert sorted(p.name for p in (repo / "dd").iterdir()) == ["flow.diff.mmd",
                                                                "flow.diff.svg"]
    mmd = (repo / "dd" / "flow.diff.mmd").read_text()
    assert "    step1 --> step2 : [-] Next" in mmd
    assert "    class step2 removed" in mmd
    assert "    step0 --> cancelled : [~] Cancel / release_dropped (was Cancel / " \
           "release_cancelled)" in mmd
    svg = (repo / "dd" / "flow.diff.svg").read_text()
    assert "[&#45;] Next" in svg and "legend" in svg
    # The temporary worktree is gone.
    assert _git(repo, "worktree", "list").count("\n") == 1


def test_diff_against_an_older_revision_as_markdown_for_a_pull_request(
        repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _diff("HEAD~1", "--format", "markdown") == 0
    md = capsys.readouterr().out
    assert md.startswith("## State machines changed since `HEAD~1`\n")
    assert "### `flow`: 7 cell(s) changed, 1 edge(s) added, 5 edge(s) removed, 2 edge(s) " \
           "changed\n" in md
    assert "- state removed: `step3`" in md and "- state removed: `step2`" in md
    assert "| step3 | Next | `-> done / release_done` | (none) |" in md
    assert "```mermaid\n---\ntitle: flow (changes since HEAD~1)\n" in md
    assert "    class step2,step3 removed" in md


def test_no_machine_changed_exits_0_and_a_new_machine_says_why_it_is_new(
        repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _git(repo, "commit", "-qam", "two steps")
    assert _diff("HEAD") == 0
    assert capsys.readouterr().out == "no machine changed since HEAD (1 compared)\n"
    (repo / "flow2.py").write_text(FLOW.format(steps=1, plan="p", cancel="c")
                                   .replace('Spec("flow"', 'Spec("flow2"'))
    assert cli.main(["diagrams", "--machines", "flow:FLOW", "--machines", "flow2:FLOW",
                     "--diff", "HEAD"]) == 0
    assert capsys.readouterr().out.splitlines()[:3] == [
        "1 of 2 machine(s) changed since HEAD", "flow2: machine added",
        "  at HEAD: ModuleNotFoundError: no module named 'flow2' at HEAD"]


def test_a_bad_revision_is_a_clear_error(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _diff("no-such-rev") == 2
    err = capsys.readouterr().err
    assert "'no-such-rev' is not a git revision of" in err


def test_compare_marks_added_guards_and_plans_as_changes() -> None:
    from terminus.fsm import Spec, go

    table = dict(JOB_SPEC.table)
    running = dict(table["running"])
    running[JOB_SPEC.events[2]] = [go("draining", when="last"),
                                   go("aborted", plan="release_done")]
    table["running"] = running
    edited = Spec("job", states=JOB_SPEC.states, events=JOB_SPEC.events, table=table,
                  guards=JOB_SPEC.guards).build()
    d = compare(extract(JOB), extract(edited))
    assert d.status == "changed"
    assert [(c.kind, c.edge.guard, c.edge.plan, c.before.guard if c.before else None)
            for c in d.edges] == [("changed", "last", None, "in_flight"),
                                  ("changed", None, "release_done", None)]
    assert [(c.state, c.event) for c in d.cells] == [("running", "Abort")]
    assert compare(extract(JOB), extract(JOB)).status == "unchanged"
