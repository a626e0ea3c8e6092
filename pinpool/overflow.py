"""The opt-in overflow policy: a put that does not fit its slot goes through a one-off buffer.

Correct but not free: one pinned and one device allocation and a second copy per spilled
put, each counted in the stats and logged as ``stage.overflow`` so a mis-sized pool shows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pinpool.encode import NUMPY_DTYPE, write
from pinpool.log import get_logger

if TYPE_CHECKING:
    from pinpool.ring import PinnedRingBuffer
    from pinpool.stage import Stage

_log = get_logger("pinpool")


def spill(pool: PinnedRingBuffer, st: Stage, src: Any, dtype: torch.dtype, numel: int, name: str) -> torch.Tensor:
    """Stage ``src`` through its own pinned buffer; returns the device tensor it lands in."""
    nbytes = numel * dtype.itemsize
    transport = pool._transport
    host = transport.alloc_host(nbytes)
    write(host.numpy().view(NUMPY_DTYPE[dtype]) if dtype in NUMPY_DTYPE else host.view(dtype), src, dtype, name)
    device = transport.alloc_device(nbytes)
    transport.copy(device, host, st.stream)
    # The one-off pinned buffer must outlive its copy: retain it with the slot, whose fence
    # (recorded when the stage closes) covers this copy too.
    pool._retained[st.slot].append(host)
    st.spilled = True
    counters = pool._counters
    counters.overflows += 1
    counters.host_allocations += 1
    counters.device_allocations += 1
    counters.copies += 1
    counters.bytes_copied += nbytes
    _log.warning(
        "stage.overflow", field=name, nbytes=nbytes, slot_bytes=pool.settings.slot_bytes, overflows=counters.overflows
    )
    return device.view(dtype)
