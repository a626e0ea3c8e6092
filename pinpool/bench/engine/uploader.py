"""The four ways a host-to-device staging site can run, behind one call.

- ``sync``: a device tensor made from the list per field (a pageable copy and a stream sync);
- ``pinned``: per field ``torch.tensor(list, pin_memory=True).to(non_blocking=True)``
  (sglang PR #28076): no sync, a pinned allocation and a copy per field;
- ``persistent``: one persistent pinned buffer per field and site, one event wait per
  site use before it is rewritten, a copy per field (the vLLM V1 runner's shape);
- ``pool``: one ``PinnedRingBuffer`` stage, one copy for all fields;
- ``pool-zc``: ``pool`` at every site, except the decode step's exchange (rows and
  positions up, tokens back), which is a zero-copy stage: no upload copy, the step's
  kernels read the pinned slot in place (``engine.loop``). Its pool is created with
  ``PoolSettings(zero_copy=True)``; on a platform that refused zero-copy the engine
  refuses the mode at creation (``PlatformError``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch

from pinpool import PinnedRingBuffer

Mode = Literal["sync", "pinned", "persistent", "pool", "pool-zc"]
MODES: tuple[Mode, ...] = ("sync", "pinned", "persistent", "pool", "pool-zc")
#: The modes that stage through the pool's one-copy paths (uploads, batch builds, read-backs).
POOL_MODES: frozenset[Mode] = frozenset(("pool", "pool-zc"))
Fields = Sequence[tuple[Any, torch.dtype]]


class Uploader:
    """``upload(site, fields)`` -> device tensors, valid at least until the next upload to ``site``."""

    def __init__(self, mode: Mode, device: torch.device, pool: PinnedRingBuffer) -> None:
        if mode not in MODES:
            raise ValueError(f"'mode' must be one of {', '.join(MODES)} (got {mode!r})")
        self.mode = mode
        self._pooled = mode in POOL_MODES
        self.device = device
        self.pool = pool
        self._pin = device.type == "cuda"
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}  # persistent: (site, field) -> pinned buffer
        self._events: dict[str, Any] = {}  # persistent: site -> event of its last copies
        self.waits = 0  # persistent: event waits that actually blocked
        self.wait_seconds = 0.0

    def upload(self, site: str, fields: Fields) -> list[torch.Tensor]:
        if self._pooled:
            with self.pool.stage() as st:
                return [st.put(values, dtype) for values, dtype in fields]
        if self.mode == "sync":
            # The synchronous mode under comparison: a pageable copy and a stream sync per field.
            return [torch.tensor(v, dtype=d, device=self.device) for v, d in fields]  # sync-ok: the mode compared
        if self.mode == "pinned":
            return [
                torch.tensor(values, dtype=dtype, pin_memory=self._pin).to(self.device, non_blocking=True)
                for values, dtype in fields
            ]
        return self._persistent(site, fields)

    def _persistent(self, site: str, fields: Fields) -> list[torch.Tensor]:
        event = self._events.get(site)
        if event is not None and not event.query():
            self.waits += 1
            start = time.perf_counter()
            event.synchronize()  # sync-ok: the persistent pattern's one wait per site use
            self.wait_seconds += time.perf_counter() - start
        out = []
        for i, (values, dtype) in enumerate(fields):
            n = len(values)
            buf = self._buffers.get((site, i))
            if buf is None or buf.numel() < n or buf.dtype != dtype:
                buf = self._buffers[(site, i)] = torch.empty(max(n, 64) * 2, dtype=dtype, pin_memory=self._pin)
            buf.numpy()[:n] = np.asarray(values)
            out.append(buf[:n].to(self.device, non_blocking=True, copy=True))
        if self._pin:
            event = self._events[site] = self._events.get(site) or torch.cuda.Event()
            event.record()
        return out
