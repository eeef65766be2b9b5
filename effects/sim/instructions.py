"""`terminus instructions`: `terminus bench e2e`'s two loops, counted in machine
instructions under valgrind's callgrind instead of timed.

    terminus instructions                          # 1,000 requests
    terminus instructions --requests 4000 --json ir.json
    terminus instructions --cache-sim              # first-level cache misses too

Each loop (the declared machines, the naive pre-fix logic) runs in its own process
under `valgrind --tool=callgrind`, on the benchmark's workload, after a warm-up run of
200 requests, with the sanitizer off; instructions are counted only inside the
measured loop and never inside a pool call (alloc, free, prefetch, lock, unlock: the
allocator work `terminus bench e2e` takes out of its figures too). A count does not
depend on what else the machine is doing: repeats of one commit agree to about 0.1 %
(objects hashed by address still order some sets), so a change of a few hundred
instructions a request shows where timings are noise. The difference between the
loops is `terminus bench e2e`'s `lifecycle_overhead_us_per_request`, in instructions.
Use 1,000 requests or more: the loop's own start is spread over the requests. The
machines' run ends, as bench e2e's does, by auditing its pools and LoRA counters: one
that leaked gives no figure but an error naming the leak.

The difference is also split by what CPython spent it on (the C function that
executed the instructions, by its source file and name):

- `interpreter`: the bytecode loop and its frames (more Python executed);
- `attribute_lookup`: attribute reads and writes the specialising interpreter did not
  specialise (a site that sees many classes, a property, a module with `__getattr__`,
  a msgspec Struct's field write);
- `cyclic_gc`: the cycle collector (more container objects made);
- `dicts`; `objects` (making and freeing objects: the allocator, deallocators);
  `torch_numpy`; `compiled_core` (the engine's compiled core, `fsm/_engine.c`, where
  it runs); and `other`.

Needs valgrind (with its headers, `valgrind/callgrind.h`) and a C compiler: a tiny
shared library that switches collection on and off is built on first use. Bad input
or a missing tool is one line on stderr and exit status 2.

With `--cache-sim`, valgrind's cache model is on too (`--cache-sim=yes`; each loop
takes about twice as long) and the first-level misses of the same region are counted:
instruction fetches (`I1mr`), data reads (`D1mr`) and data writes (`D1mw`). A loop that
executes a few per cent more instructions can take several times that share longer
when it also touches more code and more objects; the misses show that part of the
difference, deterministically, where timings cannot.

JSON keys: `requests`, `ir_per_request` (`machines`, `naive`),
`overhead_ir_per_request`, `overhead_by_part` (part -> instructions a request),
`top_functions` (the C functions whose difference is largest: `function`,
`machines`, `naive`, `diff`, instructions a request). With `--cache-sim` also
`l1_misses_per_request` (`machines`, `naive`: each `I1mr`, `D1mr`, `D1mw` a request),
`overhead_l1_misses_per_request` (`I1mr`, `D1mr`, `D1mw`, `total`: machines less
naive) and `overhead_l1_misses_by_part` (part -> misses a request, the three summed).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from terminus.fsm.cli import CliError, parser, write_json

from ..sanitize import ENV as SANITIZE_ENV

__all__ = ["MISSES", "callgrind_command", "main", "parse_annotate", "split_by_part"]

_TOGGLE_C = """\
#include <valgrind/callgrind.h>
void terminus_cg_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_TOGGLE_COLLECT; }
void terminus_cg_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
"""

_WARMUP = 200

# (part, pattern on "file:function") in order: the first match names the part.
_PARTS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("compiled_core", re.compile(r"fsm/_engine\.c|_engine\.cpython")),
    ("cyclic_gc", re.compile(r"gcmodule\.c|_traverse\b|visit_(decref|reachable)")),
    ("attribute_lookup", re.compile(
        r"_PyType_Lookup|GenericGetAttr|GenericSetAttr|PyObject_GetAttr|PyObject_SetAttr|"
        r"PyType_IsSubtype|descrobject\.c|structmember\.c|PyUnicode_InternInPlace|"
        r"attrgetter|module_getattro|slot_tp_getattr|member_get|find_name_in_mro")),
    ("interpreter", re.compile(
        r"ceval\.c|frame\.c|_PyEval_EvalFrameDefault|_PyFrame_|initialize_locals|"
        r"_PyThreadState_(Push|Pop)Frame|call\.c|PyGen_am_send")),
    ("dicts", re.compile(r"dictobject\.c")),
    ("objects", re.compile(r"obmalloc\.c|malloc|free\b|memset|memcpy|_dealloc|_alloc\b|"
                           r"_New\b|PyLong_From")),
    ("torch_numpy", re.compile(r"libtorch|libc10|numpy|_multiarray")),
)


def split_by_part(diff: dict[str, float]) -> dict[str, float]:
    """Instructions a request by part (see the module docstring), from a difference
    per C function ("file:function" -> instructions)."""
    out = {name: 0.0 for name, _ in _PARTS}
    out["other"] = 0.0
    for fn, v in diff.items():
        part = next((name for name, pat in _PARTS if pat.search(fn)), "other")
        out[part] += v
    return out


def _toggle_library(workdir: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise CliError("no C compiler (cc or gcc) on PATH: install one (Debian: gcc), "
                       "it builds the library that switches callgrind's counting on")
    src, lib = workdir / "toggle.c", workdir / "toggle.so"
    src.write_text(_TOGGLE_C)
    r = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)],
                       capture_output=True, text=True)
    if r.returncode:
        first = (r.stderr.strip().splitlines() or [""])[0]
        raise CliError(f"building the callgrind toggle failed ({first}); install valgrind's "
                       "headers (Debian: valgrind, which ships valgrind/callgrind.h)")
    return lib


MISSES = ("I1mr", "D1mr", "D1mw")
"""valgrind's first-level cache-miss events `--cache-sim` adds: instruction fetches,
data reads and data writes that missed the first-level caches."""

_COLUMN_RE = r"[\d,]+(?:\s*\(\s*[\d.]+%\))?|\."
"""One column of callgrind_annotate: a count, its share in parentheses or not, or "."."""
_COLUMN = re.compile(_COLUMN_RE)


def parse_annotate(text: str, events: int = 1) -> tuple[list[int], dict[str, list[int]]]:
    """(totals, self counts per "file:function") of `callgrind_annotate` output with
    `events` columns (Ir alone, or Ir and `MISSES`): each column a count with its share
    in parentheses, or a bare count, or "." for none; a function's counts are summed
    over its recursion depths ("'2") and over the libraries that hold its name."""
    line_re = re.compile(r"\s*((?:(?:" + _COLUMN_RE + r")\s+){" + str(events) + r"})(\S.*)")
    totals = [0] * events
    per: dict[str, list[int]] = {}
    for line in text.splitlines():
        m = line_re.match(line)
        if not m:
            continue
        cols = _COLUMN.findall(m.group(1))  # (`events` of them: the pattern's count)
        if cols[0] == ".":  # (no function runs no instruction: not a count line)
            continue
        vals = [0 if c == "." else int(c.split("(")[0].replace(",", "")) for c in cols]
        name = m.group(2).strip()
        if name.startswith("PROGRAM TOTALS"):
            totals = vals
            continue
        name = re.sub(r" \[.*$", "", name)
        name = re.sub(r"^.*/Python-[^/]+/", "", name)  # CPython's build directory
        name = re.sub(r"'\d+$", "", name)  # callgrind's recursion depth marks
        old = per.get(name)
        per[name] = vals if old is None else [a + b for a, b in zip(old, vals, strict=True)]
    return totals, per


def _annotate(out_file: Path, cache_sim: bool = False) -> tuple[list[int], dict[str, list[int]]]:
    """(totals, self counts per "file:function") of one callgrind output: Ir, and with
    `cache_sim` the `MISSES` after it."""
    # (--auto=no: no annotated source, whose call lines would read as functions)
    events = ("Ir", *MISSES) if cache_sim else ("Ir",)
    r = subprocess.run(["callgrind_annotate", "--threshold=100", "--auto=no",
                        f"--show={','.join(events)}", str(out_file)],
                       capture_output=True, text=True, check=True)
    return parse_annotate(r.stdout, len(events))


def callgrind_command(arm: str, n: int, lib: Path, out: Path,
                      cache_sim: bool = False) -> list[str]:
    """The command line of one loop under callgrind (`cache_sim`: valgrind's model of
    the first-level and last-level caches on, which counts `MISSES` too)."""
    return ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
            *(["--cache-sim=yes"] if cache_sim else []),
            f"--callgrind-out-file={out}", sys.executable, "-m", "terminus.fsm", "instructions",
            "--arm", arm, "--requests", str(n), "--toggle", str(lib)]


def _start_arm(arm: str, n: int, lib: Path, workdir: Path,
               cache_sim: bool = False) -> subprocess.Popen[str]:
    out = workdir / f"callgrind.{arm}"
    # The sanitizer off, as a serving engine runs (a test session turns it on in the
    # environment its children inherit); string hashes fixed, for the same count.
    env = dict(os.environ, PYTHONHASHSEED="0", **{SANITIZE_ENV: "0"})
    cmd = callgrind_command(arm, n, lib, out, cache_sim)
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env)


def _finish_arm(arm: str, proc: subprocess.Popen[str], workdir: Path,
                cache_sim: bool = False) -> tuple[list[int], dict[str, list[int]]]:
    _, err = proc.communicate()
    if proc.returncode:
        tail = "\n".join(err.strip().splitlines()[-5:])
        raise CliError(f"the {arm} loop under callgrind exited with status {proc.returncode}: "
                       f"{tail}")
    return _annotate(workdir / f"callgrind.{arm}", cache_sim)


def measure(n: int, top: int = 20, cache_sim: bool = False) -> dict[str, Any]:
    """Both loops under callgrind; the figures of the module docstring (with
    `cache_sim`, the first-level cache misses too)."""
    for tool in ("valgrind", "callgrind_annotate"):
        if shutil.which(tool) is None:
            raise CliError(f"{tool} is not on PATH: install valgrind (Debian: apt-get install "
                           "valgrind) to count instructions")
    with tempfile.TemporaryDirectory(prefix="terminus-ir-") as d:
        workdir = Path(d)
        lib = _toggle_library(workdir)
        # Both at once (one process each; the counts do not depend on the load).
        procs = {arm: _start_arm(arm, n, lib, workdir, cache_sim)
                 for arm in ("machines", "naive")}
        try:
            arms = {arm: _finish_arm(arm, p, workdir, cache_sim) for arm, p in procs.items()}
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
    (tm, pm), (tn, pn) = arms["machines"], arms["naive"]

    def diff_of(col: int) -> dict[str, float]:
        return {k: (pm.get(k, (0,) * len(tm))[col] - pn.get(k, (0,) * len(tn))[col]) / n
                for k in set(pm) | set(pn)}

    diff = diff_of(0)
    rows = sorted(diff, key=lambda k: -abs(diff[k]))[:top]
    out: dict[str, Any] = {
        "requests": n,
        "ir_per_request": {"machines": tm[0] / n, "naive": tn[0] / n},
        "overhead_ir_per_request": (tm[0] - tn[0]) / n,
        "overhead_by_part": split_by_part(diff),
        "top_functions": [{"function": k, "machines": pm.get(k, [0])[0] / n,
                           "naive": pn.get(k, [0])[0] / n, "diff": diff[k]} for k in rows],
    }
    if cache_sim:
        misses = {arm: dict(zip(MISSES, (v / n for v in t[1:]), strict=True))
                  for arm, t in (("machines", tm), ("naive", tn))}
        over = {e: misses["machines"][e] - misses["naive"][e] for e in MISSES}
        by_fn: dict[str, float] = {}
        for col in range(1, 1 + len(MISSES)):
            for k, v in diff_of(col).items():
                by_fn[k] = by_fn.get(k, 0.0) + v
        out["l1_misses_per_request"] = misses
        out["overhead_l1_misses_per_request"] = {**over, "total": sum(over.values())}
        out["overhead_l1_misses_by_part"] = split_by_part(by_fn)
    return out


def _run_arm(arm: str, n: int, toggle: str) -> None:
    """Inside valgrind: warm up, then run one loop with counting on outside pool calls."""
    import asyncio
    import ctypes
    import gc

    import torch

    from . import workload as workload_mod
    from .bench import _POOL_METHODS, _pools_of
    from .naive import naive_parts
    from .serving import ServingLoop, SimConfig, machine_parts
    from .simulate import collector_for_run

    lib = ctypes.CDLL(toggle)
    torch.set_num_threads(1)
    parts = naive_parts if arm == "naive" else machine_parts
    full = workload_mod.generate(workload_mod.WorkloadConfig(requests=n, seed=11, n=3))
    warm = workload_mod.generate(workload_mod.WorkloadConfig(requests=_WARMUP, seed=11, n=3))

    def uncounted(fn: Any) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            lib.terminus_cg_toggle()
            try:
                return fn(*a, **kw)
            finally:
                lib.terminus_cg_toggle()
        return call

    for workload, counted in ((warm, False), (full, True)):
        workload_mod._segment.cache_clear()
        workload_mod._prompt.cache_clear()
        loop = ServingLoop(workload, SimConfig(), parts=parts)
        if counted:
            for pool in _pools_of(loop):
                target = getattr(pool, "__wrapped__", pool)
                for name in _POOL_METHODS:
                    fn = getattr(target, name, None)
                    if fn is not None and callable(fn):
                        setattr(pool, name, uncounted(fn))
        gc.collect()
        with collector_for_run():
            if counted:
                lib.terminus_cg_start()
            asyncio.run(loop.run())
            if counted:
                lib.terminus_cg_toggle()
        # (counting is off) A count of a loop that leaked is no figure: the machines'
        # run ends, as bench e2e's does, with its pools full and its counters at zero.
        leaks = loop.leaks() if arm == "machines" else {}
        if any(leaks.values()):
            sys.exit(f"the machines leaked while counted: "
                     f"{ {k: v for k, v in leaks.items() if v} }")


def _print(r: dict[str, Any]) -> None:
    from terminus.fsm.cli import print_table

    ir = r["ir_per_request"]
    rows = [(f"machines ({r['requests']:,} requests)", f"{ir['machines']:,.0f} Ir/req"),
            ("naive loop", f"{ir['naive']:,.0f} Ir/req"),
            ("overhead", f"{r['overhead_ir_per_request']:+,.0f} Ir/req")]
    rows += [(f"  {part}", f"{v:+,.0f} Ir/req") for part, v in r["overhead_by_part"].items()]
    rows += [(f"  {f['function'][:60]}", f"{f['diff']:+,.0f} Ir/req")
             for f in r["top_functions"][:10]]
    if "l1_misses_per_request" in r:
        miss, over = r["l1_misses_per_request"], r["overhead_l1_misses_per_request"]
        rows += [(f"first-level misses {e}, machines / naive",
                  f"{miss['machines'][e]:,.0f} / {miss['naive'][e]:,.0f} a req ({over[e]:+,.0f})")
                 for e in MISSES]
        rows.append(("first-level misses, overhead", f"{over['total']:+,.0f} a req"))
        rows += [(f"  {part}", f"{v:+,.0f} misses/req")
                 for part, v in r["overhead_l1_misses_by_part"].items()]
    print_table("terminus instructions", rows)


def main(argv: list[str]) -> int:
    """Entry point of `terminus instructions` (see the module docstring)."""
    p = parser("terminus instructions",
               "Count the instructions of terminus bench e2e's two loops under callgrind.")
    p.add_argument("--requests", type=int, default=1000, metavar="N",
                   help="requests in the measured workload (default 1000)")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON to PATH")
    p.add_argument("--top", type=int, default=20, metavar="K",
                   help="C functions listed in top_functions (default 20)")
    p.add_argument("--cache-sim", action="store_true",
                   help="also count first-level cache misses (valgrind's cache model; "
                        "about twice as slow)")
    p.add_argument("--arm", choices=("machines", "naive"), help=argparse.SUPPRESS)
    p.add_argument("--toggle", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.requests < 1:
        raise CliError(f"--requests must be at least 1, got {a.requests}")
    if a.top < 0:
        raise CliError(f"--top must be 0 or more, got {a.top}")
    if a.arm:  # the child process under valgrind
        if not a.toggle:
            raise CliError("--arm is internal: it needs --toggle (run terminus instructions)")
        _run_arm(a.arm, a.requests, a.toggle)
        return 0
    if a.json:
        write_json(a.json, {})  # fail on an unwritable path before minutes of work
    r = measure(a.requests, a.top, a.cache_sim)
    _print(r)
    if a.json:
        write_json(a.json, r)
    return 0
