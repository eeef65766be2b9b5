"""Finding the machines to draw and to count: entry points or `module:attr` names.

A package registers its built machines in the entry-point group `terminus.machines`
(pyproject: `NAME = "module:ATTR"`); `terminus diagrams` and the coverage plugin load
that group, or the `module:attr` names given on their command line instead. Each entry
point belongs to the distribution that registered it: the library's own seven serving
machines are registered by `terminus-fsm` (`LIBRARY`), a user's by their project, and
`located(library=...)` picks either side.
"""

from __future__ import annotations

import importlib
import re
from importlib.metadata import EntryPoint, entry_points

from .machine import Machine

GROUP = "terminus.machines"
"""The entry-point group that declares a package's machines."""

LIBRARY = "terminus-fsm"
"""The distribution of this library, which registers its own serving machines."""


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def distribution(ep: EntryPoint) -> str:
    """The name of the distribution that registered `ep` ('' when unknown)."""
    dist = getattr(ep, "dist", None)
    return str(dist.name) if dist is not None and dist.name else ""


def registered(library: bool | None = None) -> list[EntryPoint]:
    """The `terminus.machines` entry points by name: all of them (`library=None`), only
    those of `terminus-fsm` (`True`), or only those of every other distribution
    (`False`: the machines of the user's own project)."""
    eps = sorted(entry_points(group=GROUP), key=lambda ep: ep.name)
    if library is None:
        return eps
    return [ep for ep in eps if (_canonical(distribution(ep)) == LIBRARY) == library]


def describe(specs: list[str] | None = None, library: bool | None = None) -> str:
    """Where `located(specs, library=...)` finds its machines, as a phrase for a README."""
    if specs:
        return "the machines named on the command line (" + ", ".join(
            f"`--machines {s}`" for s in specs) + ")"
    dists = sorted({distribution(ep) or "an unknown distribution"
                    for ep in registered(library)})
    if not dists:
        return f"the entry-point group `{GROUP}` (no machine is registered there)"
    return (f"the machines registered in the entry-point group `{GROUP}` by "
            + ", ".join(f"`{d}`" for d in dists))


class MachineLoadError(Exception):
    """A `module:attr` could not be loaded as a built `fsm.Machine`; the message says why."""


def _import(name: str) -> object:
    """Import a dotted module name, or a file (`path/to/file.py`), from the current directory.

    A file is imported under its dotted name: its folder, or the topmost folder above it
    that holds no `__init__.py`, goes first on `sys.path` (as `python path/to/file.py`
    does), so its relative imports work. A module name that is not installed is looked up
    in the current directory too (as `python -m` does), without PYTHONPATH.
    """
    import os
    import sys
    from pathlib import Path

    if name.endswith(".py") or "/" in name or os.sep in name:
        path = Path(name).resolve()
        if not path.is_file():
            raise ImportError(f"no such file {str(path)!r}")
        parts, root = ([] if path.stem == "__init__" else [path.stem]), path.parent
        while (root / "__init__.py").is_file():
            parts.insert(0, root.name)
            root = root.parent
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        mod = importlib.import_module(".".join(parts))
        got = getattr(mod, "__file__", None)
        if got is None or Path(got).resolve() != path:
            raise ImportError(f"{str(path)!r} would be imported as {mod.__name__!r}, which "
                              f"is already the module at {got}; rename the file, or name "
                              "the module as MODULE:ATTR")
        return mod
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        cwd = os.getcwd()
        if e.name is None or not (name + ".").startswith(e.name + ".") or cwd in sys.path:
            raise
        sys.path.append(cwd)
        return importlib.import_module(name)


def load(spec: str) -> Machine:
    """Import `module:attr` (attr may be dotted) and return it; it must be a built Machine.

    `module` is a dotted name (found on `sys.path`, or in the current directory) or a path
    to a `.py` file.
    """
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise MachineLoadError(
            f"{spec!r} is not MODULE:ATTR (e.g. terminus.states.request:REQUEST)")
    try:
        obj: object = _import(mod_name)
    except ImportError as e:
        raise MachineLoadError(f"cannot import module {mod_name!r} of {spec!r}: {e}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise MachineLoadError(f"module {mod_name!r} has no attribute {attr!r} "
                                   f"(from {spec!r})") from None
    if not isinstance(obj, Machine):
        hint = " (call .build() on the Spec)" if type(obj).__name__ == "Spec" else ""
        raise MachineLoadError(f"{spec!r} is a {type(obj).__name__}, not a built "
                               f"fsm.Machine{hint}")
    return obj


def machines(specs: list[str] | None = None, library: bool | None = None
             ) -> dict[str, Machine]:
    """Machines by name: from `specs` (`module:attr`) if given, else the entry points
    (filtered by `library`, see `registered`).

    Two different machines with one name are an error: diagrams and coverage are keyed
    by name.
    """
    return {name: m for name, (_, m) in located(specs, library).items()}


def located(specs: list[str] | None = None, library: bool | None = None
            ) -> dict[str, tuple[str, Machine]]:
    """As `machines`, with the `module:attr` each machine was loaded from."""
    if specs:
        pairs = [(s, s, load(s)) for s in specs]
    else:
        pairs = []
        for ep in registered(library):
            try:
                pairs.append((f"{ep.name} = {ep.value}", ep.value, load(ep.value)))
            except MachineLoadError as e:
                raise MachineLoadError(f"entry point {ep.name!r} in group {GROUP!r}: {e}"
                                       ) from None
    out: dict[str, tuple[str, Machine]] = {}
    where: dict[str, str] = {}
    for src, ref, m in pairs:
        prev = out.get(m.name)
        if prev is not None and prev[1].cells is not m.cells:
            raise MachineLoadError(f"two different machines are named {m.name!r} "
                                   f"({where[m.name]} and {src}); give each a distinct name")
        out.setdefault(m.name, (ref, m))
        where.setdefault(m.name, src)
    return dict(sorted(out.items()))
