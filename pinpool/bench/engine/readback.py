"""Bringing a step's sampled tokens back to the host, per mode.

The loop reads step N's tokens while the GPU runs step N+1, so every reader except
``sync`` queues a device-to-pinned copy gated by an event and waits only if that event
has not passed when the host finally reads (counted in ``waits``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from pinpool import PinnedRingBuffer, Readback
from pinpool.bench.engine.uploader import POOL_MODES, Mode

Pending = Callable[[], list[int]]


class TokenReader:
    def __init__(self, mode: Mode, pool: PinnedRingBuffer) -> None:
        self.mode = mode
        self._pooled = mode in POOL_MODES
        self.pool = pool
        self._waits = 0  # host waits that actually blocked (plus every sync-mode read)
        self._wait_seconds = 0.0
        self._cuda = pool.device.type == "cuda"
        self._persistent: list[torch.Tensor] = []
        self._flip = 0

    @property
    def waits(self) -> int:
        """Reads that blocked on the GPU (plus every sync-mode read); in the pool modes, the pool counts them."""
        return self._waits + (self.pool.stats().readback_waits if self._pooled else 0)

    @property
    def wait_seconds(self) -> float:
        """Host seconds those reads waited."""
        return self._wait_seconds + (self.pool.readback_wait_seconds if self._pooled else 0.0)

    def start(self, tokens: torch.Tensor) -> Pending:
        """Queue the copy of ``tokens`` (int64 [n], device) now; the returned call reads it."""
        if self._pooled:
            return self.wrap(self.pool.readback(tokens))
        if not self._cuda:
            # Host memory: reading now costs no sync, and the source may be a buffer the
            # next step rewrites (the graph loop's out_tokens).
            now: list[int] = tokens.tolist()  # sync-ok: host memory (the CPU path), no device
            return lambda: now
        if self.mode == "sync":

            def read_sync() -> list[int]:
                self._waits += 1
                start = time.perf_counter()
                values: list[int] = tokens.tolist()  # sync-ok: the naive pattern under comparison
                self._wait_seconds += time.perf_counter() - start
                return values

            return read_sync
        n = tokens.numel()
        if self.mode == "pinned":
            host = torch.empty(n, dtype=torch.int64, pin_memory=True)
        else:  # persistent: two buffers, so the one being read is never the one being written
            self._flip ^= 1
            if len(self._persistent) < 2 or self._persistent[self._flip].numel() < n:
                self._grow(n)
            host = self._persistent[self._flip][:n]
        host.copy_(tokens, non_blocking=True)
        event: Any = torch.cuda.Event()
        event.record()

        def read_event() -> list[int]:
            if not event.query():
                self._waits += 1
                start = time.perf_counter()
                event.synchronize()  # sync-ok: the read of step N's tokens, normally already landed
                self._wait_seconds += time.perf_counter() - start
            return host.tolist()  # sync-ok: pinned host memory whose event has passed (waited above)

        return read_event

    def wrap(self, handle: Readback) -> Pending:
        """The read of a pool read-back already queued (``pool.readback``, ``Stage.readback``, a landing).

        The pool modes read with the handle's own ``tolist``: the pool counts and times a
        read that blocks (``readback_wait_seconds``), so nothing wraps it. A reader of
        another mode handed a pool handle (the graph loop's) counts its waits itself.
        """
        if self._pooled:
            return handle.tolist

        def read_pool() -> list[int]:
            if handle.ready():
                values: list[int] = handle.tolist()  # sync-ok: the copy has landed (ready() above)
                return values
            self._waits += 1
            start = time.perf_counter()
            values = handle.tolist()  # sync-ok: the deliberate, counted and timed wait of a late read
            self._wait_seconds += time.perf_counter() - start
            return values

        return read_pool

    def _grow(self, n: int) -> None:
        size = max(n, 256) * 2
        while len(self._persistent) < 2:
            self._persistent.append(torch.empty(size, dtype=torch.int64, pin_memory=True))
        self._persistent[self._flip] = torch.empty(size, dtype=torch.int64, pin_memory=True)
