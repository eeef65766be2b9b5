"""The vocabulary of a declaration's table and the form it compiles to.

A declaration (`fsm.spec.Spec`) is a table of states x events whose cells are written
with the names here (`go`, `IGNORE`, `ERROR`, `ANY`); `Spec.build()` compiles each cell
to a tuple of `Alt` and the whole table to `Tables`, which the runtime (`fsm.machine`)
and batched stepping (`fsm.batch`) read. This module imports nothing of the engine, so
every other module of it can.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeAlias

import msgspec

if TYPE_CHECKING:
    import torch

Guard: TypeAlias = Callable[[Any, Any], bool]
"""A predicate `guard(instance, event) -> bool`; it must not change anything."""


if TYPE_CHECKING:
    # mypy's dataclass_transform refuses a subclass that does not repeat frozen=True;
    # msgspec itself inherits the config, so users subclass Event without repeating it.
    class Event(msgspec.Struct, tag=True, gc=False):
        """Base class for events (see the runtime definition)."""

else:

    class Event(msgspec.Struct, frozen=True, tag=True, gc=False):
        """Base class for events: frozen, tagged msgspec Structs (the tag is the class
        name). Subclass it with the event's fields::

            class ChunkResult(Event):
                chunk: int
                last: bool = False
        """


class State(msgspec.Struct, frozen=True):
    """A state of a machine. Exactly one is `initial`; `terminal` states are final."""

    name: str
    initial: bool = False
    terminal: bool = False
    doc: str = ""


class Go(msgspec.Struct, frozen=True):
    """A transition to `target`, taken when guard `when` holds (always when None).

    `when` is a guard's name in the Spec's `guards=`, or the guard function itself (then
    it is named after the function). `plan` names the release plan run on entry; only
    edges into terminal states have one.
    """

    target: str
    plan: str | None = None
    when: str | Guard | None = None


def go(target: str, *, plan: str | None = None, when: str | Guard | None = None) -> Go:
    """Declare a transition cell: `go("aborted", plan="release_aborted")`,
    `go("done", when="last")` or `go("done", when=is_last)`."""
    return Go(target, plan, when)


def guard_name(when: str | Guard) -> str:
    """The name a guard goes by in diagrams, errors and `Alt.guard`: the string itself,
    or the function's `__name__`."""
    if isinstance(when, str):
        return when
    return str(getattr(when, "__name__", repr(when)))


class Marker:
    """The cell markers IGNORE and ERROR, and the row key ANY."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


IGNORE: Final = Marker("IGNORE")
"""The event is absorbed where it arrives: no state change, no effect, counted."""
ERROR: Final = Marker("ERROR")
"""The event is a caller error where it arrives: firing it raises TransitionNotAllowed."""
ANY: Final = Marker("ANY")
"""Row key standing for every event the row does not name."""

Cell: TypeAlias = "Go | str | Marker | Sequence[Go | str | Marker]"

# Decisions, as stored in compiled tables.
TRANSITION: Final = 0
IGNORED: Final = 1
ERRORED: Final = 2
DECISIONS: Final = ("transition", "ignore", "error")
GUARDED: Final = 3
"""`Tables.decision` code of a cell decided by guards at run time (not in DECISIONS)."""


class Alt(msgspec.Struct, frozen=True):
    """One compiled alternative of a (state, event) cell, tried in declaration order."""

    decision: int  # TRANSITION, IGNORED or ERRORED
    target: int  # state id; the source state for IGNORED/ERRORED
    plan: str | None
    guard: str | None


class Declaration(Protocol):
    """What the runtime keeps of the declaration it was built from (`Machine.spec`)."""

    @property
    def name(self) -> str: ...
    @property
    def states(self) -> tuple[State, ...]: ...
    @property
    def events(self) -> tuple[type, ...]: ...
    @property
    def table(self) -> Mapping[str, Mapping[Any, Cell]]: ...
    @property
    def doc(self) -> str: ...


class Tables(msgspec.Struct, frozen=True):
    """The compiled tables, indexed [state][event] by declaration order.

    `next`: the target of the cell's transition, the state itself for an ignore, -1 for
    an error, -2 for a guarded cell. `decision`: TRANSITION (0), IGNORE (1), ERROR (2)
    or GUARDED (3). `plan`: index into `plan_names` of the plan the edge runs, or -1.
    """

    next: tuple[tuple[int, ...], ...]
    decision: tuple[tuple[int, ...], ...]
    plan: tuple[tuple[int, ...], ...]
    terminal: tuple[bool, ...]
    plan_names: tuple[str, ...]

    def to_torch(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """The same tables as int64/bool tensors on `device` (keys as the fields)."""
        import torch

        return {
            "next": torch.tensor(self.next, dtype=torch.int64, device=device),
            "decision": torch.tensor(self.decision, dtype=torch.int64, device=device),
            "plan": torch.tensor(self.plan, dtype=torch.int64, device=device),
            "terminal": torch.tensor(self.terminal, dtype=torch.bool, device=device),
        }
