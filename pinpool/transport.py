"""How bytes and fences move: the one seam between the ring's rules and a device.

The ring never calls CUDA itself. It asks a ``Transport`` for memory, fences, stream
waits and copies, so the same rules run on CUDA (``CudaTransport``), on plain host
memory (``HostTransport``, rule 7) and on the stream-aware simulator
(``pinpool.testing.LaggingGpu``) that the CPU tests drive. One class per path, so a
test of a path exercises exactly it.

Streams are explicit. ``resolve_stream`` turns "the one passed, or the device's current
stream now" into a concrete stream once, when a stage or read-back opens; every later
call for that operation carries it (README, rule 2). No method asks "what is current?"
again.
"""

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
    """Memory, fences, stream waits and copies for one device."""

    device: torch.device
    #: True when host memory is page-locked, so copies from it are truly asynchronous.
    pinned: bool
    #: How copies and fences are made, for logs: "torch", "host", "simulated".
    path: str

    def alloc_host(self, nbytes: int) -> torch.Tensor: ...

    def alloc_device(self, nbytes: int, stream: Stream = None) -> torch.Tensor:
        """Device memory for ``stream`` to write first (None: the current stream)."""
        ...

    def new_fence(self) -> Fence: ...

    def resolve_stream(self, stream: Stream | None) -> Stream:
        """``stream`` checked against the pool's device, or the device's current stream now."""
        ...

    def same_stream(self, a: Stream, b: Stream) -> bool: ...

    def capturing(self, stream: Stream) -> bool:
        """True while a CUDA graph capture would take a stage on ``stream``: ``stream``, the pool
        device's current stream or the current device's current stream is capturing.

        Optional for a caller's own transport (the ring then assumes no capture).
        """
        ...

    def resolve_for_stage(self, stream: Stream | None) -> tuple[Stream, bool]:
        """``(resolve_stream(stream), capturing(that stream))`` in as few calls as the path allows.

        Optional, like ``capturing``: without it the ring asks the two questions apart.
        """
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        """One copy of ``src`` into ``dst`` on ``stream``: pinned host to device, or back."""
        ...

    def stream_wait(self, waiter: Stream, fence: Fence) -> None:
        """Make ``waiter`` wait on the device for ``fence``: never a host wait."""
        ...

    def fill(self, dst_device: torch.Tensor, byte: int, stream: Stream) -> None: ...

    def check_zero_copy(self, host_slab: torch.Tensor) -> tuple[PlatformReport, torch.Tensor | None]:
        """Whether kernels can read ``host_slab`` in place; when they can, its device-readable alias.

        Called once, at the creation of a pool with ``PoolSettings(zero_copy=True)``.
        """
        ...


def wait_for_streams(transport: Transport, waiter: Stream, others: Iterable[tuple[Stream, Fence]]) -> None:
    """Make ``waiter`` wait, on the device, for the work queued so far on each other stream: never a host wait.

    ``others``: (stream, a fence of its own to record there). A stream that is ``waiter``
    itself is skipped: stream order covers it. The one home of this wait: the ring's
    hand-off and consumer guards and a ``DeviceBlock``'s writer and readers use it.
    """
    for other, fence in others:
        if not transport.same_stream(other, waiter):
            fence.record(other)
            transport.stream_wait(waiter, fence)


class HostWaitGuard:
    """Whether a pool fence's host wait is refused now: inside ``pinpool.testing.no_sync``.

    The fence waits through a raw binding that torch's sync debug mode does not see, so it
    asks here. The state lives in the library, and the test tool sets it, so that the
    library imports no test tool.
    """

    __slots__ = ("depth",)

    def __init__(self) -> None:
        #: Open ``no_sync`` blocks (they nest).
        self.depth = 0

    def refuse(self, what: str) -> None:
        """Raise ``HostSyncError`` for the host wait ``what`` inside a ``no_sync`` block."""
        if self.depth:
            raise HostSyncError(f"{what} inside no_sync()")


#: The one guard every pool fence asks before a host wait.
host_waits = HostWaitGuard()


class _NoFence:
    """Host memory needs no fence: a copy is done when ``copy`` returns."""

    def record(self, stream: Stream) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


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
        if stream is not None:
            # Host copies run in program order: a stream here can only be a mistake (a CUDA
            # stream handed to a CPU pool would otherwise be ignored silently).
            raise DeviceMismatchError(
                f"'stream' must be None for a pool on {self.device}, which copies synchronously (got {stream!r})"
            )
        return None

    def same_stream(self, a: Stream, b: Stream) -> bool:
        return True

    def capturing(self, stream: Stream) -> bool:
        return False

    def resolve_for_stage(self, stream: Stream | None) -> tuple[Stream, bool]:
        return self.resolve_stream(stream), False

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        dst.copy_(src)

    def stream_wait(self, waiter: Stream, fence: Fence) -> None:
        return None

    def fill(self, dst_device: torch.Tensor, byte: int, stream: Stream) -> None:
        dst_device.fill_(byte)

    def check_zero_copy(self, host_slab: torch.Tensor) -> tuple[PlatformReport, torch.Tensor | None]:
        # Rule 7: "device" memory is host memory, so a zero-copy view is the slab itself.
        return in_place_report("the host path"), host_slab
