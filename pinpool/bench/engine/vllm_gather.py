# mypy: disallow-untyped-defs=False, disallow-untyped-decorators=False, disallow-incomplete-defs=False
# (the Triton kernel takes untyped pointer arguments; its launcher is typed.)
"""The vllm+graph mode's per-step gather: graph inputs from per-request tables, in one kernel.

vLLM's Model Runner V2 writes a step's graph inputs with fused Triton kernels that read the
per-request tables through ``idx_mapping`` (``_prepare_pos_seq_lens_kernel`` and the block
table gather), and its sampler reads the sampling parameters from UVA tables the same way.
Here one kernel does that work for the reference engine's graph (written here in that
shape, not vLLM's code): per live row, the request row, its position (then the position
table's next value, +1) and its five sampling parameters, read from the UVA tables.
Request rows in one batch are distinct, so the +1 has no write race.

``gather_inputs`` launches it on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1`` (the
tests); elsewhere it runs ``gather_inputs_torch``, the reference, one op per field.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

#: The sampling fields gathered, in the kernel's argument order.
SAMPLING_NAMES = ("temperature", "top_p", "top_k", "min_p", "seed")
_BLOCK = 256


@triton.jit
def _gather_inputs_kernel(
    idx_ptr,  # int64 [bs]: request row of each live batch row (idx_mapping)
    pos_table_ptr,  # int64 [table rows]: next position per request row; +1 per gathered row
    rows_out_ptr,  # int64 [>= bs]: the block's request rows
    pos_out_ptr,  # int64 [>= bs]: the block's positions
    temperature_ptr,  # float32 [table rows] (UVA on CUDA)
    top_p_ptr,  # float32 [table rows]
    top_k_ptr,  # int32 [table rows]
    min_p_ptr,  # float32 [table rows]
    seed_ptr,  # int64 [table rows]
    temperature_out,  # float32 [>= bs]
    top_p_out,  # float32 [>= bs]
    top_k_out,  # int32 [>= bs]
    min_p_out,  # float32 [>= bs]
    seed_out,  # int64 [>= bs]
    bs,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < bs
    idx = tl.load(idx_ptr + offs, mask=live, other=0)
    tl.store(rows_out_ptr + offs, idx, mask=live)
    pos = tl.load(pos_table_ptr + idx, mask=live, other=0)
    tl.store(pos_out_ptr + offs, pos, mask=live)
    tl.store(pos_table_ptr + idx, pos + 1, mask=live)
    tl.store(temperature_out + offs, tl.load(temperature_ptr + idx, mask=live, other=1.0), mask=live)
    tl.store(top_p_out + offs, tl.load(top_p_ptr + idx, mask=live, other=1.0), mask=live)
    tl.store(top_k_out + offs, tl.load(top_k_ptr + idx, mask=live, other=0), mask=live)
    tl.store(min_p_out + offs, tl.load(min_p_ptr + idx, mask=live, other=0.0), mask=live)
    tl.store(seed_out + offs, tl.load(seed_ptr + idx, mask=live, other=0), mask=live)


def uses_triton(device: torch.device) -> bool:
    """Whether ``gather_inputs`` launches the kernel for tensors on ``device`` (else the torch reference)."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def gather_inputs(
    idx: torch.Tensor,
    positions: torch.Tensor,
    tables: Mapping[str, torch.Tensor],
    out: Mapping[str, torch.Tensor],
) -> None:
    """Write rows, positions and sampling fields of ``idx``'s requests into ``out``; positions table += 1.

    ``idx``: int64 [bs]; ``positions``: int64 [table rows]; ``tables``: the five sampling
    tables by name, [table rows] each; ``out``: "rows", "positions" and the five names,
    each contiguous with at least bs elements and its table's dtype.
    """
    bs = idx.numel()
    if idx.dtype != torch.int64 or positions.dtype != torch.int64:
        raise TypeError(f"'idx' and 'positions' must be int64 (got {idx.dtype}, {positions.dtype})")
    for name in ("rows", "positions", *SAMPLING_NAMES):
        view = out[name]
        if not view.is_contiguous() or view.numel() < bs:
            raise ValueError(f"out[{name!r}] must be contiguous with >= {bs} elements (got {tuple(view.shape)})")
    for name in SAMPLING_NAMES:
        if tables[name].dtype != out[name].dtype:
            raise TypeError(f"table {name!r} is {tables[name].dtype}, its output {out[name].dtype}")
    if bs == 0:
        return
    if not uses_triton(idx.device):
        gather_inputs_torch(idx, positions, tables, out)
        return
    _gather_inputs_kernel[(triton.cdiv(bs, _BLOCK),)](
        idx,
        positions,
        out["rows"],
        out["positions"],
        *(tables[name] for name in SAMPLING_NAMES),
        *(out[name] for name in SAMPLING_NAMES),
        bs,
        BLOCK=_BLOCK,
    )


def gather_inputs_torch(
    idx: torch.Tensor,
    positions: torch.Tensor,
    tables: Mapping[str, torch.Tensor],
    out: Mapping[str, torch.Tensor],
) -> None:
    """The reference: one ``index_select`` per field, then the position table's +1."""
    bs = idx.numel()
    out["rows"][:bs].copy_(idx)
    torch.index_select(positions, 0, idx, out=out["positions"][:bs])
    for name in SAMPLING_NAMES:
        torch.index_select(tables[name], 0, idx, out=out[name][:bs])
    positions.index_add_(0, idx, torch.ones_like(idx))
