"""``pinpool.transport.use_stream`` against a model of torch's stream bindings (CI has no CUDA).

The model follows ``torch._C._cuda_setStream``: setting a stream makes its device current
and that stream the device's current one. ``use_stream`` must leave the current device and
every device's current stream as it found them, as ``torch.cuda.stream`` does, with any
device current, nested, and when the body raises.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest

from pinpool import transport


class FakeCuda:
    """Current device and each device's current stream id, changed only through the raw bindings."""

    def __init__(self, devices: int = 3) -> None:
        self.device = 0
        self.current = {d: 100 * d for d in range(devices)}  # stream id 100*d: device d's default

    def get_device(self) -> int:
        return self.device

    def set_device(self, index: int) -> None:
        self.device = index

    def current_stream_of(self, index: int) -> tuple[int, int, int]:
        if index == -1:  # torch: the current device's current stream
            index = self.device
        return self.current[index], index, 1

    def set_stream(self, *, stream_id: int, device_index: int, device_type: int) -> None:
        self.device = device_index  # torch switches the device to the stream's
        self.current[device_index] = stream_id

    def state(self) -> tuple[int, dict[int, int]]:
        return self.device, dict(self.current)


def stream(stream_id: int, device: int) -> Any:
    return SimpleNamespace(stream_id=stream_id, device_index=device, device_type=1)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    cuda = FakeCuda()
    monkeypatch.setattr(transport, "_set_stream", cuda.set_stream)
    monkeypatch.setattr(transport, "_get_device", cuda.get_device)
    monkeypatch.setattr(transport, "_set_device", cuda.set_device)
    monkeypatch.setattr(transport, "_current_stream_of", cuda.current_stream_of)
    return cuda


@pytest.mark.parametrize(("current", "target"), list(itertools.product(range(3), range(3))))
def test_the_stream_is_current_inside_and_everything_is_restored_after(
    fake: FakeCuda, current: int, target: int
) -> None:
    """Catches a switch that leaves another device current or another stream current after the block."""
    fake.device = current
    fake.current[target] = 100 * target + 7  # the device's current stream is not its default
    before = fake.state()
    side = stream(100 * target + 1, target)
    with transport.use_stream(side):
        assert fake.device == target and fake.current[target] == side.stream_id
    assert fake.state() == before


def test_nested_switches_on_two_devices_unwind_in_order(fake: FakeCuda) -> None:
    """Catches an inner switch on another device that restores the outer one's device or stream wrongly."""
    fake.device = 2
    before = fake.state()
    outer, inner = stream(1, 0), stream(101, 1)
    with transport.use_stream(outer):
        with transport.use_stream(inner):
            assert fake.device == 1 and fake.current[1] == 101 and fake.current[0] == 1
        assert fake.device == 0 and fake.current == {0: 1, 1: 100, 2: 200}
    assert fake.state() == before


def test_a_body_that_raises_still_restores(fake: FakeCuda) -> None:
    """Catches a switch whose exit is skipped by an exception: the caller's stream would stay changed."""
    fake.device = 1
    before = fake.state()
    with pytest.raises(KeyError), transport.use_stream(stream(2, 0)):
        raise KeyError("inside")
    assert fake.state() == before


def test_none_is_the_host_path_and_touches_nothing(fake: FakeCuda) -> None:
    """Catches the host path (stream None) calling into CUDA."""
    before = fake.state()
    with transport.use_stream(None):
        assert fake.state() == before
    assert fake.state() == before


@pytest.mark.parametrize("current", range(3))
@pytest.mark.parametrize("is_current", [True, False], ids=["its device's current", "passed"])
@pytest.mark.parametrize("capturing", [True, False])
def test_capturing_asks_of_the_stage_stream_and_the_pool_devices_current_and_restores_everything(
    fake: FakeCuda, monkeypatch: pytest.MonkeyPatch, current: int, is_current: bool, capturing: bool
) -> None:
    """Catches a capture check that asks only of the current device's stream (another device
    current), skips the stage's own stream or the pool device's current one, or leaves another
    stream or device current."""
    import torch

    captures = {150} if capturing else set()
    # torch's binding answers for the current device's current stream only.
    monkeypatch.setattr(transport, "_is_capturing", lambda: fake.current[fake.device] in captures)
    if is_current:
        fake.current[1] = 150
    fake.device = current
    before = fake.state()
    cuda = transport.CudaTransport(torch.device("cuda", 1))
    assert cuda.capturing(stream(150, 1)) is capturing
    # Another stream of the device: taken by the capture only when the capture runs on the
    # pool device's current stream (a torch.cuda.graph body, where even a fence query breaks it).
    assert cuda.capturing(stream(160, 1)) is (capturing and is_current)
    assert fake.state() == before


def test_capturing_asks_of_the_current_devices_stream_too(fake: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches a capture check blind to a capture on the current device (the pool on another one):
    in torch's global capture mode the pool's own fence queries would break that capture."""
    import torch

    monkeypatch.setattr(transport, "_is_capturing", lambda: fake.current[fake.device] == 0)
    fake.device = 0  # device 0's current stream (id 0) captures; the pool is on device 1
    before = fake.state()
    assert transport.CudaTransport(torch.device("cuda", 1)).capturing(stream(100, 1)) is True
    assert fake.state() == before
