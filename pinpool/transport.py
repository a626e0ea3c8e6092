"""The one seam between the ring's rules and a device: a ``Transport`` gives memory, fences, stream waits and
copies, on CUDA (``pinpool.cuda``), host memory (``HostTransport``, rule 7) or the simulator (``LaggingGpu``).
Streams are explicit: ``resolve_stream`` fixes one when an operation opens and every later call carries it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch

from pinpool.exceptions import DeviceMismatchError, HostSyncError
from pinpool.platform import PlatformReport, in_place_report

Stream = Any  # torch.cuda.Stream on CUDA, None on the host path, a SimStream in the simulator.


class Fence(Protocol):
    """A marker in one stream: passed once the device has run everything queued before it."""

    def record(self, stream: Stream) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class Transport(Protocol):
    """Memory, fences, stream waits and copies for one device; a caller's own transport has every member
    (the ring asks ``resolve_for_stage`` at each open: the capture refusal rests on it)."""

    device: torch.device
    pinned: bool  # host memory is page-locked, so copies from it are truly asynchronous
    path: str  # how copies and fences are made, for logs: "torch", "host", "simulated"

    def alloc_host(self, nbytes: int) -> torch.Tensor: ...
    def alloc_device(self, nbytes: int, stream: Stream = None) -> torch.Tensor: ...  # for ``stream`` to write first
    def new_fence(self) -> Fence: ...
    # ``stream`` checked against the pool's device, or (None) the device's current stream now.
    def resolve_stream(self, stream: Stream | None) -> Stream: ...
    def same_stream(self, a: Stream, b: Stream) -> bool: ...
    # ``resolve_stream``, and whether it, the pool device's or the current device's current stream is capturing.
    def resolve_for_stage(self, stream: Stream | None) -> tuple[Stream, bool]: ...
    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None: ...  # host to device, or back
    def stream_wait(self, waiter: Stream, fence: Fence) -> None: ...  # on the device: never a host wait
    def fill(self, dst_device: torch.Tensor, byte: int, stream: Stream) -> None: ...
    # Once, at a zero-copy pool's creation: can kernels read ``host_slab`` in place, and its device alias if so.
    def check_zero_copy(self, host_slab: torch.Tensor) -> tuple[PlatformReport, torch.Tensor | None]: ...


def wait_for_streams(transport: Transport, waiter: Stream, others: Iterable[tuple[Stream, Fence]]) -> None:
    """Make ``waiter`` wait on the device (never the host) for the work queued so far on each other stream.
    ``others``: (stream, a fence of its own to record there); ``waiter`` itself is skipped (stream order)."""
    for other, fence in others:
        if not transport.same_stream(other, waiter):
            fence.record(other)
            transport.stream_wait(waiter, fence)


def drain(transport: Transport, streams: Iterable[Stream], fences: Iterable[Fence]) -> None:
    """Teardown's host wait: for ``fences`` and for the work queued so far on each of ``streams``."""
    waits = list(fences)
    distinct: list[Stream] = []
    for stream in streams:
        if not any(transport.same_stream(stream, seen) for seen in distinct):
            distinct.append(stream)
            waits.append(fence := transport.new_fence())
            fence.record(stream)
    for fence in waits:
        if not fence.query():
            fence.synchronize()  # sync-ok: teardown, once per pool; nothing is freed under queued work


class HostWaitGuard:
    """Refuses a pool fence's host wait inside ``pinpool.testing.no_sync`` (``depth``: its open blocks); lives
    here so the library imports no test tool, and asked because torch's sync debug mode misses raw bindings."""

    __slots__ = ("depth",)

    def __init__(self) -> None:
        self.depth = 0

    def refuse(self, what: str) -> None:
        if self.depth:
            raise HostSyncError(f"{what} inside no_sync()")


host_waits = HostWaitGuard()  # the one guard every pool fence asks before a host wait


class _NoFence:
    """Host copies are done when ``copy`` returns, so recording and waiting do nothing."""

    def record(self, stream: Stream) -> None: ...
    def synchronize(self) -> None: ...

    def query(self) -> bool:
        return True


class HostTransport:
    """Plain host memory and synchronous copies: CPU-only torch or ``device='cpu'`` (rule 7)."""

    pinned = False
    path = "host"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def alloc_device(self, nbytes: int, stream: Stream = None) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def new_fence(self) -> Fence:
        return _NoFence()

    def resolve_stream(self, stream: Stream | None) -> Stream:
        if stream is not None:  # host copies run in program order: a stream here is a mistake
            raise DeviceMismatchError(
                f"'stream' must be None for a pool on {self.device}, which copies synchronously (got {stream!r})"
            )
        return None

    def same_stream(self, a: Stream, b: Stream) -> bool:
        return True

    def resolve_for_stage(self, stream: Stream | None) -> tuple[Stream, bool]:
        return self.resolve_stream(stream), False

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        dst.copy_(src)

    def stream_wait(self, waiter: Stream, fence: Fence) -> None: ...

    def fill(self, dst_device: torch.Tensor, byte: int, stream: Stream) -> None:
        dst_device.fill_(byte)

    def check_zero_copy(self, host_slab: torch.Tensor) -> tuple[PlatformReport, torch.Tensor | None]:
        return in_place_report("the host path"), host_slab  # rule 7: "device" memory is the slab itself
