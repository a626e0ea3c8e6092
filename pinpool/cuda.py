"""The CUDA transport through torch: pinned memory, events, stream-ordered copies, all under the pool's device."""

from __future__ import annotations

from typing import Any

import torch

from pinpool.exceptions import DeviceMismatchError
from pinpool.platform import PlatformReport, check_cuda
from pinpool.transport import Fence, HostTransport, Stream, Transport, host_waits


def _binding(owner: Any, name: str) -> Any:
    """``owner.name``, or a stand-in that raises, naming it, when this torch build lacks it (a CPU-only build)."""

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise DeviceMismatchError(f"this torch build has no torch._C.{name}: a CUDA pool cannot be used")

    return getattr(owner, name, missing)


# Raw bindings for the hot path: one C call each, where the public wrappers add frames and device lookups.
_current_stream_of = _binding(torch._C, "_cuda_getCurrentStream")  # -> (stream_id, index, device_type)
_event_base: Any = getattr(torch._C, "_CudaEventBase", None)
_record = _binding(_event_base, "record")
_query = _binding(_event_base, "query")
_synchronize = _binding(_event_base, "synchronize")
_set_stream = _binding(torch._C, "_cuda_setStream")  # also makes the stream's device current
_get_device = _binding(torch._C, "_cuda_getDevice")
_set_device = _binding(torch._C, "_cuda_setDevice")
_is_capturing = _binding(torch._C, "_cuda_isCurrentStreamCapturing")  # of the current device's stream


class use_stream:
    """``with use_stream(s):`` makes CUDA stream ``s`` current on its device, then restores both; ``None``: no-op.
    ``torch.cuda.stream`` at a fraction of its host cost."""

    __slots__ = ("_device", "_previous", "_stream")

    def __init__(self, stream: Stream) -> None:
        self._stream = stream
        self._previous: tuple[int, int, int] | None = None

    def __enter__(self) -> None:
        stream = self._stream
        if stream is not None:
            self._device = _get_device()
            self._previous = _current_stream_of(stream.device_index)
            _set_stream(stream_id=stream.stream_id, device_index=stream.device_index, device_type=stream.device_type)

    def __exit__(self, *exc: object) -> None:
        previous, self._previous = self._previous, None
        if previous is not None:
            _set_stream(stream_id=previous[0], device_index=previous[1], device_type=previous[2])
            if self._device != previous[1]:
                _set_device(self._device)


class _CudaFence(torch.cuda.Event):
    """A CUDA event recorded on the stage's resolved stream; ATen guards its device, so rule 8 needs no switch."""

    #: Memo: an event changes only when recorded again, so once seen passed it answers without a CUDA call.
    #: Every record must go through ``record`` (torch's ``Stream.record_event`` does), or the memo goes stale.
    passed = True  # never recorded: cudaEventQuery says passed too

    def record(self, stream: Stream = None) -> None:
        self.passed = False
        _record(self, stream)

    def query(self) -> bool:
        if self.passed:
            return True
        passed = self.passed = bool(_query(self))
        return passed

    def synchronize(self) -> None:
        host_waits.refuse("a pool fence's synchronize()")
        _synchronize(self)  # sync-ok: callers wait only on a fence they queried as pending
        self.passed = True


class CudaTransport:
    """Pinned host memory, a device mirror, CUDA events and stream-ordered copies, through torch."""

    pinned = True
    path = "torch"

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" or device.index is None:
            raise DeviceMismatchError(f"'device' must be a CUDA device with an index (got {device})")
        self.device = device
        self.index: int = device.index
        self._current: torch.cuda.Stream | None = None

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        with torch.cuda.device(self.device):  # pinned under this device's context: none created on GPU 0
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def alloc_device(self, nbytes: int, stream: Stream = None) -> torch.Tensor:
        # From the pool of the stream that writes it first, so no work queued on another stream still owns it.
        if stream is None:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        with torch.cuda.stream(stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def new_fence(self) -> Fence:
        return _CudaFence(enable_timing=False)  # type: ignore[no-untyped-call]  # created at its first record

    def resolve_stream(self, stream: Stream | None) -> Stream:
        if stream is None:  # the pool's device's current stream, whichever device is current
            return self._current_stream(*_current_stream_of(self.index))
        if not isinstance(stream, torch.cuda.Stream):
            raise DeviceMismatchError(f"'stream' must be a torch.cuda.Stream (got {type(stream).__name__})")
        if stream.device_index != self.index:
            raise DeviceMismatchError(
                f"'stream' must be on the pool's device {self.device} (got a stream on cuda:{stream.device_index}); "
                "create one pool per device"
            )
        return stream

    def _current_stream(self, stream_id: int, index: int, device_type: int) -> Stream:
        """The device's current stream as a torch object, made again only when another one is current."""
        cached = self._current
        if cached is None or cached.stream_id != stream_id:
            cached = self._current = torch.cuda.Stream(  # type: ignore[no-untyped-call]
                stream_id=stream_id, device_index=index, device_type=device_type
            )
        return cached

    def same_stream(self, a: Stream, b: Stream) -> bool:
        return a is b or a.stream_id == b.stream_id

    def capturing(self, stream: Stream) -> bool:
        """Whether the current device's current stream (a ``torch.cuda.graph`` body), the pool device's current
        stream or ``stream`` is capturing, each asked in turn; another thread's capture goes unseen."""
        if _is_capturing():
            return True
        current_id, device, _ = _current_stream_of(-1)  # -1: the current device's, with its index
        if device == self.index and current_id == stream.stream_id:
            return False  # ``stream`` is the stream just asked about
        if device != self.index:
            _set_device(self.index)
            try:
                if _is_capturing():  # the pool device's current stream
                    return True
            finally:
                _set_device(device)
        if _current_stream_of(self.index)[0] == stream.stream_id:
            return False  # ``stream`` is the pool device's current stream: already asked
        with use_stream(stream):
            return bool(_is_capturing())

    def resolve_for_stage(self, stream: Stream | None) -> tuple[Stream, bool]:
        """``resolve_stream`` and ``capturing`` at once: two C calls when no stream is passed and the pool's
        device is current, where one capture query covers all three streams ``capturing`` asks about."""
        if stream is None:
            stream_id, device, device_type = _current_stream_of(-1)
            if device == self.index:
                cached = self._current  # every eager step asks: the kept stream without a call
                if cached is None or cached.stream_id != stream_id:
                    cached = self._current_stream(stream_id, device, device_type)
                return cached, bool(_is_capturing())
        resolved = self.resolve_stream(stream)
        return resolved, self.capturing(resolved)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        """One ``cudaMemcpyAsync`` on ``stream`` (rule 3); no stream switch when it already is current."""
        if _current_stream_of(self.index)[0] == stream.stream_id:
            dst.copy_(src, True)  # non_blocking by position: torch's argument parser is cheaper so
            return
        with use_stream(stream):
            dst.copy_(src, True)

    def stream_wait(self, waiter: Stream, fence: Fence) -> None:
        waiter.wait_event(fence)

    def fill(self, dst_device: torch.Tensor, byte: int, stream: Stream) -> None:
        with use_stream(stream):
            dst_device.fill_(byte)

    def check_zero_copy(self, host_slab: torch.Tensor) -> tuple[PlatformReport, torch.Tensor | None]:
        return check_cuda(host_slab, self.device)


def transport_for(device: torch.device) -> Transport:
    """The real transport for ``device``: CUDA when it can pin, plain host memory otherwise."""
    if device.type != "cuda":
        return HostTransport(device)
    if not torch.cuda.is_available():
        raise DeviceMismatchError(f"'device' is {device} but this torch build sees no CUDA device; use device='cpu'")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise DeviceMismatchError(
            f"'device' index must be < {torch.cuda.device_count()} visible CUDA devices (got {device})"
        )
    return CudaTransport(device)
