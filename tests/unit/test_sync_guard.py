"""no_sync(): the copy rules it enforces, and that it restores what it patched."""

from __future__ import annotations

import pytest
import torch

from pinpool.exceptions import HostSyncError
from pinpool.testing import check_copy, no_sync

CUDA = torch.device("cuda", 0)


class FakeHost:
    """A CPU tensor stand-in whose pinned/contiguous flags a test chooses (CPU torch cannot pin)."""

    device = torch.device("cpu")

    def __init__(self, pinned: bool, contiguous: bool) -> None:
        self._pinned, self._contiguous = pinned, contiguous

    def is_pinned(self) -> bool:
        return self._pinned

    def is_contiguous(self) -> bool:
        return self._contiguous


@pytest.mark.parametrize(
    ("pinned", "contiguous", "non_blocking", "fragment"),
    [
        (False, True, True, "pageable"),
        (True, False, True, "non-contiguous pinned"),
        (True, True, False, "without non_blocking"),
    ],
)
def test_host_to_device_copies_that_block_are_refused(
    pinned: bool, contiguous: bool, non_blocking: bool, fragment: str
) -> None:
    """Catches the two cases set_sync_debug_mode misses, and a plain blocking copy."""
    with pytest.raises(HostSyncError, match=fragment):
        check_copy(FakeHost(pinned, contiguous), CUDA, non_blocking)  # type: ignore[arg-type]


def test_pinned_contiguous_non_blocking_copy_is_allowed() -> None:
    """Catches a guard so strict that the pool's own copy would trip it."""
    check_copy(FakeHost(True, True), CUDA, True)  # type: ignore[arg-type]
    check_copy(torch.empty(2), torch.device("cpu"), False)


def test_no_sync_restores_everything_it_patched() -> None:
    """Catches a guard that leaks its patches into code after the block."""
    before = (torch.Tensor.to, torch.Tensor.copy_, torch.Tensor.cuda, torch.cuda.synchronize)
    with pytest.raises(HostSyncError), no_sync(), no_sync():
        torch.cuda.synchronize()
    assert (torch.Tensor.to, torch.Tensor.copy_, torch.Tensor.cuda, torch.cuda.synchronize) == before


def test_cpu_work_inside_no_sync_is_untouched() -> None:
    """Catches a guard that breaks host-only tensor code (the CPU fallback runs inside it)."""
    with no_sync():
        a = torch.arange(4).to(torch.float32)
        b = torch.empty(4).copy_(a)
    assert b.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_no_sync_wraps_the_real_copy_entry_points() -> None:
    """Catches a guard whose patches are installed but never consulted by Tensor.to / .cuda."""
    with no_sync(), pytest.raises(HostSyncError, match="pageable"):
        torch.ones(3).to("cuda", non_blocking=True)
    with no_sync(), pytest.raises(HostSyncError, match="without non_blocking"):
        torch.ones(3).to(torch.device("cuda", 0))
    with no_sync(), pytest.raises(HostSyncError, match="pageable"):
        torch.ones(3).cuda(non_blocking=True)


def test_to_with_the_copy_keyword_is_allowed_inside_no_sync() -> None:
    """Catches the guard's own argument parsing rejecting ``Tensor.to(..., copy=True)`` (a CPU copy, no sync)."""
    with no_sync():
        out = torch.ones(3).to(torch.float64, copy=True)
    assert out.dtype == torch.float64
