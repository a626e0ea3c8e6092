"""Owned device memory comes from the pool of the stream that writes it first."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pinpool import transport


class _Stream:
    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id


@pytest.mark.parametrize(("stage_stream", "entered"), [(None, False), (7, False), (9, True)])
def test_alloc_device_enters_the_stream_only_when_it_is_not_the_current_one(
    monkeypatch: pytest.MonkeyPatch, stage_stream: int | None, entered: bool
) -> None:
    """Catches an owned allocation taken from the current stream's pool while another stream
    writes it (the context skipped for a side stream), or the costly context entered for the
    current stream, where the allocation lands in the same pool without it."""
    entries: list[Any] = []

    @contextlib.contextmanager
    def fake_stream(stream: Any) -> Iterator[None]:
        entries.append(stream)
        yield

    monkeypatch.setattr(transport, "_current_stream_of", lambda index: (7, index, 1))
    monkeypatch.setattr(torch.cuda, "stream", fake_stream)
    monkeypatch.setattr(torch, "empty", lambda *a, **k: ("empty", a, k["device"]))
    cuda = transport.CudaTransport(torch.device("cuda", 1))
    stream = None if stage_stream is None else _Stream(stage_stream)
    got = cuda.alloc_device(64, stream)  # type: ignore[arg-type]
    assert got == ("empty", (64,), torch.device("cuda", 1))
    assert entries == ([stream] if entered else [])
