"""Finding the machines to draw and to count: entry points or `module:attr` names.

A package registers its built machines in the entry-point group `terminus.machines`
(pyproject: `NAME = "module:ATTR"`); `terminus diagrams` and the coverage plugin load
that group, or the `module:attr` names given on their command line instead.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from .machine import Machine

GROUP = "terminus.machines"
"""The entry-point group that declares a package's machines."""


class MachineLoadError(Exception):
    """A `module:attr` could not be loaded as a built `fsm.Machine`; the message says why."""


def load(spec: str) -> Machine:
    """Import `module:attr` (attr may be dotted) and return it; it must be a built Machine."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise MachineLoadError(
            f"{spec!r} is not MODULE:ATTR (e.g. terminus.states.request:REQUEST)")
    try:
        obj: object = importlib.import_module(mod_name)
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


def machines(specs: list[str] | None = None) -> dict[str, Machine]:
    """Machines by name: from `specs` (`module:attr`) if given, else the entry points.

    Two different machines with one name are an error: diagrams and coverage are keyed
    by name.
    """
    return {name: m for name, (_, m) in located(specs).items()}


def located(specs: list[str] | None = None) -> dict[str, tuple[str, Machine]]:
    """As `machines`, with the `module:attr` each machine was loaded from."""
    if specs:
        pairs = [(s, s, load(s)) for s in specs]
    else:
        pairs = []
        for ep in sorted(entry_points(group=GROUP), key=lambda ep: ep.name):
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
