"""``LaggingGpu``: a deterministic stand-in for a CUDA device that runs behind the host.

Copies, fills and checks are queued and executed later, a random number of operations
behind, as a real GPU would. It records two kinds of failure instead of raising, so a
property test can report them:
- ``races``: a copy whose host source changed between enqueue and execution (the host
  wrote a region while a copy that reads it was pending: design invariant 1 broken);
- ``mismatches``: a queued check whose device view did not hold the expected values when
  the "GPU" reached it (a staged value did not arrive intact).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

Op = Callable[[], None]


class SimFence:
    def __init__(self, gpu: LaggingGpu) -> None:
        self._gpu = gpu
        self._position = 0  # ops that must have executed for the fence to pass

    def record(self, stream: Any) -> None:
        self._position = self._gpu.enqueued

    def query(self) -> bool:
        return self._gpu.executed >= self._position

    def synchronize(self) -> None:
        self._gpu.host_waits += 1
        self._gpu.run_until(self._position)


class LaggingGpu:
    """A ``Transport`` whose device is host memory and whose queue runs up to ``max_lag`` ops late."""

    pinned = True
    path = "simulated"

    def __init__(self, max_lag: int = 8, seed: int = 0) -> None:
        self.device = torch.device("cpu")
        self.max_lag = max_lag
        self._rng = random.Random(seed)
        self._queue: deque[Op] = deque()
        self.enqueued = 0
        self.executed = 0
        self.host_waits = 0
        self.races: list[str] = []
        self.mismatches: list[str] = []

    # -- Transport ---------------------------------------------------------------------
    def alloc_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def alloc_device(self, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), 0xAB, dtype=torch.uint8)

    def new_fence(self) -> SimFence:
        return SimFence(self)

    def check_stream(self, stream: Any) -> None:
        return None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        snapshot = src.clone()
        index = self.enqueued

        def run() -> None:
            if not torch.equal(src, snapshot):
                self.races.append(f"copy #{index}: source rewritten while the copy was pending")
            dst.copy_(src)

        self._push(run)

    def stream_wait(self, waiter: Any, fence: Any) -> None:
        return None

    def fill(self, dst_device: torch.Tensor, byte: int, stream: Any) -> None:
        def run() -> None:
            dst_device.fill_(byte)

        self._push(run)

    # -- test hooks --------------------------------------------------------------------
    def enqueue_check(
        self, device_view: torch.Tensor, expected: np.ndarray[Any, Any] | torch.Tensor, label: str
    ) -> None:
        """Queue a "kernel" that reads ``device_view`` and compares it to ``expected``."""
        want = torch.as_tensor(np.asarray(expected)) if not isinstance(expected, torch.Tensor) else expected.clone()

        def run() -> None:
            got = device_view.reshape(-1).to(want.dtype)
            if not torch.equal(got, want.reshape(-1)):
                held, expected = got.tolist()[:8], want.tolist()[:8]  # sync-ok: the simulated device is host memory
                self.mismatches.append(f"{label}: device held {held}, expected {expected}")

        self._push(run)

    def run_until(self, position: int) -> None:
        while self.executed < position:
            self._step()

    def drain(self) -> None:
        self.run_until(self.enqueued)

    # -- internals ---------------------------------------------------------------------
    def _push(self, op: Op) -> None:
        self._queue.append(op)
        self.enqueued += 1
        # The GPU catches up to a random lag behind the host.
        lag = self._rng.randint(0, self.max_lag)
        while self.enqueued - self.executed > lag:
            self._step()

    def _step(self) -> None:
        op = self._queue.popleft()
        op()
        self.executed += 1
