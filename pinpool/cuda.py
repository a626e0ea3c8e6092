"""The CUDA transport: pinned memory, CUDA events and stream-ordered copies through torch.

Split from ``pinpool.transport`` (the protocol the ring speaks, and the host path) so the
hot path's raw torch bindings, looked up once, sit with the one class that uses them.
Every call runs under the pool's device whatever device is current (rule 8).
"""

from __future__ import annotations

from typing import Any

import torch

from pinpool.exceptions import DeviceMismatchError
from pinpool.platform import PlatformReport, check_cuda
from pinpool.transport import Fence, HostTransport, Stream, Transport, host_waits


def _no_cuda(*args: Any) -> Any:
    raise DeviceMismatchError("this torch build has no CUDA: a CUDA pool cannot be used")


# Raw bindings of the torch calls the hot path makes, looked up once. Each is one C call;
# the public wrappers around them add a Python frame and a current-stream lookup each.
# (stream_id, device_index, device_type) of a device's current stream.
_current_stream_of = getattr(torch._C, "_cuda_getCurrentStream", _no_cuda)
_event_base: Any = getattr(torch._C, "_CudaEventBase", None)
_record = getattr(_event_base, "record", _no_cuda)
_query = getattr(_event_base, "query", _no_cuda)
_synchronize = getattr(_event_base, "synchronize", _no_cuda)
# Setting a device's current stream (it also makes that device current), and the current
# device. ``torch.cuda.stream(...)`` does the same through several Python-level device
# lookups, each paid on every step that switches streams.
_set_stream = getattr(torch._C, "_cuda_setStream", None)
_get_device = getattr(torch._C, "_cuda_getDevice", None)
_set_device = getattr(torch._C, "_cuda_setDevice", None)
# Whether the current device's current stream is capturing a CUDA graph (one runtime query,
# safe during a capture); ``torch.cuda.is_current_stream_capturing`` wraps it.
_is_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)


class use_stream:
    """``with use_stream(s):`` makes CUDA stream ``s`` current on its device, then restores both.

    Restores the previous current stream of ``s``'s device and the previous current
    device, as ``torch.cuda.stream`` does, at a fraction of its host cost. A no-op for
    ``None`` (the host path); a torch without the raw bindings gets ``torch.cuda.stream``.
    """

    __slots__ = ("_device", "_fallback", "_previous", "_stream")

    def __init__(self, stream: Stream) -> None:
        self._stream = stream
        self._previous: tuple[int, int, int] | None = None
        self._fallback: Any = None
        self._device = -1

    def __enter__(self) -> None:
        stream = self._stream
        if stream is None:
            return
        if _set_stream is None or _get_device is None or _set_device is None:
            self._fallback = torch.cuda.stream(stream)
            self._fallback.__enter__()
            return
        self._device = _get_device()
        self._previous = _current_stream_of(stream.device_index)
        _set_stream(stream_id=stream.stream_id, device_index=stream.device_index, device_type=stream.device_type)

    def __exit__(self, *exc: object) -> None:
        if self._fallback is not None:
            fallback, self._fallback = self._fallback, None
            fallback.__exit__(*exc)
            return
        previous, self._previous = self._previous, None
        if previous is None or _set_stream is None or _set_device is None:
            return
        _set_stream(stream_id=previous[0], device_index=previous[1], device_type=previous[2])
        if self._device != previous[1]:
            _set_device(self._device)


class _CudaFence(torch.cuda.Event):
    """A CUDA event (timing off), recorded on the stage's resolved stream, never "the current one".

    Rule 8 holds without a device switch here: ATen's record guards the event's device
    (and refuses a stream of another device), and ``cudaEventQuery`` /
    ``cudaEventSynchronize`` may be called from any device (ATen's ``CUDAEvent.h``).
    """

    #: Seen passed since its last record. An event's state changes only when it is
    #: recorded again, so a passed fence answers later queries without a CUDA call: a
    #: decode loop reads step N's tokens (one query) and claims the same slot again some
    #: steps later (a second query of the same record) for one cudaEventQuery, not two.
    #: Every record must go through ``record`` below (torch's ``Stream.record_event``
    #: does): recording through the raw binding would leave the memo stale.
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
    """Pinned host memory, a device mirror, CUDA events and stream-ordered copies, through torch.

    Every call runs under the pool's device whatever device is current (rule 8): torch's
    copy, record and stream-wait guard the device of their tensor or stream, and
    ``_CudaFence`` guards the rest.
    """

    pinned = True
    path = "torch"

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" or device.index is None:
            raise DeviceMismatchError(f"'device' must be a CUDA device with an index (got {device})")
        self.device = device
        self.index: int = device.index
        self._current: torch.cuda.Stream | None = None

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        # Pin on behalf of this device's context so that, on a multi-GPU host, the
        # allocation does not create a context on GPU 0.
        with torch.cuda.device(self.device):
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def alloc_device(self, nbytes: int, stream: Stream = None) -> torch.Tensor:
        # The caching allocator hands out blocks per stream: take it from the pool of the
        # stream that will write it, so no work queued on another stream still owns it.
        # None: the writer is the device's current stream (the ring passes None for a stream it
        # resolved from "current"), whose pool a plain allocation takes, without entering
        # ``torch.cuda.stream``, which costs more than the allocation.
        if stream is None:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        with torch.cuda.stream(stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def new_fence(self) -> Fence:
        fence = _CudaFence(enable_timing=False)  # type: ignore[no-untyped-call]
        # The event itself is created at its first record, on that stream's device.
        return fence

    def resolve_stream(self, stream: Stream | None) -> Stream:
        if stream is None:
            # The pool's device's current stream, not the current device's: with cuda:0
            # current, a pool on cuda:1 still stages on cuda:1's stream.
            stream_id, index, device_type = _current_stream_of(self.index)
            cached = self._current
            if cached is None or cached.stream_id != stream_id:
                cached = self._current = torch.cuda.Stream(  # type: ignore[no-untyped-call]
                    stream_id=stream_id, device_index=index, device_type=device_type
                )
            return cached
        if not isinstance(stream, torch.cuda.Stream):
            raise DeviceMismatchError(f"'stream' must be a torch.cuda.Stream (got {type(stream).__name__})")
        if stream.device_index != self.index:
            raise DeviceMismatchError(
                f"'stream' must be on the pool's device {self.device} (got a stream on cuda:{stream.device_index}); "
                "create one pool per device"
            )
        return stream

    def same_stream(self, a: Stream, b: Stream) -> bool:
        return a is b or a.stream_id == b.stream_id

    def capturing(self, stream: Stream) -> bool:
        """Whether a graph capture would take a stage on ``stream``.

        Three streams are asked: the current device's current stream (the body of a
        ``torch.cuda.graph``: in its default mode even a fence query on another stream
        breaks the capture), the pool device's current stream, and ``stream`` itself (a
        stream forked into a capture). torch answers only for the current device's current
        stream, so the others are made current for the question and everything restored.
        Common case (``stream`` is the pool device's current stream, that device current):
        two C calls. A capture this thread cannot see from these (another thread's, or one
        on a stream that is none of them) is not detected.
        """
        if _is_capturing is None or _set_device is None:
            return False
        if _is_capturing():
            return True
        # -1: the current device's current stream, with that device's index (one call for both).
        current_id, device, _ = _current_stream_of(-1)
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
        """The stage's stream and whether a graph capture would take the stage: two C calls in
        the common case (no stream passed, the pool's device current).

        There the current device's current stream is the pool device's current stream and the
        stage's stream all at once, so torch's one capture query covers the three streams that
        ``capturing`` asks about. Every other case asks ``resolve_stream`` and ``capturing``.
        """
        if stream is None and _is_capturing is not None:
            # -1: the current device's current stream, with that device's index (one call for both).
            stream_id, device, device_type = _current_stream_of(-1)
            if device == self.index:
                cached = self._current
                if cached is None or cached.stream_id != stream_id:
                    cached = self._current = torch.cuda.Stream(  # type: ignore[no-untyped-call]
                        stream_id=stream_id, device_index=device, device_type=device_type
                    )
                return cached, bool(_is_capturing())
        resolved = self.resolve_stream(stream)
        return resolved, self.capturing(resolved)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        """One ``cudaMemcpyAsync`` of a contiguous range, on ``stream`` (rule 3).

        torch queues a copy on the current stream of the CUDA tensor's device, under that
        device's guard; switching streams is skipped when ``stream`` already is current.
        """
        if _current_stream_of(self.index)[0] == stream.stream_id:
            dst.copy_(src, True)  # non_blocking, passed by position: torch's argument parser is cheaper so
            return
        with use_stream(stream):
            dst.copy_(src, True)

    def stream_wait(self, waiter: Stream, fence: Fence) -> None:
        waiter.wait_event(fence)

    def fill(self, dst_device: torch.Tensor, byte: int, stream: Stream) -> None:
        with use_stream(stream):
            dst_device.fill_(byte)

    def check_zero_copy(self, host_slab: torch.Tensor) -> tuple[PlatformReport, torch.Tensor | None]:
        """The start-up platform check (``pinpool.platform``): pinned, aliased, live; one host sync."""
        return check_cuda(host_slab, self.device)


def is_pin_memory_available(device: str | torch.device | None = None) -> bool:
    """Whether host memory can be page-locked for copies to ``device``.

    False for CPU devices and for torch builds without CUDA, where pinning raises.
    """
    target = torch.device("cuda" if device is None else device)
    if target.type != "cuda":
        return False
    return torch.cuda.is_available()


def transport_for(device: torch.device) -> Transport:
    """The real transport for ``device``: CUDA when it can pin, plain host memory otherwise."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceMismatchError(
                f"'device' is {device} but this torch build sees no CUDA device; use device='cpu'"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceMismatchError(
                f"'device' index must be < {torch.cuda.device_count()} visible CUDA devices (got {device})"
            )
        return CudaTransport(device)
    return HostTransport(device)
