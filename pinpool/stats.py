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
class PoolStats:
    """A snapshot of a pool's counters.

    ``stalls`` and ``stall_seconds`` count the host waits of rule 1 (README), the
    only host waits the pool ever makes; ``host_allocations`` counts pinned buffers
    the pool allocated (one at construction, plus one per spilled put).
    ``readback_waits`` counts reads of a ``Readback`` whose copy had not landed yet: the
    deliberate host wait of a device-to-host read, which an overlapped loop keeps at 0.
    ``zero_copy_stages`` counts stages read in place (no copy; also counted in ``stages``);
    ``platform`` is the start-up check behind them (``PinnedRingBuffer.platform``).
    """

    stages: int
    copies: int
    bytes_copied: int
    stalls: int
    stall_seconds: float
    max_stall_seconds: float
    overflows: int
    aborted_stages: int
    owned_stages: int
    host_allocations: int
    device_allocations: int
    readbacks: int
    bytes_read_back: int
    readback_waits: int
    readback_wait_seconds: float
    zero_copy_stages: int = 0
    platform: PlatformReport = attrs.field(factory=PlatformReport.unchecked)

    @classmethod
    def of(cls, counters: Counters, platform: PlatformReport | None = None) -> PoolStats:
        # Plain getattr over a fixed field list: attrs.asdict walks and copies every field
        # generically, at several times the cost, and engines read stats every step.
        # (mypy cannot count the star-args, which stop before ``platform``.)
        return cls(  # type: ignore[misc]
            *[getattr(counters, name) for name in _FIELDS], platform=platform or PlatformReport.unchecked()
        )


_FIELDS = tuple(field.name for field in attrs.fields(Counters))
assert tuple(field.name for field in attrs.fields(PoolStats))[: len(_FIELDS)] == _FIELDS
