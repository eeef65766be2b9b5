"""The HTML transition-coverage report (`pytest --fsm-coverage-html DIR`).

A static site that opens from disk, with no server and nothing fetched from the network
(styles and scripts are inline):

- `index.html`: one row per reported machine (transitions and (state, event) pairs
  covered/declared, terminal states reached, a bar of the score), sortable by any
  column, the gated machines marked, and the run's `--fsm-coverage-fail-under` result;
- `<machine>.html`: the machine's diagram as inline SVG coloured by coverage (taken
  edges green, never-taken edges red and dashed; states green / amber / red by the
  events exercised there, terminal states that were entered blue), what was never
  exercised (missing pairs and transitions first), then the full state x event table:
  each cell's alternatives with their hit counts. Clicking an edge of the diagram or a
  cell of the table lists the pytest node ids during which it ran (recorded per
  decision while `--fsm-coverage-html` is on, merged across pytest-xdist workers).

`site(recorder, report)` returns the files by name; `write_site(dir, files)` writes them.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .coverage import CoverageRecorder, CoverageReport, MachineCoverage
from .diagram import COVERAGE_COLOURS, MachineDiagram, Marks, cells, dot, svg

_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif;
       margin: 0 2em 3em; color: #1b1b1b; }
h1 { font-size: 1.5em; margin: .8em 0 .3em; }
h2 { font-size: 1.15em; margin: 1.4em 0 .4em; }
a { color: #0b5cad; }
table { border-collapse: collapse; }
th, td { border: 1px solid #d0d0d0; padding: .25em .5em; vertical-align: top; }
th { background: #f3f3f3; text-align: left; }
th.sortable { cursor: pointer; user-select: none; }
th.sortable::after { content: " \\2195"; color: #999; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.bar { width: 10em; height: .8em; background: #f6c4c4; border: 1px solid #b00020;
       display: inline-block; vertical-align: middle; }
.bar > span { display: block; height: 100%; background: #1a7f1a; }
.gated { font-weight: 600; color: #1a4f8f; }
.pass { color: #1a7f1a; font-weight: 600; }
.fail { color: #b00020; font-weight: 600; }
.legend span.swatch { display: inline-block; width: 1em; height: 1em; border: 1px solid #666;
                      vertical-align: middle; margin: 0 .3em 0 1em; }
.diagram { overflow: auto; border: 1px solid #ddd; padding: .5em; max-height: 80vh; }
.wide { overflow-x: auto; }
.diagram g.edge { cursor: pointer; }
.diagram g.edge:hover path { stroke-width: 3; }
.diagram g.edge.selected path { stroke-width: 4; }
.layout { display: grid; grid-template-columns: minmax(0, 1fr) 22em; gap: 1.5em; }
#details { position: sticky; top: 1em; align-self: start; background: #fffbe8;
           border: 1px solid #e0c060; padding: .5em .8em; margin-top: 1em;
           max-height: calc(100vh - 2em); overflow: auto; overflow-wrap: anywhere; }
#details ul { margin: .3em 0; padding-left: 1.2em; }
#details code { font-size: .92em; }
table.cells td { cursor: pointer; min-width: 7em; }
table.cells td.hit { background: #e3f5e3; }
table.cells td.miss { background: #fbe0e0; }
table.cells td.selected { outline: 3px solid #0b5cad; }
table.cells td .alt { white-space: nowrap; }
table.cells td .n { color: #555; font-size: .9em; }
table.cells td .alt.never { color: #b00020; }
ul.missing li { font-family: ui-monospace, monospace; font-size: .92em; }
"""

_INDEX_JS = """
document.querySelectorAll("th.sortable").forEach(function (th, col) {
  th.addEventListener("click", function () {
    var tbody = th.closest("table").tBodies[0];
    var asc = th.getAttribute("aria-sort") !== "ascending";
    th.closest("tr").querySelectorAll("th").forEach(function (h) {
      h.removeAttribute("aria-sort");
    });
    th.setAttribute("aria-sort", asc ? "ascending" : "descending");
    var rows = Array.prototype.slice.call(tbody.rows);
    rows.sort(function (a, b) {
      var x = a.cells[col].dataset.v, y = b.cells[col].dataset.v;
      var nx = parseFloat(x), ny = parseFloat(y);
      var c = (isNaN(nx) || isNaN(ny)) ? x.localeCompare(y) : nx - ny;
      return asc ? c : -c;
    });
    rows.forEach(function (r) { tbody.appendChild(r); });
  });
});
"""

_MACHINE_JS = """
var data = JSON.parse(document.getElementById("coverage-data").textContent);
var details = document.getElementById("details");
function clearSelection() {
  document.querySelectorAll(".selected").forEach(function (el) {
    el.classList.remove("selected");
  });
}
function show(title, alts) {
  details.textContent = "";
  var h = document.createElement("strong");
  h.textContent = title;
  details.appendChild(h);
  alts.forEach(function (a) {
    var p = document.createElement("div");
    p.textContent = a.text + ": " + a.hits + (a.hits === 1 ? " decision" : " decisions") +
      (a.tests.length ? ", in " + a.tests.length + (a.tests.length === 1 ? " test:" : " tests:")
                      : ", in no test");
    details.appendChild(p);
    if (a.tests.length) {
      var ul = document.createElement("ul");
      ul.className = "tests";
      a.tests.forEach(function (t) {
        var li = document.createElement("li");
        var code = document.createElement("code");
        code.textContent = t;
        li.appendChild(code);
        ul.appendChild(li);
      });
      details.appendChild(ul);
    }
  });
}
function showEdge(i) {
  var e = data.edges[i];
  clearSelection();
  var g = document.getElementById("edge_" + i);
  if (g) { g.classList.add("selected"); }
  show("transition " + e.title, [e]);
}
function showCell(td) {
  var c = data.cells[td.dataset.cell];
  clearSelection();
  td.classList.add("selected");
  show("(" + c.state + ", " + c.event + ")", c.alts);
}
document.querySelectorAll(".diagram g.edge").forEach(function (g) {
  var m = /^edge_(\\d+)$/.exec(g.id);
  if (m) { g.addEventListener("click", function () { showEdge(+m[1]); }); }
});
document.querySelectorAll("table.cells td[data-cell]").forEach(function (td) {
  td.addEventListener("click", function () { showCell(td); });
});
document.querySelectorAll("a[data-cell]").forEach(function (a) {
  a.addEventListener("click", function () {
    showCell(document.querySelector('td[data-cell="' + a.dataset.cell + '"]'));
  });
});
"""


_GENERATOR = "terminus pytest --fsm-coverage-html"


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _page(title: str, body: list[str], script: str) -> bytes:
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f'<meta name="generator" content="{_GENERATOR}">',
        # No favicon request: the report makes none at all.
        '<link rel="icon" href="data:,">',
        f"<title>{_e(title)}</title>", f"<style>{_CSS}</style>", "</head>", "<body>",
        *body, f"<script>{script}</script>", "</body>", "</html>", ""]).encode()


def _bar(percent: float) -> str:
    return (f'<span class="bar" title="{percent:g}%"><span style="width:{percent:g}%">'
            "</span></span>")


def _legend() -> str:
    words = {"covered": "every event exercised", "partial": "some events exercised",
             "reached": "terminal state entered", "uncovered": "never exercised"}
    swatches = "".join(f'<span class="swatch" style="background:{c}"></span>{words[k]}'
                       for k, c in COVERAGE_COLOURS.items())
    return (f'<p class="legend">States:{swatches}. Edges: green taken, red dashed never '
            "taken. Click an edge or a table cell for the tests that exercised it.</p>")


def _verdict(report: CoverageReport) -> str:
    if report.fail_under is None:
        return "<p>No <code>--fsm-coverage-fail-under</code> was given.</p>"
    if report.passed:
        return (f'<p class="pass">fail-under {report.fail_under:g}%: passed (every gated '
                "machine reaches it).</p>")
    return (f'<p class="fail">fail-under {report.fail_under:g}%: FAILED, below for '
            f"{_e(', '.join(report.below))}.</p>")


def _index(report: CoverageReport) -> bytes:
    head = ["machine", "gated", "transitions", "%", "(state, event) pairs", "%",
            "terminal states reached", "score"]
    rows = []
    for name, m in report.machines.items():
        t, p, term = m.transitions, m.pairs, m.terminals
        rows.append(
            f'<tr data-machine="{_e(name)}">'
            f'<td data-v="{_e(name)}"><a href="{_e(name)}.html">{_e(name)}</a></td>'
            f'<td data-v="{int(m.gated)}">'
            + ('<span class="gated">gated</span>' if m.gated else "no") + "</td>"
            f'<td class="num" data-v="{t.covered}">{t.covered}/{t.declared}</td>'
            f'<td class="num" data-v="{t.percent}">{t.percent:.1f}%</td>'
            f'<td class="num" data-v="{p.covered}">{p.covered}/{p.declared}</td>'
            f'<td class="num" data-v="{p.percent}">{p.percent:.1f}%</td>'
            f'<td class="num" data-v="{len(term.reached)}">'
            f"{len(term.reached)}/{len(term.declared)}</td>"
            f'<td data-v="{m.score}">{_bar(m.score)} {m.score:.1f}%</td></tr>')
    body = ["<h1>Transition coverage</h1>",
            "<p>Written by <code>pytest --fsm-coverage-html</code>. A machine's score is "
            "min(transition %, pair %); the gated machines are the ones "
            "<code>--fsm-coverage-fail-under</code> applies to. Click a column to sort.</p>",
            _verdict(report)]
    if not report.machines:
        body.append("<p>No fsm machine was declared or seen.</p>")
    else:
        body += ['<table id="machines">', "<thead><tr>"
                 + "".join(f'<th class="sortable">{_e(h)}</th>' for h in head)
                 + "</tr></thead>", "<tbody>", *rows, "</tbody>", "</table>"]
    return _page("Transition coverage", body, _INDEX_JS)


def _inline_svg(data: bytes) -> str:
    text = data.decode()
    return text[text.index("<svg"):]


def _machine(name: str, d: MachineDiagram, m: MachineCoverage,
             hits: Mapping[tuple[int, int, int], int],
             tests: Mapping[tuple[int, int, int], set[str]]) -> bytes:
    sid = {st.name: i for i, st in enumerate(d.states)}
    eid = {ev: j for j, ev in enumerate(d.events)}
    marks = Marks(frozenset((d.states[s].name, d.events[e], a) for (s, e, a) in hits
                            if a >= 0),
                  frozenset((d.states[s].name, d.events[e]) for (s, e, _) in hits))
    picture = _inline_svg(svg(dot(d, marks, errors=False, ids=True)))

    def alt_data(s: int, e: int, a: int, text: str) -> dict[str, Any]:
        return {"text": text, "hits": hits.get((s, e, a), 0),
                "tests": sorted(tests.get((s, e, a), ()))}

    edges = []
    for x in d.edges:
        s, e = sid[x.source], eid[x.event]
        guard = f" [{x.guard}]" if x.guard else " [else]" if x.otherwise else ""
        plan = f" / {x.plan}" if x.plan else ""
        edges.append(dict(alt_data(s, e, x.alt, f"{x.source} -> {x.target}"),
                          title=f"{x.source} --{x.event}{guard}{plan}--> {x.target}"))
    table = cells(d)
    cell_data: dict[str, Any] = {}
    rows = []
    for s, st in enumerate(d.states):
        tds = [f'<th>{_e(st.name)}{" (terminal)" if st.terminal else ""}</th>']
        for e, ev in enumerate(d.events):
            alts = table[(st.name, ev)]
            key = f"{s},{e}"
            cell_data[key] = {"state": st.name, "event": ev,
                              "alts": [alt_data(s, e, a.alt, a.text) for a in alts]}
            total = sum(hits.get((s, e, a.alt), 0) for a in alts)
            lines = "".join(
                f'<div class="alt{"" if hits.get((s, e, a.alt)) else " never"}">{_e(a.text)}'
                f' <span class="n">&times;{hits.get((s, e, a.alt), 0)}</span></div>'
                for a in alts)
            tds.append(f'<td id="cell_{s}_{e}" data-cell="{key}" class="'
                       f'{"hit" if total else "miss"}">{lines}</td>')
        rows.append("<tr>" + "".join(tds) + "</tr>")
    data = json.dumps({"edges": edges, "cells": cell_data}, sort_keys=True)
    # Inside <script>, only "</" could end the element early.
    data = data.replace("</", "<\\/")

    missing = [f'<li><a href="#cell_{sid[p.state]}_{eid[p.event]}" '
               f'data-cell="{sid[p.state]},{eid[p.event]}">({_e(p.state)}, {_e(p.event)})'
               "</a></li>" for p in m.pairs.missing]
    missing_t = [f"<li>{_e(t)}</li>" for t in m.transitions.missing]
    t, p, term = m.transitions, m.pairs, m.terminals
    body = [
        '<p><a href="index.html">&larr; all machines</a></p>',
        f"<h1>{_e(name)}" + (' <span class="gated">(gated)</span>' if m.gated else "")
        + "</h1>",
        f"<p>{_e(d.doc)}</p>" if d.doc else "",
        f"<p>Transitions {t.covered}/{t.declared} ({t.percent:.1f}%), (state, event) pairs "
        f"{p.covered}/{p.declared} ({p.percent:.1f}%), terminal states reached "
        f"{len(term.reached)}/{len(term.declared)}"
        + (f" (never: {_e(', '.join(term.missing))})" if term.missing else "") + ".</p>",
        _legend(),
        f'<div class="diagram" id="diagram">{picture}</div>',
        "<h2>Never exercised</h2>",
    ]
    if missing or missing_t:
        if missing:
            body += [f"<p>(state, event) pairs ({len(missing)}):</p>",
                     '<ul class="missing" id="missing-pairs">', *missing, "</ul>"]
        if missing_t:
            body += [f"<p>transitions ({len(missing_t)}):</p>",
                     '<ul class="missing" id="missing-transitions">', *missing_t, "</ul>"]
    else:
        body.append("<p>Nothing: every pair and transition ran.</p>")
    body += ["<h2>State &times; event table</h2>",
             "<p>Each cell lists its alternatives in order, with how often each was decided "
             "(&times;N); red cells were never exercised.</p>",
             '<div class="wide"><table class="cells" id="cells"><thead><tr>'
             "<th>state \\ event</th>"
             + "".join(f"<th>{_e(ev)}</th>" for ev in d.events) + "</tr></thead>",
             "<tbody>", *rows, "</tbody></table></div>",
             f'<script type="application/json" id="coverage-data">{data}</script>']
    layout = ['<div class="layout">', "<main>", *body, "</main>",
              '<aside id="details">Click an edge of the diagram or a cell of the table to '
              "list the tests that exercised it.</aside>", "</div>"]
    return _page(f"{name}: transition coverage", layout, _MACHINE_JS)


def site(recorder: CoverageRecorder, report: CoverageReport) -> dict[str, bytes]:
    """The report's files by name: `index.html` and `<machine>.html` per reported machine."""
    out = {"index.html": _index(report)}
    diagrams = recorder.diagrams()
    for key, name in recorder.names().items():
        if name in report.machines:
            out[f"{name}.html"] = _machine(name, diagrams[name], report.machines[name],
                                           recorder.hits[key], recorder.tests.get(key, {}))
    return out


def write_site(out_dir: Path, files: Mapping[str, bytes]) -> None:
    """Write the report into `out_dir`, removing the pages an earlier report wrote for
    machines no longer reported (and no other file)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for p in out_dir.glob("*.html"):
        if p.name not in files and _GENERATOR.encode() in p.read_bytes()[:1000]:
            p.unlink()
    for name, data in files.items():
        (out_dir / name).write_bytes(data)
