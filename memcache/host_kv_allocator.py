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
    """KV slots 1..size on a host stack; slot 0 is reserved as padding. Nothing touches the device.

    The free slots are ``stack[:top]``; ``where[s]`` is slot s's last place in the stack, so
    s is free exactly when ``where[s] < top`` and ``stack[where[s]] == s``. An allocation
    then only moves ``top`` down and copies the slots out: one numpy operation per decode
    step, where an in-use bitmap cost a second one (right after a step's launches each
    numpy call runs cold and costs more than its work). Freeing (a finished request, rare) pays the check.
    """

    def __init__(self, size: int) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise AllocationError(f"'size' must be an int >= 1 (got {size!r})")
        self.size = size
        # A stack whose top is the end: alloc takes the last n, free appends.
        self._stack = np.arange(size, 0, -1, dtype=np.int64)
        self._top = size
        self._where = np.zeros(size + 1, dtype=np.int64)
        self._where[self._stack] = np.arange(size)
        self._where[0] = size  # slot 0 is never free (never handed out, never taken back)

    def available_size(self) -> int:
        return self._top

    def alloc(self, n: int) -> np.ndarray[Any, Any]:
        """int64 [n] slot indices (a fresh array), or ``AllocationError`` with nothing taken."""
        taken = np.empty(self._check_n(n), dtype=np.int64)
        self._take(taken)
        return taken

    def alloc_into(self, out: np.ndarray[Any, Any]) -> None:
        """Write ``len(out)`` fresh slot indices into ``out`` (int64 [n], the caller's: a staged
        image's column, say); ``AllocationError`` with nothing taken and ``out`` untouched."""
        if not isinstance(out, np.ndarray) or out.ndim != 1 or out.dtype != np.int64 or not out.flags.writeable:
            raise AllocationError(f"'out' must be a writable 1-D int64 numpy array (got {type(out).__name__})")
        self._check_n(out.shape[0])
        self._take(out)

    def _take(self, out: np.ndarray[Any, Any]) -> None:
        """Move the top ``len(out)`` free slots into ``out`` (checked by the caller)."""
        top = self._top - out.shape[0]
        out[:] = self._stack[top : self._top][::-1]
        self._top = top

    def free(self, slots: np.ndarray[Any, Any]) -> None:
        """Return slots (int [k]); every slot is checked before any is freed (all or nothing)."""
        if not isinstance(slots, np.ndarray) or slots.ndim != 1 or slots.dtype.kind not in "iu":
            raise AllocationError(f"'slots' must be a 1-D integer numpy array (got {type(slots).__name__})")
        k = slots.shape[0]
        if k == 0:
            return
        if int(slots.min()) < 1 or int(slots.max()) > self.size:
            raise AllocationError(f"'slots' must lie in [1, {self.size}] (got {int(slots.min())}..{int(slots.max())})")
        where = self._where[slots]
        free_now = (where < self._top) & (self._stack[np.minimum(where, self.size - 1)] == slots)
        if free_now.any() or np.unique(slots).shape[0] != k:
            raise AllocationError("'slots' holds a slot that is not in use, or one twice (double free)")
        top = self._top
        self._stack[top : top + k] = slots
        self._where[slots] = np.arange(top, top + k)
        self._top = top + k

    def _check_n(self, n: int) -> int:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise AllocationError(f"'n' must be an int >= 0 (got {n!r})")
        if n > self._top:
            raise AllocationError(
                f"'n' asks for {n} KV slots but only {self._top} of {self.size} are free; "
                "finish or preempt requests first, or build a larger KV pool"
            )
        return n
