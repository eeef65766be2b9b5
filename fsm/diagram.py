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


class Alternative(msgspec.Struct, frozen=True):
    """One alternative of a (state, event) cell, as the coverage recorder counts it.

    `alt`: its index in the cell (-1: no guard held, an error); `decision`:
    `transition`, `ignore` or `error`; `edge`: its index in `MachineDiagram.edges`.
    """

    alt: int
    decision: str
    text: str
    edge: int | None = None


def cells(d: MachineDiagram) -> dict[tuple[str, str], tuple[Alternative, ...]]:
    """Every (state, event) cell's alternatives in order, e.g. `[last] -> done /
    release_done`, `[else] -> running`, `ignore`, `error (no guard held)`."""
    edges: dict[tuple[str, str], list[tuple[int, Edge]]] = {}
    for i, e in enumerate(d.edges):
        edges.setdefault((e.source, e.event), []).append((i, e))
    out: dict[tuple[str, str], tuple[Alternative, ...]] = {}
    for st in d.states:
        absorbed = {a.event: ("ignore", a) for a in st.ignored}
        absorbed.update({a.event: ("error", a) for a in st.errors if not a.implicit})
        for ev in d.events:
            alts = []
            taken = sorted(edges.get((st.name, ev), []), key=lambda ie: ie[1].alt)
            for i, e in taken:
                cond = f"[{e.guard}] " if e.guard else "[else] " if e.otherwise else ""
                plan = f" / {e.plan}" if e.plan else ""
                alts.append(Alternative(e.alt, "transition", f"{cond}-> {e.target}{plan}", i))
            if ev in absorbed:
                kind, a = absorbed[ev]
                alts.append(Alternative(len(taken) if a.otherwise else 0, kind,
                                        ("[else] " if a.otherwise else "") + kind))
            if any(a.event == ev and a.implicit for a in st.errors):
                alts.append(Alternative(-1, "error", "error (no guard held)"))
            out[(st.name, ev)] = tuple(alts)
    return out


def _absorbed_text(items: tuple[Absorbed, ...], n_events: int) -> str:
    if len(items) == n_events and not any(a.otherwise for a in items):
        return "every event"
    parts = []
    for a in items:
        parts.append(a.event + (" (no guard held)" if a.implicit else
                                " (else)" if a.otherwise else ""))
    return ", ".join(parts)


def state_notes(d: MachineDiagram, st: StateNode, *, errors: bool = True) -> list[str]:
    """The `ignores: ...` / `errors: ...` lines shown on a state (`errors=False`: only
    the ignores)."""
    lines = []
    if st.ignored:
        lines.append("ignores: " + _absorbed_text(st.ignored, len(d.events)))
    if st.errors and errors:
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


def reached(d: MachineDiagram, marks: Marks) -> set[str]:
    """The states some exercised edge entered."""
    return {e.target for e in d.edges if (e.source, e.event, e.alt) in marks.edges}


def state_coverage(d: MachineDiagram, st: StateNode, marks: Marks) -> str:
    """`covered` (every event exercised in `st`), `reached` (a terminal state entered,
    not every event exercised after it), `partial` (some events) or `uncovered`."""
    done = sum((st.name, ev) in marks.pairs for ev in d.events)
    if done == len(d.events):
        return "covered"
    if st.terminal and st.name in reached(d, marks):
        return "reached"
    return "partial" if done else "uncovered"


def _mermaid_text(text: str) -> str:
    # A Mermaid state description ends at ';' or '#'.
    return text.replace(";", ",").replace("#", "no.")


# -- Mermaid -------------------------------------------------------------------------------

_MERMAID_WORDS = {"end", "state", "note", "class", "classdef", "direction", "click", "style",
                  "as", "left", "right", "of", "default"}
_IDENT = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")


def _mid(name: str, i: int) -> str:
    return name if _IDENT.match(name) and name.lower() not in _MERMAID_WORDS else f"s{i}"


def mermaid(d: MachineDiagram, marks: Marks | None = None, *, errors: bool = True) -> str:
    """A Mermaid `stateDiagram-v2` of the machine; `marks` colours it by coverage.

    Terminal states get a thick grey style and an arrow to the end marker `[*]`; a
    state's doc is its description; each edge reads `Event [guard] / plan`; ignores and
    errors (unless `errors=False`) are notes on their state. With `marks`, states are
    green (every event exercised there), amber (some), blue (a terminal state entered)
    or red (none), and never-taken edges are labelled `(never)`.
    """
    ids = {st.name: _mid(st.name, i) for i, st in enumerate(d.states)}
    origin = f" from {d.source}" if d.source else ""
    out = ["---", f"title: {d.name}", "---", "stateDiagram-v2",
           f"    %% generated by `terminus diagrams`{origin}: edit the machine's "
           "declaration, not this file"]
    for st in d.states:
        if ids[st.name] != st.name:
            out.append(f'    state "{st.name}" as {ids[st.name]}')
    for st in d.states:
        for w in _wrap(st.doc, 48) if st.doc else ():
            out.append(f"    {ids[st.name]} : {_mermaid_text(w.strip())}")
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
        lines = [w for line in state_notes(d, st, errors=errors) for w in _wrap(line)]
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
        out.append("    classDef reached fill:#cfe3fa,stroke:#1f5fa8,stroke-width:3px")
        for kind in COVERAGE_COLOURS:
            names = [ids[st.name] for st in d.states if state_coverage(d, st, marks) == kind]
            if names:
                out.append(f"    class {','.join(names)} {kind}")
    return "\n".join(out) + "\n"


# -- Graphviz ------------------------------------------------------------------------------

COVERAGE_COLOURS = {"covered": "#c8f0c8", "partial": "#fbe5a6", "reached": "#cfe3fa",
                    "uncovered": "#f6c4c4"}
"""Fill of a state by `state_coverage`, in the SVG (and the HTML report's legend)."""


def dot_string(s: str) -> str:
    """`s` as a quoted DOT string."""
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def state_label(d: MachineDiagram, st: StateNode, *, errors: bool = True) -> str:
    """A state's DOT label (escaped, without quotes): its name, its doc, its notes."""
    lines = [st.name] + (_wrap(st.doc, 40) if st.doc else []) + [
        w for line in state_notes(d, st, errors=errors) for w in _wrap(line, 40)]
    return "\\n".join(dot_string(w)[1:-1] for w in lines)


def dot(d: MachineDiagram, marks: Marks | None = None, *, errors: bool = True,
        ids: bool = False) -> str:
    """Graphviz DOT source of the machine (same conventions as `mermaid`).

    Terminal states are double-bordered, bold and grey; with `marks`, states are filled
    by coverage (`COVERAGE_COLOURS`) and edges are green (taken) or red and dashed
    (never taken). `ids`: give each state and edge an SVG id, `state_N` and `edge_N`
    (its index in `d.states` and `d.edges`).
    """
    origin = f" from {d.source}" if d.source else ""
    out = [f"// generated by `terminus diagrams`{origin}", f"digraph {dot_string(d.name)} {{",
           f'  graph [label={dot_string(d.name)}, labelloc=t, fontname="Helvetica", fontsize=14];',
           '  node [shape=box, style=rounded, fontname="Helvetica", fontsize=11];',
           '  edge [fontname="Helvetica", fontsize=10];',
           '  "__start__" [shape=point, width=0.15, label=""];']
    for i, st in enumerate(d.states):
        attrs = [f'label="{state_label(d, st, errors=errors)}"']
        if ids:
            attrs.append(f'id="state_{i}"')
        styles = ["rounded"]
        if st.terminal:
            attrs += ["peripheries=2", "penwidth=2"]
            styles += ["bold"]
        fill = "#e6e6e6" if st.terminal else None
        if marks is not None:
            fill = COVERAGE_COLOURS[state_coverage(d, st, marks)]
        if fill:
            styles.append("filled")
            attrs.append(f'fillcolor="{fill}"')
        attrs.append(f'style="{",".join(styles)}"')
        out.append(f"  {dot_string(st.name)} [{', '.join(attrs)}];")
    out.append(f'  "__start__" -> {dot_string(d.initial)};')
    for k, e in enumerate(d.edges):
        attrs = [f"label={dot_string(edge_label(e))}"]
        if ids:
            attrs.append(f'id="edge_{k}"')
        if e.terminal:
            attrs.append("penwidth=1.6")
        if marks is not None:
            taken = (e.source, e.event, e.alt) in marks.edges
            attrs.append('color="#1a7f1a"' if taken else 'color="#b00020", style=dashed')
        out.append(f"  {dot_string(e.source)} -> {dot_string(e.target)} [{', '.join(attrs)}];")
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
           intro: str | None = None, marks: Mapping[str, Marks] | None = None,
           origin: str | None = None, errors: bool = True,
           command: str = "terminus diagrams") -> str:
    """diagrams/README.md: where the machines came from, an index table (with each
    machine's `module:attr`), then each machine's Mermaid source and SVG link.

    `origin` says where the machines were found (default: the entry points); `command`
    is the command line that regenerates the directory.
    """
    ds = list(diagrams)
    out = [f"# {title}", ""]
    where = origin or "the machines registered in the entry-point group `terminus.machines`"
    out.append(intro if intro is not None else (
        f"Generated by `{command}` from {where}; do not edit. `{command} --check` fails "
        "when these files differ from the declarations."))
    notes = ("the events a state ignores, and those that are errors there, are listed on "
             "the state" if errors else "the events a state ignores are listed on the "
             "state (its error events are left out: `--hide-errors`)")
    out += ["", "Legend: terminal states are grey with a thick (double, in the SVG) border "
            "and an arrow to the end marker; under a state's name, its doc; an edge reads "
            "`Event [guard] / release_plan` (`[else]`: taken when the guards before it did "
            f"not hold); {notes}.", ""]
    if not ds:
        out += ["No machines are registered yet.", ""]
        return "\n".join(out)
    out += ["| machine | from | states | terminal states | transitions | (state, event) pairs "
            "| files |", "|---|---|---|---|---|---|---|"]
    for d in ds:
        n_term = sum(st.terminal for st in d.states)
        src = f"`{d.source}`" if d.source else ""
        out.append(f"| [{d.name}](#{d.name.lower()}) | {src} | {len(d.states)} | {n_term} | "
                   f"{len(d.edges)} | {len(d.states) * len(d.events)} | "
                   f"[{d.name}.mmd]({d.name}.mmd), [{d.name}.svg]({d.name}.svg) |")
    for d in ds:
        out += ["", f"## {d.name}", ""]
        if d.doc:
            out += [d.doc.strip(), ""]
        out += ["```mermaid", mermaid(d, None if marks is None else marks.get(d.name),
                                      errors=errors).rstrip("\n"),
                "```", "", f"SVG: [{d.name}.svg]({d.name}.svg)"]
    out.append("")
    return "\n".join(out)


def files(diagrams: Iterable[MachineDiagram], marks: Mapping[str, Marks] | None = None,
          *, errors: bool = True, **readme_kwargs: str) -> dict[str, bytes]:
    """The files `terminus diagrams` writes, by name: README.md, NAME.mmd, NAME.svg
    (`errors=False`: without the per-state lists of error events)."""
    ds = sorted(diagrams, key=lambda d: d.name)
    out: dict[str, bytes] = {"README.md": readme(ds, marks=marks, errors=errors,
                                                 **readme_kwargs).encode()}
    for d in ds:
        mk = None if marks is None else marks.get(d.name, Marks())
        out[f"{d.name}.mmd"] = mermaid(d, mk, errors=errors).encode()
        out[f"{d.name}.svg"] = svg(dot(d, mk, errors=errors))
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
    """`terminus diagrams [--out DIR] [--machines MODULE:ATTR]... [--hide-errors]
    [--check | --diff REV [--format text|markdown]]`."""
    import shlex

    from .cli import CliError, parser
    from .discover import GROUP, MachineLoadError, describe, located

    p = parser("terminus diagrams",
               "Write a Mermaid and an SVG diagram of every declared machine, and an "
               "index README.md, into DIR; with --check, write nothing and fail when the "
               "files there are stale; with --diff REV, show what changed in each "
               "machine since the git revision REV.")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="output directory (default: diagrams/ under the current directory; "
                        "with --diff, where to write each changed machine's diff diagram, "
                        "none written when not given)")
    p.add_argument("--machines", metavar="MODULE:ATTR", action="append",
                   help=f"a built machine to draw, repeatable (default: the {GROUP!r} "
                        "entry points)")
    p.add_argument("--hide-errors", action="store_true",
                   help="leave out each state's list of error events (the edges and the "
                        "ignored events stay)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help="exit 1 naming each stale, missing or extra file; write nothing")
    mode.add_argument("--diff", metavar="REV",
                      help="compare every machine's declaration at git revision REV "
                           "(imported from a temporary git worktree) with the working tree")
    p.add_argument("--format", choices=("text", "markdown"), default="text",
                   help="with --diff: a plain-text summary (default) or Markdown for a "
                        "pull-request comment (tables of changed cells, Mermaid diagrams)")
    a = p.parse_args(argv)
    if a.format != "text" and not a.diff:
        raise CliError("--format applies only with --diff REV")
    try:
        found = located(a.machines)
    except MachineLoadError as e:
        raise CliError(str(e)) from None
    if a.diff:
        from .diagram_diff import main as diff_main

        return diff_main(a.diff, found, a.machines, out=a.out, markdown=a.format == "markdown",
                         errors=not a.hide_errors)
    out = Path(a.out or "diagrams")
    words = ["terminus", "diagrams"]
    if a.out not in (None, "diagrams"):
        words += ["--out", a.out]
    for m in a.machines or ():
        words += ["--machines", m]
    if a.hide_errors:
        words.append("--hide-errors")
    command = shlex.join(words)
    want = files((extract(m, ref) for ref, m in found.values()), errors=not a.hide_errors,
                 origin=describe(a.machines), command=command)
    if a.check:
        problems = stale(out, want)
        if problems:
            for line in problems:
                print(line, file=sys.stderr)
            print(f"terminus diagrams: {len(problems)} file(s) in {out} differ from the "
                  f"declarations; run `{command}` and commit the result", file=sys.stderr)
            return 1
        print(f"terminus diagrams: {len(want)} file(s) in {out} are up to date")
        return 0
    try:
        changed = write(out, want)
    except OSError as e:
        raise CliError(f"cannot write diagrams to {str(out)!r}: {e.strerror or e}") from None
    print(f"terminus diagrams: {len(found)} machine(s), {len(changed)} file(s) changed in {out}")
    return 0
