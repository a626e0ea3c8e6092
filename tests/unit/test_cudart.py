"""pinpool.cudart without a GPU: finding torch's runtime, error codes, the no_sync guard.

The calls themselves run on the H200 (tests/gpu/test_cudart_cuda.py); here a fake
library stands in for libcudart so each return code's handling can be checked.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pinpool import HostSyncError, PinnedRingBuffer, PoolSettings, TransportError, no_sync
from pinpool.cudart import NOT_READY, Cudart, cudart_path
from pinpool.transport import CudaTransport, _DirectFence

_NAMES = {0: b"cudaSuccess", 1: b"cudaErrorInvalidValue", 600: b"cudaErrorNotReady", 700: b"cudaErrorIllegalAddress"}


class FakeLib:
    """Each entry point returns ``rc`` and logs its call; the error helpers name the code."""

    def __init__(self, rc: int) -> None:
        self.rc = rc
        self.query_rc: int | None = None  # what cudaEventQuery returns, when set (else rc)
        self.calls: list[str] = []
        for name in (
            "cudaMemcpyAsync",
            "cudaEventCreateWithFlags",
            "cudaEventDestroy",
            "cudaEventRecord",
            "cudaEventQuery",
            "cudaEventSynchronize",
            "cudaStreamWaitEvent",
        ):
            setattr(self, name, self._entry(name))
        self.cudaGetErrorName = lambda rc: _NAMES.get(rc, b"cudaErrorUnknown")
        self.cudaGetErrorString = lambda rc: b"text for " + _NAMES.get(rc, b"?")

    def _entry(self, name: str) -> Callable[..., int]:
        def call(*args: Any) -> int:
            self.calls.append(name)
            if name == "cudaEventCreateWithFlags":
                ctypes.cast(args[0], ctypes.POINTER(ctypes.c_void_p))[0] = 0x1234
            if name == "cudaEventQuery" and self.query_rc is not None:
                return self.query_rc
            return self.rc

        return call


def runtime(rc: int) -> tuple[Cudart, FakeLib]:
    lib = FakeLib(rc)
    return Cudart(lib), lib  # type: ignore[arg-type]


def test_cudart_path_picks_the_mapped_runtime() -> None:
    """Catches a loader that would open a second CUDA runtime instead of torch's."""
    maps = [
        "7f00-7f01 r-xp 00000000 08:01 42 /usr/lib/libc.so.6",
        "7f02-7f03 r--p 00000000 08:01 43 /site/nvidia/cu13/lib/libcudart.so.13",
        "7f04-7f05 r--p 00000000 08:01 44 /other/libcudart.so.12",
        "7f06-7f07 rw-p 00000000 00:00 0",
    ]
    assert cudart_path(maps) == "/site/nvidia/cu13/lib/libcudart.so.13"
    assert cudart_path(maps[:1] + maps[3:]) is None
    assert cudart_path(["7f-80 r--p 0 0:0 1 /opt/libcudart_static_helper.a"]) is None


def direct_transport(rt: Cudart) -> CudaTransport:
    """A CUDA transport driven by ``rt``, built without a GPU (streams are then given explicitly)."""
    transport = CudaTransport(torch.device("cuda", 0))
    transport._rt = rt
    return transport


def test_query_reads_not_ready_as_pending_and_success_as_passed() -> None:
    """Catches a pending fence read as passed (a slot rewritten under its copy)."""
    rt, lib = runtime(0)
    fence = _recorded_fence(rt)
    lib.query_rc = NOT_READY
    assert fence.query() is False
    lib.query_rc = 0
    assert fence.query() is True


def _recorded_fence(rt: Cudart) -> _DirectFence:
    fence = _DirectFence(rt, direct_transport(rt))
    fence.record(_Stream(5))
    return fence


def _copy_call(rt: Cudart) -> Callable[[], object]:
    transport = direct_transport(rt)
    return lambda: transport.copy(torch.zeros(4), torch.zeros(4), _Stream(5))


def _fence_call(method: str) -> Callable[[Cudart], Callable[[], object]]:
    def prepare(rt: Cudart) -> Callable[[], object]:
        fence = _recorded_fence(rt)
        return (lambda: fence.record(_Stream(5))) if method == "record" else getattr(fence, method)

    return prepare


# Each case builds its objects while the runtime still succeeds and returns the call to fail.
_FAILING: list[tuple[Callable[[Cudart], Callable[[], object]], str]] = [
    (_copy_call, "cudaMemcpyAsync"),
    (_fence_call("record"), "cudaEventRecord"),
    (_fence_call("query"), "cudaEventQuery"),
    (_fence_call("synchronize"), "cudaEventSynchronize"),
    (lambda rt: lambda: rt.stream_wait_event(0, 1), "cudaStreamWaitEvent"),
    (lambda rt: rt.event_create, "cudaEventCreateWithFlags"),
]


@pytest.mark.parametrize(("prepare", "name"), _FAILING)
def test_a_failed_call_raises_transport_error_naming_call_and_code(
    prepare: Callable[[Cudart], Callable[[], object]], name: str
) -> None:
    """Catches a CUDA error (a faulted kernel, a bad handle) swallowed or reported without its cause."""
    rt, lib = runtime(0)
    call = prepare(rt)
    lib.rc = 700  # every call fails from here on
    with pytest.raises(TransportError, match=rf"{name} failed with cudaErrorIllegalAddress \(700\): text for"):
        call()


def test_create_returns_the_handle_the_runtime_wrote() -> None:
    """Catches an event handle lost between ctypes and the fence."""
    rt, _ = runtime(0)
    assert rt.event_create() == 0x1234


def test_fence_wait_inside_no_sync_is_refused_before_the_runtime_is_called() -> None:
    """Catches a direct event wait that slips past no_sync() (torch's guards cannot see it)."""
    rt, lib = runtime(0)
    with no_sync(), pytest.raises(HostSyncError, match="fence's synchronize"):
        rt.event_synchronize(1)
    assert "cudaEventSynchronize" not in lib.calls
    rt.event_synchronize(1)
    assert lib.calls[-1] == "cudaEventSynchronize"


def test_transport_without_a_gpu_goes_through_torch() -> None:
    """Catches a transport that would load a CUDA runtime on a machine without a GPU."""
    if torch.cuda.is_available():
        pytest.skip("this check is about machines without a GPU; tests/gpu covers the direct path")
    assert CudaTransport(torch.device("cuda", 0)).path == "torch"
    assert PinnedRingBuffer(PoolSettings(device="cpu"))._transport.path == "host"


class _Stream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle


def test_fence_watermark_skips_queries_only_for_earlier_fences_on_the_same_stream() -> None:
    """Catches a fence answered as passed from another stream's progress, or from its own stale record."""
    rt, lib = runtime(0)
    lib.query_rc = NOT_READY
    transport = CudaTransport(torch.device("cuda", 0))  # no GPU touched: streams are given explicitly
    a, b, c = (_DirectFence(rt, transport) for _ in range(3))
    assert a.query() and lib.calls.count("cudaEventQuery") == 0  # never recorded: passed, no call
    a.record(_Stream(5))
    b.record(_Stream(5))
    c.record(_Stream(7))
    assert not a.query()
    lib.query_rc = 0
    assert b.query()
    queries = lib.calls.count("cudaEventQuery")
    assert a.query()  # recorded before b on the same stream: answered without a call
    a.synchronize()
    assert lib.calls.count("cudaEventQuery") == queries and "cudaEventSynchronize" not in lib.calls
    lib.query_rc = NOT_READY
    assert not c.query()  # another stream: b's progress says nothing about it
    a.record(_Stream(5))  # re-recorded after b: the watermark no longer covers it
    assert not a.query()
