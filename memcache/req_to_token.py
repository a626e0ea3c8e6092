"""``ReqToTokenPool``: one row of KV-slot indices per running request."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from memcache.exceptions import AllocationError
from pinpool.log import get_logger

_log = get_logger("memcache")


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise AllocationError(f"'{name}' must be an int >= {minimum} (got {value!r})")
    return value


class ReqToTokenPool:
    """``req_to_token``: int32 [size, max_context_len] on ``device``; rows are handed out on the host.

    The free list lives on the host (the scheduler decides allocation there), so
    ``alloc`` and ``free`` never touch the device.
    """

    def __init__(self, size: int, max_context_len: int, device: torch.device | str) -> None:
        self.size = _check_int("size", size, 1)
        self.max_context_len = _check_int("max_context_len", max_context_len, 1)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=device)
        self.device = self.req_to_token.device  # resolved: "cuda" becomes "cuda:<current>"
        self._free_rows: list[int] = list(range(size - 1, -1, -1))  # a stack: pop from the end
        self._row_is_free = bytearray(b"\x01" * size)

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self, n: int) -> list[int]:
        """``n`` free row indices, or ``AllocationError`` with nothing taken."""
        _check_int("n", n, 0)
        free = len(self._free_rows)
        if n > free:
            raise AllocationError(
                f"'n' asks for {n} request rows but only {free} of {self.size} are free; "
                "finish or preempt requests first, or build a larger ReqToTokenPool"
            )
        if n == 0:
            return []
        rows = self._free_rows[-n:]
        del self._free_rows[-n:]
        for row in rows:
            self._row_is_free[row] = 0
        return rows

    def free(self, rows: int | Iterable[int]) -> None:
        """Return rows; every row is checked before any is freed (all or nothing)."""
        batch = [rows] if isinstance(rows, int) else list(rows)
        seen = set()
        for row in batch:
            if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < self.size:
                raise AllocationError(f"'rows' must be ints in [0, {self.size}) (got {row!r})")
            if self._row_is_free[row] or row in seen:
                raise AllocationError(f"'rows' holds row {row}, which is already free (double free)")
            seen.add(row)
        for row in batch:
            self._row_is_free[row] = 1
        self._free_rows.extend(batch)
