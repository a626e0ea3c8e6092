"""Staging on a stream that is capturing a CUDA graph is refused (the stream-aware simulator).

A captured copy or fence would be baked into the graph at the slot's address; every
replay would then read or write that slot after the ring has handed it to another stage:
silent corruption. The simulator records any work submitted to a stream marked as
capturing (``SimStream.capturing``), which is the control: with the guard bypassed, the
same calls leave errors there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from pinpool import DeviceBlock, Field, Layout, PinnedRingBuffer, PoolSettings, PoolStateError
from pinpool.testing import LaggingGpu, SimStream

FIELDS = (Field("step", torch.int64, pad=-1),)
#: A decode step's layout: an input and a landing.
STEP = Layout([Field("step", torch.int64, pad=-1), Field.landing("tokens")], max_rows=4)


def _pool(gpu: LaggingGpu) -> PinnedRingBuffer:
    return PinnedRingBuffer(PoolSettings(device="cpu", num_slots=3, slot_bytes=1024, zero_copy=True), transport=gpu)


def _openers(pool: PinnedRingBuffer, stream: SimStream | None) -> dict[str, Callable[[], Any]]:
    block = DeviceBlock(pool, Layout(FIELDS, max_rows=4))
    return {
        "stage": lambda: pool.stage(stream=stream),
        "layout stage": lambda: pool.stage(STEP, rows=4, live=2, stream=stream),
        "owned stage": lambda: pool.stage(stream=stream, owned=64),
        "owned layout stage": lambda: pool.stage(STEP, rows=2, stream=stream, owned=256),
        "zero-copy stage": lambda: pool.stage(stream=stream, zero_copy=True),
        "zero-copy layout stage": lambda: pool.stage(STEP, rows=2, stream=stream, zero_copy=True),
        "read-back": lambda: pool.readback(torch.arange(4), stream=stream),
        "block stage": lambda: block.stage(4, 2, stream=stream),
    }


@pytest.mark.parametrize("explicit", [False, True], ids=["current stream", "stream passed"])
@pytest.mark.parametrize(
    "kind",
    [
        "stage",
        "layout stage",
        "owned stage",
        "owned layout stage",
        "zero-copy stage",
        "zero-copy layout stage",
        "read-back",
        "block stage",
    ],
)
def test_every_way_to_stage_is_refused_on_a_capturing_stream_and_changes_nothing(kind: str, explicit: bool) -> None:
    """Catches a stage opened on a capturing stream: its copy and fence would be baked into the graph."""
    gpu = LaggingGpu(max_lag=4, seed=1, devices=2)
    pool = _pool(gpu)
    capture = gpu.new_stream("capture")
    gpu.set_current(capture)
    gpu.current_device = 1  # another device current: the pool asks of its own device's stream
    capture.capturing = True
    claims, calls = pool.claims, len(gpu.calls)
    with pytest.raises(PoolStateError, match="capturing a CUDA graph"):
        _openers(pool, capture if explicit else None)[kind]()
    assert (pool.claims, len(gpu.calls), gpu.errors) == (claims, calls, [])
    capture.capturing = False  # the capture ended: the same call works
    opened = _openers(pool, capture if explicit else None)[kind]()
    if kind != "read-back":
        opened.close(ok=False)  # opened is what this test asks; nothing needs copying
    gpu.drain()
    assert gpu.errors == []


@pytest.mark.parametrize(
    "captures", ["current stream, stage on another", "forked stream, not current"], ids=["current", "forked"]
)
def test_a_stage_is_refused_when_the_capture_runs_on_a_stream_it_would_touch(captures: str) -> None:
    """Catches a guard that asks only of the stage's stream: inside a capture body the fence
    query alone breaks the capture; and a stage on a stream forked into a capture is baked in."""
    gpu = LaggingGpu(max_lag=4, seed=2)
    pool = _pool(gpu)
    capture, side = gpu.new_stream("capture"), gpu.new_stream("side")
    gpu.set_current(capture)
    with pool.stage(stream=side) as st:  # a fence on record for the slot the refused stage would query
        st.put([1], torch.int64)
    if captures.startswith("current"):
        capture.capturing = True
    else:
        side.capturing = True  # forked into a capture running elsewhere; ``capture`` is current and idle
    claims = pool.claims
    with pytest.raises(PoolStateError, match="capturing a CUDA graph"):
        pool.stage(stream=side)
    assert (pool.claims, gpu.errors) == (claims, [])


class _Unguarded(LaggingGpu):
    """The control: a transport that never reports a capture (the guard bypassed)."""

    def capturing(self, stream: SimStream) -> bool:
        return False


@pytest.mark.parametrize("stage_on", ["capture", "side"])
def test_control_without_the_guard_the_simulator_sees_the_capture_broken(stage_on: str) -> None:
    """Shows the simulator catches a missing guard: the stage's copy and fence go to the
    capturing stream, or its fence queries run while the capture does."""
    gpu = _Unguarded(max_lag=4, seed=3)
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=1024), transport=gpu)
    capture, side = gpu.new_stream("capture"), gpu.new_stream("side")
    gpu.set_current(capture)
    for _ in range(2):  # every slot fenced once, so the next claims query a fence
        with pool.stage(stream=side) as st:
            st.put([1], torch.int64)
    capture.capturing = True
    with pool.stage(stream=capture if stage_on == "capture" else side) as st:
        st.put(np.arange(4), torch.int64)
    assert any("captures a graph" in e for e in gpu.errors)
