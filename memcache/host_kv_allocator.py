"""``HostKVAllocator``: KV-cache slot indices handed out on the host.

``TokenToKVPoolAllocator`` keeps its free list on the device (sglang's shape), so the
host never knows which slots a step writes and a graph input holding them must be
filled by a device-to-device copy. Keeping the free list on the host (vLLM's block
manager is host-side too) lets the scheduler write each step's slots into the same
staged block as the rest of its metadata: one host-to-device copy for all of it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from memcache.exceptions import AllocationError


class HostKVAllocator:
    """KV slots 1..size on a host stack; slot 0 is reserved as padding. Nothing touches the device."""

    def __init__(self, size: int) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise AllocationError(f"'size' must be an int >= 1 (got {size!r})")
        self.size = size
        # A stack whose top is the end: alloc takes the last n, free appends.
        self._stack = np.arange(size, 0, -1, dtype=np.int64)
        self._top = size
        self._in_use = np.zeros(size + 1, dtype=np.bool_)

    def available_size(self) -> int:
        return self._top

    def alloc(self, n: int) -> np.ndarray[Any, Any]:
        """int64 [n] slot indices (a fresh array), or ``AllocationError`` with nothing taken."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise AllocationError(f"'n' must be an int >= 0 (got {n!r})")
        if n > self._top:
            raise AllocationError(
                f"'n' asks for {n} KV slots but only {self._top} of {self.size} are free; "
                "finish or preempt requests first, or build a larger KV pool"
            )
        top = self._top - n
        taken = self._stack[top : self._top][::-1].copy()
        self._top = top
        self._in_use[taken] = True
        return taken

    def free(self, slots: np.ndarray[Any, Any]) -> None:
        """Return slots (int [k]); every slot is checked before any is freed (all or nothing)."""
        if not isinstance(slots, np.ndarray) or slots.ndim != 1 or slots.dtype.kind not in "iu":
            raise AllocationError(f"'slots' must be a 1-D integer numpy array (got {type(slots).__name__})")
        k = slots.shape[0]
        if k == 0:
            return
        if int(slots.min()) < 1 or int(slots.max()) > self.size:
            raise AllocationError(f"'slots' must lie in [1, {self.size}] (got {int(slots.min())}..{int(slots.max())})")
        if not self._in_use[slots].all() or np.unique(slots).shape[0] != k:
            raise AllocationError("'slots' holds a slot that is not in use, or one twice (double free)")
        self._in_use[slots] = False
        self._stack[self._top : self._top + k] = slots
        self._top += k
