"""pinpool: a persistent pinned staging ring for per-step GPU metadata; test tools are in ``pinpool.testing``."""

#: The one place the version is written: pyproject.toml reads it (``[tool.setuptools.dynamic]``).
__version__ = "0.2.0"

from pinpool.block import DeviceBlock
from pinpool.exceptions import (
    CapacityError,
    DeviceMismatchError,
    PinpoolError,
    PoolStateError,
    SettingsError,
    StagingTypeError,
    StagingValueError,
    StaleLeaseError,
)
from pinpool.layout import Field, Layout
from pinpool.platform import PlatformReport
from pinpool.readback import Readback
from pinpool.ring import PinnedRingBuffer
from pinpool.settings import PoolSettings
from pinpool.stage import Stage
from pinpool.stats import PoolStats

__all__ = [
    "CapacityError",
    "DeviceBlock",
    "DeviceMismatchError",
    "Field",
    "Layout",
    "PinnedRingBuffer",
    "PinpoolError",
    "PlatformReport",
    "PoolSettings",
    "PoolStateError",
    "PoolStats",
    "Readback",
    "SettingsError",
    "Stage",
    "StagingTypeError",
    "StagingValueError",
    "StaleLeaseError",
]
