"""Shared test set-up: quiet logs, and the ``gpu`` marker's skip rule."""

from __future__ import annotations

import logging

import pytest
import structlog
import torch

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run tests/gpu/run_on_device.sh on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
