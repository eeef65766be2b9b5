"""README.md is code: every ```python block runs, the table of machines matches the
declarations, and every invariant the README cites (I1..I10) is defined in it.

Blocks run in order, one test per `## ` section; the blocks of a section share one
namespace (a later block builds on an earlier one) and one asyncio event loop, and may
use top-level `await`. A block fails the test with its README line numbers in the
traceback.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import re
import traceback
from pathlib import Path

import pytest

from terminus.fsm.discover import GROUP, located

README = Path(__file__).resolve().parent.parent / "README.md"


def sections(text: str) -> list[tuple[str, list[tuple[int, str]]]]:
    """[(section title, [(first line number, code)])] for sections with python blocks."""
    out: list[tuple[str, list[tuple[int, str]]]] = []
    title, blocks = "(top)", []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            if blocks:
                out.append((title, blocks))
            title, blocks = line[3:].strip(), []
        elif line.strip() == "```python":
            start = i + 2  # 1-based number of the block's first code line
            body = []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            assert i < len(lines), f"README.md:{start - 1}: a ```python block is never closed"
            blocks.append((start, "\n".join(body) + "\n"))
        i += 1
    if blocks:
        out.append((title, blocks))
    return out


SECTIONS = sections(README.read_text())


def test_the_readme_has_python_examples():
    assert sum(len(b) for _, b in SECTIONS) >= 4


@pytest.mark.parametrize("title, blocks", SECTIONS, ids=[t for t, _ in SECTIONS])
def test_readme_examples_run(title, blocks):
    ns: dict[str, object] = {"__name__": "readme_example"}
    loop = asyncio.new_event_loop()
    try:
        for start, code in blocks:
            # Pad so that tracebacks point at the README's own line numbers.
            src = "\n" * (start - 1) + code
            compiled = compile(src, str(README), "exec",
                               flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
            failure = None
            try:
                result = eval(compiled, ns)  # exec, but returns the coroutine of an await
                if inspect.iscoroutine(result):
                    loop.run_until_complete(result)
            except Exception as e:
                # The README's own lines (linecache reads them at the padded numbers).
                tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
                failure = (f"the ```python block at README.md:{start - 1} (section "
                           f"{title!r}) raised {type(e).__name__}: {e}\n\n{tb}")
            if failure is not None:
                pytest.fail(failure, pytrace=False)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


# -- the table of machines ---------------------------------------------------------------

_HEADER = "| machine | module | initial state | other states | terminal states |"


def _names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def expected_table() -> str:
    """The table as the declarations make it (what the README must hold)."""
    rows = [_HEADER, "|---|---|---|---|---|"]
    for name, (ref, m) in located().items():
        module = ref.partition(":")[0]
        others = [s for i, s in enumerate(m.states) if i != m.initial and not m.terminal[i]]
        terminals = [s for i, s in enumerate(m.states) if m.terminal[i]]
        rows.append(f"| `{name}` | `{module}` | `{m.states[m.initial]}` | "
                    + ", ".join(f"`{s}`" for s in others) + " | "
                    + ", ".join(f"`{s}`" for s in terminals) + " |")
    return "\n".join(rows)


def test_the_table_of_machines_matches_their_declarations():
    text = README.read_text()
    assert _HEADER in text, f"README.md has no table of machines headed {_HEADER!r}"
    lines = text[text.index(_HEADER):].splitlines()
    table = []
    for line in lines:
        if not line.startswith("|"):
            break
        table.append(line)
    want = expected_table()
    assert "\n".join(table) == want, (
        f"README.md's table of machines differs from the {GROUP!r} machines' declarations; "
        f"replace it with:\n\n{want}\n")


def test_the_table_lists_states_as_the_machines_declare_them():
    # Independent of the formatting above: parse the README's rows and compare sets.
    text = README.read_text()
    rows = {}
    for line in text[text.index(_HEADER):].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[_names(cells[0])[0]] = cells
    found = located()
    assert set(rows) == set(found)
    for name, (_, m) in found.items():
        _, _, initial, others, terminals = rows[name]
        assert _names(initial) == [m.states[m.initial]], name
        assert set(_names(others)) | set(_names(initial)) | set(_names(terminals)) == set(
            m.states), name
        assert set(_names(terminals)) == {s for i, s in enumerate(m.states) if m.terminal[i]}


# -- invariants ----------------------------------------------------------------------------


def test_every_invariant_the_readme_cites_is_defined_in_it():
    text = README.read_text()
    assert "## Invariants" in text
    section = text[text.index("## Invariants"):]
    section = section[:section.index("\n## ", 3)] if "\n## " in section[3:] else section
    defined = set(re.findall(r"^\| \*\*(I\d+)\*\* \|", section, flags=re.M))
    assert defined == {f"I{i}" for i in range(1, 11)}, sorted(defined)
    cited = set(re.findall(r"\b(I\d+)\b", text))
    assert cited <= defined, f"cited but not defined: {sorted(cited - defined)}"
