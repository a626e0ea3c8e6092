"""Errors raised by the memcache package (all are ``pinpool.PinpoolError`` too)."""

from __future__ import annotations

from pinpool.exceptions import PinpoolError


class AllocationError(PinpoolError, RuntimeError):
    """A row or KV-slot allocation cannot be satisfied, or a free is invalid."""


class CacheIndexError(PinpoolError, ValueError):
    """``write_cache_indices`` inputs are inconsistent or out of bounds (caught before launch)."""
