"""`terminus instructions`: bench e2e's two loops counted in instructions (callgrind)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from terminus.effects.sim.instructions import split_by_part
from terminus.fsm.cli import main as terminus


def test_split_by_part_names_what_cpython_spent_the_instructions_on():
    diff = {
        "Python/ceval.c:_PyEval_EvalFrameDefault": 100.0,
        "./Include/object.h:_PyEval_EvalFrameDefault": 5.0,  # an inlined decref
        "Objects/typeobject.c:_PyType_Lookup": 20.0,
        "Objects/descrobject.c:member_get": 3.0,
        "Objects/typeobject.c:subtype_traverse": 7.0,
        "Modules/gcmodule.c:gc_collect_main": 2.0,
        "Objects/dictobject.c:_Py_dict_lookup": -4.0,
        "Objects/obmalloc.c:_PyObject_Free": 6.0,
        "???:at::native::empty_cpu [/x/libtorch_cpu.so]": 1.0,
        "Objects/unicodeobject.c:PyUnicode_Splitlines": 9.0,
        "fsm/_engine.c:run_steps": 4.0,  # the engine's compiled core
        "???:0x000000000000a3c1 [/x/fsm/_engine.cpython-311-x86_64-linux-gnu.so]": 1.0,
    }
    parts = split_by_part(diff)
    assert parts == {"compiled_core": 5.0, "cyclic_gc": 9.0, "attribute_lookup": 23.0,
                     "interpreter": 105.0, "dicts": -4.0, "objects": 6.0,
                     "torch_numpy": 1.0, "other": 9.0}
    assert sum(parts.values()) == sum(diff.values())  # every function in one part


@pytest.mark.parametrize("args, message", [
    (["--requests", "0"], "--requests must be at least 1, got 0"),
    (["--top", "-1"], "--top must be 0 or more, got -1"),
    (["--arm", "naive"], "--arm is internal: it needs --toggle"),
    (["--json", "/no/such/dir/x.json"], "/no/such/dir/x.json"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    assert terminus(["instructions", *args]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_without_valgrind_it_says_what_to_install(capsys, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    assert terminus(["instructions", "--requests", "5"]) == 2
    err = capsys.readouterr().err
    assert "valgrind is not on PATH" in err and "apt-get install valgrind" in err


@pytest.mark.skipif(shutil.which("valgrind") is None or shutil.which("cc") is None
                    or not Path("/usr/include/valgrind/callgrind.h").exists(),
                    reason="needs valgrind, its headers and a C compiler")
def test_counts_both_loops_and_splits_the_whole_difference(tmp_path, capsys):
    out = tmp_path / "ir.json"
    assert terminus(["instructions", "--requests", "20", "--top", "5",
                     "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    ir = r["ir_per_request"]
    assert r["requests"] == 20
    # A request through either loop is hundreds of thousands of instructions (millions
    # at 20 requests, the loop's own start spread over few); the machines loop runs the
    # engine on top of the same skeleton.
    assert 50_000 < ir["naive"] < ir["machines"] < 50_000_000
    assert r["overhead_ir_per_request"] == pytest.approx(ir["machines"] - ir["naive"])
    # The per-function difference covers every function (callgrind_annotate's
    # threshold 100 %), so the parts add up to the whole difference.
    assert sum(r["overhead_by_part"].values()) == pytest.approx(
        r["overhead_ir_per_request"], abs=1.0)
    assert r["overhead_by_part"]["interpreter"] > 0
    assert len(r["top_functions"]) == 5
    assert {"function", "machines", "naive", "diff"} == set(r["top_functions"][0])
    assert "Ir/req" in capsys.readouterr().out
