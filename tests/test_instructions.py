"""`terminus instructions`: bench e2e's two loops counted in instructions (callgrind)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from terminus.effects.sim.instructions import (
    MISSES,
    callgrind_command,
    parse_annotate,
    split_by_part,
)
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
    assert "l1_misses_per_request" not in r  # the cache model only with --cache-sim


@pytest.mark.skipif(shutil.which("valgrind") is None or shutil.which("cc") is None
                    or not Path("/usr/include/valgrind/callgrind.h").exists(),
                    reason="needs valgrind, its headers and a C compiler")
def test_cache_sim_counts_first_level_misses_and_splits_them(tmp_path, capsys):
    out = tmp_path / "ir.json"
    assert terminus(["instructions", "--requests", "20", "--top", "3", "--cache-sim",
                     "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    miss, over = r["l1_misses_per_request"], r["overhead_l1_misses_per_request"]
    for arm in ("machines", "naive"):
        assert set(miss[arm]) == set(MISSES)
        # Every loop misses the first-level caches, fewer times than it runs instructions.
        assert miss[arm]["D1mw"] > 0 and 0 < miss[arm]["I1mr"] < r["ir_per_request"][arm]
    for e in MISSES:
        assert over[e] == pytest.approx(miss["machines"][e] - miss["naive"][e])
    assert over["total"] == pytest.approx(sum(over[e] for e in MISSES))
    # As for the instructions: every function in one part, the parts add up.
    assert sum(r["overhead_l1_misses_by_part"].values()) == pytest.approx(over["total"],
                                                                          abs=1.0)
    assert "first-level misses" in capsys.readouterr().out


# callgrind_annotate's layout with --show=Ir,I1mr,D1mr,D1mw (the shape of a real run's): a
# count with its share, a bare 0, or "." for none; a recursion depth mark ("'2").
_ANNOTATED_CACHE = """\
--------------------------------------------------------------------------------
I1 cache: 32768 B, 64 B, 8-way associative
Events shown:     Ir I1mr D1mr D1mw
Thresholds:       100
--------------------------------------------------------------------------------
Ir                     I1mr                 D1mr                D1mw
--------------------------------------------------------------------------------
5,588,173,408 (100.0%) 161,966,170 (100.0%) 91,430,930 (100.0%) 33,332,758 (100.0%)  PROGRAM TOTALS

--------------------------------------------------------------------------------
Ir                   I1mr                D1mr               D1mw                file:function
--------------------------------------------------------------------------------
677,429 (12.12%) 13,356 ( 8.25%) 9,269 (10.14%)   273 ( 0.82%)  /Python-3/Python/ceval.c:ev [/l]
587,888 (10.52%) 11,578 ( 7.15%) 8,731 ( 9.55%)   411 ( 1.24%)  /Python-3/Python/ceval.c:ev'2
  4,806 ( 0.09%)    185 ( 0.00%) 3,013 ( 3.30%)     0           /Python-3/./o.h:vd [/l]
  4,582 ( 0.08%)      0          3,008 ( 3.29%)     .           /Python-3/./o.h:vr
"""


def test_parse_annotate_reads_every_column_of_the_cache_model():
    totals, per = parse_annotate(_ANNOTATED_CACHE, 1 + len(MISSES))
    assert totals == [5_588_173_408, 161_966_170, 91_430_930, 33_332_758]
    # Both recursion depths summed into one function, CPython's build path cut.
    assert per["Python/ceval.c:ev"] == [677_429 + 587_888, 13_356 + 11_578, 9_269 + 8_731,
                                         273 + 411]
    assert per["./o.h:vd"] == [4_806, 185, 3_013, 0]
    assert per["./o.h:vr"] == [4_582, 0, 3_008, 0]
    assert len(per) == 3  # no header, event or threshold line read as a function


def test_parse_annotate_of_instructions_alone():
    text = ("5,374,223,850 (100.0%)  PROGRAM TOTALS\n"
            "Ir                   file:function\n"
            "677,429,285 (12.12%)  /tmp/b/Python-3.11.7/Python/ceval.c:f'2 [/x/lib.so]\n"
            "      1,000 ( 0.00%)  ???:Struct_hash [/x/_core.so]\n")
    totals, per = parse_annotate(text)
    assert totals == [5_374_223_850]
    assert per == {"Python/ceval.c:f": [677_429_285], "???:Struct_hash": [1_000]}


def test_the_cache_model_is_on_only_when_asked(tmp_path):
    lib, out = tmp_path / "t.so", tmp_path / "cg.out"
    plain = callgrind_command("naive", 5, lib, out)
    cached = callgrind_command("naive", 5, lib, out, cache_sim=True)
    assert "--cache-sim=yes" not in plain
    assert cached == [*plain[:4], "--cache-sim=yes", *plain[4:]]
