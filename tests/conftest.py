"""Shared test configuration: tests marked ``gpu`` run only where CUDA is present."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu = [item for item in items if "gpu" in item.keywords]
    if not gpu:
        return
    import torch  # only when a gpu test was collected: most test files never need torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is false)")
    for item in gpu:
        item.add_marker(skip)
