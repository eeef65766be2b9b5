"""Shared test configuration: one torch thread per process; tests marked ``gpu`` run only
where CUDA is present."""

from __future__ import annotations

import pytest
import torch

# `make test` runs two xdist workers on a two-core machine: with torch's default
# intra-op pool (one thread per core) in each worker the cores are oversubscribed, and
# the small-tensor ops these tests make slow down 10-100x waiting on each other.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu = [item for item in items if "gpu" in item.keywords]
    if not gpu or torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is false)")
    for item in gpu:
        item.add_marker(skip)
