"""Shared test configuration: one torch thread per process; tests marked ``gpu`` run only
where CUDA is present, those marked ``python_core`` only where the engine runs its Python
core alone (``TERMINUS_PURE_PYTHON=1``); the ``device`` fixture runs a kernel test on CPU
and on CUDA; ``kv`` is a strict KV pool checked full at the end; ``unobserved`` detaches
the coverage recorder for a test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from terminus.fsm import _core, observe
from terminus.kernels import TokenKVAllocator

# `make test` runs two xdist workers on a two-core machine: with torch's default
# intra-op pool (one thread per core) in each worker the cores are oversubscribed, and
# the small-tensor ops these tests make slow down 10-100x waiting on each other.
torch.set_num_threads(1)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    """The device a kernel pool is built on: ``"cpu"``, then ``"cuda"``.

    The ``cuda`` variant is marked ``gpu``, so it is collected everywhere and skipped
    where CUDA is absent (see ``pytest_collection_modifyitems``); on a GPU machine
    ``pytest -m gpu`` runs exactly the CUDA variants. A plain string, so it is safe to
    share across the examples of a Hypothesis ``@given`` test.
    """
    return request.param


@pytest.fixture
def unobserved() -> Iterator[None]:
    """No coverage recorder attached for the test (the suite's plugin attaches one): the
    machines run as in a serving engine, their compiled cells unwrapped (`m._on` holds
    them, not their recording wrappers), a quiet batched step not read back."""
    previous = observe.set_recorder(None)
    try:
        yield
    finally:
        observe.set_recorder(previous)


@pytest.fixture
def kv() -> Iterator[TokenKVAllocator]:
    """A strict 64-token KV pool, checked full when the test ends (a module may define
    its own ``kv``)."""
    pool = TokenKVAllocator(64, strict=True)
    yield pool
    pool.assert_full()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _core.C is not None:  # the Python core's own machinery does not run
        skip_core = pytest.mark.skip(reason="tests the Python core; the compiled one runs "
                                     f"(set {_core.PURE_ENV}=1 to run it)")
        for item in items:
            if "python_core" in item.keywords:
                item.add_marker(skip_core)
    gpu = [item for item in items if "gpu" in item.keywords]
    if not gpu or torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is false)")
    for item in gpu:
        item.add_marker(skip)
