"""``land``: a kernel writes its output straight into a ring slot's pinned memory (zero-copy read-back).

A graph replay's outputs (the sampled tokens) normally come back by a device-to-host copy
queued after the replay: one more CUDA call a step. A landing field (``Field.landing``)
instead stages, in the step's one copy, the pinned host address each live row's value should go to, and
the graph's last kernel (``land``, captured with it) stores each value there over the
bus. Padding rows carry address 0 and store nothing. The addresses are read on the
device when the kernel runs, so one captured graph writes into whichever slot the step
staged: the ring's rotation and fences work as for a copy.

The slot's fence, recorded when the stage closes, follows the kernel (it must be launched
before close, on the stage's stream or on a registered reader); the host reads the values
after that fence, through the ``Landing`` handle.

Needs host memory the device can write at the host's address (UVA pinned memory): a pool
created with ``PoolSettings(zero_copy=True)`` whose platform check passed.
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
#: struct format per landing tag (``pinpool.stage.LANDING_TAG``): what the reference stores.
_PACK = {0: "=q", 1: "=i", 2: "=f"}


def __getattr__(name: str) -> Any:
    """``store_landed`` and ``BLOCK`` (for kernels that land their own output), loaded on first use.

    Triton is imported here, not at the top: the pool and the CPU reference work without it.
    """
    if name in ("store_landed", "BLOCK"):
        from pinpool import landing_kernel

        return getattr(landing_kernel, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def land(values: torch.Tensor, addresses: torch.Tensor) -> None:
    """Store ``values[i]`` at host address ``addresses[i]`` for each i whose address is not 0.

    ``values``: contiguous 1-D, a ``LANDING_DTYPES`` dtype; ``addresses``: contiguous 1-D
    int64 of the same length on the same device, as a landing staged them (``Stage.land``,
    or a ``Field.landing`` field of a layout): each carries its landing's
    dtype in its two low bits, and the value is stored converted to it. On CUDA tensors
    one kernel on the current stream (capturable); on CPU tensors the reference
    (``land_reference``), or the kernel under ``TRITON_INTERPRET=1``.
    """
    _check(values, addresses)
    n = values.numel()
    if n == 0:
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
        raise StagingTypeError(
            f"'values' must be a tensor of {[str(d) for d in LANDING_DTYPES]} "
            f"(got {getattr(values, 'dtype', type(values).__name__)})"
        )
    if not isinstance(addresses, torch.Tensor) or addresses.dtype != torch.int64:
        raise StagingTypeError(
            f"'addresses' must be an int64 tensor (got {getattr(addresses, 'dtype', type(addresses).__name__)})"
        )
    if values.dim() != 1 or addresses.dim() != 1 or values.shape != addresses.shape:
        raise StagingValueError(
            f"'values' and 'addresses' must be 1-D of one length (got {tuple(values.shape)} and "
            f"{tuple(addresses.shape)})"
        )
    if not (values.is_contiguous() and addresses.is_contiguous()):
        raise StagingValueError("'values' and 'addresses' must be contiguous")
    if values.device != addresses.device:
        raise DeviceMismatchError(
            f"'values' and 'addresses' must be on one device (got {values.device} and {addresses.device})"
        )
