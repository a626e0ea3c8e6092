"""pool.readback(): device values back through a pinned slot, fenced like a stage."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pinpool import CapacityError, PinnedRingBuffer, PoolSettings, PoolStateError, Readback, StaleLeaseError
from pinpool.testing import LaggingGpu


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
    gpu.frozen = True  # the "GPU" never catches up on its own
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


@pytest.mark.parametrize("seed", range(6))
def test_stages_and_readbacks_interleaved_under_lag_stay_exact(seed: int) -> None:
    """Catches a read-back that reuses a slot whose copy is pending, or returns another slot's bytes."""
    rng = random.Random(seed)
    gpu = LaggingGpu(max_lag=12, seed=seed)
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=3, slot_bytes=512), transport=gpu)
    pending: list[tuple[Readback, int, int]] = []
    read, stale = 0, 0
    for i in range(200):
        if rng.random() < 0.5:
            values = np.arange(i, i + rng.randint(1, 40), dtype=np.int64)
            with pool.stage() as st:
                view = st.put(values)
            gpu.enqueue_check(view, values, f"stage {i}")
        else:
            src = torch.full((rng.randint(1, 60),), i, dtype=torch.int32)
            pending.append((pool.readback(src), i, src.numel()))
        if pending and rng.random() < 0.6:
            handle, value, n = pending.pop(0)
            try:
                got = handle.values()
            except StaleLeaseError:  # read after its slot was recycled: refused, never wrong
                stale += 1
                continue
            assert got.tolist() == [value] * n
            read += 1
    gpu.drain()
    assert gpu.races == []
    assert gpu.mismatches == []
    assert read >= 10, (read, stale)  # most reads land in time; late ones are refused, not wrong


def test_readbacks_of_changing_shapes_and_dtypes_through_the_same_slots_read_their_own_values() -> None:
    """Catches a cached readback view reused for a different shape, dtype or size."""
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=512))
    rng = random.Random(3)
    for _ in range(60):
        dtype = rng.choice([torch.int64, torch.int32, torch.float32, torch.uint8])
        shape = rng.choice([(0,), (1,), (5,), (2, 3), (4, 1), (3,)])
        src = torch.randint(0, 100, shape).to(dtype)
        handle = pool.readback(src)
        assert handle.tolist() == src.tolist()
        got = handle.values()
        assert got.shape == tuple(shape) and got.dtype == np.dtype(str(dtype).removeprefix("torch."))
        assert torch.equal(torch.from_numpy(got), src)


def test_readback_tolist_is_refused_after_recycle_like_values() -> None:
    """Catches tolist() skipping the lease check that values() makes."""
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=64))
    rb = pool.readback(torch.arange(3))
    pool.readback(torch.arange(2))
    pool.readback(torch.arange(2))
    with pytest.raises(StaleLeaseError, match="recycled"):
        rb.tolist()


def test_stage_readback_shares_the_slot_and_fence_with_the_upload() -> None:
    """Catches a step's read-back that takes a second slot, or reads back before the upload copy."""
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=4, slot_bytes=256))
    with pool.stage() as st:
        up = st.put([1, 2, 3], torch.int64)
        st.flush()  # the upload's copy, before the "kernel" that reads it
        result = up * 10
        handle = st.readback(result)
        with pytest.raises(Exception, match="flushed"):
            st.put([4], torch.int64)
    assert handle.tolist() == [10, 20, 30] and handle.slot == st.slot
    stats = pool.stats()
    assert (stats.stages, stats.copies, stats.readbacks) == (1, 1, 1)
    with pool.stage() as nxt:
        nxt.put([0], torch.int64)
    assert nxt.slot == (st.slot + 1) % 4


def test_stage_readbacks_under_lag_never_race_and_read_their_own_values() -> None:
    """Catches a stage readback whose slot is reused (host region rewritten) before its copy ran."""
    gpu = LaggingGpu(max_lag=12, seed=4)
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=3, slot_bytes=512), transport=gpu)
    rng = random.Random(0)
    pending: list[tuple[Readback, list[int]]] = []
    for step in range(300):
        values = [rng.randrange(1000) for _ in range(rng.randint(1, 20))]
        with pool.stage() as st:
            st.put(values, torch.int64)
            handle = st.readback(torch.tensor(values) + step)
        pending.append((handle, [v + step for v in values]))
        if len(pending) > 2:  # read two steps late, within num_slots
            old, want = pending.pop(0)
            assert old.tolist() == want
    gpu.drain()
    assert gpu.races == []


def test_stage_readback_that_does_not_fit_is_refused_before_any_copy() -> None:
    """Catches a readback written past the end of its slot."""
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=64))
    with pool.stage() as st:
        st.put([1] * 6, torch.int64)
        with pytest.raises(CapacityError, match="'src' needs 32 bytes"):
            st.readback(torch.zeros(4, dtype=torch.int64))
    assert pool.stats().readbacks == 0


def test_stage_readback_is_readable_at_once_takes_no_put_after_it_and_close_fences_later_kernels() -> None:
    """Catches a stage read-back whose fence is left for close (its handle unreadable, or read before its
    copy landed, inside the stage), a put after it (those values would miss the stage's one copy), or a
    close that does not fence again after the kernels launched since, which a ``retain`` then leans on."""
    gpu = LaggingGpu(max_lag=4, seed=1)
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=256), transport=gpu)
    with pool.stage() as st:
        st.put([1, 2], torch.int64)
        st.flush()
        gpu.calls.clear()
        handle = st.readback(torch.tensor([5, 6]))
        assert gpu.calls == [("cudaMemcpyAsync", "default:0"), ("cudaEventRecord", "default:0")]
        assert handle.tolist() == [5, 6]  # readable before the stage closes
        with pytest.raises(PoolStateError, match="flushed"):
            st.put([3], torch.int64)
        st.retain(torch.zeros(1))  # kept for a kernel launched after the read-back
        gpu.enqueue_check(torch.zeros(1), torch.zeros(1), "a kernel launched after the read-back")
    assert gpu.calls[-2:] == [("kernel", "default:0"), ("cudaEventRecord", "default:0")]
    assert [c for c, _ in gpu.calls].count("cudaEventRecord") == 2
    gpu.drain()
    assert handle.tolist() == [5, 6] and not gpu.races and not gpu.mismatches


@pytest.mark.parametrize(
    "src",
    [
        torch.zeros(2, dtype=torch.bfloat16),  # no numpy dtype
        torch.zeros(4, 2, dtype=torch.int64).t(),  # not contiguous
        torch.zeros(2, device="meta"),  # another device
        [1, 2],  # not a tensor
    ],
    ids=["dtype", "layout", "device", "type"],
)
def test_a_refused_stage_readback_leaves_the_stage_unflushed(src: object) -> None:
    """Catches a stage read-back that flushes before checking its source: the refusal would
    leave the stage flushed, so later puts raise and the values put so far land early."""
    gpu = LaggingGpu(max_lag=4, seed=3)
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=256), transport=gpu)
    with pool.stage() as st:
        first = st.put([1, 2], torch.int64)
        with pytest.raises((ValueError, RuntimeError)):
            st.readback(src)  # type: ignore[arg-type]
        assert not st.flushed
        second = st.put([3], torch.int64)  # still open for puts
    gpu.drain()
    assert (first.tolist(), second.tolist()) == ([1, 2], [3])
    assert (pool.stats().copies, pool.stats().readbacks) == (1, 0)
