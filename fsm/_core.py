"""Which core the engine runs: the compiled one (`fsm/_engine.c`), or the Python alone.

The Python in `ledger.py` and `machine.py` is the reference: every decision is written
there, and the compiled module is that Python's common case in C, handing everything
else back to it. It is built when the package is installed (`pip install` compiles it
with the machine's C compiler; `make setup` does). It is not used when:

- it was not built (no compiler: the install skips it, and the Python runs alone);
- ``TERMINUS_PURE_PYTHON=1`` is set (the tests of both cores run the suite this way too);
- it is older than its source (`_engine.c` changed since the build: run `make setup`),
  or was built for another version of this package's Python side (`API`).
"""

from __future__ import annotations

import importlib
import os
import warnings
from pathlib import Path
from types import ModuleType

__all__ = ["API", "PURE_ENV", "C", "load"]

API = 3
"""What the compiled module must say it implements (`_engine.API`)."""

PURE_ENV = "TERMINUS_PURE_PYTHON"
"""Set to 1 to run the Python reference alone."""


def load(source: Path | None = None) -> ModuleType | None:
    """The compiled module, or None where the Python runs alone (see the docstring).
    `source`: the C file it was built from (by default `_engine.c` beside this file)."""
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return None
    try:  # (by name: the package's own modules import this one)
        _engine = importlib.import_module(f"{__package__}._engine")
    except ImportError:
        return None
    built = Path(_engine.__file__ or "")
    source = source or Path(__file__).with_name("_engine.c")
    try:
        stale = source.stat().st_mtime > built.stat().st_mtime
    except OSError:  # an installed wheel ships no source: nothing to compare
        stale = False
    if stale or getattr(_engine, "API", None) != API:
        warnings.warn(
            f"{built.name} is {'older than fsm/_engine.c' if stale else 'of another API'}; "
            "the engine runs its Python alone until it is rebuilt (make setup, or pip "
            "install -e . again)", RuntimeWarning, stacklevel=2)
        return None
    return _engine


C: ModuleType | None = load()
"""The compiled core in use, or None."""
