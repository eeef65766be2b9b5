"""The HTML coverage report (`--fsm-coverage-html DIR`): its files, and the report opened
in a real headless chromium (tests marked `browser`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_coverage_plugin import ABORT_EARLY, BATCH, MACHINES, START_AND_FINISH

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]

START_TEST = "test_start.py::test_start_progress_finish"
ABORT_TEST = "test_abort.py::test_abort_in_queued_then_errors"


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The report of a small suite run on two xdist workers (so the workers' records and
    test ids are merged): job gated at 50 % and below it, toggle seen only."""
    root = tmp_path_factory.mktemp("suite")
    (root / "machines.py").write_text(MACHINES)
    (root / "test_start.py").write_text(START_AND_FINISH)
    (root / "test_abort.py").write_text(ABORT_EARLY)
    (root / "test_batch.py").write_text(BATCH)
    r = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider",
                        "--fsm-coverage-html", "html", "--fsm-coverage-fail-under", "50",
                        "--fsm-coverage-machines", "machines:JOB"],
                       cwd=root, capture_output=True, text=True)
    assert r.returncode == 1, r.stdout + r.stderr  # job is below 50 %
    assert f"fsm coverage HTML report written to {Path('html') / 'index.html'}" in r.stdout
    return root / "html"


def _data(page: str) -> Any:
    m = re.search(r'<script type="application/json" id="coverage-data">(.*?)</script>', page,
                  re.S)
    assert m is not None
    return json.loads(m.group(1).replace("<\\/", "</"))


def test_the_site_has_an_index_and_a_page_per_machine(report: Path) -> None:
    assert sorted(p.name for p in report.iterdir()) == ["index.html", "job.html",
                                                        "toggle.html"]
    index = (report / "index.html").read_text()
    assert 'fail-under 50%: FAILED, below for job.' in index
    job_row = re.search(r'<tr data-machine="job">.*?</tr>', index).group(0)  # type: ignore[union-attr]
    assert '<span class="gated">gated</span>' in job_row
    assert '>4/8</td>' in job_row and '>6/20</td>' in job_row and '>2/2</td>' in job_row
    toggle_row = re.search(r'<tr data-machine="toggle">.*?</tr>', index).group(0)  # type: ignore[union-attr]
    assert "<td data-v=\"0\">no</td>" in toggle_row
    # Nothing is fetched: no URL of another host, no external script or stylesheet.
    for page in report.iterdir():
        text = page.read_text()
        assert "http://" not in text.replace("http://www.w3.org/", "")
        assert "https://" not in text and "src=" not in text


def test_each_transition_lists_the_tests_that_took_it_merged_across_workers(
        report: Path) -> None:
    page = (report / "job.html").read_text()
    data = _data(page)
    by_title = {e["title"]: e for e in data["edges"]}
    start = by_title["queued --Start--> running"]
    assert start["tests"] == [START_TEST] and start["hits"] == 1
    # queued --Abort--> aborted ran only in the other test file (the other worker).
    assert by_title["queued --Abort / release_aborted--> aborted"]["tests"] == [ABORT_TEST]
    assert by_title["running --Abort [else] / release_aborted--> aborted"]["tests"] == []
    # Every edge of the diagram carries the id the page's script looks up.
    assert all(f'id="edge_{i}"' in page for i in range(len(data["edges"])))
    # The cell (queued, Progress) is an error, taken in the abort test only.
    cell = data["cells"]["0,1"]
    assert (cell["state"], cell["event"]) == ("queued", "Progress")
    assert cell["alts"] == [{"text": "error", "hits": 1, "tests": [ABORT_TEST]}]


def test_missing_pairs_come_first_and_terminal_states_reached_are_not_red(
        report: Path) -> None:
    page = (report / "job.html").read_text()
    assert page.index('id="missing-pairs"') < page.index('id="cells"')
    missing = re.search(r'<ul class="missing" id="missing-pairs">(.*?)</ul>', page, re.S)
    assert missing is not None and "(running, Abort)" in missing.group(1)
    assert "(queued, Start)" not in missing.group(1)
    # done and aborted were entered, no event was fired after: blue (reached), not red.
    svg = page[page.index("<svg"):page.index("</svg>")]
    for state in ("done", "aborted"):
        node = re.search(rf"<title>{state}</title>\n<path fill=\"([^\"]+)\"", svg)
        assert node is not None and node.group(1) == "#cfe3fa"


# -- in a real browser -------------------------------------------------------------------


def _required() -> bool:
    return os.environ.get("TERMINUS_REQUIRE_BROWSER") == "1" or os.environ.get("CI") == "true"


def _no_browser(why: str) -> None:
    if _required():
        pytest.fail(f"{why}; CI runs the browser tests (.ci/run installs chromium from the "
                    "Debian packages and sets TERMINUS_REQUIRE_BROWSER=1)")
    pytest.skip(why)


@pytest.fixture(scope="module")
def browser() -> Any:
    """Headless chromium from the system's package (never a downloaded browser)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _no_browser("playwright is not installed (pip install -e '.[test]')")
    exe = os.environ.get("TERMINUS_CHROMIUM") or shutil.which("chromium") \
        or shutil.which("chromium-browser")
    if exe is None or not os.access(exe, os.X_OK):
        _no_browser(f"no chromium found ({exe or 'none on PATH'}; apt-get install chromium, "
                    "or set TERMINUS_CHROMIUM)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.mark.browser
def test_the_report_renders_and_an_edge_click_lists_its_tests_in_chromium(
        report: Path, browser: Any, tmp_path: Path) -> None:
    shots = Path(os.environ.get("TERMINUS_SCREENSHOTS", tmp_path / "screenshots"))
    shots.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))

    page.goto((report / "index.html").as_uri())
    assert page.locator("#machines tbody tr").count() == 2
    # Sorting by the score column puts job (30 %) above toggle (83.3 %), then below.
    score = page.locator("#machines th").nth(7)
    score.click()
    assert page.locator("#machines tbody tr").first.get_attribute("data-machine") == "job"
    score.click()
    assert page.locator("#machines tbody tr").first.get_attribute("data-machine") == "toggle"
    page.screenshot(path=str(shots / "index.png"), full_page=True)

    for name in ("job", "toggle"):
        page.goto((report / f"{name}.html").as_uri())
        box = page.locator("#diagram svg").bounding_box()
        assert box is not None and box["width"] > 0 and box["height"] > 0
        page.screenshot(path=str(shots / f"{name}.png"), full_page=True)

    page.goto((report / "job.html").as_uri())
    data = _data(page.content())
    edge = next(i for i, e in enumerate(data["edges"])
                if e["title"] == "queued --Start--> running")
    page.locator(f"#edge_{edge}").click()
    details = page.locator("#details")
    assert "queued --Start--> running" in details.inner_text()
    assert details.locator("ul.tests li").all_inner_texts() == [START_TEST]
    page.locator("#cell_0_1").click()  # (queued, Progress): an error, in the abort test
    assert details.locator("ul.tests li").all_inner_texts() == [ABORT_TEST]
    page.screenshot(path=str(shots / "job-clicked.png"), full_page=True)

    assert problems == []
    assert all(u.startswith(("file://", "data:")) for u in requests), requests
    assert sorted(p.name for p in shots.iterdir()) >= ["index.png", "job-clicked.png",
                                                        "job.png", "toggle.png"]


def test_rewriting_the_report_removes_only_its_own_stale_pages(
        report: Path, tmp_path: Path) -> None:
    from terminus.fsm.html_report import write_site

    out = tmp_path / "html"
    shutil.copytree(report, out)
    (out / "notes.html").write_text("<html>someone else's page</html>")
    index = (out / "index.html").read_bytes()
    write_site(out, {"index.html": index})  # job and toggle are no longer reported
    assert sorted(p.name for p in out.iterdir()) == ["index.html", "notes.html"]
