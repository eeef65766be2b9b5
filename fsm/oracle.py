"""The declaration as a `transitions.Machine`: the source of diagrams and the test oracle.

    transitions_machine(m)   Machine(model=None, auto_transitions=False), terminal
                             states final=True, one transition per declared edge
                             (guards as conditions), ignores as internal transitions
                             (dest=None), errors as no transition (MachineError)
    OracleModel(m, subject)  a model driven side by side with a compiled instance;
                             guards are evaluated on `subject`, so both engines see
                             the same data, and release plans are counted per plan

The runtime never uses this: `transitions` costs microseconds per trigger and
kilobytes per model, while the compiled table costs nanoseconds and bytes.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from transitions import Machine as TMachine
from transitions import MachineError
from transitions import State as TState

from .machine import Machine
from .spec import ERRORED, TRANSITION


def transitions_machine(m: Machine, *, machine_cls: type[TMachine] = TMachine,
                        oracle: bool = True, **kwargs: Any) -> TMachine:
    """Build the `transitions` machine of a compiled declaration (model=None).

    With `oracle` (the default) every transition records its decision and terminal
    edges count their plan on the model (see OracleModel); without it the machine is
    the bare declaration (for diagrams and benchmarks). `machine_cls` may be a diagram
    class (GraphMachine); extra kwargs go to it.
    """
    states = [TState(name, final=m.terminal[i]) for i, name in enumerate(m.states)]
    trans: list[dict[str, Any]] = []
    for s, row in enumerate(m.cells):
        for e, alts in enumerate(row):
            for a in alts:
                if a.decision == ERRORED:
                    continue
                t: dict[str, Any] = {"trigger": m.event_names[e], "source": m.states[s],
                                     "dest": m.states[a.target] if a.decision == TRANSITION
                                     else None}
                if a.guard is not None:
                    t["conditions"] = [_condition(m, a.guard)]
                if not oracle:
                    trans.append(t)
                    continue
                t["after"] = [_mark("transition" if a.decision == TRANSITION else "ignore")]
                if a.decision == TRANSITION and m.terminal[a.target]:
                    t["after"].append(_count_plan(a.plan or "<release owned>"))
                trans.append(t)
    return machine_cls(model=None, states=states, transitions=trans,
                       initial=m.states[m.initial], auto_transitions=False,
                       send_event=oracle, ignore_invalid_triggers=False, **kwargs)


def _condition(m: Machine, guard: str) -> Any:
    fn = m.guards[guard]

    def cond(ev: Any) -> bool:
        return bool(fn(ev.model.subject, ev.kwargs["event"]))

    cond.__name__ = guard
    return cond


def _mark(decision: str) -> Any:
    def after(ev: Any) -> None:
        ev.model.last = decision

    after.__name__ = decision
    return after


def _count_plan(plan: str) -> Any:
    def after(ev: Any) -> None:
        ev.model.plans_run[plan] += 1

    after.__name__ = f"plan:{plan}"
    return after


class OracleModel:
    """A `transitions` model mirroring one compiled instance (see module docstring)."""

    def __init__(self, tm: TMachine, subject: Any = None) -> None:
        self.subject = subject
        self.plans_run: Counter[str] = Counter()
        self.ignored = 0
        self.state: str = ""
        self.last = ""
        self._tm = tm
        tm.add_model(self)

    def deliver(self, event: Any) -> str:
        """Fire `event`; returns 'transition', 'ignore' or 'error' as the oracle decides."""
        self.last = "error"
        try:
            self.trigger(type(event).__name__, event=event)  # type: ignore[attr-defined]
        except MachineError:
            return "error"
        if self.last == "ignore":
            self.ignored += 1
        return self.last


class Differential:
    """Drives a compiled instance and an OracleModel side by side, event by event.

    `deliver(event)` fires on both and raises AssertionError when they disagree on the
    decision (transition / ignore / error) or the resulting state; `plans_match()`
    compares how many times each release plan ran.
    """

    def __init__(self, instance: Any) -> None:
        self.instance = instance
        self.machine = instance.machine
        self.model = OracleModel(transitions_machine(self.machine), subject=instance)
        self.plans_run: Counter[str] = Counter()

    def deliver(self, event: Any) -> str:
        """Fire `event` at both engines; returns the decision they agreed on."""
        from .errors import TransitionNotAllowed

        inst = self.instance
        before = inst.state
        ignored = sum(self.machine.stats.ignored.values())
        try:
            report = inst.fire(event)
        except TransitionNotAllowed:
            got = "error"
        else:
            if report is not None:
                self.plans_run[report.plan] += 1
            got = ("ignore" if sum(self.machine.stats.ignored.values()) > ignored
                   else "transition")
        want = self.model.deliver(event)
        if (got, inst.state) != (want, self.model.state):
            raise AssertionError(
                f"machine {self.machine.name!r}: {type(event).__name__} in {before!r}: "
                f"compiled {got} -> {inst.state!r}, transitions {want} -> "
                f"{self.model.state!r}")
        return got

    def plans_match(self) -> bool:
        """True when both engines ran every release plan the same number of times."""
        return +self.plans_run == +self.model.plans_run
