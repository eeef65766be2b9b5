"""`terminus diagrams --diff REV`: what changed in each machine since a git revision.

The declarations at REV are imported, never parsed: REV is checked out into a temporary
`git worktree`, and a child Python process imports each machine from there (every
top-level module that the working tree's machines were imported from inside the
repository is redirected to its copy in the worktree, the rest imports as usual) and
extracts its diagram data with the `fsm.diagram.extract` it finds there. The worktree
is removed afterwards.

Two `MachineDiagram`s are compared as data:

- cells: each (state, event) cell's alternatives as text (`fsm.diagram.cells`); a cell
  whose text differs (or exists on one side only) is a changed cell;
- edges: matched by (source, event, target) in declaration order; an edge only in the
  working tree is added, only at REV removed, and one whose guard, plan or position
  changed is changed;
- states: added, removed, or changed (doc, initial, terminal, ignores or errors).

Renderings: a text summary, Markdown for a pull-request comment (a table of changed
cells and a Mermaid diagram per machine), and per changed machine a Mermaid file (states
classed `added`, `removed`, `changed`; edges labelled `[+]`, `[-]`, `[~]`) and an SVG
(the same in colours, with a legend).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import msgspec

from .diagram import (
    Edge,
    MachineDiagram,
    StateNode,
    cells,
    dot_string,
    edge_label,
    state_label,
    svg,
)
from .machine import Machine

ADDED, REMOVED, CHANGED = "#1a7f1a", "#b00020", "#c26a00"


class CellChange(msgspec.Struct, frozen=True):
    """A (state, event) cell whose alternatives differ; '' where the cell is absent."""

    state: str
    event: str
    before: str
    after: str


class EdgeChange(msgspec.Struct, frozen=True):
    """An edge added, removed or changed (then `before` is the edge at REV)."""

    kind: str
    edge: Edge
    before: Edge | None = None


class StateChange(msgspec.Struct, frozen=True):
    """A state added, removed or changed; `what` says what changed."""

    kind: str
    state: str
    what: str = ""


class MachineDiff(msgspec.Struct, frozen=True):
    """One machine's changes; `status` is added, removed, changed or unchanged."""

    name: str
    status: str
    cells: tuple[CellChange, ...] = ()
    edges: tuple[EdgeChange, ...] = ()
    states: tuple[StateChange, ...] = ()
    notes: tuple[str, ...] = ()


# -- comparing ---------------------------------------------------------------------------


def _cell_texts(d: MachineDiagram | None) -> dict[tuple[str, str], str]:
    if d is None:
        return {}
    return {k: "; ".join(a.text for a in alts) for k, alts in cells(d).items()}


def _edge_keys(d: MachineDiagram | None) -> dict[tuple[str, str, str, int], Edge]:
    out: dict[tuple[str, str, str, int], Edge] = {}
    for e in d.edges if d is not None else ():
        n = 0
        while (e.source, e.event, e.target, n) in out:
            n += 1
        out[(e.source, e.event, e.target, n)] = e
    return out


def _state_what(d0: MachineDiagram, a: StateNode, d1: MachineDiagram, b: StateNode) -> str:
    what = []
    if a.doc != b.doc:
        what.append("doc")
    if a.initial != b.initial:
        what.append("now initial" if b.initial else "no longer initial")
    if a.terminal != b.terminal:
        what.append("now terminal" if b.terminal else "no longer terminal")
    if a.ignored != b.ignored:
        what.append("ignored events")
    if a.errors != b.errors:
        what.append("error events")
    return ", ".join(what)


def compare(old: MachineDiagram | None, new: MachineDiagram | None) -> MachineDiff:
    """What changed from `old` (at REV; None: absent there) to `new` (None: removed)."""
    base = new if new is not None else old
    if base is None:
        raise ValueError("compare() needs a machine on at least one side")
    name = base.name
    status = "added" if old is None else "removed" if new is None else "changed"
    c0, c1 = _cell_texts(old), _cell_texts(new)
    cell_changes = tuple(CellChange(s, e, c0.get((s, e), ""), c1.get((s, e), ""))
                         for (s, e) in [*c1, *(k for k in c0 if k not in c1)]
                         if c0.get((s, e)) != c1.get((s, e)))
    e0, e1 = _edge_keys(old), _edge_keys(new)
    edges: list[EdgeChange] = []
    for k, e in e1.items():
        if k not in e0:
            edges.append(EdgeChange("added", e))
        elif e0[k] != e:
            edges.append(EdgeChange("changed", e, e0[k]))
    edges += [EdgeChange("removed", e) for k, e in e0.items() if k not in e1]
    s0 = {st.name: st for st in old.states} if old is not None else {}
    s1 = {st.name: st for st in new.states} if new is not None else {}
    states: list[StateChange] = []
    for n, st in s1.items():
        if n not in s0:
            states.append(StateChange("added", n))
        elif st != s0[n]:
            assert old is not None and new is not None
            states.append(StateChange("changed", n, _state_what(old, s0[n], new, st)))
    states += [StateChange("removed", n) for n in s0 if n not in s1]
    notes = []
    if old is not None and new is not None:
        if old.doc != new.doc:
            notes.append("the machine's doc changed")
        if old.events != new.events:
            added = [e for e in new.events if e not in old.events]
            gone = [e for e in old.events if e not in new.events]
            notes += [f"events added: {', '.join(added)}"] * bool(added)
            notes += [f"events removed: {', '.join(gone)}"] * bool(gone)
        if not (cell_changes or edges or states or notes):
            status = "unchanged"
    return MachineDiff(name, status, cell_changes, tuple(edges), tuple(states), tuple(notes))


# -- reading the declarations at REV ---------------------------------------------------------

_CHILD = r"""
import importlib, importlib.abc, importlib.machinery, importlib.util, json, sys
from pathlib import Path

args = json.loads(sys.argv[1])
sys.path[:] = [p for p in args["path"] if p] + [p for p in sys.path if p not in args["path"]]
mapped = {name: Path(p) for name, p in args["map"].items()}


class AtRevision(importlib.abc.MetaPathFinder):
    # The repository's own top-level modules come from the worktree, or not at all.
    def find_spec(self, fullname, path=None, target=None):
        top = fullname.partition(".")[0]
        if top not in mapped:
            return None
        if fullname == top:
            where = mapped[top]
            if where.suffix == ".py":
                if where.is_file():
                    return importlib.util.spec_from_file_location(fullname, where)
            elif (where / "__init__.py").is_file():
                return importlib.util.spec_from_file_location(
                    fullname, where / "__init__.py", submodule_search_locations=[str(where)])
        else:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is not None:
                return spec
        raise ModuleNotFoundError(f"no module named {fullname!r} at {args['rev']}",
                                  name=fullname)


sys.meta_path.insert(0, AtRevision())
out = {}
try:
    from terminus.fsm.diagram import extract
    import msgspec
except Exception as e:
    print(json.dumps({"": {"error": f"cannot import terminus.fsm.diagram: {e}"}}))
    raise SystemExit(0)
for ref in args["refs"]:
    mod_name, _, attr = ref.partition(":")
    try:
        obj = importlib.import_module(mod_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        try:
            d = extract(obj, ref)
        except TypeError:
            d = extract(obj)
        out[ref] = {"diagram": json.loads(msgspec.json.encode(d))}
    except Exception as e:
        out[ref] = {"error": f"{type(e).__name__}: {e}"}
print(json.dumps(out))
"""


class DiffError(Exception):
    """REV could not be read (not a git repository, no such revision, ...)."""


def _git(repo: Path, *args: str) -> str:
    r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise DiffError(f"git {' '.join(args)}: {r.stderr.strip() or r.stdout.strip()}")
    return r.stdout.strip()


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root)
    except ValueError:
        return False
    return True


def _module_map(root: Path, tree: Path) -> dict[str, str]:
    """Top-level modules imported from inside `root` (the repository, less its
    installed environments) -> where the same file lies in `tree`."""
    skip = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    out: dict[str, str] = {}
    for name, mod in list(sys.modules.items()):
        if "." in name or mod is None or name == "__main__":
            continue
        locations = list(getattr(mod, "__path__", None) or [])
        file = getattr(mod, "__file__", None)
        where = Path(locations[0]) if locations else Path(file) if file else None
        if where is None or not _inside(where, root) or "site-packages" in where.parts:
            continue
        if any(_inside(where, s) for s in skip if _inside(s, root)):
            continue
        out[name] = str(tree / where.resolve().relative_to(root))
    return out


def _refs_at(tree: Path) -> list[str]:
    """The `terminus.machines` entry points REV's pyproject.toml declares, if any."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: REV's own entry points are not read
        return []
    try:
        data = tomllib.loads((tree / "pyproject.toml").read_text())
    except (OSError, ValueError):
        return []
    eps = data.get("project", {}).get("entry-points", {}).get("terminus.machines", {})
    return [str(v) for v in eps.values()]


def at_revision(rev: str, refs: list[str], *, specs_given: bool, cwd: Path | None = None
                ) -> tuple[dict[str, MachineDiagram], dict[str, str]]:
    """The machines at `rev`: (diagrams by machine name, why each `module:attr` that
    could not be loaded there failed). Without `specs_given`, the machines REV's own
    pyproject.toml registers are read too (so a machine since removed shows)."""
    repo = Path(_git(cwd or Path.cwd(), "rev-parse", "--show-toplevel")).resolve()
    try:
        commit = _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except DiffError:
        raise DiffError(f"{rev!r} is not a git revision of {repo} (e.g. HEAD, HEAD~1, "
                        "main, a commit hash)") from None
    tmp = Path(tempfile.mkdtemp(prefix="terminus-diff-"))
    tree = tmp / "tree"
    try:
        _git(repo, "worktree", "add", "--detach", "--quiet", str(tree), commit)
        extra = [] if specs_given else [r for r in _refs_at(tree) if r not in refs]
        args = {"rev": rev, "refs": refs + extra, "map": _module_map(repo, tree),
                "path": [p for p in sys.path if p and not _inside(Path(p), repo)]}
        r = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(args)], cwd=tmp,
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise DiffError(f"reading the machines at {rev} failed:\n{r.stderr.strip()}")
        found = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)],
                       capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run(["git", "-C", str(repo), "worktree", "prune"], capture_output=True)
    if "" in found:
        raise DiffError(f"at {rev}: {found['']['error']}")
    out: dict[str, MachineDiagram] = {}
    errors: dict[str, str] = {}
    for ref, res in found.items():
        if "diagram" in res:
            d = msgspec.convert(res["diagram"], MachineDiagram)
            out[d.name] = d
        else:
            errors[ref] = res["error"]
    return out, errors


# -- rendering -----------------------------------------------------------------------------


def merged_dot(old: MachineDiagram | None, new: MachineDiagram | None, diff: MachineDiff,
               *, errors: bool = True) -> str:
    """Graphviz source of the machine as it is now, with what REV had and it lost:
    added edges and states green, removed red and dashed, changed amber; a legend."""
    base = new or old
    assert base is not None
    state_kind = {c.state: c.kind for c in diff.states}
    edge_kind = {(c.edge.source, c.edge.event, c.edge.alt): c for c in diff.edges
                 if c.kind != "removed"}
    out = [f"// generated by `terminus diagrams --diff`: {base.name}",
           f"digraph {dot_string(base.name)} {{",
           f'  graph [label={dot_string(base.name + " (changes)")}, labelloc=t, '
           'fontname="Helvetica", fontsize=14];',
           '  node [shape=box, style=rounded, fontname="Helvetica", fontsize=11];',
           '  edge [fontname="Helvetica", fontsize=10, color="#555555"];']
    states = list(new.states if new is not None else ())
    states += [st for st in (old.states if old is not None else ())
               if st.name not in {s.name for s in states}]
    colour = {"added": ADDED, "removed": REMOVED, "changed": CHANGED}
    for st in states:
        d = new if new is not None and any(s.name == st.name for s in new.states) else old
        assert d is not None
        attrs = [f'label="{state_label(d, st, errors=errors)}"']
        styles = ["rounded"]
        if st.terminal:
            attrs += ["peripheries=2"]
        kind = state_kind.get(st.name)
        if kind:
            attrs += [f'color="{colour[kind]}"', "penwidth=2.5"]
            if kind == "removed":
                styles.append("dashed")
        attrs.append(f'style="{",".join(styles)}"')
        out.append(f"  {dot_string(st.name)} [{', '.join(attrs)}];")
    if new is not None:
        for e in new.edges:
            change = edge_kind.get((e.source, e.event, e.alt))
            label = edge_label(e)
            attrs = []
            if change is not None and change.kind == "added":
                attrs += [f'color="{ADDED}"', f'fontcolor="{ADDED}"', "penwidth=2"]
                label = "[+] " + label
            elif change is not None and change.before is not None:
                attrs += [f'color="{CHANGED}"', f'fontcolor="{CHANGED}"', "penwidth=2"]
                label = f"[~] {label}\nwas: {edge_label(change.before)}"
            out.append(f"  {dot_string(e.source)} -> {dot_string(e.target)} "
                       f"[{', '.join([f'label={dot_string(label)}', *attrs])}];")
    for c in diff.edges:
        if c.kind == "removed":
            e = c.edge
            out.append(f"  {dot_string(e.source)} -> {dot_string(e.target)} [label="
                       f"{dot_string('[-] ' + edge_label(e))}, color=\"{REMOVED}\", "
                       f"fontcolor=\"{REMOVED}\", style=dashed, penwidth=2];")
    out.append('  "__legend__" [shape=plaintext, label=<<TABLE BORDER="0" CELLBORDER="1" '
               'CELLSPACING="0" CELLPADDING="4"><TR><TD><B>legend</B></TD></TR>'
               f'<TR><TD><FONT COLOR="{ADDED}">[+] added</FONT></TD></TR>'
               f'<TR><TD><FONT COLOR="{REMOVED}">[-] removed (dashed)</FONT></TD></TR>'
               f'<TR><TD><FONT COLOR="{CHANGED}">[~] changed guard or plan</FONT></TD></TR>'
               '<TR><TD>grey: unchanged</TD></TR></TABLE>>];')
    out.append("}")
    return "\n".join(out) + "\n"


def merged_mermaid(old: MachineDiagram | None, new: MachineDiagram | None,
                   diff: MachineDiff, rev: str) -> str:
    """A Mermaid `stateDiagram-v2` of the changes: states classed added / removed /
    changed, edges labelled `[+]`, `[-]` or `[~] ... (was ...)`."""
    from .diagram import _mid

    base = new or old
    assert base is not None
    states = list(new.states if new is not None else ())
    states += [st for st in (old.states if old is not None else ())
               if st.name not in {s.name for s in states}]
    ids = {st.name: _mid(st.name, i) for i, st in enumerate(states)}
    out = ["---", f"title: {base.name} (changes since {rev})", "---", "stateDiagram-v2",
           "    %% generated by `terminus diagrams --diff`; legend: [+] added, [-] removed, "
           "[~] changed guard or plan"]
    for st in states:
        if ids[st.name] != st.name:
            out.append(f'    state "{st.name}" as {ids[st.name]}')
    if new is not None:
        out.append(f"    [*] --> {ids[new.initial]}")
        changed = {(c.edge.source, c.edge.event, c.edge.alt): c for c in diff.edges
                   if c.kind != "removed"}
        for e in new.edges:
            c = changed.get((e.source, e.event, e.alt))
            label = edge_label(e)
            if c is not None and c.kind == "added":
                label = "[+] " + label
            elif c is not None and c.before is not None:
                label = f"[~] {label} (was {edge_label(c.before)})"
            out.append(f"    {ids[e.source]} --> {ids[e.target]} : {label}")
    for c in diff.edges:
        if c.kind == "removed":
            out.append(f"    {ids[c.edge.source]} --> {ids[c.edge.target]} : "
                       f"[-] {edge_label(c.edge)}")
    out += [f"    classDef added fill:#c8f0c8,stroke:{ADDED},stroke-width:3px",
            f"    classDef removed fill:#f6c4c4,stroke:{REMOVED},stroke-width:3px,"
            "stroke-dasharray:5 5",
            f"    classDef changed fill:#fbe5a6,stroke:{CHANGED},stroke-width:3px"]
    for kind in ("added", "removed", "changed"):
        names = [ids[c.state] for c in diff.states if c.kind == kind]
        if names:
            out.append(f"    class {','.join(names)} {kind}")
    return "\n".join(out) + "\n"


def _edge_line(c: EdgeChange) -> str:
    e = c.edge
    sign = {"added": "+", "removed": "-", "changed": "~"}[c.kind]
    text = f"{sign} {e.source} --{edge_label(e)}--> {e.target}"
    if c.before is not None:
        text += f" (was {edge_label(c.before)})"
    return text


def _counts(d: MachineDiff) -> str:
    if d.status in ("added", "removed"):
        return f"machine {d.status}"
    kinds = [c.kind for c in d.edges]
    parts = [f"{len(d.cells)} cell(s) changed"]
    parts += [f"{kinds.count(k)} edge(s) {k}" for k in ("added", "removed", "changed")
              if kinds.count(k)]
    return ", ".join(parts)


def text_summary(diffs: list[MachineDiff], rev: str) -> list[str]:
    """The plain-text summary: per changed machine its counts, edges, states, cells."""
    changed = [d for d in diffs if d.status != "unchanged"]
    if not changed:
        return [f"no machine changed since {rev} ({len(diffs)} compared)"]
    lines = [f"{len(changed)} of {len(diffs)} machine(s) changed since {rev}"]
    for d in changed:
        lines.append(f"{d.name}: {_counts(d)}")
        lines += [f"  {n}" for n in d.notes]
        lines += [f"  state {c.kind}: {c.state}" + (f" ({c.what})" if c.what else "")
                  for c in d.states]
        lines += [f"  {_edge_line(c)}" for c in d.edges]
        lines += [f"  cell ({c.state}, {c.event}): {c.before or '(none)'} => "
                  f"{c.after or '(none)'}" for c in d.cells]
    return lines


def _md(text: str) -> str:
    return "`" + text.replace("`", "'").replace("|", "\\|") + "`" if text else "(none)"


def markdown_summary(diffs: list[MachineDiff], rev: str,
                     mermaids: Mapping[str, str]) -> list[str]:
    """Markdown for a pull-request comment: per changed machine a table of changed cells,
    the edges and states that changed, and the Mermaid diagram of the changes."""
    changed = [d for d in diffs if d.status != "unchanged"]
    if not changed:
        return [f"**State machines:** no machine changed since `{rev}` "
                f"({len(diffs)} compared)."]
    out = [f"## State machines changed since `{rev}`", "",
           f"{len(changed)} of {len(diffs)} machine(s) changed. Legend: [+] added (green), "
           "[-] removed (red, dashed), [~] changed guard or plan (amber).", ""]
    for d in changed:
        out += [f"### `{d.name}`: {_counts(d)}", ""]
        out += [f"- {n}" for n in d.notes]
        out += [f"- state {c.kind}: `{c.state}`" + (f" ({c.what})" if c.what else "")
                for c in d.states]
        out += [f"- `{_edge_line(c)}`" for c in d.edges]
        if d.cells:
            out += ["", "| state | event | before | after |", "|---|---|---|---|"]
            out += [f"| {c.state} | {c.event} | {_md(c.before)} | {_md(c.after)} |"
                    for c in d.cells]
        if d.name in mermaids:
            out += ["", "```mermaid", mermaids[d.name].rstrip("\n"), "```"]
        out.append("")
    return out


def main(rev: str, found: Mapping[str, tuple[str, Machine]], specs: list[str] | None, *,
         out: str | None, markdown: bool, errors: bool) -> int:
    """`terminus diagrams --diff REV`: print the summary; with `--out DIR`, write each
    changed machine's `NAME.diff.svg` and `NAME.diff.mmd` there."""
    from .cli import CliError
    from .diagram import extract

    now = {name: extract(m, ref) for name, (ref, m) in found.items()}
    try:
        then, failed = at_revision(rev, [ref for ref, _ in found.values()],
                                   specs_given=bool(specs))
    except DiffError as e:
        raise CliError(str(e)) from None
    diffs = [compare(then.get(n), now.get(n)) for n in sorted(set(now) | set(then))]
    # A machine absent at REV: say why it could not be loaded there.
    for i, d in enumerate(diffs):
        ref = found[d.name][0] if d.name in found else ""
        if d.status == "added" and ref in failed:
            diffs[i] = msgspec.structs.replace(d, notes=(*d.notes, f"at {rev}: {failed[ref]}"))
    mermaids: dict[str, str] = {}
    written: dict[str, bytes] = {}
    for d in diffs:
        if d.status == "unchanged":
            continue
        old, new = then.get(d.name), now.get(d.name)
        mermaids[d.name] = merged_mermaid(old, new, d, rev)
        if out is not None:
            written[f"{d.name}.diff.mmd"] = mermaids[d.name].encode()
            written[f"{d.name}.diff.svg"] = svg(merged_dot(old, new, d, errors=errors))
    lines = (markdown_summary(diffs, rev, mermaids) if markdown
             else text_summary(diffs, rev))
    print("\n".join(lines))
    if out is not None and written:
        path = Path(out)
        try:
            path.mkdir(parents=True, exist_ok=True)
            for name, data in written.items():
                (path / name).write_bytes(data)
        except OSError as e:
            raise CliError(f"cannot write to {out!r}: {e.strerror or e}") from None
        if not markdown:
            print(f"diff diagrams written to {path}: {', '.join(sorted(written))}")
    return 0
