"""The `terminus` command: subcommands and benchmarks come from entry points.

`fsm` knows nothing of LLM serving, so it does not import the packages that do: the
subcommands (`terminus.commands`) and benchmarks (`terminus.benchmarks`) are looked up
by name in the installed entry points, which is also how a user's package adds its own.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import inspect
import json
import re
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def _group(name: str) -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=name)}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `terminus` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    commands = _group("terminus.commands")
    if args and args[0] in ("-V", "--version"):
        print(f"terminus {_version()}")
        return 0
    if not args or args[0] in ("-h", "--help"):
        print("usage: terminus [--version] COMMAND [ARGS...]\n\n"
              "Explicit finite-state-machine request lifecycles for LLM serving.\n\n"
              "commands:")
        width = max((len(n) for n in commands), default=0)
        for name in sorted(commands):
            print(f"  {name:<{width}}  {summary(commands[name])}")
        print("\noptions:\n  -h, --help     show this message and exit\n"
              "  -V, --version  print the installed version (distribution terminus-fsm) "
              "and exit\n\n`terminus COMMAND --help` describes each command's options.")
        return 0 if args else 2
    name, rest = args[0], args[1:]
    ep = commands.get(name)
    if ep is None:
        print(f"terminus: unknown command {name!r}; commands: {', '.join(sorted(commands))}",
              file=sys.stderr)
        return 2
    fn: Callable[[list[str]], int] = ep.load()
    try:
        return int(fn(rest) or 0)
    except CliError as e:
        print(f"terminus {name}: {e}", file=sys.stderr)
        return 2


def console() -> int:
    """The `terminus` console script (and `python -m terminus.fsm`): `main()`, then,
    the process ending next, what exists (torch's modules, a run's records) is frozen
    out of the collector, so the interpreter's collections at shutdown do not scan it
    all once more only to find nothing worth freeing (~1.2 s of a `terminus simulate`
    run's exit on a busy 2-core host, 0.4 s left). `atexit` handlers and
    `weakref.finalize` callbacks still run; a reference cycle that is garbage when the
    command returns is not collected (its `__del__` does not run), as CPython does not
    promise at exit anyway. `main()` itself leaves the collector alone: a program or a
    test that calls it goes on with its heap as it was (`process_ends()` is False
    there)."""
    global _process_ends
    _process_ends = True
    try:
        return main()
    finally:
        gc.freeze()


_process_ends = False


def process_ends() -> bool:
    """Whether the process ends when the running command returns (it runs from
    `console()`, the `terminus` script): a command may then freeze its heap out of the
    collector once its real work is done (`terminus simulate` after its runs: a full
    collection would only find the runs' garbage, for a process about to exit)."""
    return _process_ends


def _version() -> str:
    from terminus import __version__

    return __version__


class _Captured(Exception):
    """Raised by a command's parser while `command_parser` looks at it."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


_capturing = False


def command_parser(ep: Any) -> argparse.ArgumentParser | None:
    """The argument parser a subcommand of this distribution builds, without running it.

    Each of them builds its parser with `parser()` before doing anything else; another
    package's command is never called (None), since it may not parse arguments at all.
    """
    global _capturing
    dist = getattr(ep, "dist", None)
    if dist is None or dist.name != "terminus-fsm":
        return None
    fn = ep.load()
    _capturing = True
    try:
        fn(["--help"])
    except _Captured as c:
        return c.parser
    except (Exception, SystemExit):
        return None
    finally:
        _capturing = False
    return None


def summary(ep: Any) -> str:
    """One line describing a subcommand: its parser's description, else its docstring."""
    p = command_parser(ep)
    text = (p.description if p is not None else None) or (ep.load().__doc__ or "")
    first = re.split(r"\.\s+(?=[A-Z])|;\s", " ".join(text.split()))[0].rstrip(".")
    return first or "(no description)"


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad option as one line (CliError), not a usage dump."""

    def error(self, message: str) -> Any:
        raise CliError(f"{message} (see --help)")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if _capturing:
            raise _Captured(self)
        return super().parse_known_args(args, namespace)


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    """An ArgumentParser whose errors become one-line CliErrors; for subcommands."""
    return _Parser(prog=prog, description=description)


def write_json(path: str, obj: Any) -> None:
    """Write `obj` as indented JSON to `path`, as a CliError when the path is unwritable."""
    try:
        with open(path, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
    except OSError as e:
        raise CliError(f"cannot write {path!r}: {e.strerror or e}") from None


def print_table(title: str, rows: Sequence[tuple[str, str]]) -> None:
    """Print two-column rows (figure, value) under a title."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, show_header=True, header_style="bold")
    t.add_column("figure")
    t.add_column("value", justify="right")
    for k, v in rows:
        t.add_row(k, v)
    Console(width=None if sys.stdout.isatty() else 110).print(t)


def _takes_device(mod: Any) -> bool:
    return "device" in inspect.signature(mod.run).parameters


def bench_main(argv: list[str]) -> int:
    """`terminus bench [NAME...] [--quick] [--json PATH] [--device DEV]`: print figures."""
    benches = _group("terminus.benchmarks")
    p = parser("terminus bench", "Run benchmarks and print one table of figures each.")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"benchmarks to run (default: all of {', '.join(sorted(benches))})")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON to PATH")
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    p.add_argument("--device", metavar="DEVICE",
                   help="where the benchmarks that take a device (kernels) put their "
                        "tensors: cpu (default) or cuda[:N]")
    a = p.parse_args(argv)
    # Engine first, then the layers built on it; a user's own benchmarks after.
    order = ["engine", "kernels", "e2e", "e2e-parts"]
    names = a.names or sorted(benches, key=lambda n: (order.index(n) if n in order
                                                      else len(order), n))
    for n in names:
        if n not in benches:
            raise CliError(f"unknown benchmark {n!r}; benchmarks: {', '.join(sorted(benches))}")
    mods = {n: importlib.import_module(benches[n].value) for n in names}
    on_device = [n for n in names if _takes_device(mods[n])]
    if a.device not in (None, "cpu") and len(on_device) < len(names):
        cpu_only = [n for n in names if n not in on_device]
        verb = "runs" if len(cpu_only) == 1 else "run"
        # Every registered benchmark that takes a device, not only the ones named.
        able = [n for n in sorted(benches)
                if _takes_device(mods.get(n) or importlib.import_module(benches[n].value))]
        raise CliError(f"--device {a.device}: {', '.join(cpu_only)} {verb} on the CPU only; "
                       "name the benchmarks that take a device: "
                       f"{', '.join(able) or 'none is installed'}")
    if a.json:
        write_json(a.json, {})  # fail on an unwritable path before minutes of work
    results: dict[str, Any] = {}
    rows: list[tuple[str, str]] = []
    for n, mod in mods.items():
        kwargs: dict[str, Any] = {"device": a.device} if a.device and n in on_device else {}
        try:
            results[n] = mod.run(quick=a.quick, **kwargs)
        except ValueError as e:
            if not kwargs:
                raise
            raise CliError(f"{n}: {e}") from None
        rows += [(f"{n}: {k}" if len(names) > 1 else k, v) for k, v in mod.table(results[n])]
    title = "terminus bench " + (names[0] if len(names) == 1 else "(" + ", ".join(names) + ")")
    print_table(title, rows)
    if a.json:
        write_json(a.json, results[names[0]] if len(names) == 1 else results)
    return 0
