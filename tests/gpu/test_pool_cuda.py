"""The ring on a real CUDA device: lag, syncs, copies, allocations, consumer streams.

Awkward sizes on purpose (1, 3, 999, 1024, 4097 elements). The GPU is made to lag with
``torch.cuda._sleep`` so the host laps the ring and the slot fences actually matter.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from pinpool import PinnedRingBuffer, PoolSettings
from pinpool.cuda import CudaTransport
from pinpool.testing import no_sync
from tests.fakes import UnfencedTransport

DEV = torch.device("cuda", 0)
DTYPES = [torch.float32, torch.int32, torch.int64, torch.float16, torch.uint8, torch.bfloat16, torch.bool]
SIZES = [1, 3, 999, 1024, 4097]
SLEEP_CYCLES = 2_000_000  # about 1 ms at H200 clocks: enough to fall num_slots stages behind


def values_for(rng: random.Random, dtype: torch.dtype, n: int) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.tensor([rng.random() < 0.5 for _ in range(n)])
    if dtype.is_floating_point:
        return torch.tensor([rng.uniform(-100, 100) for _ in range(n)], dtype=torch.float32).to(dtype)
    hi = 255 if dtype == torch.uint8 else 2**31 - 1
    return torch.tensor([rng.randint(0, hi) for _ in range(n)], dtype=dtype)


def stage_random(pool: PinnedRingBuffer, rng: random.Random) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One stage of 1-4 random fields; returns (device snapshot taken in stream order, expected)."""
    out = []
    with pool.stage() as st:
        fields = []
        for _ in range(rng.randint(1, 4)):
            expected = values_for(rng, rng.choice(DTYPES), rng.choice(SIZES))
            source: Any = expected.tolist() if rng.random() < 0.5 and expected.dtype != torch.bfloat16 else expected
            fields.append((st.put(source, expected.dtype), expected))
    for view, expected in fields:
        out.append((view.clone(), expected))  # queued after the stage's copy: reads what landed
    return out


def test_1000_lagged_stages_arrive_exactly() -> None:
    """Catches a slot rewritten on the host while its copy is still queued (rule 1)."""
    rng = random.Random(0)
    pool = PinnedRingBuffer(PoolSettings(device=DEV, num_slots=3, slot_bytes=1 << 18))
    seen = []
    for _ in range(1000):
        if rng.random() < 0.5:
            torch.cuda._sleep(rng.randint(0, 5 * SLEEP_CYCLES))
        seen.extend(stage_random(pool, rng))
    torch.cuda.synchronize()
    bad = [i for i, (got, want) in enumerate(seen) if not torch.equal(got.cpu(), want)]
    assert bad == []
    stats = pool.stats()
    assert stats.stages == 1000
    assert stats.copies == 1000
    assert stats.stalls > 0, "the GPU never lagged, so the fences were not exercised"
    pool.close()


def test_control_a_ring_without_fences_is_corrupted_under_lag() -> None:
    """Catches a lag set-up too weak to expose the race the fences prevent."""
    pool = PinnedRingBuffer(
        PoolSettings(device=DEV, num_slots=2, slot_bytes=1 << 16), transport=UnfencedTransport(CudaTransport(DEV))
    )
    seen = []
    for step in range(60):
        torch.cuda._sleep(SLEEP_CYCLES)
        with pool.stage() as st:
            view = st.put([step] * 256, torch.int32)
        seen.append((view.clone(), step))
    torch.cuda.synchronize()
    wrong = sum(1 for got, step in seen if not bool((got == step).all()))
    assert wrong > 0


def test_steady_state_stage_makes_no_host_sync() -> None:
    """Catches a hidden sync (pageable copy, .item(), event wait) on the hot path."""
    pool = PinnedRingBuffer(PoolSettings(device=DEV, num_slots=8, slot_bytes=1 << 16))
    lists = [[0.5] * 256, [0.9] * 256, list(range(256)), [0.0] * 256, list(range(256))]
    dtypes = [torch.float32, torch.float32, torch.int32, torch.float32, torch.int64]
    for _ in range(16):
        with pool.stage() as st:
            for v, d in zip(lists, dtypes, strict=True):
                st.put(v, d)
    torch.cuda.synchronize()
    with no_sync():
        for _ in range(50):
            with pool.stage() as st:
                outs = [st.put(v, d) for v, d in zip(lists, dtypes, strict=True)]
                st.put(np.arange(7, dtype=np.int64))
    assert outs[2].cpu().tolist() == list(range(256))
    assert pool.stats().stalls == 0


def test_profiler_shows_one_memcpy_per_stage_and_no_sync_or_alloc() -> None:
    """Catches a stage that issues one copy per field, or any sync / pinned allocation."""
    from torch.profiler import ProfilerActivity, profile

    pool = PinnedRingBuffer(PoolSettings(device=DEV, num_slots=8, slot_bytes=1 << 16))
    for _ in range(8):
        with pool.stage() as st:
            st.put([1.0] * 64, torch.float32)
    torch.cuda.synchronize()
    stages = 20
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(stages):
            with pool.stage() as st:
                st.put([0.5] * 256, torch.float32)
                st.put(list(range(256)), torch.int32)
                st.put(list(range(256)), torch.int64)
                st.put([0.1] * 256, torch.float32)
                st.put([0.0] * 256, torch.float32)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert sum(1 for n in names if n.startswith("cudaMemcpyAsync")) == stages
    assert not [n for n in names if n.startswith(("cudaHostAlloc", "cudaMallocHost", "cudaStreamSynchronize"))]


def test_no_host_or_device_allocation_after_construction() -> None:
    """Catches per-stage pinned allocations (the cost PR #28076 still pays)."""
    pool = PinnedRingBuffer(PoolSettings(device=DEV, num_slots=4, slot_bytes=1 << 16))
    rng = random.Random(1)
    torch.cuda.synchronize()
    host_before = torch.cuda.host_memory_stats().get("num_host_alloc", 0)
    device_before = torch.cuda.memory_allocated(DEV)
    for _ in range(500):
        with pool.stage() as st:
            st.put([rng.random() for _ in range(rng.choice(SIZES))], torch.float32)
    torch.cuda.synchronize()
    assert torch.cuda.host_memory_stats().get("num_host_alloc", 0) == host_before
    assert torch.cuda.memory_allocated(DEV) == device_before
    assert pool.host_slab.is_pinned()


def _consumer_reads_late(register: bool) -> bool:
    pool = PinnedRingBuffer(PoolSettings(device=DEV, num_slots=2, slot_bytes=1 << 16))
    consumer = torch.cuda.Stream(DEV)
    if register:
        pool.register_consumer_stream(consumer)
    with pool.stage() as st:
        view = st.put(list(range(4097)), torch.int32)
    staged = torch.cuda.Event()
    staged.record()
    with torch.cuda.stream(consumer):
        consumer.wait_event(staged)
        torch.cuda._sleep(50 * SLEEP_CYCLES)  # the consumer lags far behind the staging stream
        late = view.clone()
    for _ in range(4):  # the host laps the ring: slot 0's device region is staged into again
        with pool.stage() as st:
            st.put([-1] * 4097, torch.int32)
    torch.cuda.synchronize()
    return bool(torch.equal(late.cpu(), torch.arange(4097, dtype=torch.int32)))


def test_registered_consumer_stream_is_protected() -> None:
    """Catches a device region overwritten while another stream's queued kernel still reads it (rule 2)."""
    assert _consumer_reads_late(register=True)


def test_control_unregistered_consumer_stream_sees_overwritten_data() -> None:
    """Catches a consumer test that would pass even without the guard."""
    assert not _consumer_reads_late(register=False)


def test_owned_stage_survives_the_ring_on_device() -> None:
    """Catches owned data aliasing the ring mirror (rule 4)."""
    pool = PinnedRingBuffer(PoolSettings(device=DEV, num_slots=2, slot_bytes=1 << 16))
    with pool.stage(owned=4 * 999) as st:
        kept = st.put(list(range(999)), torch.int32)
    for _ in range(6):
        with pool.stage() as st2:
            st2.put([-7] * 999, torch.int32)
    assert kept.cpu().tolist() == list(range(999))
    assert kept.data_ptr() < pool.device_mirror.data_ptr() or kept.data_ptr() >= pool.device_mirror.data_ptr() + (
        pool.settings.total_bytes
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_debug_poison_shows_on_device(dtype: torch.dtype) -> None:
    """Catches a stale device view that reads plausible old data in debug mode."""
    pool = PinnedRingBuffer(PoolSettings(device=DEV, num_slots=2, slot_bytes=4096, debug=True))
    with pool.stage() as st:
        stale = st.put([1] * 16, dtype)
    for _ in range(2):
        with pool.stage() as st:
            st.put([2], dtype)
    tail = stale[1:].cpu()
    assert bool(torch.isnan(tail).all()) if dtype.is_floating_point else bool((tail == -1).all())
