"""The Triton side of ``pinpool.landing``, imported at the first launch so that the pool needs no triton."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256


@triton.jit
def store_landed(addr, value, mask):
    """Store ``value`` at a tagged landing address as the landing's dtype (``pinpool.layout.LANDING_TAG``).

    Tag 0: int64, 1: int32, 2: float32; address 0 (a padding row) and tag 3 store nothing. The
    width comes from the landing, never the writer: a store cannot run past the landing's bytes.
    """
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
    values = tl.load(values_ptr + offs, mask=inside, other=0)
    store_landed(addr, values, inside)


def launch_land(values: torch.Tensor, addresses: torch.Tensor) -> None:
    """One ``_land_kernel`` over ``values`` [n] and ``addresses`` [n] int64, already checked by ``land``."""
    n = values.numel()
    grid = (triton.cdiv(n, BLOCK),)
    # Triton launches on the current device's stream: run under the tensors' device.
    if values.device.type == "cuda" and values.device.index != torch.cuda.current_device():
        with torch.cuda.device(values.device):
            _land_kernel[grid](values, addresses, n, BLOCK=BLOCK)
        return
    _land_kernel[grid](values, addresses, n, BLOCK=BLOCK)
