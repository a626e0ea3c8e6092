"""pool.readback(): device values back through a pinned slot, fenced like a stage."""

from __future__ import annotations

import pytest
import torch

from pinpool import PinnedRingBuffer, PoolSettings, StaleLeaseError
from pinpool.simulated import LaggingGpu


def test_readback_returns_the_values_and_survives_later_writes_to_the_source() -> None:
    """Catches a readback that aliases the device tensor instead of copying it."""
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=3, slot_bytes=256))
    src = torch.tensor([[3, 1], [4, 1]], dtype=torch.int64)
    rb = pool.readback(src)
    src.fill_(0)
    assert rb.ready()
    assert rb.values().tolist() == [[3, 1], [4, 1]]
    assert pool.stats().readbacks == 1


def test_readback_read_after_recycle_is_refused() -> None:
    """Catches a late read returning the bytes of whatever reused the slot."""
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=256))
    rb = pool.readback(torch.arange(4))
    for _ in range(2):
        with pool.stage() as st:
            st.put([9] * 4, torch.int64)
    with pytest.raises(StaleLeaseError, match="recycled"):
        rb.values()


def test_readback_waits_only_when_the_copy_is_still_queued() -> None:
    """Catches a read that returns before the copy landed, or a wait that goes uncounted."""
    gpu = LaggingGpu(max_lag=1000, seed=0)
    gpu._rng.randint = lambda a, b: b  # type: ignore[method-assign]  # never catches up on its own
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=4, slot_bytes=256), transport=gpu)
    rb = pool.readback(torch.tensor([7, 8, 9]))
    assert not rb.ready()
    assert rb.values().tolist() == [7, 8, 9]
    stats = pool.stats()
    assert (stats.readback_waits, gpu.host_waits) == (1, 1)


def test_readback_checks_size_device_and_dtype() -> None:
    """Catches a readback that would write past its slot or reinterpret bytes."""
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=64))
    with pytest.raises(ValueError, match="needs 800 bytes"):
        pool.readback(torch.zeros(100, dtype=torch.int64))
    with pytest.raises(ValueError, match="pool's device"):
        pool.readback(torch.zeros(2, device="meta"))
    with pytest.raises(RuntimeError, match="numpy dtype"):
        pool.readback(torch.zeros(2, dtype=torch.bfloat16))
    assert pool.stats().readbacks == 0
