"""pytest plugin: transition coverage of fsm machines (`pytest --fsm-coverage`).

Registered through the `pytest11` entry point, so installing terminus makes the options
available; nothing is recorded unless `--fsm-coverage` (or one of the options that
imply it) is given, and with no recorder attached every machine keeps its fast table.

    --fsm-coverage                     record every decision of every machine
    --fsm-coverage-json PATH           write the report (fsm.coverage.CoverageReport)
    --fsm-coverage-diagrams DIR        write each machine's diagram coloured by coverage
    --fsm-coverage-html DIR            write a static HTML site (fsm.html_report), with
                                       the tests that exercised each transition
    --fsm-coverage-fail-under N        fail the session when a gated machine's
                                       min(transition %, pair %) is below N
    --fsm-coverage-machines MOD:ATTR   the machines to gate (repeatable) instead of the
                                       project's own `terminus.machines` entry points

Which machines are gated: those named with `--fsm-coverage-machines`, else the
`terminus.machines` entry points of every installed distribution except terminus-fsm
itself (the user's project), else every machine seen. The library's own seven serving
machines are gated only where the ini option `fsm_coverage_library_machines = true`
says so (this repository's pyproject.toml); elsewhere they are left out of the report.

Definitions (declared, covered, gated, percent) are in `fsm.coverage`. Under
pytest-xdist each worker records on its own and sends its records to the controller
(`config.workeroutput`), which merges them in `pytest_testnodedown` and reports.
This module imports fsm (and so torch) only when coverage is on.

It also carries the leak sanitizer's switch (`terminus.effects.sanitize`: pools and
ledger audited after every driver call), off by default:

    --terminus-sanitize                audit after every driver call (sets
                                       TERMINUS_SANITIZE=1 for the session)
    ini: terminus_sanitize = true      the same, for a project's whole suite
    @pytest.mark.terminus_no_sanitize  one test without it (say why in the reason)

fsm knows nothing of pools: the switch is the environment variable the effects read
(once per process; after changing it the plugin asks `terminus.effects.sanitize` to read
it again, if that module is loaded, without importing it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .coverage import CoverageRecorder, CoverageReport

_KEY = "terminus_fsm_coverage"
SANITIZE_ENV = "TERMINUS_SANITIZE"


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add the `--fsm-coverage*` options."""
    g = parser.getgroup("fsm-coverage", "terminus: transition coverage of fsm machines")
    g.addoption("--fsm-coverage", action="store_true", default=False,
                help="record every transition and (state, event) decision of every fsm "
                     "machine and print coverage per machine")
    g.addoption("--fsm-coverage-json", metavar="PATH", default=None,
                help="write the coverage report as JSON to PATH (implies --fsm-coverage)")
    g.addoption("--fsm-coverage-diagrams", metavar="DIR", default=None,
                help="write each machine's diagram coloured by coverage (Mermaid and SVG) "
                     "into DIR (implies --fsm-coverage)")
    g.addoption("--fsm-coverage-html", metavar="DIR", default=None,
                help="write a static HTML report into DIR (index.html, a page per machine "
                     "with its coverage diagram, state x event table and the tests that "
                     "exercised each transition; implies --fsm-coverage)")
    g.addoption("--fsm-coverage-fail-under", metavar="N", type=float, default=None,
                help="fail when any gated machine's transition or (state, event) pair "
                     "coverage is below N percent (implies --fsm-coverage)")
    s = parser.getgroup("terminus-sanitize", "terminus: the leak sanitizer")
    s.addoption("--terminus-sanitize", action="store_true", default=False,
                help="audit pools against the ownership ledger after every driver call "
                     "(sets TERMINUS_SANITIZE=1; see terminus.effects.sanitize)")
    parser.addini("terminus_sanitize", "turn the leak sanitizer on for the whole suite",
                  type="bool", default=False)
    g.addoption("--fsm-coverage-machines", metavar="MODULE:ATTR", action="append",
                default=None,
                help="machines to declare and gate, repeatable (default: the "
                     "'terminus.machines' entry points of your own project; implies "
                     "--fsm-coverage)")
    parser.addini("fsm_coverage_library_machines", type="bool", default=False,
                  help="also gate the serving machines terminus-fsm itself registers "
                       "(terminus's own suite sets this)")


def _enabled(config: pytest.Config) -> bool:
    o = config.option
    return bool(o.fsm_coverage or o.fsm_coverage_json or o.fsm_coverage_diagrams
                or o.fsm_coverage_html or o.fsm_coverage_machines
                or o.fsm_coverage_fail_under is not None)


def pytest_configure(config: pytest.Config) -> None:
    """Attach the recorder when coverage is on (and only then); turn the sanitizer on."""
    config.addinivalue_line("markers", "terminus_no_sanitize(reason): run this test "
                                       "without the leak sanitizer")
    if config.option.terminus_sanitize or config.getini("terminus_sanitize"):
        os.environ[SANITIZE_ENV] = "1"
        _sanitize_env_changed()
    if _enabled(config):
        config.pluginmanager.register(FsmCoverage(config), f"{_KEY}_session")


def _sanitize_env_changed() -> None:
    """Have the sanitizer read `SANITIZE_ENV` again (it caches it per process)."""
    mod = sys.modules.get("terminus.effects.sanitize")
    if mod is not None:
        mod.refresh()


@pytest.fixture(autouse=True)
def _terminus_no_sanitize(request: pytest.FixtureRequest) -> Any:
    """Tests marked `terminus_no_sanitize` run with the sanitizer off; after every test
    the sanitizer reads the variable again (a test may have changed it)."""
    if request.node.get_closest_marker("terminus_no_sanitize") is None:
        yield
        _sanitize_env_changed()
        return
    old = os.environ.get(SANITIZE_ENV)
    os.environ[SANITIZE_ENV] = "0"
    _sanitize_env_changed()
    try:
        yield
    finally:
        if old is None:
            del os.environ[SANITIZE_ENV]
        else:
            os.environ[SANITIZE_ENV] = old
        _sanitize_env_changed()


class FsmCoverage:
    """The session's coverage: a recorder, plus the hooks that merge and report it."""

    def __init__(self, config: pytest.Config) -> None:
        from . import observe
        from .coverage import CoverageRecorder

        self.config = config
        self.worker = hasattr(config, "workerinput")
        self.recorder: CoverageRecorder = CoverageRecorder()
        # An in-process inner session (pytester) must hand the outer recorder back.
        self._previous = observe.set_recorder(self.recorder)
        self.report: CoverageReport | None = None
        self.error: str | None = None
        self.contexts = bool(config.option.fsm_coverage_html)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Any:
        """With --fsm-coverage-html, note the test every decision is made in."""
        if self.contexts:
            self.recorder.context = item.nodeid
        try:
            yield
        finally:
            self.recorder.context = None

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        """Detach the recorder, restoring whichever was attached before."""
        from . import observe

        observe.set_recorder(self._previous)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """(xdist controller) merge what a worker recorded."""
        data = getattr(node, "workeroutput", {}).get(_KEY)
        if data:
            self.recorder.merge(data)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        """Workers send their records; the controller (or a lone process) reports."""
        if self.worker:
            self.config.workeroutput[_KEY] = self.recorder.export()  # type: ignore[attr-defined]
            return
        from .discover import MachineLoadError, machines

        o = self.config.option
        library = bool(self.config.getini("fsm_coverage_library_machines"))
        try:
            named = o.fsm_coverage_machines
            for m in machines(named, library=None if library else False).values():
                self.recorder.learn(m, registered=True)
            if not library:
                for m in machines(library=True).values():
                    self.recorder.learn(m, hidden=True)
        except MachineLoadError as e:
            self.error = f"fsm coverage: cannot load the machines to gate: {e}"
            session.exitstatus = pytest.ExitCode.USAGE_ERROR
            return
        self.report = self.recorder.report(o.fsm_coverage_fail_under)
        if o.fsm_coverage_json:
            import msgspec

            Path(o.fsm_coverage_json).write_bytes(
                msgspec.json.format(msgspec.json.encode(self.report)) + b"\n")
        if o.fsm_coverage_diagrams:
            from .diagram import files, write

            write(Path(o.fsm_coverage_diagrams),
                  files(self.recorder.diagrams().values(), self.recorder.marks(),
                        title="Transition coverage",
                        intro="Written by `pytest --fsm-coverage-diagrams`: states are green "
                              "when every event was exercised there, amber when some were, "
                              "blue when a terminal state was entered, red when none; "
                              "never-taken edges are red and dashed in the "
                              "SVG and labelled `(never)` in Mermaid."))
        if o.fsm_coverage_html:
            from .html_report import site, write_site

            write_site(Path(o.fsm_coverage_html), site(self.recorder, self.report))
        if not self.report.passed and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        """Print the coverage table and what was never exercised."""
        if self.worker:
            return
        from .coverage import format_report

        tr = terminalreporter
        tr.write_sep("-", "fsm transition coverage")
        if self.error:
            tr.write_line(self.error, red=True)
            return
        if self.report is None:
            return
        for line in format_report(self.report):
            tr.write_line(line, red=line.startswith("FAIL"))
        o = self.config.option
        if o.fsm_coverage_json:
            tr.write_line(f"fsm coverage JSON written to {o.fsm_coverage_json}")
        if o.fsm_coverage_diagrams:
            tr.write_line(f"fsm coverage diagrams written to {o.fsm_coverage_diagrams}")
        if o.fsm_coverage_html:
            index = Path(o.fsm_coverage_html) / "index.html"
            tr.write_line(f"fsm coverage HTML report written to {index}")
