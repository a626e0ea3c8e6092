"""How bytes and fences move: the one seam between the ring's logic and a real GPU.

The ring never calls CUDA directly. It asks a ``Transport`` for memory, fences and the
one host-to-device copy per stage, so that the same ring logic runs on CUDA, on plain
host memory (design invariant 7), and on ``pinpool.simulated.LaggingGpu`` in tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from pinpool import cudart
from pinpool.exceptions import DeviceMismatchError

Stream = Any  # torch.cuda.Stream on CUDA; an opaque token elsewhere.


class Fence(Protocol):
    """A marker in a stream: done once the device has passed it."""

    def record(self, stream: Stream | None) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class Transport(Protocol):
    """Memory, fences and copies for one device."""

    device: torch.device
    #: True when host memory is page-locked, so copies from it are truly asynchronous.
    pinned: bool
    #: How copies and fences are made, for logs: "cudart", "torch", "host", "simulated".
    path: str

    def alloc_host(self, nbytes: int) -> torch.Tensor: ...

    def alloc_device(self, nbytes: int) -> torch.Tensor: ...

    def new_fence(self) -> Fence: ...

    def check_stream(self, stream: Stream) -> None: ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream | None) -> None:
        """One stream-ordered copy of ``src`` into ``dst``: pinned host to device, or back."""
        ...

    def stream_wait(self, waiter: Stream | None, fence: Fence) -> None: ...

    def fill(self, dst_device: torch.Tensor, byte: int, stream: Stream | None) -> None: ...


class _NoFence:
    """Host memory needs no fence: the copy is done when ``copy`` returns."""

    def record(self, stream: Stream | None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class HostTransport:
    """Plain host memory and synchronous copies: CPU-only torch or ``device='cpu'``."""

    pinned = False
    path = "host"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def alloc_device(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def new_fence(self) -> Fence:
        return _NoFence()

    def check_stream(self, stream: Stream) -> None:
        # Host copies run in program order: a stream here can only be a mistake (a CUDA
        # stream handed to a CPU pool would otherwise be ignored silently).
        raise DeviceMismatchError(
            f"'stream' must be None for a pool on {self.device}, which copies synchronously (got {stream!r})"
        )

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream | None) -> None:
        dst.copy_(src)

    def stream_wait(self, waiter: Stream | None, fence: Fence) -> None:
        return None

    def fill(self, dst_device: torch.Tensor, byte: int, stream: Stream | None) -> None:
        dst_device.fill_(byte)


class _CudaFence(torch.cuda.Event):
    """A CUDA event whose ``record(None)`` finds the current stream cheaply.

    ``torch.cuda.Event.record()`` with no stream calls ``torch.cuda.current_stream()``,
    which costs more host time than the rest of a stage's bookkeeping (measured with
    cProfile on an H200 host, torch 2.11).
    """

    _transport: CudaTransport

    def record(self, stream: Stream | None = None) -> None:
        torch._C._CudaEventBase.record(self, self._transport.current_stream() if stream is None else stream)


def _no_cuda_stream(index: int) -> int:
    raise DeviceMismatchError(f"this torch build has no CUDA: there is no current stream on cuda:{index}")


# The current cudaStream_t of a device, one C call (the hot path's way to find the stream).
_current_raw_stream: Callable[[int], int] = getattr(torch._C, "_cuda_getCurrentRawStream", _no_cuda_stream)


class _DirectFence:
    """A CUDA event owned by the pool and driven through ``pinpool.cudart`` (no torch on the path).

    Each record takes the transport's next sequence number. Work on one stream completes
    in order, so once a fence is seen passed, every fence recorded earlier on the same
    stream has passed too: ``query`` answers those from the transport's per-stream
    watermark without a CUDA call. In a decode loop, reading step N's tokens thus also
    clears the slot the next stage claims.
    """

    __slots__ = ("_passed", "_rt", "_seq", "_stream", "_transport", "handle")

    def __init__(self, rt: cudart.Cudart, transport: CudaTransport) -> None:
        self._rt = rt
        self._transport = transport
        self._passed = transport.passed
        self.handle = rt.event_create()
        self._seq = 0  # never recorded: reads as passed, as cudaEventQuery would say
        self._stream = 0

    def record(self, stream: Stream | None) -> None:
        transport = self._transport
        raw = _current_raw_stream(transport.index) if stream is None else stream.cuda_stream
        rc = self._rt.record_raw(self.handle, raw)
        if rc:
            self._rt.fail(rc, "cudaEventRecord")
        transport.records += 1
        self._seq, self._stream = transport.records, raw

    def query(self) -> bool:
        seq, passed = self._seq, self._passed
        if seq <= passed.get(self._stream, 0):
            return True
        rc = self._rt.query_raw(self.handle)
        if rc == cudart.SUCCESS:
            passed[self._stream] = seq  # above the old watermark (checked just above)
            return True
        if rc != cudart.NOT_READY:
            self._rt.fail(rc, "cudaEventQuery")
        return False

    def synchronize(self) -> None:
        seq, passed = self._seq, self._passed
        if seq <= passed.get(self._stream, 0):
            return
        self._rt.event_synchronize(self.handle)  # sync-ok: refused inside no_sync(); callers query first
        if seq > passed.get(self._stream, 0):
            passed[self._stream] = seq

    def __del__(self) -> None:
        try:
            self._rt.event_destroy(self.handle)
        except Exception:  # interpreter shutdown: the runtime may already be unloaded
            return


class CudaTransport:
    """Pinned host memory, a device mirror, CUDA events and stream-ordered copies.

    With ``direct`` (the default) and torch's CUDA runtime found in the process, copies,
    fences and stream waits call that runtime directly (``pinpool.cudart``: about half
    the host time per stage); otherwise they go through torch. ``path`` says which.
    """

    pinned = True

    def __init__(self, device: torch.device, *, direct: bool = True) -> None:
        if device.type != "cuda":
            raise DeviceMismatchError(f"'device' must be a CUDA device for CudaTransport (got {device})")
        self.device = device
        self.index: int = device.index if device.index is not None else torch.cuda.current_device()
        self._current: torch.cuda.Stream | None = None
        # Resolved only with a GPU present, so a transport can be built (and its checks
        # tested) on a machine without one.
        self._rt = cudart.load() if direct and torch.cuda.is_available() else None
        self.path = "cudart" if self._rt is not None else "torch"
        self.records = 0  # direct fence records so far: their sequence numbers
        self.passed: dict[int, int] = {}  # cudaStream_t -> highest sequence number seen passed on it

    def current_stream(self) -> torch.cuda.Stream:
        """The device's current stream, as ``torch.cuda.current_stream`` but without its Python overhead."""
        stream_id, index, device_type = torch._C._cuda_getCurrentStream(self.index)
        cached = self._current
        if cached is None or cached.stream_id != stream_id:
            cached = self._current = torch.cuda.Stream(  # type: ignore[no-untyped-call]
                stream_id=stream_id, device_index=index, device_type=device_type
            )
        return cached

    def raw_stream(self, stream: Stream | None) -> int:
        """The ``cudaStream_t`` of ``stream``, or of the device's current stream for None."""
        if stream is None:
            return int(_current_raw_stream(self.index))
        return int(stream.cuda_stream)

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        # Pin on behalf of this device's context so that, on a multi-GPU host, the
        # allocation does not create a context on GPU 0.
        with torch.cuda.device(self.device):
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def alloc_device(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def new_fence(self) -> Fence:
        with torch.cuda.device(self.device):  # an event belongs to the device current at creation
            if self._rt is not None:
                return _DirectFence(self._rt, self)
            # Timing off: a timing event costs more to record and we never read times.
            fence = _CudaFence(enable_timing=False)  # type: ignore[no-untyped-call]
        fence._transport = self
        return fence

    def check_stream(self, stream: Stream) -> None:
        if not isinstance(stream, torch.cuda.Stream):
            raise DeviceMismatchError(f"'stream' must be a torch.cuda.Stream (got {type(stream).__name__})")
        if stream.device != self.device:
            raise DeviceMismatchError(
                f"'stream' must be on the pool's device {self.device} (got a stream on {stream.device}); "
                "create one pool per device"
            )

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream | None) -> None:
        """One stream-ordered copy between a pinned host range and device memory (either way).

        Both are contiguous and equally long (the ring only passes such pairs), so the
        direct path is one ``cudaMemcpyAsync`` of ``src.nbytes`` (design invariant 3).
        """
        rt = self._rt
        if rt is not None:
            kind = cudart.HOST_TO_DEVICE if dst.is_cuda else cudart.DEVICE_TO_HOST
            raw = _current_raw_stream(self.index) if stream is None else stream.cuda_stream
            rc = rt.memcpy_raw(dst.data_ptr(), src.data_ptr(), src.nbytes, kind, raw)
            if rc:
                rt.fail(rc, "cudaMemcpyAsync")
            return
        if stream is None:
            dst.copy_(src, non_blocking=True)
            return
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def stream_wait(self, waiter: Stream | None, fence: Fence) -> None:
        if isinstance(fence, _DirectFence):
            fence._rt.stream_wait_event(self.raw_stream(waiter), fence.handle)
            return
        target = self.current_stream() if waiter is None else waiter
        target.wait_event(fence)  # type: ignore[arg-type]

    def fill(self, dst_device: torch.Tensor, byte: int, stream: Stream | None) -> None:
        if stream is None:
            dst_device.fill_(byte)
            return
        with torch.cuda.stream(stream):
            dst_device.fill_(byte)


def is_pin_memory_available(device: str | torch.device | None = None) -> bool:
    """Whether host memory can be page-locked for copies to ``device``.

    False for CPU devices and for torch builds without CUDA, where pinning raises.
    """
    target = torch.device("cuda" if device is None else device)
    if target.type != "cuda":
        return False
    return torch.cuda.is_available()


def transport_for(device: torch.device, *, direct: bool = True) -> Transport:
    """The real transport for ``device``: CUDA when it can pin, plain host memory otherwise.

    ``direct``: let the CUDA transport call torch's CUDA runtime itself (see ``CudaTransport``).
    """
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceMismatchError(
                f"'device' is {device} but this torch build sees no CUDA device; use device='cpu'"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceMismatchError(
                f"'device' index must be < {torch.cuda.device_count()} visible CUDA devices (got {device})"
            )
        return CudaTransport(device, direct=direct)
    return HostTransport(device)
