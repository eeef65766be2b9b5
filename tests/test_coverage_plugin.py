"""The transition-coverage pytest plugin (`--fsm-coverage`), run on small inner sessions."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

pytest_plugins = ["pytester"]

MACHINES = (Path(__file__).parent / "machines.py").read_text()

# Two inner test files that exercise different parts of JOB, and one that steps TOGGLE
# as a batch; each drives its instances to a terminal state.
START_AND_FINISH = """
from machines import JOB, Start, Progress, Poke

def test_start_progress_finish():
    j = JOB.bind(partial=True).create()  # a table test: plans run empty
    j.fire(Poke())                     # ignored in queued
    j.fire(Start())
    j.fire(Progress())                 # alt 1: [else] back to running
    j.fire(Progress(last=True))        # alt 0: [last] -> done
    assert j.state == "done"
"""

ABORT_EARLY = """
import pytest
from terminus.fsm import TransitionNotAllowed
from machines import JOB, Abort, Progress, Start

def test_abort_in_queued_then_errors():
    j = JOB.bind(partial=True).create()  # a table test: plans run empty
    with pytest.raises(TransitionNotAllowed):
        j.fire(Progress())             # error in queued
    j.fire(Abort())
    with pytest.raises(TransitionNotAllowed):
        j.fire(Start())                # error in aborted
    assert j.state == "aborted"
"""

BATCH = """
from machines import TOGGLE, Go, Stop

def test_batched_steps_are_recorded():
    b = TOGGLE.batch(3)
    b.step(b.event_ids([Go, Stop, None]))
    b.step(b.event_ids([Go, Go, None]))     # busy->idle; finished ignores Go
    b.step(b.event_ids([Go, None, Stop]))   # idle->busy; idle->finished
    b.step(b.event_ids([Stop, None, None])) # busy->finished
    assert b.count("finished") == 3
"""


def _setup(pytester: pytest.Pytester, **files: str) -> None:
    pytester.makepyfile(machines=MACHINES, **files)
    pytester.syspathinsert()


def _report(pytester: pytest.Pytester, name: str = "cov.json") -> Any:
    return json.loads((pytester.path / name).read_text())


def test_records_transitions_pairs_and_terminal_states_per_machine(
        pytester: pytest.Pytester) -> None:
    _setup(pytester, test_start=START_AND_FINISH, test_abort=ABORT_EARLY)
    r = pytester.runpytest("--fsm-coverage", "--fsm-coverage-json", "cov.json",
                           "--fsm-coverage-machines", "machines:JOB")
    r.assert_outcomes(passed=2)
    job = _report(pytester)["machines"]["job"]
    assert job["transitions"]["covered"] == 4 and job["transitions"]["declared"] == 8
    assert job["pairs"]["covered"] == 6 and job["pairs"]["declared"] == 20
    missing = {(t["source"], t["event"], t["alt"]) for t in job["transitions"]["missing"]}
    assert missing == {("running", "Abort", 0), ("running", "Abort", 1),
                       ("running", "Poke", 0), ("draining", "Progress", 0)}
    assert {"state": "running", "event": "Abort"} in job["pairs"]["missing"]
    assert job["terminals"] == {"reached": ["done", "aborted"],
                                "declared": ["done", "aborted"], "missing": []}
    assert job["decisions"] == {"transition": 4, "ignore": 1, "error": 2}
    assert job["registered"] and job["gated"] and job["score"] == 30.0
    r.stdout.fnmatch_lines(["*fsm transition coverage*",
                            "job * 4/8 * 50.0% * 6/20 * 30.0% * 2/2",
                            "job: never exercised",
                            "  transition running --Abort [in_flight]--> draining (alt 0)",
                            "  pairs      in running: Start, Abort, Poke",
                            "  pairs      in done: every event"])


def test_batched_steps_count_and_machines_seen_but_not_registered_are_reported(
        pytester: pytest.Pytester) -> None:
    _setup(pytester, test_batch=BATCH)
    r = pytester.runpytest("--fsm-coverage-json", "cov.json",
                           "--fsm-coverage-machines", "machines:JOB")
    r.assert_outcomes(passed=1)
    rep = _report(pytester)["machines"]
    toggle = rep["toggle"]
    assert (toggle["transitions"]["covered"], toggle["transitions"]["declared"]) == (4, 4)
    assert toggle["pairs"]["missing"] == [{"state": "finished", "event": "Stop"}]
    assert toggle["decisions"] == {"transition": 6, "ignore": 1, "error": 0}
    assert not toggle["registered"] and not toggle["gated"]
    assert rep["job"]["transitions"]["covered"] == 0  # registered, never run


def test_workers_records_are_merged_under_xdist(pytester: pytest.Pytester) -> None:
    _setup(pytester, test_start=START_AND_FINISH, test_abort=ABORT_EARLY, test_batch=BATCH)
    r = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider",
                                      "--fsm-coverage-json", "cov.json",
                                      "--fsm-coverage-machines", "machines:JOB")
    r.assert_outcomes(passed=3)
    rep = _report(pytester)["machines"]
    assert rep["job"]["transitions"]["covered"] == 4  # the union of both workers
    assert rep["job"]["pairs"]["covered"] == 6
    assert rep["toggle"]["transitions"]["covered"] == 4
    r.stdout.fnmatch_lines(["*fsm transition coverage*", "job * 4/8 *"])


def test_fail_under_fails_the_session_and_names_the_machines_below(
        pytester: pytest.Pytester) -> None:
    _setup(pytester, test_start=START_AND_FINISH)
    r = pytester.runpytest("--fsm-coverage-fail-under", "50",
                           "--fsm-coverage-machines", "machines:JOB")
    r.assert_outcomes(passed=1)
    assert r.ret == pytest.ExitCode.TESTS_FAILED
    r.stdout.fnmatch_lines(["FAIL: fsm coverage below 50% (min of transition and pair "
                            "coverage) for: job"])


FULL = """
from terminus.fsm.testing import drive_machine
from machines import JOB, Job, Abort, Poke, Progress

def arrange(job, step):
    if step.event is Progress:
        return Progress(last=step.guard == "last")
    if step.event in (Abort, Poke):
        job.in_flight = 1 if step.guard == "in_flight" else 0
    return step.event()

def test_every_path():
    m = JOB.bind(partial=True)  # a table test: plans run empty
    assert drive_machine(m, lambda: Job(m), arrange).ok
"""


def test_full_coverage_passes_fail_under_100_and_writes_coloured_diagrams(
        pytester: pytest.Pytester) -> None:
    _setup(pytester, test_full=FULL, test_batch=BATCH)
    r = pytester.runpytest("--fsm-coverage-fail-under", "100", "--fsm-coverage-diagrams",
                           "cov", "--fsm-coverage-machines", "machines:JOB")
    r.assert_outcomes(passed=2)
    assert r.ret == pytest.ExitCode.OK  # toggle misses a pair, but only job is gated
    r.stdout.fnmatch_lines(["fsm coverage: every gated machine reaches 100%"])
    out = pytester.path / "cov"
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md", "job.mmd", "job.svg", "toggle.mmd", "toggle.svg"]
    job = (out / "job.mmd").read_text()
    assert "    class queued,running,draining,done,aborted covered" in job
    assert "(never)" not in job
    toggle = (out / "toggle.mmd").read_text()
    assert "    class finished reached" in toggle  # entered, Stop never fired there


def test_without_the_option_nothing_is_attached_or_reported(
        pytester: pytest.Pytester) -> None:
    _setup(pytester, test_off="""
from terminus.fsm import observe
from machines import JOB

def test_no_recorder():
    assert observe.recorder() is None
    assert JOB._rows is JOB._fast_rows
""")
    # In a subprocess: in-process, an outer `--fsm-coverage` session's recorder shows.
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    r.assert_outcomes(passed=1)
    assert "fsm transition coverage" not in r.stdout.str()


def test_a_bad_machine_reference_is_a_usage_error(pytester: pytest.Pytester) -> None:
    _setup(pytester, test_start=START_AND_FINISH)
    r = pytester.runpytest("--fsm-coverage", "--fsm-coverage-machines", "machines:NOPE")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stdout.fnmatch_lines(["fsm coverage: cannot load the machines to gate: module "
                            "'machines' has no attribute 'NOPE'*"])


def test_a_rejected_batch_step_records_only_the_errors_that_rejected_it() -> None:
    from terminus.fsm import TransitionNotAllowed, observe
    from terminus.fsm.coverage import CoverageRecorder
    from tests.machines import TOGGLE, Go, Stop

    rec = CoverageRecorder()
    previous = observe.set_recorder(rec)
    try:
        b = TOGGLE.batch(2)
        b.step(b.event_ids([Stop, None]))  # row 0: idle -> finished
        with pytest.raises(TransitionNotAllowed, match="'Stop' is not allowed in state "
                           "'finished'"):
            b.step(b.event_ids([Stop, Go]))  # row 0 errs, so row 1 never goes busy
        assert b.states.tolist() == [TOGGLE.state_id("finished"), TOGGLE.state_id("idle")]
        b.step(b.event_ids([None, Stop]))
    finally:
        observe.set_recorder(previous)
    toggle = rec.report().machines["toggle"]
    assert toggle.decisions == {"transition": 2, "ignore": 0, "error": 1}
    assert [(t.source, t.event) for t in toggle.transitions.missing] == [
        ("idle", "Go"), ("busy", "Go"), ("busy", "Stop")]
    assert [(p.state, p.event) for p in toggle.pairs.missing] == [
        ("idle", "Go"), ("busy", "Go"), ("busy", "Stop"), ("finished", "Go")]


# -- the plugin in a user's own project ----------------------------------------------------

USER_PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "doorco"
version = "0.1.0"

[project.entry-points."terminus.machines"]
door = "doorco.door:DOOR"

[tool.setuptools]
packages = ["doorco"]
package-dir = {"" = "src"}
"""

USER_MACHINE = """
from terminus.fsm import ANY, ERROR, IGNORE, Event, Spec, State, go

class Open(Event):
    pass

class Close(Event):
    pass

class Remove(Event):
    pass

DOOR = Spec(
    "door",
    states=(State("closed", initial=True), State("open"), State("gone", terminal=True)),
    events=(Open, Close, Remove),
    table={"closed": {Open: go("open"), Close: IGNORE, Remove: go("gone", plan="release")},
           "open": {Close: go("closed"), Open: IGNORE, Remove: ERROR},
           "gone": {ANY: IGNORE}},
).build()
"""

USER_TESTS = """
import pytest
from terminus.fsm import Ledger, Plan, TransitionNotAllowed
from doorco.door import DOOR, Close, Open, Remove

BOUND = DOOR.bind({"release": Plan()}, Ledger({}))

def test_every_event_in_every_state():
    d = BOUND.create()
    d.fire(Close())
    d.fire(Open())
    d.fire(Open())
    with pytest.raises(TransitionNotAllowed):
        d.fire(Remove())
    d.fire(Close())
    d.fire(Remove())
    for ev in (Open(), Close(), Remove()):
        d.fire(ev)
    assert d.state == "gone"

def test_a_library_machine_the_project_drives_is_not_its_to_gate():
    from terminus.states.sequence import SEQUENCE, Admit
    s = SEQUENCE.create()
    s.fire(Admit())
    assert s.state == "prefill"
"""


@pytest.fixture(scope="module")
def user_project(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A project of its own (package `doorco`, one registered machine, two tests),
    installed into a folder of its own; returns (project, env to run its pytest)."""
    import os
    import subprocess
    import sys

    tmp_path = tmp_path_factory.mktemp("user")
    proj = tmp_path / "doorco-project"
    (proj / "src" / "doorco").mkdir(parents=True)
    (proj / "tests").mkdir()
    (proj / "pyproject.toml").write_text(USER_PYPROJECT)
    (proj / "src" / "doorco" / "__init__.py").write_text("")
    (proj / "src" / "doorco" / "door.py").write_text(USER_MACHINE)
    (proj / "tests" / "test_door.py").write_text(USER_TESTS)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-index", "--no-build-isolation", "--target", str(site), str(proj)],
                   check=True, capture_output=True)
    env = dict(os.environ, PYTHONPATH=str(site))
    return proj, env


def _pytest(proj: Path, env: dict[str, str], *args: str) -> Any:
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           "-q", *args], cwd=proj, env=env, capture_output=True, text=True)


def _coverage_section(out: str) -> list[str]:
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if "fsm transition coverage" in ln)
    end = next(i for i in range(start + 1, len(lines))
               if re.match(r"=|\d+ (passed|failed)", lines[i]))
    return lines[start:end]


LIBRARY_MACHINES = ("request", "sampling", "lora_adapter", "prefetch", "disagg_prefill",
                    "chunk", "sequence")


def test_in_a_users_project_only_the_users_own_machine_is_gated_and_reported(
        user_project: tuple[Path, dict[str, str]]) -> None:
    proj, env = user_project
    r = _pytest(proj, env, "--fsm-coverage-fail-under", "100",
                "--fsm-coverage-json", "cov.json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 passed" in r.stdout
    report = json.loads((proj / "cov.json").read_text())
    assert list(report["machines"]) == ["door"]  # the library's sequence ran, unreported
    door = report["machines"]["door"]
    assert door["registered"] and door["gated"] and door["score"] == 100.0
    assert report["passed"] and report["below"] == []
    section = _coverage_section(r.stdout)
    assert len(section) <= 40, "\n".join(section)
    assert not any(name in line for line in section for name in LIBRARY_MACHINES)
    assert "fsm coverage: every gated machine reaches 100%" in section


def test_naming_machines_alone_turns_coverage_on_and_gates_them(
        user_project: tuple[Path, dict[str, str]]) -> None:
    proj, env = user_project
    r = _pytest(proj, env, "--fsm-coverage-machines", "doorco.door:DOOR",
                "--fsm-coverage-machines", "terminus.states.sequence:SEQUENCE",
                "--fsm-coverage-fail-under", "50")
    assert r.returncode == 1, r.stdout + r.stderr  # sequence, named, is far below 50 %
    section = _coverage_section(r.stdout)
    assert section[3].split()[0] == "door" and section[4].split()[0] == "sequence"
    assert section[-1] == ("FAIL: fsm coverage below 50% (min of transition and pair "
                           "coverage) for: sequence")
    r = _pytest(proj, env, "--fsm-coverage-machines", "doorco.door:DOOR")
    assert r.returncode == 0
    assert [ln.split()[0] for ln in _coverage_section(r.stdout)[3:]] == ["door"]


def test_this_repository_gates_the_library_machines_by_its_own_ini_option(
        pytestconfig: pytest.Config) -> None:
    assert pytestconfig.getini("fsm_coverage_library_machines") is True
