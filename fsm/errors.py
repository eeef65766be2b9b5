"""The two error families of the engine, each carrying machine, state and event.

Declaration errors (`InvalidDefinition`) surface when a machine is built; runtime
errors (`TransitionNotAllowed` and the release errors) surface when an instance fires.
Every message says what was wrong and what to do about it.
"""

from __future__ import annotations

import sys
from typing import Any

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import ExceptionGroup


class FsmError(Exception):
    """Base class of every error the engine raises."""


class InvalidDefinition(FsmError):
    """A machine declaration is wrong; raised by `Spec.build()` or `Machine.bind()`.

    Fields: `machine`, `state` and `event` (either may be None when the problem is not
    about one state or event), `problem` and `fix`.
    """

    def __init__(
        self,
        machine: str,
        problem: str,
        fix: str,
        *,
        state: str | None = None,
        event: str | None = None,
    ) -> None:
        self.machine = machine
        self.state = state
        self.event = event
        self.problem = problem
        self.fix = fix
        where = f"machine {machine!r}"
        if state is not None:
            where += f", state {state!r}"
        if event is not None:
            where += f", event {event!r}"
        super().__init__(f"{where}: {problem}; {fix}")


class TransitionNotAllowed(FsmError):
    """An event was fired where the declaration makes it an error.

    Fields: `machine`, `state`, `event` (names), `reason`, and `instance` (the instance's
    key, or its index in a batch).
    """

    def __init__(
        self, machine: str, state: str, event: str, reason: str, instance: Any = None
    ) -> None:
        self.machine = machine
        self.state = state
        self.event = event
        self.reason = reason
        self.instance = instance
        who = "" if instance is None else f" (instance {instance!r})"
        super().__init__(
            f"machine {machine!r}{who}: event {event!r} is not allowed in state "
            f"{state!r}: {reason}"
        )


class UnknownEvent(FsmError):
    """An object that is not one of the machine's declared events was fired.

    Fields: `machine`, `state`, `event` (names), `problem` and `fix`. The default
    problem is "not an event of this machine"; the engine says more where it can (an
    event class fired instead of an instance, another machine's event of the same name).
    """

    def __init__(self, machine: str, state: str, event: str, known: tuple[str, ...], *,
                 problem: str | None = None, fix: str | None = None) -> None:
        self.machine = machine
        self.state = state
        self.event = event
        self.problem = problem or f"{event!r} is not an event of this machine"
        self.fix = fix or (f"fire one of {', '.join(known)} (declare new events in the "
                           "Spec)")
        super().__init__(f"machine {machine!r}, state {state!r}: {self.problem}; {self.fix}")


class PlanNotBound(InvalidDefinition):
    """A planned edge was fired on a machine whose plans were never bound.

    Raised before anything changes. Fields as `InvalidDefinition`, plus `plan`.
    """

    def __init__(self, machine: str, plan: str, state: str, event: str) -> None:
        self.plan = plan
        super().__init__(
            machine,
            f"this edge runs release plan {plan!r}, but the machine was never bound to an "
            "implementation of it, so its terminal transition would release nothing",
            f"fire on machine.bind(plans={{{plan!r}: Plan(...), ...}}, ledger=...); for a "
            "declaration-only use (an oracle, a table test) bind(partial=True) runs "
            "missing plans as empty ones",
            state=state,
            event=event,
        )


class ReleaseOutsideTerminal(FsmError):
    """A release effect was called without the context of a running terminal transition."""

    def __init__(self, effect: str) -> None:
        self.effect = effect
        super().__init__(
            f"release effect {effect!r} was called outside a terminal transition; "
            "release effects run only from a Plan step while the engine runs a "
            "transition into a terminal state (fire the event that makes the owner "
            "terminal instead of calling the effect)"
        )


class DoubleRelease(FsmError):
    """A handle that was already released was released again."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        super().__init__(
            f"{handle!r} was already released; each handle is released exactly once, "
            "by the terminal transition of its owner"
        )


class OwnershipError(FsmError):
    """A ledger operation named a handle or owner in a way that breaks single ownership."""


class ReleaseFailed(ExceptionGroup[Exception], FsmError):
    """Steps of a release plan raised; every other step still ran.

    `report` is the `PlanReport` of the run; the group holds the step errors.
    """

    report: Any

    def __new__(cls, message: str, errors: list[Exception], report: Any) -> ReleaseFailed:
        self = super().__new__(cls, message, errors)
        self.report = report
        return self

    def derive(self, excs: Any) -> ReleaseFailed:  # type: ignore[override]
        # keeps `report` on split()/subgroup()
        return ReleaseFailed(self.message, list(excs), self.report)
