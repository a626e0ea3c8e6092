"""``land``: a kernel stores its output straight into a ring slot's pinned memory (zero-copy read-back).

A landing field (``Field.landing``) stages, in the step's one copy, each live row's pinned host
address (0 on padding rows); ``land``, captured with the graph, stores each value there, so no copy
follows the step. Launch it before the stage closes (so the slot's fence follows it) and read the
values through the ``Landing`` handle. Needs a pool with ``PoolSettings(zero_copy=True)``.
"""

from __future__ import annotations

import ctypes
import os
import struct
from typing import Any

import torch

from pinpool.exceptions import DeviceMismatchError, StagingTypeError, StagingValueError

#: The dtypes a writer may hand ``land`` (each value is stored as its landing's dtype).
LANDING_DTYPES = (torch.int64, torch.int32, torch.float32)
#: struct format per landing tag (``pinpool.layout.LANDING_TAG``): what the reference stores.
_PACK = {0: "=q", 1: "=i", 2: "=f"}


def __getattr__(name: str) -> Any:
    """``store_landed`` and ``BLOCK``, for kernels that land their own output: Triton loads on first use."""
    if name in ("store_landed", "BLOCK"):
        from pinpool import landing_kernel

        return getattr(landing_kernel, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def land(values: torch.Tensor, addresses: torch.Tensor) -> None:
    """Store ``values[i]`` at host address ``addresses[i]`` for each i whose address is not 0.

    ``addresses``: int64 as a landing staged them, each tagged in its two low bits with the landing's
    dtype, which the value is stored as. CUDA tensors: one capturable kernel on the current stream;
    CPU tensors: ``land_reference``, or the kernel under ``TRITON_INTERPRET=1``.
    """
    _check(values, addresses)
    if values.numel() == 0:
        return
    if values.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        from pinpool.landing_kernel import launch_land

        launch_land(values, addresses)
        return
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
