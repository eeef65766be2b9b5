"""The `terminus` command: dispatch, one-line errors, `bench engine --json`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from terminus.fsm.cli import main


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fsm", *args], capture_output=True,
                          text=True, timeout=300)


def test_an_unknown_command_is_one_line_and_exit_2(capsys):
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("terminus: unknown command 'frobnicate'; commands: ")
    assert "bench" in err and err.count("\n") == 1


def test_an_unknown_benchmark_or_option_is_one_line_and_exit_2(capsys):
    assert main(["bench", "nope"]) == 2
    assert capsys.readouterr().err.startswith("terminus bench: unknown benchmark 'nope'")
    assert main(["bench", "--frob"]) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --frob" in err and err.count("\n") == 1


def test_an_unwritable_json_path_fails_before_running(capsys, tmp_path):
    assert main(["bench", "engine", "--json", str(tmp_path / "no" / "x.json")]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_bench_engine_writes_the_documented_json_keys(tmp_path):
    out = tmp_path / "engine.json"
    p = run("bench", "engine", "--quick", "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert "fire(), terminus" in p.stdout
    r = json.loads(out.read_text())
    assert set(r["fire_ns"]) >= {"terminus", "transitions", "dict_table"}
    for key in ("bytes_per_instance", "create_us", "batch_step_ns_per_instance"):
        assert r[key] > 0
    # The compiled table must beat transitions.Machine on the same declaration.
    assert r["fire_ns"]["terminus"] < r["fire_ns"]["transitions"]


def test_device_for_a_cpu_only_benchmark_is_refused_before_running(capsys):
    assert main(["bench", "engine", "kernels", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err == ("terminus bench: --device cuda: engine runs on the CPU only; name the "
                   "benchmarks that take a device: batch, kernels\n")


def test_an_unusable_device_is_one_line_naming_it(capsys):
    assert main(["bench", "kernels", "--device", "tpu9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("terminus bench: kernels: unknown device 'tpu9'")
    assert err.count("\n") == 1


def test_bench_kernels_on_cpu_writes_the_device_keys(tmp_path):
    out = tmp_path / "kernels.json"
    assert main(["bench", "kernels", "--quick", "--device", "cpu", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["device"] == "cpu" and r["device_name"] == "cpu"
    assert r["release_ms"]["batched"] > 0


def test_help_lists_the_commands(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert "usage: terminus [--version] COMMAND" in out and "bench" in out


def test_version_prints_the_installed_distributions_version(capsys):
    from importlib.metadata import version

    import terminus

    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out == f"terminus {version('terminus-fsm')}\n"
    assert terminus.__version__ == version("terminus-fsm")
    assert main(["-V"]) == 0 and capsys.readouterr().out == out


def test_every_command_and_every_option_has_a_help_line(capsys):
    from importlib.metadata import entry_points

    from terminus.fsm.cli import command_parser

    commands = {ep.name: ep for ep in entry_points(group="terminus.commands")}
    assert {"bench", "diagrams", "simulate"} <= set(commands)
    assert main(["--help"]) == 0
    listing = capsys.readouterr().out
    for name, ep in commands.items():
        p = command_parser(ep)
        assert p is not None, f"{name} does not build its parser with terminus.fsm.cli.parser"
        assert p.description, f"terminus {name} has no description"
        line = next(ln for ln in listing.splitlines() if ln.split()[:1] == [name])
        assert len(line.split()) > 3, f"`terminus --help` gives {name} no help line: {line!r}"
        for action in p._actions:
            assert action.help and action.help.strip(), (
                f"terminus {name} {'/'.join(action.option_strings) or action.dest} has no "
                "help line")
    # Looking at a parser ran no command: the next call parses for real.
    assert main(["bench", "--frob"]) == 2


def test_device_with_only_cpu_benchmarks_named_lists_the_ones_that_take_a_device(capsys):
    assert main(["bench", "engine", "--device", "cuda"]) == 2
    assert capsys.readouterr().err == (
        "terminus bench: --device cuda: engine runs on the CPU only; name the benchmarks "
        "that take a device: batch, kernels\n")


_MACHINE = '''
from terminus.fsm import ANY, IGNORE, Event, Spec, State, go
{extra}

class Go(Event): ...


FLOW = Spec("{name}", states=(State("idle", initial=True), State("done", terminal=True)),
            events=(Go,), table={{"idle": {{Go: go("done")}}, "done": {{ANY: IGNORE}}}}
            ).build()
'''


def _terminus(*args: str, cwd) -> subprocess.CompletedProcess:
    import os
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    exe = Path(sys.executable).parent / "terminus"  # the console script, as a user runs it
    return subprocess.run([str(exe), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def test_diagrams_load_a_file_path_or_a_module_from_the_current_directory(tmp_path):
    # A plain folder whose file imports a sibling, and a package with a relative import.
    (tmp_path / "flows").mkdir()
    (tmp_path / "flows" / "helper.py").write_text("NAME = 'from_file'\n")
    (tmp_path / "flows" / "machines.py").write_text(
        _MACHINE.format(extra="from helper import NAME", name="from_file"))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "names.py").write_text("NAME = 'from_module'\n")
    (tmp_path / "pkg" / "machines.py").write_text(
        _MACHINE.format(extra="from .names import NAME", name="from_module"))
    r = _terminus("diagrams", "--machines", "flows/machines.py:FLOW", "--machines",
                  "pkg.machines:FLOW", "--out", "out", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "2 machine(s)" in r.stdout
    assert (tmp_path / "out" / "from_file.mmd").is_file()
    assert (tmp_path / "out" / "from_module.mmd").is_file()
    # A package file named by its path is imported under its dotted name.
    r = _terminus("diagrams", "--machines", str(tmp_path / "pkg" / "machines.py") + ":FLOW",
                  "--out", "../out", "--check", cwd=tmp_path / "flows")
    assert r.returncode == 1 and "extra (no such machine)" in r.stderr  # from_file.* there


@pytest.mark.parametrize("ref, message", [
    ("flows/nope.py:FLOW", "cannot import module 'flows/nope.py' of 'flows/nope.py:FLOW': "
                           "no such file"),
    ("nosuchmodule:FLOW", "cannot import module 'nosuchmodule'"),
])
def test_a_machine_reference_that_cannot_be_found_is_one_line(tmp_path, ref, message):
    r = _terminus("diagrams", "--machines", ref, "--check", cwd=tmp_path)
    assert r.returncode == 2
    assert message in r.stderr and r.stderr.count("\n") == 1


def test_a_file_whose_name_is_taken_by_another_module_is_refused(tmp_path, monkeypatch):
    from terminus.fsm.discover import MachineLoadError, load

    monkeypatch.setattr(sys, "path", list(sys.path))  # load() puts tmp_path on it

    (tmp_path / "json.py").write_text(_MACHINE.format(extra="", name="shadow"))
    with pytest.raises(MachineLoadError, match="would be imported as 'json', which is "
                                               "already the module at"):
        load(str(tmp_path / "json.py") + ":FLOW")


def test_another_packages_command_is_described_by_its_docstring_and_never_called():
    from importlib.metadata import EntryPoint

    from terminus.fsm.cli import command_parser, summary

    # No distribution: a command some other package registered. Looking at it must not
    # run it (it may not parse arguments), so its docstring describes it.
    ep = EntryPoint("other", "terminus.fsm.cli:bench_main", "terminus.commands")
    assert command_parser(ep) is None
    assert summary(ep) == ("`terminus bench [NAME...] [--quick] [--json PATH] [--device DEV]`: "
                           "print figures")


def test_main_leaves_the_collector_alone_and_the_console_script_freezes_before_exit(
        monkeypatch, capsys):
    import gc

    frozen = gc.get_freeze_count()
    monkeypatch.setattr(sys, "argv", ["terminus", "--version"])
    try:
        assert main() == 0  # a program calling main() goes on with its heap as it was
        assert gc.get_freeze_count() == frozen
        from terminus.fsm.cli import console

        assert console() == 0
        assert gc.get_freeze_count() > frozen  # the process ends next: heap frozen
    finally:
        gc.unfreeze()
    assert capsys.readouterr().out.count("terminus ") == 2
