"""Zero-copy stages against the stream-aware simulator: the slot is reused only after its readers.

In the simulator a zero-copy view *is* the pinned slot, so a queued reader reads the host
bytes when it runs, as a kernel reading pinned memory through UVA does. Each plan mixes
zero-copy stages with copy stages and read-backs on random streams (stage, reader,
consumer, current stream at close, current device) and lets every stream lag by its own
random amount; a reader that runs after the host rewrote its slot reports a mismatch.

The controls plant the bugs the zero-copy fence exists for and must be caught:
- the fence moved before the readers (recorded at open, as if the stage were a copy);
- registered consumers left out of the fence (readers on them not covered).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pinpool import Field, Layout, PinnedRingBuffer, PoolSettings, PoolStateError, StaleLeaseError
from pinpool.exceptions import PlatformError, UnguardedReaderError
from pinpool.platform import PlatformReport
from pinpool.stage import Placement, Stage
from pinpool.testing import LaggingGpu, SimStream
from pinpool.transport import Stream
from tests.unit.test_ring_streams import Read, fire_due, readback_step, stage_step


class FenceAtOpenRing(PinnedRingBuffer):
    """Planted bug: the zero-copy fence recorded when the stage opens, before its readers are launched
    (the close's record goes to a throwaway event)."""

    def _open_stage(self, stream: Stream | None, placement: Placement, *args: Any, **kw: Any) -> Stage:
        opened = super()._open_stage(stream, placement, *args, **kw)
        if placement is Placement.IN_PLACE:
            self._slots[opened.slot].fence.record(opened.stream)
        return opened

    def _finish(self, st_: Stage, ok: bool) -> None:
        if st_.placement is not Placement.IN_PLACE:
            super()._finish(st_, ok)
            return
        fence, self._slots[st_.slot].fence = self._slots[st_.slot].fence, self._transport.new_fence()
        try:
            super()._finish(st_, ok)
        finally:
            self._slots[st_.slot].fence = fence


class ConsumersUncoveredRing(PinnedRingBuffer):
    """Planted bug: the zero-copy fence covers the stage's stream only, not registered consumers."""

    def _finish(self, st_: Stage, ok: bool) -> None:
        if st_.placement is not Placement.IN_PLACE:
            super()._finish(st_, ok)
            return
        consumers, self._consumers = self._consumers, []
        try:
            super()._finish(st_, ok)
        finally:
            self._consumers = consumers


def zero_copy_step(
    pool: PinnedRingBuffer,
    gpu: LaggingGpu,
    rng: random.Random,
    streams: list[SimStream],
    consumers: list[SimStream],
    step: int,
) -> None:
    """One zero-copy stage; its readers are launched before close, interleaved with the puts."""
    with pool.stage(zero_copy=True, stream=rng.choice(streams) if rng.random() < 0.5 else None) as stage:
        for _ in range(rng.randint(0, 3)):
            values = np.array([rng.randint(-(2**40), 2**40) for _ in range(rng.randint(1, 24))], dtype=np.int64)
            view = stage.put(values.tolist(), torch.int64)
            for _ in range(rng.randint(0, 2)):
                reader = rng.choice([stage.stream, *consumers])
                gpu.enqueue_check(view, values, f"step {step} zero-copy read on {reader.name}", reader)
        if rng.random() < 0.3:
            stage.flush()
        gpu.set_current(rng.choice(streams))  # the current stream at close need not be the stage's


def run_plan(
    ring: type[PinnedRingBuffer], seed: int, num_slots: int, max_lag: int, steps: int = 40
) -> tuple[LaggingGpu, list[str]]:
    """One random plan of zero-copy stages, copy stages and read-backs on random streams."""
    rng = random.Random(seed)
    gpu = LaggingGpu(max_lag=max_lag, seed=seed, devices=2)
    streams: list[SimStream] = [gpu.current_stream(0)]
    streams += [gpu.new_stream(f"s{i}") for i in range(1, rng.randint(2, 3) + 1)]
    gpu.set_current(gpu.new_stream("other-device", device_index=1))
    settings_ = PoolSettings(device="cpu", num_slots=num_slots, slot_bytes=1024, zero_copy=True)
    pool = ring(settings_, transport=gpu)
    consumers = rng.sample(streams, rng.randint(0, 2))
    for consumer in consumers:
        pool.register_consumer_stream(consumer)
    reads: list[Read] = []
    bad_readbacks: list[str] = []
    for step in range(steps):
        fire_due(reads, pool.claims)
        gpu.current_device = rng.choice([0, 1])
        gpu.set_current(rng.choice(streams))
        kind = rng.random()
        if kind < 0.6:
            zero_copy_step(pool, gpu, rng, streams, consumers, step)
        elif kind < 0.85:
            stage_step(pool, gpu, rng, streams, consumers, reads, step)
        else:
            readback_step(pool, gpu, rng, streams, reads, bad_readbacks, step)
    fire_due(reads, 1 << 60)
    gpu.drain()
    return gpu, bad_readbacks


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**20), num_slots=st.integers(2, 5), max_lag=st.integers(0, 30))
def test_zero_copy_readers_always_see_their_values_among_copies_and_read_backs(
    seed: int, num_slots: int, max_lag: int
) -> None:
    """Catches a zero-copy slot rewritten by the host while a reader on any stream is still queued."""
    gpu, bad_readbacks = run_plan(PinnedRingBuffer, seed, num_slots, max_lag)
    assert gpu.races == []
    assert gpu.mismatches == []
    assert bad_readbacks == []
    assert gpu.errors == []


def _zero_copy_failures(ring: type[PinnedRingBuffer]) -> list[str]:
    found: list[str] = []
    for seed in range(60):
        gpu, _ = run_plan(ring, seed, num_slots=2 + seed % 3, max_lag=30)
        found += [m for m in gpu.mismatches if "zero-copy read" in m]
    return found


def test_control_with_the_fence_before_the_readers_a_reader_sees_the_next_stage() -> None:
    """Catches a property test that cannot see a fence recorded before the readers: it must fail then."""
    assert _zero_copy_failures(FenceAtOpenRing), "the plans never exposed a fence ahead of its readers"


def test_control_with_consumers_left_out_of_the_fence_a_consumer_reader_sees_the_next_stage() -> None:
    """Catches a property test that cannot see a consumer stream missing from the zero-copy fence."""
    found = _zero_copy_failures(ConsumersUncoveredRing)
    assert found, "the plans never exposed an uncovered consumer"


# -- the rules, one at a time -------------------------------------------------------------
def _pool(gpu: LaggingGpu, num_slots: int = 2, **kw: bool) -> PinnedRingBuffer:
    return PinnedRingBuffer(
        PoolSettings(device="cpu", num_slots=num_slots, slot_bytes=256, zero_copy=True, **kw), transport=gpu
    )


def test_a_zero_copy_stage_issues_no_copy_and_fences_after_the_readers() -> None:
    """Catches a copy issued anyway, or the fence recorded before the kernels launched inside the stage."""
    gpu = LaggingGpu(max_lag=0)
    pool = _pool(gpu)
    with pool.stage(zero_copy=True) as stage:
        view = stage.put([1, 2, 3], torch.int32)
        gpu.enqueue_check(view, np.array([1, 2, 3], dtype=np.int32), "reader")
    assert stage.placement is Placement.IN_PLACE
    assert view.data_ptr() == pool.host_slab.data_ptr()  # the view is the pinned slot itself
    assert gpu.calls == [("kernel", "default:0"), ("cudaEventRecord", "default:0")]
    stats = pool.stats()
    assert (stats.copies, stats.stages, stats.zero_copy_stages) == (0, 1, 1)


def test_a_registered_consumer_is_covered_on_the_device_not_by_a_host_wait() -> None:
    """Catches consumer readers left out of the zero-copy fence, or covered by a host wait."""
    gpu = LaggingGpu(max_lag=0)
    side = gpu.new_stream("side")
    pool = _pool(gpu)
    pool.register_consumer_stream(side)
    gpu.calls.clear()
    with pool.stage(zero_copy=True) as stage:
        stage.put([1], torch.int32)
    assert gpu.calls == [
        ("cudaEventRecord", "side"),
        ("cudaStreamWaitEvent", "default:0"),
        ("cudaEventRecord", "default:0"),
    ]
    assert gpu.host_waits == 0


def test_reuse_waits_for_a_lagging_reader_of_a_zero_copy_slot() -> None:
    """Catches the host rewriting a zero-copy slot while its reader still waits to run (rule 1)."""
    gpu = LaggingGpu(max_lag=0)
    pool = _pool(gpu, num_slots=2)
    gpu.frozen = True  # the device runs nothing until the host waits
    with pool.stage(zero_copy=True) as stage:
        view = stage.put([7] * 8, torch.int64)
        gpu.enqueue_check(view, np.full(8, 7), "first reader")
    for i in range(2):  # the second of these reuses the first stage's slot
        with pool.stage(zero_copy=True) as stage:
            stage.put([i] * 8, torch.int64)
    gpu.frozen = False
    gpu.drain()
    assert gpu.mismatches == []
    assert pool.stats().stalls == 1


def test_a_copy_stage_after_a_zero_copy_one_keeps_the_mirror_hand_off() -> None:
    """Catches a zero-copy claim overwriting the slot's last mirror user, so a later copy skips its hand-off."""
    gpu = LaggingGpu(max_lag=0)
    s1, s2 = gpu.new_stream("s1"), gpu.new_stream("s2")
    pool = _pool(gpu, num_slots=2)
    for stream in (s1, s1):  # copy stages on s1 in slots 0 and 1
        with pool.stage(stream=stream) as stage:
            stage.put([1], torch.int32)
    with pool.stage(zero_copy=True, stream=s2) as stage:  # slot 0, zero-copy on s2
        stage.put([2], torch.int32)
    with pool.stage(stream=s2) as stage:  # slot 1
        stage.put([3], torch.int32)
    gpu.calls.clear()
    with pool.stage(stream=s2) as stage:  # slot 0 again: its mirror was last written on s1
        stage.put([4], torch.int32)
    assert gpu.calls[:2] == [("cudaEventRecord", "s1"), ("cudaStreamWaitEvent", "s2")]


def test_an_aborted_zero_copy_stage_is_still_fenced() -> None:
    """Catches an exception inside the stage skipping the fence while kernels launched before it read the slot."""
    gpu = LaggingGpu(max_lag=0)
    pool = _pool(gpu)
    with pytest.raises(RuntimeError, match="boom"), pool.stage(zero_copy=True) as stage:
        stage.put([1], torch.int32)
        raise RuntimeError("boom")
    assert gpu.calls[-1] == ("cudaEventRecord", "default:0")
    assert pool.stats().aborted_stages == 1


def test_views_are_live_only_while_the_stage_is_open() -> None:
    """Catches a zero-copy view reported usable after close, when no fence covers a new reader."""
    pool = _pool(LaggingGpu())
    with pool.stage(zero_copy=True) as stage:
        stage.put([1], torch.int32)
        stage.check_live()
    assert not stage.is_live
    with pytest.raises(StaleLeaseError, match="used after its stage closed"):
        stage.check_live()


def test_debug_refuses_a_close_under_an_unregistered_stream() -> None:
    """Catches readers launched on an unregistered side stream going unflagged in debug mode."""
    gpu = LaggingGpu(max_lag=0)
    side = gpu.new_stream("side")
    pool = _pool(gpu, debug=True)
    with pytest.raises(UnguardedReaderError, match="neither the stage's stream"), pool.stage(zero_copy=True) as st_:
        st_.put([1], torch.int32)
        gpu.set_current(side)
    pool.register_consumer_stream(side)
    with pool.stage(zero_copy=True) as st_:  # registered: covered, so accepted
        st_.put([1], torch.int32)


def test_zero_copy_needs_the_setting_and_a_passing_platform_check() -> None:
    """Catches zero-copy views handed out without the check, or on a platform that failed it."""
    with pytest.raises(PoolStateError, match=r"PoolSettings\(zero_copy=True\)"):
        PinnedRingBuffer(PoolSettings(device="cpu", slot_bytes=256)).stage(zero_copy=True)

    class RefusingGpu(LaggingGpu):
        def check_zero_copy(self, host_slab: torch.Tensor) -> tuple[PlatformReport, torch.Tensor | None]:
            return PlatformReport(checked=True, zero_copy_ok=False, reason="the slab is not page-locked"), None

    pool = _pool(RefusingGpu())
    with pytest.raises(PlatformError, match="refused on cpu: the slab is not page-locked"):
        pool.stage(zero_copy=True)
    assert pool.claims == 0
    with pool.stage() as stage:  # copy stages still work
        stage.put([1], torch.int32)
    assert pool.stats().platform.zero_copy_ok is False


def test_zero_copy_and_owned_are_refused_together() -> None:
    """Catches an owned zero-copy stage silently reading the ring (owned data must outlive it)."""
    with pytest.raises(PoolStateError, match="either 'zero_copy=True' or 'owned'"):
        _pool(LaggingGpu()).stage(zero_copy=True, owned=64)


def test_the_host_path_reads_the_slab_in_place() -> None:
    """Catches the CPU fallback (rule 7) lacking zero-copy stages: same API, plain memory."""
    pool = PinnedRingBuffer(PoolSettings(device="cpu", slot_bytes=256, zero_copy=True))
    with pool.stage(zero_copy=True) as stage:
        view = stage.put([0.5, 1.5], torch.float32)
        assert view.tolist() == [0.5, 1.5]
    assert view.data_ptr() == pool.host_slab.data_ptr()
    assert pool.platform.zero_copy_ok


def test_a_read_back_inside_a_zero_copy_stage_is_fenced_after_its_copy() -> None:
    """Catches a zero-copy stage whose read-back is read before its device-to-host copy landed."""
    gpu = LaggingGpu(max_lag=4)
    pool = _pool(gpu, num_slots=3)
    src = torch.arange(4, dtype=torch.int64)
    with pool.stage(zero_copy=True) as stage:
        stage.put([1], torch.int32)
        handle = stage.readback(src)
    assert handle.tolist() == [0, 1, 2, 3]
    assert [c for c, _ in gpu.calls] == ["cudaMemcpyAsync", "cudaEventRecord", "cudaEventRecord"]


def test_a_layout_staged_in_place_is_padded_at_flush_and_never_copied() -> None:
    """Catches a layout in a zero-copy stage copied anyway, its views not the pinned slot, its padding
    rows left holding an earlier step's values, or a missing field let through (read in place, the
    device would see the older step's bytes)."""
    gpu = LaggingGpu(max_lag=0)
    pool = _pool(gpu, num_slots=2)
    layout = Layout([Field("ids", torch.int64, pad=-1), Field("temp", torch.float32, pad=1.0)], 8)
    for step in range(6):
        live = 8 if step < 2 else 3  # both slots full of values first
        with pool.stage(layout, rows=8, live=live, zero_copy=True) as stage:
            assert stage.placement is Placement.IN_PLACE
            stage.put("ids", [step] * live)
            stage.put("temp", [0.5] * live)
            stage.flush()  # padding written: readers launched from here read the whole layout
            want_ids = np.array([step] * live + [-1] * (8 - live), dtype=np.int64)
            gpu.enqueue_check(stage.views["ids"], want_ids, f"step {step} ids")
            gpu.enqueue_check(stage.views["temp"], np.array([0.5] * live + [1.0] * (8 - live), np.float32), "temp")
        base = pool.host_slab.data_ptr() + stage.slot * 256
        assert stage.views["ids"].data_ptr() == base
    gpu.drain()
    assert gpu.mismatches == [] and gpu.races == []
    with pytest.raises(PoolStateError, match=r"missing: \['temp'\]"), pool.stage(layout, rows=2, zero_copy=True) as st_:
        st_.put("ids", [1, 2])
    stats = pool.stats()
    assert (stats.copies, stats.zero_copy_stages, stats.aborted_stages) == (0, 7, 1)  # the aborted one too
