"""Shared test set-up: the ``gpu`` marker's skip rule."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import structlog
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors through the interpreter. Set before any kernel
    # module is imported: @triton.jit reads it at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (bash tests/bench/run_on_device.sh runs these on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    """The CLI configures structlog globally; keep one test's configuration out of the next."""
    yield
    structlog.reset_defaults()
