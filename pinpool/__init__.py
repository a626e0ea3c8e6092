"""pinpool: a persistent pinned staging ring for per-step GPU metadata.

One ``PinnedRingBuffer`` per worker and device. ``pool.stage()`` claims a slot, takes values
into pinned host memory and lands them on the device with one asynchronous copy. A step
whose shape repeats declares it once as a ``Layout`` of ``Field``s; the same layout lands in
the ring (``pool.stage(layout, rows=n)``), in a fixed ``DeviceBlock`` a CUDA graph captures,
in device memory the caller owns (``owned=``) or in the pinned slot itself
(``zero_copy=True``). Test tools (the stream-aware simulator, ``no_sync``) are in
``pinpool.testing``.
"""

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
