"""The platform check's pieces that run without a GPU: the report, its log fields, settings; the lab's NUMA parsing."""

from __future__ import annotations

from pathlib import Path

import pytest

from pinpool import PinnedRingBuffer, PoolSettings, PoolStateError
from pinpool.bench.numa import host_numa_node, node_from_numa_maps, read_node_file
from pinpool.exceptions import PlatformError
from pinpool.platform import PlatformReport

MAPS = [
    "55d0c0000000 default file=/usr/bin/python3.11 mapped=10 N0=10 kernelpagesize_kB=4\n",
    "7f0000000000 default anon=300 dirty=300 N0=100 N1=200 kernelpagesize_kB=4\n",
    "7f1000000000 default file=/dev/nvidiactl\n",
]


def test_numa_maps_gives_the_node_holding_most_pages_of_the_mapping() -> None:
    """Catches the slab's node read from the wrong mapping (the next one, or the first)."""
    assert node_from_numa_maps(MAPS, 0x7F0000000000 + 4096) == 1
    assert node_from_numa_maps(MAPS, 0x55D0C0000000) == 0
    assert node_from_numa_maps(MAPS, 0x7F1000000010) is None  # a device mapping: the OS does not say
    assert node_from_numa_maps(MAPS, 0x1000) is None  # below every mapping


def test_sysfs_node_minus_one_or_unreadable_is_none(tmp_path: Path) -> None:
    """Catches -1 ("no affinity") or a missing sysfs file reported as a real NUMA node."""
    f = tmp_path / "numa_node"
    f.write_text("-1\n")
    assert read_node_file(str(f)) is None
    f.write_text("1\n")
    assert read_node_file(str(f)) == 1
    assert read_node_file(str(tmp_path / "missing")) is None


def test_host_numa_node_never_raises() -> None:
    """Catches the NUMA probe failing pool creation where the OS hides the node (containers, other arches)."""
    node = host_numa_node(id(object()))
    assert node is None or node >= 0


def test_an_unchecked_report_logs_off_and_refuses_with_the_setting_to_change() -> None:
    """Catches a pool without the check handing out zero-copy views, or an error that does not say what to do."""
    report = PlatformReport.unchecked()
    assert report.log_fields() == {"zero_copy": "off"}
    err = report.refusal(PoolSettings(device="cpu").device)
    assert isinstance(err, PoolStateError) and "PINPOOL_ZERO_COPY=1" in str(err)


def test_a_failed_report_refuses_with_a_platform_error_naming_the_reason() -> None:
    """Catches a failed check raising an untyped error, or one that does not say why."""
    report = PlatformReport(checked=True, zero_copy_ok=False, reason="the slab is not page-locked", pinned=False)
    err = report.refusal(PoolSettings(device="cpu").device)
    assert isinstance(err, PlatformError) and "not page-locked" in str(err) and "pool.stage()" in str(err)
    assert report.log_fields()["zero_copy"] == "refused"


def test_zero_copy_setting_reads_from_the_environment() -> None:
    """Catches PINPOOL_ZERO_COPY ignored, or the check run when it is off."""
    assert PoolSettings.from_env({"PINPOOL_ZERO_COPY": "1"}, device="cpu").zero_copy is True
    pool = PinnedRingBuffer(PoolSettings.from_env({}, device="cpu", slot_bytes=256))
    assert pool.platform.checked is False and pool.stats().platform == pool.platform


def test_pool_created_event_records_the_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches the check's outcome missing from the pool.created log event."""
    from pinpool import ring

    events: list[tuple[str, dict[str, object]]] = []

    class Capture:
        def info(self, event: str, **kw: object) -> None:
            events.append((event, kw))

    monkeypatch.setattr(ring, "_log", Capture())
    PinnedRingBuffer(PoolSettings(device="cpu", slot_bytes=256, zero_copy=True))
    (name, fields), *_ = events
    assert name == "pool.created" and fields["zero_copy"] == "ok"
