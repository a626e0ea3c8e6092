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
    """A frozen snapshot of the counters (docs/structure.md says what they count) and the zero-copy ``platform``."""

    platform: PlatformReport = attrs.field(factory=PlatformReport.unchecked)

    @classmethod
    def of(cls, counters: Counters, platform: PlatformReport | None = None) -> PoolStats:
        # Engines read stats every step: getattr over a fixed list beats attrs.asdict. (mypy cannot count star-args.)
        values = [getattr(counters, name) for name in _FIELDS]
        return cls(*values, platform=platform or PlatformReport.unchecked())  # type: ignore[misc]


_FIELDS = tuple(field.name for field in attrs.fields(Counters))
