"""State diagrams of declared machines: extract -> data -> renderers.

    extract(machine)            -> MachineDiagram   (msgspec data: what tests check)
    mermaid(diagram[, marks])   -> str              (renders on code hosts)
    dot(diagram[, marks])       -> str              (Graphviz source)
    svg(dot_source)             -> bytes            (pygraphviz; its wheel bundles Graphviz)
    files(diagrams[, marks])    -> {filename: bytes} (what `terminus diagrams` writes)

Why not `transitions`' own diagram support (GraphMachine / the pygraphviz backend)?
Its graph knows states, triggers and condition names, but not the engine's annotations:
release plans on terminal edges, explicit errors, which alternative is the fallback of
a guarded cell. It draws ignores (internal transitions) as self-loops, where we want
them listed on the state, and its styling and ordering are not ours to keep stable.
So the graph is generated here from the compiled tables, which are the runtime truth;
the tests check the extracted edges against `fsm.oracle.transitions_machine`, so the
picture and the `transitions` declaration cannot disagree.

Determinism: the same declarations give the same bytes. Everything is emitted in
declaration order, and the SVG loses Graphviz's version comment. Graphviz measures
label text with the fonts installed on the machine, so the SVG's coordinates can
differ between two machines drawing the same DOT source; each SVG therefore carries
the SHA-256 of its DOT source (`<!-- terminus-dot-sha256: ... -->`), and `--check`
compares that for SVGs (and the bytes of every other file): a changed declaration
always changes the DOT source, a different font never does.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import msgspec

from .machine import Machine
from .spec import ERRORED, IGNORED, TRANSITION

# -- data --------------------------------------------------------------------------------


class Absorbed(msgspec.Struct, frozen=True):
    """An event a state ignores or rejects, rather than an edge.

    `otherwise`: only when the guarded alternatives before it did not hold;
    `implicit`: an error because no guard held (the cell has no unguarded alternative).
    """

    event: str
    otherwise: bool = False
    implicit: bool = False


class StateNode(msgspec.Struct, frozen=True):
    """A state, with the events it ignores and the ones that are errors there."""

    name: str
    initial: bool
    terminal: bool
    doc: str
    ignored: tuple[Absorbed, ...]
    errors: tuple[Absorbed, ...]


class Edge(msgspec.Struct, frozen=True):
    """One declared transition: alternative `alt` of the cell (source, event).

    `otherwise`: an unguarded alternative after guarded ones (taken when none held).
    `plan` is set only on edges into terminal states (the release plan they run).
    """

    source: str
    event: str
    alt: int
    target: str
    guard: str | None
    plan: str | None
    terminal: bool
    otherwise: bool = False


class MachineDiagram(msgspec.Struct, frozen=True):
    """Everything a diagram shows, in declaration order."""

    name: str
    doc: str
    initial: str
    events: tuple[str, ...]
    states: tuple[StateNode, ...]
    edges: tuple[Edge, ...]
    plans: tuple[str, ...]
    source: str = ""
    """Where the machine was loaded from (`module:attr`), named in the file's header."""


class Marks(msgspec.Struct, frozen=True):
    """A coverage overlay: exercised edges (source, event, alt) and pairs (state, event)."""

    edges: frozenset[tuple[str, str, int]] = frozenset()
    pairs: frozenset[tuple[str, str]] = frozenset()


def extract(m: Machine, source: str = "") -> MachineDiagram:
    """The diagram data of a compiled machine (bound copies give the same data);
    `source` is the `module:attr` it was loaded from, if known."""
    states: list[StateNode] = []
    edges: list[Edge] = []
    for s, row in enumerate(m.cells):
        ignored: list[Absorbed] = []
        errors: list[Absorbed] = []
        for e, alts in enumerate(row):
            ev = m.event_names[e]
            for k, a in enumerate(alts):
                if a.decision == TRANSITION:
                    edges.append(Edge(m.states[s], ev, k, m.states[a.target], a.guard, a.plan,
                                      m.terminal[a.target], k > 0 and a.guard is None))
                elif a.decision == IGNORED:
                    ignored.append(Absorbed(ev, otherwise=k > 0))
                elif a.decision == ERRORED:
                    errors.append(Absorbed(ev, otherwise=k > 0))
            if alts[-1].guard is not None:
                errors.append(Absorbed(ev, otherwise=True, implicit=True))
        st = m.spec.states[s]
        states.append(StateNode(st.name, s == m.initial, st.terminal, st.doc,
                                tuple(ignored), tuple(errors)))
    return MachineDiagram(m.name, m.spec.doc, m.states[m.initial], m.event_names,
                          tuple(states), tuple(edges), m.plan_names, source)


def edge_label(e: Edge) -> str:
    """`Event [guard] / plan` as both renderers print it."""
    label = e.event
    if e.guard is not None:
        label += f" [{e.guard}]"
    elif e.otherwise:
        label += " [else]"
    if e.plan is not None:
        label += f" / {e.plan}"
    return label


def _absorbed_text(items: tuple[Absorbed, ...], n_events: int) -> str:
    if len(items) == n_events and not any(a.otherwise for a in items):
        return "every event"
    parts = []
    for a in items:
        parts.append(a.event + (" (no guard held)" if a.implicit else
                                " (else)" if a.otherwise else ""))
    return ", ".join(parts)


def state_notes(d: MachineDiagram, st: StateNode) -> list[str]:
    """The `ignores: ...` / `errors: ...` lines shown on a state."""
    lines = []
    if st.ignored:
        lines.append("ignores: " + _absorbed_text(st.ignored, len(d.events)))
    if st.errors:
        lines.append("errors: " + _absorbed_text(st.errors, len(d.events)))
    return lines


def _wrap(line: str, width: int = 56) -> list[str]:
    out: list[str] = []
    cur = ""
    for word in line.split(" "):
        if cur and len(cur) + 1 + len(word) > width:
            out.append(cur)
            cur = "    " + word
        else:
            cur = f"{cur} {word}" if cur else word
    out.append(cur)
    return out


def _state_marks(d: MachineDiagram, st: StateNode, marks: Marks) -> str:
    done = sum((st.name, ev) in marks.pairs for ev in d.events)
    return "covered" if done == len(d.events) else "partial" if done else "uncovered"


# -- Mermaid -------------------------------------------------------------------------------

_MERMAID_WORDS = {"end", "state", "note", "class", "classdef", "direction", "click", "style",
                  "as", "left", "right", "of", "default"}
_IDENT = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")


def _mid(name: str, i: int) -> str:
    return name if _IDENT.match(name) and name.lower() not in _MERMAID_WORDS else f"s{i}"


def mermaid(d: MachineDiagram, marks: Marks | None = None) -> str:
    """A Mermaid `stateDiagram-v2` of the machine; `marks` colours it by coverage.

    Terminal states get a thick grey style and an arrow to the end marker `[*]`; each
    edge reads `Event [guard] / plan`; ignores and errors are notes on their state.
    With `marks`, states are green (every event exercised there), amber (some) or red
    (none), and never-taken edges are labelled `(never)`.
    """
    ids = {st.name: _mid(st.name, i) for i, st in enumerate(d.states)}
    origin = f" from {d.source}" if d.source else ""
    out = ["---", f"title: {d.name}", "---", "stateDiagram-v2",
           f"    %% generated by `terminus diagrams`{origin}: edit the machine's "
           "declaration, not this file"]
    for st in d.states:
        if ids[st.name] != st.name:
            out.append(f'    state "{st.name}" as {ids[st.name]}')
    out.append(f"    [*] --> {ids[d.initial]}")
    for e in d.edges:
        label = edge_label(e)
        if marks is not None and (e.source, e.event, e.alt) not in marks.edges:
            label += " (never)"
        out.append(f"    {ids[e.source]} --> {ids[e.target]} : {label}")
    for st in d.states:
        if st.terminal:
            out.append(f"    {ids[st.name]} --> [*]")
    for st in d.states:
        lines = [w for line in state_notes(d, st) for w in _wrap(line)]
        if lines:
            out.append(f"    note right of {ids[st.name]}")
            out.extend(f"        {w}" for w in lines)
            out.append("    end note")
    terminal = [ids[st.name] for st in d.states if st.terminal]
    out.append("    classDef terminal fill:#e6e6e6,stroke:#222,stroke-width:3px")
    if marks is None:
        out.append(f"    class {','.join(terminal)} terminal")
    else:
        out.append("    classDef covered fill:#c8f0c8,stroke:#1a7f1a")
        out.append("    classDef partial fill:#fbe5a6,stroke:#a66f00")
        out.append("    classDef uncovered fill:#f6c4c4,stroke:#b00020")
        for kind in ("covered", "partial", "uncovered"):
            names = [ids[st.name] for st in d.states if _state_marks(d, st, marks) == kind]
            if names:
                out.append(f"    class {','.join(names)} {kind}")
    return "\n".join(out) + "\n"


# -- Graphviz ------------------------------------------------------------------------------

_COLOURS = {"covered": "#c8f0c8", "partial": "#fbe5a6", "uncovered": "#f6c4c4"}


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def dot(d: MachineDiagram, marks: Marks | None = None) -> str:
    """Graphviz DOT source of the machine (same conventions as `mermaid`).

    Terminal states are double-bordered, bold and grey; with `marks`, states are filled
    by coverage and edges are green (taken) or red and dashed (never taken).
    """
    origin = f" from {d.source}" if d.source else ""
    out = [f"// generated by `terminus diagrams`{origin}", f"digraph {_q(d.name)} {{",
           f'  graph [label={_q(d.name)}, labelloc=t, fontname="Helvetica", fontsize=14];',
           '  node [shape=box, style=rounded, fontname="Helvetica", fontsize=11];',
           '  edge [fontname="Helvetica", fontsize=10];',
           '  "__start__" [shape=point, width=0.15, label=""];']
    for st in d.states:
        label = "\\n".join([_q(st.name)[1:-1]] + [
            _q(w)[1:-1] for line in state_notes(d, st) for w in _wrap(line, 40)])
        attrs = [f'label="{label}"']
        styles = ["rounded"]
        if st.terminal:
            attrs += ["peripheries=2", "penwidth=2"]
            styles += ["bold"]
        fill = "#e6e6e6" if st.terminal else None
        if marks is not None:
            fill = _COLOURS[_state_marks(d, st, marks)]
        if fill:
            styles.append("filled")
            attrs.append(f'fillcolor="{fill}"')
        attrs.append(f'style="{",".join(styles)}"')
        out.append(f"  {_q(st.name)} [{', '.join(attrs)}];")
    out.append(f'  "__start__" -> {_q(d.initial)};')
    for e in d.edges:
        attrs = [f"label={_q(edge_label(e))}"]
        if e.terminal:
            attrs.append("penwidth=1.6")
        if marks is not None:
            taken = (e.source, e.event, e.alt) in marks.edges
            attrs.append('color="#1a7f1a"' if taken else 'color="#b00020", style=dashed')
        out.append(f"  {_q(e.source)} -> {_q(e.target)} [{', '.join(attrs)}];")
    out.append("}")
    return "\n".join(out) + "\n"


_VERSION_COMMENT = re.compile(rb"<!-- Generated by graphviz[^>]*-->\n")
_DIGEST = re.compile(rb"<!-- terminus-dot-sha256: ([0-9a-f]{64}) -->")


def svg(dot_source: str) -> bytes:
    """Lay out `dot_source` with Graphviz `dot`: the SVG, minus Graphviz's version line,
    plus a comment holding the SHA-256 of `dot_source` (see the module docstring)."""
    import pygraphviz

    g = pygraphviz.AGraph(string=dot_source)
    data: bytes = g.draw(format="svg", prog="dot")
    digest = hashlib.sha256(dot_source.encode()).hexdigest()
    data = _VERSION_COMMENT.sub(f"<!-- terminus-dot-sha256: {digest} -->\n".encode(), data,
                                count=1)
    if not _DIGEST.search(data):
        raise RuntimeError("Graphviz's SVG lacks its version comment; terminus cannot "
                           "stamp it with the source digest (unsupported Graphviz build)")
    return data


def same_file(name: str, have: bytes, want: bytes) -> bool:
    """Whether committed `have` is up to date with generated `want` (SVGs: same DOT source)."""
    if name.endswith(".svg"):
        a, b = _DIGEST.search(have), _DIGEST.search(want)
        return a is not None and b is not None and a.group(1) == b.group(1)
    return have == want


# -- the diagrams/ directory ----------------------------------------------------------------


def readme(diagrams: Iterable[MachineDiagram], *, title: str = "State diagrams",
           intro: str | None = None, marks: Mapping[str, Marks] | None = None) -> str:
    """diagrams/README.md: an index table, then each machine's Mermaid source and SVG link."""
    ds = list(diagrams)
    out = [f"# {title}", ""]
    out.append(intro if intro is not None else (
        "Generated by `terminus diagrams` from the machines registered in the entry-point "
        "group `terminus.machines`; do not edit. `terminus diagrams --check` (run by "
        "`make test`) fails when these files differ from the declarations."))
    out += ["", "Legend: terminal states are grey with a thick (double, in the SVG) border "
            "and an arrow to the end marker; an edge reads `Event [guard] / release_plan` "
            "(`[else]`: taken when the guards before it did not hold); the events a state "
            "ignores, and those that are errors there, are listed on the state.", ""]
    if not ds:
        out += ["No machines are registered yet.", ""]
        return "\n".join(out)
    out += ["| machine | states | terminal states | transitions | (state, event) pairs "
            "| files |", "|---|---|---|---|---|---|"]
    for d in ds:
        n_term = sum(st.terminal for st in d.states)
        out.append(f"| [{d.name}](#{d.name.lower()}) | {len(d.states)} | {n_term} | "
                   f"{len(d.edges)} | {len(d.states) * len(d.events)} | "
                   f"[{d.name}.mmd]({d.name}.mmd), [{d.name}.svg]({d.name}.svg) |")
    for d in ds:
        out += ["", f"## {d.name}", ""]
        if d.doc:
            out += [d.doc.strip(), ""]
        out += ["```mermaid", mermaid(d, None if marks is None else marks.get(d.name))
                .rstrip("\n"), "```", "", f"SVG: [{d.name}.svg]({d.name}.svg)"]
    out.append("")
    return "\n".join(out)


def files(diagrams: Iterable[MachineDiagram], marks: Mapping[str, Marks] | None = None,
          **readme_kwargs: str) -> dict[str, bytes]:
    """The files `terminus diagrams` writes, by name: README.md, NAME.mmd, NAME.svg."""
    ds = sorted(diagrams, key=lambda d: d.name)
    out: dict[str, bytes] = {"README.md": readme(ds, marks=marks, **readme_kwargs).encode()}
    for d in ds:
        mk = None if marks is None else marks.get(d.name, Marks())
        out[f"{d.name}.mmd"] = mermaid(d, mk).encode()
        out[f"{d.name}.svg"] = svg(dot(d, mk))
    return out


def _managed(name: str) -> bool:
    return name == "README.md" or name.endswith((".mmd", ".svg"))


def stale(out_dir: Path, want: Mapping[str, bytes]) -> list[str]:
    """Lines naming each file of `out_dir` that differs from `want`, is missing or extra."""
    have = {p.name for p in out_dir.iterdir() if p.is_file() and _managed(p.name)} \
        if out_dir.is_dir() else set()
    problems = []
    for name in sorted(set(want) | have):
        path = out_dir / name
        if name not in have:
            problems.append(f"missing: {path}")
        elif name not in want:
            problems.append(f"extra (no such machine): {path}")
        elif not same_file(name, path.read_bytes(), want[name]):
            problems.append(f"stale: {path}")
    return problems


def write(out_dir: Path, want: Mapping[str, bytes]) -> list[str]:
    """Write `want` into `out_dir`, removing diagram files of machines no longer declared.

    Returns the names of the files that changed (written or removed).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    changed = []
    for p in sorted(out_dir.iterdir()):
        if p.is_file() and _managed(p.name) and p.name not in want:
            p.unlink()
            changed.append(p.name)
    for name, data in want.items():
        path = out_dir / name
        if not path.is_file() or path.read_bytes() != data:
            tmp = path.with_name(f".{name}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
            changed.append(name)
    return changed


def main(argv: list[str]) -> int:
    """`terminus diagrams [--out DIR] [--machines MODULE:ATTR]... [--check]`."""
    from .cli import CliError, parser
    from .discover import GROUP, MachineLoadError, located

    p = parser("terminus diagrams",
               "Write a Mermaid and an SVG diagram of every declared machine, and an "
               "index README.md, into DIR; with --check, write nothing and fail when the "
               "files there are stale.")
    p.add_argument("--out", metavar="DIR", default="diagrams",
                   help="output directory (default: diagrams/ under the current directory)")
    p.add_argument("--machines", metavar="MODULE:ATTR", action="append",
                   help=f"a built machine to draw, repeatable (default: the {GROUP!r} "
                        "entry points)")
    p.add_argument("--check", action="store_true",
                   help="exit 1 naming each stale, missing or extra file; write nothing")
    a = p.parse_args(argv)
    try:
        found = located(a.machines)
    except MachineLoadError as e:
        raise CliError(str(e)) from None
    want = files(extract(m, ref) for ref, m in found.values())
    out = Path(a.out)
    if a.check:
        problems = stale(out, want)
        if problems:
            for line in problems:
                print(line, file=sys.stderr)
            print(f"terminus diagrams: {len(problems)} file(s) in {out} differ from the "
                  "declarations; run `terminus diagrams` and commit the result",
                  file=sys.stderr)
            return 1
        print(f"terminus diagrams: {len(want)} file(s) in {out} are up to date")
        return 0
    try:
        changed = write(out, want)
    except OSError as e:
        raise CliError(f"cannot write diagrams to {str(out)!r}: {e.strerror or e}") from None
    print(f"terminus diagrams: {len(found)} machine(s), {len(changed)} file(s) changed in {out}")
    return 0
