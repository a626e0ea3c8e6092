"""pinpool: a persistent pinned staging ring for per-step GPU metadata.

One ``PinnedRingBuffer`` per worker and device. Each ``stage()`` claims a slot, takes
values into pinned host memory, and lands them on the device with one asynchronous copy;
``stage(zero_copy=True)`` lets kernels read the pinned slot in place instead. Test tools
(the stream-aware simulator, ``no_sync``) are in ``pinpool.testing``.
"""

#: The one place the version is written: pyproject.toml reads it (``[tool.setuptools.dynamic]``).
__version__ = "0.1.0"

from pinpool.exceptions import (
    CapacityError,
    DeviceMismatchError,
    HostSyncError,
    PinpoolError,
    PlatformError,
    PoolStateError,
    SettingsError,
    StagingTypeError,
    StagingValueError,
    StaleLeaseError,
    ThreadOwnershipError,
    UnguardedReaderError,
)
from pinpool.exchange import Exchange
from pinpool.platform import PlatformReport
from pinpool.readback import Readback
from pinpool.ring import PinnedRingBuffer
from pinpool.settings import OverflowPolicy, PoolSettings
from pinpool.stage import Stage
from pinpool.static_inputs import HostImage, StaticField, StaticInputs, StaticStage
from pinpool.stats import PoolStats
from pinpool.transport import is_pin_memory_available
from pinpool.zero_copy import ZeroCopyStage

__all__ = [
    "CapacityError",
    "DeviceMismatchError",
    "Exchange",
    "HostImage",
    "HostSyncError",
    "OverflowPolicy",
    "PinnedRingBuffer",
    "PinpoolError",
    "PlatformError",
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
    "StaticField",
    "StaticInputs",
    "StaticStage",
    "ThreadOwnershipError",
    "UnguardedReaderError",
    "ZeroCopyStage",
    "is_pin_memory_available",
]
