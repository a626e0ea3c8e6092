"""pinpool: a persistent pinned staging ring for per-step GPU metadata.

One ``PinnedRingBuffer`` per worker and device. Each ``stage()`` claims a slot, takes
values into pinned host memory, and lands them on the device with one asynchronous copy.
"""

from pinpool.exceptions import (
    CapacityError,
    DeviceMismatchError,
    HostSyncError,
    PinpoolError,
    PoolStateError,
    SettingsError,
    StagingTypeError,
    StagingValueError,
    StaleLeaseError,
    ThreadOwnershipError,
)
from pinpool.readback import Readback
from pinpool.ring import PinnedRingBuffer
from pinpool.settings import OverflowPolicy, PoolSettings
from pinpool.stage import Stage
from pinpool.stats import PoolStats
from pinpool.sync_guard import no_sync
from pinpool.transport import is_pin_memory_available

__all__ = [
    "CapacityError",
    "DeviceMismatchError",
    "HostSyncError",
    "OverflowPolicy",
    "PinnedRingBuffer",
    "PinpoolError",
    "PoolSettings",
    "PoolStateError",
    "PoolStats",
    "Readback",
    "SettingsError",
    "Stage",
    "StagingTypeError",
    "StagingValueError",
    "StaleLeaseError",
    "ThreadOwnershipError",
    "is_pin_memory_available",
    "no_sync",
]
