"""Counters a pool keeps, and the immutable snapshot ``PinnedRingBuffer.stats()`` returns."""

from __future__ import annotations

import attrs

from pinpool.platform import PlatformReport


@attrs.define
class Counters:
    """Mutable counters, bumped on the hot path with plain attribute adds."""

    stages: int = 0
    copies: int = 0
    bytes_copied: int = 0
    stalls: int = 0
    stall_seconds: float = 0.0
    max_stall_seconds: float = 0.0
    overflows: int = 0
    aborted_stages: int = 0
    owned_stages: int = 0
    host_allocations: int = 0
    device_allocations: int = 0
    readbacks: int = 0
    bytes_read_back: int = 0
    readback_waits: int = 0
    readback_wait_seconds: float = 0.0
    zero_copy_stages: int = 0


@attrs.frozen
class PoolStats(Counters):
    """A snapshot of a pool's counters (the same fields, frozen), and its zero-copy platform check.

    ``stalls`` and ``stall_seconds`` count the host waits of rule 1 (README), the only ones the
    pool makes; ``host_allocations`` counts pinned buffers (one at construction, one per spilled
    put); ``readback_waits`` counts reads of a ``Readback`` whose copy had not landed yet (an
    overlapped loop keeps it at 0); ``zero_copy_stages`` counts stages read in place (also in
    ``stages``), and ``platform`` is the start-up check behind them.
    """

    platform: PlatformReport = attrs.field(factory=PlatformReport.unchecked)

    @classmethod
    def of(cls, counters: Counters, platform: PlatformReport | None = None) -> PoolStats:
        # getattr over a fixed field list: attrs.asdict is several times slower, and engines
        # read stats every step. (mypy cannot count the star-args, which stop before ``platform``.)
        values = [getattr(counters, name) for name in _FIELDS]
        return cls(*values, platform=platform or PlatformReport.unchecked())  # type: ignore[misc]


_FIELDS = tuple(field.name for field in attrs.fields(Counters))
