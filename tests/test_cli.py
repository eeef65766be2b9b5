"""The `terminus` command: dispatch, one-line errors, `bench engine --json`."""

from __future__ import annotations

import json
import subprocess
import sys

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
                   "benchmarks that take a device: kernels\n")


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
    assert "usage: terminus COMMAND" in out and "bench" in out
