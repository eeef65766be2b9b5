"""The distribution installs one import package, `terminus`, and nothing else at the top
level of site-packages (`kernels`, `states` and `effects` are other projects' names)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from importlib.metadata import distribution, entry_points, packages_distributions
from pathlib import Path

import pytest

DIST = "terminus-fsm"
ROOT = Path(__file__).resolve().parent.parent
SUBPACKAGES = ("fsm", "states", "effects", "kernels", "metrics")


def test_the_installed_distribution_declares_only_the_terminus_import_name():
    top_level = distribution(DIST).read_text("top_level.txt")
    assert top_level is not None, f"{DIST} has no top_level.txt: was it installed?"
    assert top_level.split() == ["terminus"]
    # Every import name the environment attributes to this distribution.
    mine = sorted(name for name, dists in packages_distributions().items() if DIST in dists)
    assert mine == ["terminus"]


def test_every_entry_point_of_the_distribution_names_a_terminus_module_and_loads():
    eps = [ep for ep in distribution(DIST).entry_points]
    assert eps, "the distribution declares no entry points"
    for ep in eps:
        assert ep.value.startswith("terminus."), f"{ep.group} {ep.name} = {ep.value}"
        assert ep.load() is not None
    # The console script, and the pytest plugin's registration, under their public names.
    assert {ep.name for ep in entry_points(group="console_scripts") if ep.value.startswith(
        "terminus.")} == {"terminus"}
    assert [ep.value for ep in entry_points(group="pytest11")
            if ep.name == "terminus_fsm_coverage"] == ["terminus.fsm.pytest_plugin"]


def test_the_old_top_level_names_are_not_importable():
    for name in SUBPACKAGES:
        r = subprocess.run([sys.executable, "-c", f"import {name}"], cwd="/",
                           capture_output=True, text=True)
        assert r.returncode != 0, f"`import {name}` works outside the source tree"


@pytest.mark.slow
def test_the_wheel_holds_only_terminus_and_its_metadata(tmp_path: Path):
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--quiet", "--wheel-dir", str(tmp_path), str(ROOT)],
        capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"terminus", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1]
                    + ".dist-info"}
    for sub in (*SUBPACKAGES, "effects/sim"):
        assert f"terminus/{sub}/__init__.py" in names
    assert "terminus/__init__.py" in names and "terminus/py.typed" in names
    assert not any(n.startswith("terminus/tests/") for n in names)
