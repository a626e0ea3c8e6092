"""Property tests of the ring against a simulated GPU that lags a random number of ops.

``LaggingGpu`` records a race whenever a copy's host source changed between enqueue and
execution (rule 1), and a mismatch whenever a queued "kernel" read a device
view that did not hold the staged values (values intact, rule 2 in stream order).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pinpool import PinnedRingBuffer, PoolSettings
from pinpool.testing import LaggingGpu
from tests.fakes import UnfencedTransport

DTYPES = [torch.float32, torch.int32, torch.int64, torch.float16, torch.uint8, torch.float64, torch.bool, torch.int8]


class Boom(Exception):
    pass


def random_values(rng: np.random.Generator, dtype: torch.dtype, n: int) -> np.ndarray[Any, Any]:
    if dtype == torch.bool:
        return rng.integers(0, 2, n).astype(np.bool_)
    if dtype.is_floating_point:
        return rng.standard_normal(n).astype(
            {torch.float32: np.float32, torch.float16: np.float16}.get(dtype, np.float64)
        )
    info = torch.iinfo(dtype)
    return rng.integers(max(info.min, -(2**40)), min(info.max, 2**40), n, endpoint=True).astype(
        {torch.int32: np.int32, torch.int64: np.int64, torch.uint8: np.uint8, torch.int8: np.int8}[dtype]
    )


stage_plan = st.lists(
    st.tuples(
        st.lists(st.tuples(st.sampled_from(DTYPES), st.integers(0, 60), st.booleans()), max_size=5),
        st.sampled_from(["ok", "ok", "ok", "raise", "owned"]),
        st.integers(0, 10),  # how many later stages the check waits
    ),
    min_size=1,
    max_size=40,
)


def run_plan(pool: PinnedRingBuffer, gpu: LaggingGpu, plan: list[Any], seed: int) -> None:
    rng = np.random.default_rng(seed)
    num_slots = pool.settings.num_slots
    waiting: deque[tuple[int, list[tuple[torch.Tensor, np.ndarray[Any, Any]]]]] = deque()
    committed = 0
    for stage_index, (puts, mode, delay) in enumerate(plan):
        staged: list[tuple[torch.Tensor, np.ndarray[Any, Any]]] = []
        try:
            owned = 4096 if mode == "owned" else None
            with pool.stage(owned=owned) as stage:
                for dtype, n, as_list in puts:
                    values = random_values(rng, dtype, n)
                    source = values.tolist() if as_list else values
                    staged.append((stage.put(source, dtype), values))
                if mode == "raise":
                    raise Boom
        except Boom:
            continue
        if stage.used_bytes:
            committed += 1
        # A consumer may read a ring view until num_slots - 1 further stages committed.
        wait = 0 if mode == "owned" else min(delay, num_slots - 1)
        waiting.append((committed + wait, staged))
        while waiting and waiting[0][0] <= committed:
            for view, values in waiting.popleft()[1]:
                gpu.enqueue_check(view, values, f"stage {stage_index}")
    for _, batch in waiting:
        for view, values in batch:
            gpu.enqueue_check(view, values, "tail")
    gpu.drain()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=stage_plan, num_slots=st.integers(2, 6), max_lag=st.integers(0, 40), seed=st.integers(0, 2**16))
def test_no_race_and_every_value_arrives(plan: list[Any], num_slots: int, max_lag: int, seed: int) -> None:
    """Catches a slot reused while its copy is pending, or a value that lands corrupted."""
    gpu = LaggingGpu(max_lag=max_lag, seed=seed)
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=num_slots, slot_bytes=4096), transport=gpu)
    run_plan(pool, gpu, plan, seed)
    assert gpu.races == []
    assert gpu.mismatches == []
    stats = pool.stats()
    assert stats.copies == sum(1 for puts, mode, _ in plan if mode != "raise" and any(n for _, n, _ in puts))
    assert stats.host_allocations == 1


def test_the_simulator_catches_a_ring_without_fences() -> None:
    """Catches a detector that cannot fail: an unguarded ring must show races (the design's 59/60)."""
    gpu = LaggingGpu(max_lag=40, seed=3)
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=4096), transport=UnfencedTransport(gpu))
    plan = [([(torch.int32, 16, False)], "ok", 0)] * 60
    run_plan(pool, gpu, plan, seed=1)
    assert gpu.races, "an unguarded ring under lag must be caught"


def test_stalls_are_counted_and_timed_when_the_gpu_lags() -> None:
    """Catches a host wait that is not counted (rule 1's wait must be visible in stats)."""
    gpu = LaggingGpu(max_lag=1000, seed=0)  # the "GPU" never catches up on its own
    gpu.frozen = True  # the "GPU" never catches up on its own
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=256), transport=gpu)
    for _ in range(10):
        with pool.stage() as stage:
            stage.put([1, 2, 3], torch.int32)
    stats = pool.stats()
    assert stats.stalls == 8 == gpu.host_waits
    assert stats.stall_seconds >= 0.0 and stats.max_stall_seconds <= stats.stall_seconds
    gpu.drain()
    assert gpu.races == []


@pytest.mark.parametrize("num_slots", [2, 5])
def test_views_read_just_before_recycle_are_intact(num_slots: int) -> None:
    """Catches an off-by-one in the ring's lifetime promise (valid for num_slots - 1 more stages)."""
    gpu = LaggingGpu(max_lag=0, seed=0)
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=num_slots, slot_bytes=256), transport=gpu)
    plan = [([(torch.int64, 4, True)], "ok", num_slots - 1)] * (3 * num_slots)
    run_plan(pool, gpu, plan, seed=5)
    assert gpu.mismatches == []
