"""Print the mutation score per module after `make mutants` (run from build/mutmut/).

Reads mutmut's per-file results (`mutants/<path>.meta`) and prints, per mutated module,
killed / total and the percentage, then the surviving mutants by name (`mutmut show NAME`
prints one's diff). A timeout counts as killed (the mutant made a test hang), as mutmut
does; "no tests" (no selected test calls the function) counts as a survivor.
"""

from __future__ import annotations

import json
from pathlib import Path

KILLED = {1, 3, -24, 24, 36, 152, 255}  # mutmut's exit codes for killed and timeout


def main() -> int:
    total_k = total_n = 0
    survivors: list[str] = []
    rows = []
    for meta in sorted(Path("mutants").rglob("*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        checked = {k: v for k, v in codes.items() if v is not None}
        if not checked:
            continue
        killed = sum(1 for v in checked.values() if v in KILLED)
        survivors += sorted(k for k, v in checked.items() if v not in KILLED)
        module = str(meta.relative_to("mutants"))[: -len(".py.meta")].replace("/", ".")
        rows.append((module, killed, len(checked), len(codes) - len(checked)))
        total_k += killed
        total_n += len(checked)
    for module, killed, n, unchecked in rows:
        extra = f"  ({unchecked} not checked)" if unchecked else ""
        print(f"{module:<32} {killed:>4} / {n:<4} killed  {100 * killed / n:5.1f} %{extra}")
    if total_n:
        print(f"{'total':<32} {total_k:>4} / {total_n:<4} killed  "
              f"{100 * total_k / total_n:5.1f} %")
    print(f"\n{len(survivors)} surviving (`mutmut show NAME` in build/mutmut prints one):")
    for name in survivors:
        print(" ", name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
