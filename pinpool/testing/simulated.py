"""``LaggingGpu``: a deterministic, stream-aware stand-in for a CUDA device that runs behind the host.

It models what the ring's rules depend on:
- one queue per stream (``SimStream``), run in order within a stream and in a random
  interleaving across streams, each falling behind the host by a random amount;
- events recorded on a stream (``SimFence``): passed once that stream has run past them;
- device-side stream waits: the waiting stream's later work starts only after the event;
- zero-copy readers: a zero-copy stage's device views are the pinned host memory itself
  here, so a queued "kernel" (``enqueue_check``) reads the host bytes when it *runs*, as a
  kernel reading pinned memory through UVA does; a host write before it runs is seen;
- a current stream per device and a current device, as CUDA has. A pool resolves "the
  current stream" of its own device; a copy or record handed a stream of another device
  is recorded as an error, as CUDA answers ``invalid resource handle``.

Failures are recorded, not raised, so a property test can report them:
- ``races``: a host-to-device copy whose pinned source changed between enqueue and
  execution, or a device-to-host copy whose pinned destination the host wrote meanwhile
  (rule 1 broken);
- ``mismatches``: a queued reader ("kernel") that found other values than the ones
  staged (rule 2 broken: the region was overwritten before its reader ran; for a
  zero-copy view, rule 1: the host rewrote the slot before its reader ran);
- ``errors``: work handed to a stream of another device, or to a stream a test marked as
  capturing a CUDA graph (``SimStream.capturing``), and event queries or waits while any
  stream captures (CUDA's global capture mode refuses them).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pinpool.exceptions import DeviceMismatchError
from pinpool.platform import PlatformReport, in_place_report

Op = Callable[[], object]


class _Marker:
    """A point in one stream's queue; ``done`` once the stream has run past it."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = False


class SimStream:
    """One in-order queue of device work on one device."""

    def __init__(self, gpu: LaggingGpu, name: str, device_index: int) -> None:
        self.gpu = gpu
        self.name = name
        self.device_index = device_index
        #: (op, the marker it must wait for or None)
        self.queue: deque[tuple[Op, _Marker | None]] = deque()
        #: How often the device picks this stream when several can run: streams of one
        #: device drift apart, as a busy forward stream lags an idle copy stream.
        self.speed = gpu.rng.uniform(0.05, 1.0)
        #: True while a test models a CUDA graph capture on this stream: work submitted to
        #: it is recorded in ``errors`` (it would be baked into the graph, not run).
        self.capturing = False

    def __repr__(self) -> str:
        return f"SimStream({self.name!r}, device {self.device_index})"


class SimFence:
    """An event: ``record`` puts a marker at the end of a stream's queue."""

    def __init__(self, gpu: LaggingGpu) -> None:
        self._gpu = gpu
        self.marker: _Marker | None = None  # never recorded: reads as passed, as CUDA does

    def record(self, stream: SimStream) -> None:
        marker = _Marker()

        def run() -> None:
            marker.done = True

        self._gpu.submit(stream, run, "cudaEventRecord")
        self.marker = marker

    def query(self) -> bool:
        # torch captures in its "global" mode: while any capture runs, an event query from
        # the host is refused and the capture is invalidated.
        self._gpu.note_capture_unsafe("cudaEventQuery")
        return self.marker is None or self.marker.done

    def synchronize(self) -> None:
        self._gpu.note_capture_unsafe("cudaEventSynchronize")
        self._gpu.host_waits += 1
        marker = self.marker
        if marker is not None:
            self._gpu.run_until(lambda: marker.done)


class LaggingGpu:
    """A ``Transport`` whose device memory is host memory and whose streams run late.

    ``max_lag``: how many queued ops the device may hold back after each submission.
    ``devices``: how many devices exist (the pool's is ``device_index``); each starts
    with one stream, ``default``, as its current stream.
    """

    pinned = True
    path = "simulated"

    def __init__(self, max_lag: int = 8, seed: int = 0, *, devices: int = 1, device_index: int = 0) -> None:
        self.device = torch.device("cpu")
        self.device_index = device_index
        self.max_lag = max_lag
        self.rng = random.Random(seed)
        self.streams: list[SimStream] = []
        self.current_device = device_index
        self._current: dict[int, SimStream] = {}
        for index in range(devices):
            self._current[index] = self.new_stream(f"default:{index}", device_index=index)
        self._host_ranges: list[tuple[int, int]] = []
        #: While True the device runs nothing on its own: only a host wait moves it.
        self.frozen = False
        self.pending = 0
        self.host_waits = 0
        self.stream_waits = 0
        self.races: list[str] = []
        self.mismatches: list[str] = []
        self.errors: list[str] = []
        #: Every submitted call as (call, stream name), in host order: what a profiler shows.
        self.calls: list[tuple[str, str]] = []

    # -- streams and devices, as a CUDA program sees them -------------------------------
    def new_stream(self, name: str, *, device_index: int | None = None) -> SimStream:
        stream = SimStream(self, name, self.device_index if device_index is None else device_index)
        self.streams.append(stream)
        return stream

    def set_current(self, stream: SimStream) -> None:
        """Make ``stream`` its device's current stream (``torch.cuda.set_stream``)."""
        self._current[stream.device_index] = stream

    def current_stream(self, device_index: int | None = None) -> SimStream:
        return self._current[self.current_device if device_index is None else device_index]

    # -- Transport ---------------------------------------------------------------------
    def alloc_host(self, nbytes: int) -> torch.Tensor:
        host = torch.empty(nbytes, dtype=torch.uint8)
        self._host_ranges.append((host.data_ptr(), host.data_ptr() + nbytes))
        return host

    def alloc_device(self, nbytes: int, stream: SimStream | None = None) -> torch.Tensor:
        return torch.full((nbytes,), 0xAB, dtype=torch.uint8)

    def new_fence(self) -> SimFence:
        return SimFence(self)

    def resolve_stream(self, stream: SimStream | None) -> SimStream:
        if stream is None:
            return self._current[self.device_index]  # the pool's device, whatever device is current
        if not isinstance(stream, SimStream) or stream.gpu is not self:
            raise DeviceMismatchError(f"'stream' must be a SimStream of this LaggingGpu (got {stream!r})")
        if stream.device_index != self.device_index:
            raise DeviceMismatchError(
                f"'stream' must be on the pool's device {self.device_index} (got one on {stream.device_index})"
            )
        return stream

    def same_stream(self, a: SimStream, b: SimStream) -> bool:
        return a is b

    def capturing(self, stream: SimStream) -> bool:
        # As the CUDA transport asks: the stage's stream, the pool device's current stream and
        # the current device's current stream.
        current = self._current
        return stream.capturing or current[self.device_index].capturing or current[self.current_device].capturing

    def resolve_for_stage(self, stream: SimStream | None) -> tuple[SimStream, bool]:
        resolved = self.resolve_stream(stream)
        return resolved, self.capturing(resolved)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: SimStream) -> None:
        to_host = self._is_host(dst)
        pinned = dst if to_host else src
        snapshot = pinned.clone()
        label = f"copy on {stream.name}"

        def run() -> None:
            if not torch.equal(pinned, snapshot):
                side = "destination" if to_host else "source"
                self.races.append(f"{label}: pinned {side} rewritten by the host while the copy was pending")
            dst.copy_(src)

        self.submit(stream, run, "cudaMemcpyAsync")

    def stream_wait(self, waiter: SimStream, fence: SimFence) -> None:
        self.stream_waits += 1
        self.submit(waiter, lambda: None, "cudaStreamWaitEvent", wait_for=fence.marker)

    def fill(self, dst_device: torch.Tensor, byte: int, stream: SimStream) -> None:
        self.submit(stream, lambda: dst_device.fill_(byte), "fill")

    def check_zero_copy(self, host_slab: torch.Tensor) -> tuple[PlatformReport, torch.Tensor | None]:
        # The simulated device reads host memory: a zero-copy view *is* the pinned slab, and
        # a kernel queued on it reads whatever the host wrote there by the time it runs.
        return in_place_report("the simulator"), host_slab

    # -- test hooks: kernels that read or write device memory --------------------------
    def enqueue_check(
        self,
        device_view: torch.Tensor,
        expected: np.ndarray[Any, Any] | torch.Tensor,
        label: str,
        stream: SimStream | None = None,
    ) -> None:
        """Queue a "kernel" on ``stream`` (default: the pool device's current) that reads ``device_view``."""
        want = torch.as_tensor(np.asarray(expected)) if not isinstance(expected, torch.Tensor) else expected.clone()

        def run() -> None:
            got = device_view.reshape(-1).to(want.dtype)
            if not torch.equal(got, want.reshape(-1)):
                held, expected = got.tolist()[:8], want.tolist()[:8]  # sync-ok: the simulated device is host memory
                self.mismatches.append(f"{label}: device held {held}, expected {expected}")

        self.submit(self._target(stream), run, "kernel")

    def enqueue_write(self, device_dst: torch.Tensor, values: torch.Tensor, stream: SimStream | None = None) -> None:
        """Queue a "kernel" on ``stream`` that writes ``values`` into ``device_dst`` (a producer)."""
        held = values.clone()
        self.submit(self._target(stream), lambda: device_dst.copy_(held), "kernel")

    def run_until(self, done: Callable[[], bool]) -> None:
        while not done():
            if not self._step():
                raise RuntimeError("simulated device deadlock: no stream can make progress")

    def drain(self) -> None:
        self.run_until(lambda: self.pending == 0)

    def note_capture_unsafe(self, call: str) -> None:
        """Record ``call`` as an error while any stream captures (CUDA's global capture mode refuses it)."""
        for stream in self.streams:
            if stream.capturing:
                self.errors.append(f"{call} while {stream!r} captures a graph: refused, the capture invalidated")
                return

    # -- internals ---------------------------------------------------------------------
    def submit(self, stream: SimStream, op: Op, call: str, wait_for: _Marker | None = None) -> None:
        if stream.device_index != self.device_index:
            # CUDA rejects work for one device's event or memory on another device's stream.
            self.errors.append(f"{call} on {stream!r} for a pool on device {self.device_index}")
        if stream.capturing:
            self.errors.append(f"{call} on {stream!r} while it captures a graph: baked in, replayed later")
        self.calls.append((call, stream.name))
        stream.queue.append((op, wait_for))
        self.pending += 1
        # The device catches up to a random lag behind the host, stream by stream.
        lag = self.rng.randint(0, self.max_lag)
        while not self.frozen and self.pending > lag and self._step():
            pass

    def _step(self) -> bool:
        runnable = [s for s in self.streams if s.queue and (s.queue[0][1] is None or s.queue[0][1].done)]
        if not runnable:
            return False
        stream = runnable[0] if len(runnable) == 1 else self.rng.choices(runnable, [s.speed for s in runnable])[0]
        op, _ = stream.queue.popleft()
        op()
        self.pending -= 1
        return True

    def _target(self, stream: SimStream | None) -> SimStream:
        return self._current[self.device_index] if stream is None else stream

    def _is_host(self, t: torch.Tensor) -> bool:
        ptr = t.data_ptr()
        return any(lo <= ptr < hi for lo, hi in self._host_ranges)
