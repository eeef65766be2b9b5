# The engine's compiled core (fsm/_engine.c); terminus.fsm._core says when it runs.
from collections.abc import Callable, Sequence
from typing import Any

API: int

class Holder:
    _m: Any
    _s: int
    _q: Any
    _owns: Any
    key: Any
    def __init__(self, machine: Any, key: Any = None) -> None: ...
    def fire(self, event: Any) -> Any: ...

class MachineCore:
    _rows: Any
    _on: Any
    terminal: tuple[bool, ...]
    ledger: Any
    initial: int

class LedgerCore:
    resources: Any
    errors: list[Any]
    late_released: int
    def acquire(self, owner: Any, kind: str, value: Any) -> Any: ...
    def transfer(self, handle: Any, to: Any) -> None: ...
    def owned(self, owner: Any, kind: str | None = None) -> list[Any]: ...
    def _compact(self) -> None: ...

class PlanCell:
    def __init__(self, target: int, edge: Any, pname: str, pid: int, mname: str,
                 runs: list[int], ledger: LedgerCore,
                 steps: tuple[tuple[str | None, Callable[..., Any] | None,
                                    tuple[str | None, bool]], ...]) -> None: ...
    def __call__(self, inst: Any, event: Any) -> Any: ...

def setup(*, Handle: type, PlanReport: type, ReleaseContext: type, QueuedInPlan: type,
          PLAN_RUNNING: list[Any], step_failed: Callable[..., Any],
          step_returned: Callable[..., Any], sweeps: int, compact_min: int) -> None: ...

__all__: Sequence[str]
