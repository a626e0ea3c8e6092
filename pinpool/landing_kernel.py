"""The Triton side of ``pinpool.landing``, imported at the first launch so that the pool needs no triton."""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

BLOCK = 256


@triton.jit
def store_landed(addr, value, mask):
    """Store ``value`` at a tagged landing address as the landing's dtype (``LANDING_TAG``: 0 int64, 1 int32,
    2 float32); address 0 (padding) and tag 3 store nothing, and no store runs past the landing."""
    tag = addr & 3
    base = addr - tag
    live = mask & (addr != 0)
    tl.store(base.to(tl.pointer_type(tl.int64)), value.to(tl.int64), mask=live & (tag == 0))
    tl.store(base.to(tl.pointer_type(tl.int32)), value.to(tl.int32), mask=live & (tag == 1))
    tl.store(base.to(tl.pointer_type(tl.float32)), value.to(tl.float32), mask=live & (tag == 2))


@triton.jit(do_not_specialize=["n"])
def _land_kernel(values_ptr, addr_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    addr = tl.load(addr_ptr + offs, mask=inside, other=0)  # 0 on padding rows
    store_landed(addr, tl.load(values_ptr + offs, mask=inside, other=0), inside)


def launch_land(values: torch.Tensor, addresses: torch.Tensor) -> None:
    """One ``_land_kernel`` over ``values`` [n] and ``addresses`` [n] int64, already checked by ``land``."""
    n = values.numel()
    # Triton launches on the current device's stream: run under the tensors' device.
    other = values.device.type == "cuda" and values.device.index != torch.cuda.current_device()
    with torch.cuda.device(values.device) if other else contextlib.nullcontext():
        _land_kernel[(triton.cdiv(n, BLOCK),)](values, addresses, n, BLOCK=BLOCK)
