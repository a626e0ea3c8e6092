"""``land``: a kernel stores its output straight into a slot's pinned memory (docs/layouts.md, landings)."""

from __future__ import annotations

import ctypes
import os
import struct
from typing import Any

import torch

from pinpool.exceptions import DeviceMismatchError, StagingTypeError, StagingValueError

LANDING_DTYPES = (torch.int64, torch.int32, torch.float32)  # what ``land`` takes; stored as the landing's dtype
_PACK = {0: "=q", 1: "=i", 2: "=f"}  # struct format per landing tag (``pinpool.layout.LANDING_TAG``)


def __getattr__(name: str) -> Any:
    """``store_landed`` and ``BLOCK``, for kernels that land their own output: Triton loads on first use."""
    if name in ("store_landed", "BLOCK"):
        from pinpool import landing_kernel

        return getattr(landing_kernel, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def land(values: torch.Tensor, addresses: torch.Tensor) -> None:
    """Store ``values[i]`` at host address ``addresses[i]`` (int64, its landing's dtype tagged in the two low
    bits) for each i whose address is not 0. CUDA: one capturable kernel on the current stream; CPU:
    ``land_reference``, or the kernel under ``TRITON_INTERPRET=1``."""
    _check(values, addresses)
    if values.numel() == 0:
        return
    if values.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        from pinpool.landing_kernel import launch_land

        launch_land(values, addresses)
    else:
        land_reference(values, addresses)


def land_reference(values: torch.Tensor, addresses: torch.Tensor) -> None:
    """The kernel's oracle on CPU tensors: each row with a non-zero address stores its value as its tag says."""
    _check(values, addresses)
    if values.device.type != "cpu":
        raise DeviceMismatchError(f"'values' of land_reference must be CPU tensors (got {values.device})")
    for value, addr in zip(values.tolist(), addresses.tolist(), strict=True):  # sync-ok: CPU tensors, no device
        tag = addr & 3
        if addr and tag in _PACK:
            packed = struct.pack(_PACK[tag], int(value) if tag < 2 else float(value))
            ctypes.memmove(addr - tag, packed, len(packed))


def _check(values: torch.Tensor, addresses: torch.Tensor) -> None:
    if not isinstance(values, torch.Tensor) or values.dtype not in LANDING_DTYPES:
        got = getattr(values, "dtype", type(values).__name__)
        raise StagingTypeError(f"'values' must be a tensor of {[str(d) for d in LANDING_DTYPES]} (got {got})")
    if not isinstance(addresses, torch.Tensor) or addresses.dtype != torch.int64:
        got = getattr(addresses, "dtype", type(addresses).__name__)
        raise StagingTypeError(f"'addresses' must be an int64 tensor (got {got})")
    if values.dim() != 1 or addresses.dim() != 1 or values.shape != addresses.shape:
        shapes = f"{tuple(values.shape)} and {tuple(addresses.shape)}"
        raise StagingValueError(f"'values' and 'addresses' must be 1-D of one length (got {shapes})")
    if not (values.is_contiguous() and addresses.is_contiguous()):
        raise StagingValueError("'values' and 'addresses' must be contiguous")
    if values.device != addresses.device:
        raise DeviceMismatchError(
            f"'values' and 'addresses' must be on one device (got {values.device} and {addresses.device})"
        )
