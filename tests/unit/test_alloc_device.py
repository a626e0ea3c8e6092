"""Owned device memory comes from the pool of the stream that writes it first, and the
current stream is asked for once per stage."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pinpool import PinnedRingBuffer, PoolSettings
from pinpool import cuda as transport
from pinpool.testing import LaggingGpu


@pytest.mark.parametrize("side_stream", [False, True])
def test_alloc_device_enters_a_stream_only_when_one_is_named(
    monkeypatch: pytest.MonkeyPatch, side_stream: bool
) -> None:
    """Catches an owned allocation taken from the current stream's pool while a named stream writes
    it, or the costly stream context entered for the current stream."""
    entries: list[Any] = []

    @contextlib.contextmanager
    def fake_stream(stream: Any) -> Iterator[None]:
        entries.append(stream)
        yield

    asked: list[int] = []
    monkeypatch.setattr(transport, "_current_stream_of", lambda index: asked.append(index) or (7, index, 1))
    monkeypatch.setattr(torch.cuda, "stream", fake_stream)
    monkeypatch.setattr(torch, "empty", lambda *a, **k: ("empty", a, k["device"]))
    cuda = transport.CudaTransport(torch.device("cuda", 1))
    stream = object() if side_stream else None
    assert cuda.alloc_device(64, stream) == ("empty", (64,), torch.device("cuda", 1))  # type: ignore[arg-type]
    assert entries == ([stream] if side_stream else [])
    assert asked == []  # the transport never asks what is current: its caller knows


@pytest.mark.parametrize("named", [False, True])
def test_an_owned_stage_names_its_stream_to_the_allocation_only_when_one_was_passed(named: bool) -> None:
    """Catches the ring handing the allocation a stream it resolved from "current" (the transport
    would then ask the current stream again), or dropping a stream the caller named."""
    gpu = LaggingGpu(max_lag=0)
    side = gpu.new_stream("side")
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=256), transport=gpu)
    seen: list[Any] = []  # recorded from here: the pool's own mirror was allocated above
    real = gpu.alloc_device
    gpu.alloc_device = lambda nbytes, stream=None: seen.append(stream) or real(nbytes, stream)  # type: ignore[method-assign]
    with pool.stage(owned=64, stream=side if named else None) as st:
        st.put([1, 2], torch.int32)
        assert st.stream is (side if named else gpu.current_stream())
    assert seen == [side if named else None]
