"""The engine's two ways of running a step, for tests that must hold on both.

`engine_path` runs a test unobserved (no recorder: `Instance.fire` calls the compiled
function of each cell, `fsm.machine._compile_terminal` for an unguarded terminal edge)
and recorded (a recorder attached, the coverage plugin's when it runs: every cell's
compiled function also records its decision). Use it on a module with
`pytestmark = pytest.mark.usefixtures("engine_path")`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from terminus.fsm import observe


class _NullRecorder:
    def record(self, machine: Any, source: int, event: int, alt: int) -> None:
        pass

    def record_counts(self, machine: Any, counts: Any) -> None:
        pass


@pytest.fixture(params=["unobserved", "recorded"])
def engine_path(request: pytest.FixtureRequest) -> Iterator[str]:
    prev = observe.recorder()
    if request.param == "unobserved":
        observe.set_recorder(None)
    elif prev is None:
        observe.set_recorder(_NullRecorder())
    try:
        yield request.param
    finally:
        observe.set_recorder(prev)
