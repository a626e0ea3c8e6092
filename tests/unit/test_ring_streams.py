"""The ring's stream and device rules against the stream-aware simulator.

Each plan picks streams at random: the stream of each stage (passed, or the current one
at open), the current stream at close, the reader of each staged slice (the stage's own
stream or a registered consumer), the stream of each read-back, and the current device.
The simulator runs every stream behind the host by its own random amount, so a rule
that leans on "the GPU is probably done" shows up as a race or a wrong value.

The controls plant the two bugs the rules exist for and must be caught:
- case 1: the stream is not fixed at open (the fence follows the current stream at
  close, so it can pass while the copy still waits on a lagging stream);
- case 2: no hand-off when a slot changes stream (a reader still queued on the previous
  stage's stream sees the next stage's values).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pinpool import DeviceMismatchError, Field, Layout, PinnedRingBuffer, PoolSettings
from pinpool import cuda as transport_module
from pinpool.cuda import CudaTransport
from pinpool.stage import Placement, Stage
from pinpool.testing import LaggingGpu, SimStream
from pinpool.transport import Stream

Read = tuple[int, Callable[[], None]]


class NoHandOffRing(PinnedRingBuffer):
    """Planted bug (case 2): a slot changes stream without the new stream waiting for the old.

    The ring is told, before each claim, that the slot's last user was the claiming stream
    itself, so the claim sees no change of stream and makes no device-side wait.
    """

    def _claim(self, stream: Stream, placement: Placement, *, writes_mirror: bool) -> int:
        self._slots[self._next_slot].last_user = stream
        return super()._claim(stream, placement, writes_mirror=writes_mirror)


class StreamAtCloseRing(PinnedRingBuffer):
    """Planted bug (case 1): the stage's stream is taken again at the copy and at close, as "whatever is current"."""

    def _issue_copy(self, st: Stage) -> None:
        st.stream = self._transport.resolve_stream(None)
        super()._issue_copy(st)

    def _finish(self, st: Stage, ok: bool) -> None:
        st.stream = self._transport.resolve_stream(None)
        super()._finish(st, ok)


def run_plan(
    ring: type[PinnedRingBuffer], seed: int, num_slots: int, max_lag: int, steps: int = 40
) -> tuple[LaggingGpu, list[str]]:
    """Run one random multi-stream plan; returns the simulator and read-back mismatches."""
    rng = random.Random(seed)
    gpu = LaggingGpu(max_lag=max_lag, seed=seed, devices=2)
    streams: list[SimStream] = [gpu.current_stream(0)]
    streams += [gpu.new_stream(f"s{i}") for i in range(1, rng.randint(2, 3) + 1)]
    gpu.set_current(gpu.new_stream("other-device", device_index=1))
    settings = PoolSettings(
        device="cpu", num_slots=num_slots, slot_bytes=1024, debug=rng.random() < 0.2, zero_copy=True
    )
    pool = ring(settings, transport=gpu)
    consumers = rng.sample(streams, rng.randint(0, 2))
    for consumer in consumers:
        pool.register_consumer_stream(consumer)
    reads: list[Read] = []
    bad_readbacks: list[str] = []
    for step in range(steps):
        fire_due(reads, pool.claims)
        gpu.current_device = rng.choice([0, 1])  # rule 8: the pool must not follow it
        gpu.set_current(rng.choice(streams))
        if rng.random() < 0.75:
            stage_step(pool, gpu, rng, streams, consumers, reads, step)
        else:
            readback_step(pool, gpu, rng, streams, reads, bad_readbacks, step)
    fire_due(reads, 1 << 60)
    gpu.drain()
    return gpu, bad_readbacks


def fire_due(reads: list[Read], claims: int) -> None:
    due = [r for r in reads if r[0] <= claims]
    reads[:] = [r for r in reads if r[0] > claims]
    for _, read in due:
        read()


class Abort(Exception):
    pass


#: A decode step's declared layout: ``stage_step``'s "layout" stages land it in the ring's mirror.
LAYOUT = Layout([Field("ids", torch.int64, pad=-1), Field("temps", torch.float32, pad=0.5)], max_rows=24)


def put_layout(stage: Stage, rng: random.Random) -> list[tuple[torch.Tensor, np.ndarray[Any, Any]]]:
    """Each field's live rows, as a list or an array; returns every field's view with its padded values."""
    staged = []
    for name, dtype, pad in (("ids", np.int64, -1), ("temps", np.float32, 0.5)):
        live = np.array([rng.randint(-(2**20), 2**20) for _ in range(stage.live)], dtype=dtype)
        stage.put(name, live.tolist() if rng.random() < 0.5 else live)
        padded = np.concatenate([live, np.full(stage.rows - stage.live, pad, dtype=dtype)])
        staged.append((stage.views[name], padded))
    return staged


def stage_step(
    pool: PinnedRingBuffer,
    gpu: LaggingGpu,
    rng: random.Random,
    streams: list[SimStream],
    consumers: list[SimStream],
    reads: list[Read],
    step: int,
) -> None:
    """One stage: plain, aborted (maybe after its flush), owned, with a read-back inside, a declared
    layout in the ring, or read in place (its readers launched inside the stage)."""
    kind = rng.choice(["plain", "plain", "plain", "abort", "owned", "readback", "layout", "in place"])
    staged: list[tuple[torch.Tensor, np.ndarray[Any, Any]]] = []
    stream = rng.choice(streams) if rng.random() < 0.5 else None
    if kind == "layout":
        rows = rng.randint(1, LAYOUT.max_rows)
        opened = pool.stage(LAYOUT, rows=rows, live=rng.randint(0, rows), stream=stream)
    else:
        opened = pool.stage(stream=stream, owned=1024 if kind == "owned" else None, zero_copy=kind == "in place")
    try:
        with opened as stage:
            if kind == "layout":
                staged += put_layout(stage, rng)
            for _ in range(rng.randint(0, 3) if kind != "layout" else 0):
                values = np.array([rng.randint(-(2**40), 2**40) for _ in range(rng.randint(1, 24))], dtype=np.int64)
                staged.append((stage.put(values.tolist(), torch.int64), values))
            if kind == "in place":
                # Read in place: the readers go before close, on the stage's stream or a consumer,
                # and close is called under one of them (debug refuses any other).
                for view, values in staged:
                    reader = rng.choice([stage.stream, *consumers])
                    gpu.enqueue_check(view, values, f"step {step} in-place read on {reader.name}", reader)
                gpu.set_current(rng.choice([stage.stream, *consumers]))
                return
            if rng.random() < 0.3:
                stage.flush()
            if kind == "readback":
                src = torch.zeros(4, dtype=torch.int64)
                want = torch.tensor([rng.randint(0, 2**40) for _ in range(4)], dtype=torch.int64)
                gpu.enqueue_write(src, want, stage.stream)
                handle = stage.readback(src)
                gpu.enqueue_write(src, want + 1, stage.stream)
            gpu.set_current(rng.choice(streams))  # the current stream at close need not be the stage's
            if kind == "abort":
                raise Abort
    except Abort:
        return
    copied = gpu.new_fence()
    copied.record(stage.stream)
    limit = pool.claims + pool.settings.num_slots - 1  # rule 2's lifetime, in claims
    for view, values in staged:
        reader = rng.choice([stage.stream, *consumers])

        def read(view: torch.Tensor = view, values: np.ndarray[Any, Any] = values, reader: SimStream = reader) -> None:
            if reader is not stage.stream:
                gpu.stream_wait(reader, copied)  # the consumer's own ordering after the copy
            gpu.enqueue_check(view, values, f"step {step} read on {reader.name}", reader)

        reads.append((rng.randint(pool.claims, limit), read))
    if kind == "readback":

        def read_back() -> None:
            got = handle.values()
            if not np.array_equal(got, want.numpy()):
                gpu.mismatches.append(f"step {step}: stage read-back {got.tolist()}, expected {want.tolist()}")

        reads.append((rng.randint(pool.claims, limit), read_back))


def readback_step(
    pool: PinnedRingBuffer,
    gpu: LaggingGpu,
    rng: random.Random,
    streams: list[SimStream],
    reads: list[Read],
    bad: list[str],
    step: int,
) -> None:
    producer = rng.choice(streams)
    src = torch.zeros(rng.randint(1, 16), dtype=torch.int64)
    want = torch.tensor([rng.randint(0, 2**40) for _ in range(src.numel())], dtype=torch.int64)
    gpu.enqueue_write(src, want, producer)
    if rng.random() < 0.5:
        handle = pool.readback(src, stream=producer)
    else:
        gpu.set_current(producer)
        handle = pool.readback(src)
    gpu.enqueue_write(src, want + 1, producer)  # the producer moves on: a late copy would see this

    def read() -> None:
        got = handle.values()
        if not np.array_equal(got, want.numpy()):
            bad.append(f"step {step}: read back {got[:4]}, expected {want[:4].tolist()}")

    reads.append((rng.randint(pool.claims, pool.claims + pool.settings.num_slots - 1), read))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**20), num_slots=st.integers(2, 5), max_lag=st.integers(0, 30))
def test_any_mix_of_streams_keeps_every_value_intact(seed: int, num_slots: int, max_lag: int) -> None:
    """Catches a stage, reader or read-back on one stream that another stream's work overtakes."""
    gpu, bad_readbacks = run_plan(PinnedRingBuffer, seed, num_slots, max_lag)
    assert gpu.races == []
    assert gpu.mismatches == []
    assert bad_readbacks == []
    assert gpu.errors == []


def _failures(ring: type[PinnedRingBuffer]) -> list[str]:
    found: list[str] = []
    for seed in range(60):
        gpu, bad = run_plan(ring, seed, num_slots=2 + seed % 3, max_lag=30)
        found += gpu.races + gpu.mismatches + bad
    return found


def test_control_without_the_hand_off_a_reader_on_the_old_stream_sees_new_values() -> None:
    """Catches a property test that cannot see case 2: it must fail once the hand-off is gone."""
    found = _failures(NoHandOffRing)
    assert any("expected" in f for f in found), "the plans never exposed a missing hand-off"


def test_control_with_the_stream_taken_at_close_the_copy_races_its_slot() -> None:
    """Catches a property test that cannot see case 1: it must fail once the stream is not fixed at open."""
    found = _failures(StreamAtCloseRing)
    assert any("rewritten by the host" in f for f in found), "the plans never exposed a fence on the wrong stream"


# -- the rules, one at a time -------------------------------------------------------------
def _pool(gpu: LaggingGpu, num_slots: int = 2) -> PinnedRingBuffer:
    return PinnedRingBuffer(PoolSettings(device="cpu", num_slots=num_slots, slot_bytes=256), transport=gpu)


def test_the_stream_is_fixed_at_open_whatever_is_current_at_close() -> None:
    """Catches a copy or fence issued on the stream current at close instead of the stage's (case 1)."""
    gpu = LaggingGpu(max_lag=0)
    s1, s2 = gpu.new_stream("s1"), gpu.new_stream("s2")
    gpu.set_current(s1)
    pool = _pool(gpu)
    with pool.stage() as stage:
        stage.put([1, 2, 3], torch.int32)
        gpu.set_current(s2)
    assert stage.stream is s1
    assert gpu.calls == [("cudaMemcpyAsync", "s1"), ("cudaEventRecord", "s1")]


def test_a_change_of_stream_waits_on_the_device_for_the_slots_previous_stream() -> None:
    """Catches case 2: the next user of a slot on another stream must wait for the old stream's queued work."""
    gpu = LaggingGpu(max_lag=0)
    s1, s2 = gpu.new_stream("s1"), gpu.new_stream("s2")
    pool = _pool(gpu, num_slots=2)
    for stream in (s1, s1):  # slots 0 and 1 used on s1
        with pool.stage(stream=stream) as stage:
            stage.put([1], torch.int32)
    gpu.calls.clear()
    with pool.stage(stream=s2) as stage:  # slot 0 again, now on s2
        stage.put([2], torch.int32)
    assert gpu.calls == [
        ("cudaEventRecord", "s1"),  # the hand-off, recorded on the old stream at claim time
        ("cudaStreamWaitEvent", "s2"),
        ("cudaMemcpyAsync", "s2"),
        ("cudaEventRecord", "s2"),
    ]
    assert gpu.host_waits == 0


def test_a_stage_on_an_unchanged_stream_makes_no_extra_call() -> None:
    """Catches a guard that costs CUDA calls when nothing changed: one copy and one record per stage."""
    gpu = LaggingGpu(max_lag=3)
    pool = _pool(gpu, num_slots=3)
    for i in range(20):
        with pool.stage() as stage:
            stage.put([i], torch.int64)
    assert gpu.calls == [("cudaMemcpyAsync", "default:0"), ("cudaEventRecord", "default:0")] * 20
    assert gpu.stream_waits == 0


def test_read_backs_follow_the_same_stream_rules() -> None:
    """Catches a read-back that fences on the wrong stream or skips the hand-off on a change of stream."""
    gpu = LaggingGpu(max_lag=0)
    s1, s2 = gpu.new_stream("s1"), gpu.new_stream("s2")
    pool = _pool(gpu, num_slots=2)
    src = torch.arange(4, dtype=torch.int64)
    gpu.set_current(s1)
    pool.readback(src)
    with pool.stage(stream=s1) as stage:
        stage.put([1], torch.int32)
    gpu.calls.clear()
    gpu.set_current(s2)
    pool.readback(src)  # slot 0 again, last used on s1
    assert gpu.calls == [
        ("cudaEventRecord", "s1"),
        ("cudaStreamWaitEvent", "s2"),
        ("cudaMemcpyAsync", "s2"),
        ("cudaEventRecord", "s2"),
    ]


def test_the_cuda_transport_asks_for_the_pool_devices_current_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches rule 8 on the CUDA path: "the current stream" taken from the current device, not the pool's."""
    asked: list[int] = []

    def current_stream_of(index: int) -> tuple[int, int, int]:
        asked.append(index)
        return (100 + index, index, 1)

    class FakeStream:
        def __init__(self, stream_id: int, device_index: int, device_type: int) -> None:
            self.stream_id, self.device_index = stream_id, device_index

    monkeypatch.setattr(transport_module, "_current_stream_of", current_stream_of)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    transport = CudaTransport(torch.device("cuda", 1))  # constructing it touches no GPU
    stream = transport.resolve_stream(None)
    assert asked == [1]
    assert (stream.stream_id, stream.device_index) == (101, 1)
    assert transport.resolve_stream(None) is stream  # unchanged stream: the same object, so ``is`` settles it


def test_the_first_stage_on_another_stream_waits_for_the_mirrors_allocation_stream() -> None:
    """Catches a first copy on a side stream into a mirror block whose previous owner may still be read there."""
    gpu = LaggingGpu(max_lag=0)
    side = gpu.new_stream("side")
    pool = _pool(gpu)  # allocated while default:0 is current
    with pool.stage(stream=side) as stage:
        stage.put([1], torch.int32)
    assert gpu.calls[:2] == [("cudaEventRecord", "default:0"), ("cudaStreamWaitEvent", "side")]


def test_close_waits_for_readers_queued_after_a_stages_fence() -> None:
    """Catches teardown that frees the mirror while a kernel queued on the stage's stream still reads it."""
    gpu = LaggingGpu(max_lag=0)
    s1 = gpu.new_stream("s1")
    pool = _pool(gpu)
    with pool.stage(stream=s1) as stage:
        view = stage.put([3, 4], torch.int32)
    gpu.drain()
    gpu.frozen = True
    gpu.enqueue_check(view, np.array([3, 4], dtype=np.int32), "late reader", s1)
    pool.close()
    assert gpu.pending == 0, "close() returned with a reader of the mirror still queued"
    assert gpu.mismatches == []


def test_a_stream_of_another_device_is_refused_before_anything_is_claimed() -> None:
    """Catches a stage queued on another device's stream (CUDA's invalid resource handle, or worse)."""
    gpu = LaggingGpu(devices=2)
    pool = _pool(gpu)
    with pytest.raises(DeviceMismatchError, match="'stream' must be on the pool's device 0"):
        pool.stage(stream=gpu.new_stream("dev1", device_index=1))
    assert pool.claims == 0 and gpu.calls == []
