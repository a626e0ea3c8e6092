"""``TokenToKVPoolAllocator``: a device free list of KV-cache slot indices."""

from __future__ import annotations

import torch

from memcache.exceptions import AllocationError


class TokenToKVPoolAllocator:
    """KV slots 1..size live in a device free list; slot 0 is reserved as padding.

    The count of free slots is the free list's length, which torch keeps on the host,
    so ``alloc`` and ``available_size`` never read the device.
    """

    def __init__(self, size: int, device: torch.device | str) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise AllocationError(f"'size' must be an int >= 1 (got {size!r})")
        self.size = size
        self._free_slots = torch.arange(1, size + 1, dtype=torch.int64, device=device)
        self.device = self._free_slots.device  # resolved: "cuda" becomes "cuda:<current>"

    def available_size(self) -> int:
        return int(self._free_slots.shape[0])

    def alloc(self, n: int) -> torch.Tensor:
        """int64 [n] slot indices (a device view), or ``AllocationError`` with nothing taken."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise AllocationError(f"'n' must be an int >= 0 (got {n!r})")
        free = self.available_size()
        if n > free:
            raise AllocationError(
                f"'n' asks for {n} KV slots but only {free} of {self.size} are free; "
                "finish or preempt requests first, or build a larger KV pool"
            )
        taken = self._free_slots[:n]
        self._free_slots = self._free_slots[n:]
        return taken

    def free(self, indices: torch.Tensor) -> None:
        """Return slots (int64 [k] on this device). Values are not read back: no sync."""
        if not isinstance(indices, torch.Tensor) or indices.dim() != 1:
            raise AllocationError(f"'indices' must be a 1-D tensor (got {type(indices).__name__})")
        if indices.device != self.device:
            raise AllocationError(f"'indices' must be on {self.device} (got {indices.device})")
        if indices.dtype not in (torch.int32, torch.int64):
            raise AllocationError(f"'indices' must be int32 or int64 (got {indices.dtype})")
        if indices.numel() + self.available_size() > self.size:
            raise AllocationError(
                f"'indices' frees {indices.numel()} slots but only {self.size - self.available_size()} are in use"
            )
        if indices.numel():
            self._free_slots = torch.cat((self._free_slots, indices.to(torch.int64)))
