"""Terminus' generic engine: declared machines compiled to tables, release plans that
run only on terminal transitions, exactly once, and an ownership ledger.

Declare with `Spec`, build (validate + compile) with `Spec.build()`, bind release plans
and a ledger with `Machine.bind()`, then `create()` instances and `fire()` events.
"""

from typing import TYPE_CHECKING, Any

from .errors import (
    DoubleRelease,
    FsmError,
    InvalidDefinition,
    OwnershipError,
    PlanNotBound,
    ReleaseFailed,
    ReleaseOutsideTerminal,
    TransitionNotAllowed,
    UnknownEvent,
)
from .ledger import Handle, Ledger
from .machine import Instance, Machine, Tables
from .observe import TransitionRecord, set_recorder
from .plan import (
    Action,
    EffectError,
    Plan,
    PlanReport,
    Release,
    ReleaseContext,
    release_effect,
)
from .spec import ANY, ERROR, IGNORE, Event, Go, Spec, State, go

if TYPE_CHECKING:
    from .batch import Batch, BatchStep


def __getattr__(name: str) -> Any:
    # Batched stepping needs torch; declaring and firing machines does not, so
    # `import terminus.fsm` (and `terminus.states`, which imports only fsm) stays free of torch.
    if name in ("Batch", "BatchStep"):
        from . import batch

        return getattr(batch, name)
    raise AttributeError(f"module 'fsm' has no attribute {name!r}")

__all__ = [
    "ANY",
    "ERROR",
    "IGNORE",
    "Action",
    "Batch",
    "BatchStep",
    "DoubleRelease",
    "EffectError",
    "Event",
    "FsmError",
    "Go",
    "Handle",
    "Instance",
    "InvalidDefinition",
    "Ledger",
    "Machine",
    "OwnershipError",
    "Plan",
    "PlanNotBound",
    "PlanReport",
    "Release",
    "ReleaseContext",
    "ReleaseFailed",
    "ReleaseOutsideTerminal",
    "Spec",
    "State",
    "Tables",
    "TransitionNotAllowed",
    "TransitionRecord",
    "UnknownEvent",
    "go",
    "release_effect",
    "set_recorder",
]
