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

from pinpool import DeviceMismatchError
from pinpool import cuda as transport


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


class _FakeStream:
    """``torch.cuda.Stream(stream_id=, device_index=, device_type=)`` without a GPU."""

    def __init__(self, stream_id: int, device_index: int, device_type: int) -> None:
        self.stream_id, self.device_index, self.device_type = stream_id, device_index, device_type


@pytest.mark.parametrize("capturing", [True, False])
def test_resolve_for_stage_common_case_is_two_calls_on_the_pool_devices_current_stream(
    fake: FakeCuda, monkeypatch: pytest.MonkeyPatch, capturing: bool
) -> None:
    """Catches the one-question shortcut answering for a stream other than the stage's, or
    costing more than the two C calls it exists to save."""
    import torch

    calls: list[str] = []

    def current_stream_of(index: int) -> tuple[int, int, int]:
        calls.append(f"current({index})")
        return fake.current_stream_of(index)

    def is_capturing() -> bool:
        calls.append("is_capturing")
        return capturing and fake.current[fake.device] == 150

    monkeypatch.setattr(transport, "_current_stream_of", current_stream_of)
    monkeypatch.setattr(transport, "_is_capturing", is_capturing)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    fake.device, fake.current[1] = 1, 150
    cuda = transport.CudaTransport(torch.device("cuda", 1))
    stream, answer = cuda.resolve_for_stage(None)
    assert (stream.stream_id, stream.device_index, answer) == (150, 1, capturing)
    assert calls == ["current(-1)", "is_capturing"]
    assert cuda.resolve_for_stage(None)[0] is stream  # unchanged stream: the same object
    assert cuda.resolve_stream(None) is stream  # and the one resolve_stream gives


@pytest.mark.parametrize("captures_on", ["current device", "pool device", "none"])
def test_resolve_for_stage_with_another_device_current_asks_every_stream(
    fake: FakeCuda, monkeypatch: pytest.MonkeyPatch, captures_on: str
) -> None:
    """Catches the shortcut taken with another device current: the stage would go to that
    device's stream, or a capture on either device's current stream would go unseen."""
    import torch

    capture_id = {"current device": 7, "pool device": 150, "none": -1}[captures_on]
    monkeypatch.setattr(transport, "_is_capturing", lambda: fake.current[fake.device] == capture_id)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    fake.device, fake.current[0], fake.current[1] = 0, 7, 150  # cuda:0 current, the pool on cuda:1
    before = fake.state()
    cuda = transport.CudaTransport(torch.device("cuda", 1))
    stream, answer = cuda.resolve_for_stage(None)
    assert (stream.stream_id, stream.device_index) == (150, 1)
    assert answer is (captures_on != "none")
    assert fake.state() == before


def test_resolve_for_stage_asks_of_a_passed_stream_forked_into_a_capture(
    fake: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches the shortcut applied to a passed stream: the current one idle, the passed one capturing."""
    import torch

    monkeypatch.setattr(transport, "_is_capturing", lambda: fake.current[fake.device] == 160)
    fake.device, fake.current[1] = 1, 150
    before = fake.state()
    cuda = transport.CudaTransport(torch.device("cuda", 1))
    side = SimpleNamespace(stream_id=160, device_index=1, device_type=1)
    # ``resolve_stream`` checks that a passed stream is a torch.cuda.Stream, which a CPU build
    # cannot construct: the check answers yes for this stand-in.
    monkeypatch.setattr(transport, "isinstance", lambda obj, cls: True, raising=False)
    resolved, answer = cuda.resolve_for_stage(side)
    assert (resolved, answer) == (side, True)
    assert fake.state() == before


@pytest.mark.parametrize("capturing", [True, False])
def test_resolve_for_stage_with_the_current_stream_passed_answers_for_it(
    fake: FakeCuda, monkeypatch: pytest.MonkeyPatch, capturing: bool
) -> None:
    """Catches the explicit-stream path (the fallback) answering for another stream than the one passed."""
    import torch

    monkeypatch.setattr(transport, "_is_capturing", lambda: capturing and fake.current[fake.device] == 150)
    fake.device, fake.current[1] = 1, 150
    before = fake.state()
    cuda = transport.CudaTransport(torch.device("cuda", 1))
    current = SimpleNamespace(stream_id=150, device_index=1, device_type=1)
    # A CPU build cannot construct a torch.cuda.Stream: the type check answers yes for this stand-in.
    monkeypatch.setattr(transport, "isinstance", lambda obj, cls: True, raising=False)
    assert cuda.resolve_for_stage(current) == (current, capturing)
    assert fake.state() == before


def test_a_missing_raw_binding_is_named_when_called() -> None:
    """Catches a torch build without one of the raw CUDA bindings failing with an error that names the wrong
    cause (or none): the stand-in says which binding is missing, as a typed error."""
    stand_in = transport._binding(object(), "_cuda_notThere")
    with pytest.raises(DeviceMismatchError, match=r"torch\._C\._cuda_notThere"):
        stand_in(stream_id=1)
