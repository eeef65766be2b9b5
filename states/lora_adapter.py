"""A LoRA adapter on the registry side: loaded, used, unloaded once nobody holds it.

    loading ──Loaded──► ready ──UnloadRequested──► unloading ──UsersDrained──► unloaded
       │                 ↺ Upserted (same stable id)   ↺ UnloadTimedOut (still waiting)
       └──LoadFailed──► load_failed

`unloading` is the declared wait for the adapter's usage counter to reach exactly zero:
the registry refuses new acquires from here on, so the counter only falls. A timed-out
wait is not an end: the adapter stays in `unloading` until its users drain (a leaked
reference shows up as an adapter stuck here, with its id and count in the error).
The adapter owns no handle; requests own references to it (`states.request`).
"""

from __future__ import annotations

from typing import Any

from terminus.fsm import ANY, ERROR, IGNORE, Event, Machine, Spec, State, go

__all__ = [
    "LORA_ADAPTER",
    "LoadFailed",
    "Loaded",
    "UnloadRequested",
    "UnloadTimedOut",
    "Upserted",
    "UsersDrained",
]


class Loaded(Event):
    """The registry registered the adapter under its stable id (an int in ours, a
    string in SGLang's)."""

    lora_id: int | str = 0


class LoadFailed(Event):
    """Registration failed (registry full, name taken)."""

    message: str = ""


class Upserted(Event):
    """New weights were loaded in place; the id (and its usage counter) stay."""


class UnloadRequested(Event):
    """Unload asked: the registry stops new acquires of the adapter."""


class UsersDrained(Event):
    """The adapter's usage counter reached exactly zero."""


class UnloadTimedOut(Event):
    """The wait for zero timed out; `count` references were still held (-1: the
    registry cannot count them)."""

    count: int = 0


_terminal_row: dict[Any, Any] = {
    UsersDrained: IGNORE,  # a drain noticed twice (two waiters) is harmless
    UnloadRequested: IGNORE,  # unloading an unloaded adapter is idempotent
    ANY: ERROR,
}

SPEC = Spec(
    "lora_adapter",
    states=(
        State("loading", initial=True, doc="registering in the registry"),
        State("ready", doc="acquirable; requests hold references"),
        State("unloading", doc="no new acquires; waits for the counter to reach zero"),
        State("unloaded", terminal=True, doc="forgotten by the registry"),
        State("load_failed", terminal=True, doc="never registered"),
    ),
    events=(Loaded, LoadFailed, Upserted, UnloadRequested, UsersDrained, UnloadTimedOut),
    table={
        "loading": {
            Loaded: go("ready"),
            LoadFailed: go("load_failed"),
            ANY: ERROR,
        },
        "ready": {
            Upserted: go("ready"),
            UnloadRequested: go("unloading"),
            ANY: ERROR,
        },
        "unloading": {
            UsersDrained: go("unloaded"),
            UnloadTimedOut: go("unloading"),
            UnloadRequested: IGNORE,  # a second unload call joins the wait
            ANY: ERROR,
        },
        "unloaded": _terminal_row,
        "load_failed": _terminal_row,
    },
    doc="Registry-side adapter lifecycle; unload waits for every reference to be released.",
)

LORA_ADAPTER: Machine = SPEC.build()
"""The built adapter machine (driven by `effects.lora_adapter.AdapterManager`)."""
