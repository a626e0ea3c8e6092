"""Writing request rows of ``req_to_token``: the Triton kernel, its launcher, its reference.

Each program owns one request and copies its prefix (through a staged pointer whose bit
0 says int64, else int32: ``memcache.prefix_check``) and its newly allocated KV slots
(from ``out_cache_loc`` at a staged start offset). Work is O(total tokens + bs): start
offsets come in precomputed, where sglang's kernel sums ``extend_lens[0:pid]`` in every
program (O(bs²)).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import triton
import triton.language as tl
from triton.compiler import CompiledKernel

from memcache.exceptions import CacheIndexError

#: Rows of the staged metadata matrix, int64 [META_ROWS, bs].
META_ROW, META_PREFIX_LEN, META_SEQ_LEN, META_START, META_PREFIX_PTR = range(5)
META_ROWS = 5
BLOCK = 256


# bs and row_stride change with every batch and pool: specialising them (== 1, % 16) would
# compile a variant per class of value and test both on every launch, for no faster code.
@triton.jit(do_not_specialize=["bs", "row_stride"])
def _write_req_to_token_kernel(
    req_to_token_ptr,  # int32 [num_rows, row_stride]
    meta_ptr,  # int64 [5, bs]: row, prefix_len, seq_len, start offset, prefix data_ptr | int64 tag
    out_cache_loc_ptr,  # int32 | int64 [sum(seq_len - prefix_len)]
    bs,
    row_stride,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    row = tl.load(meta_ptr + pid)
    prefix_len = tl.load(meta_ptr + bs + pid)
    seq_len = tl.load(meta_ptr + 2 * bs + pid)
    start = tl.load(meta_ptr + 3 * bs + pid)
    prefix_addr = tl.load(meta_ptr + 4 * bs + pid)
    dst = req_to_token_ptr + row * row_stride
    # An empty prefix stages address 0: the loop below never runs, so it is never read.
    tag = prefix_addr & 1  # 1: the prefix is int64
    prefix32 = prefix_addr.to(tl.pointer_type(tl.int32))
    prefix64 = (prefix_addr - 1).to(tl.pointer_type(tl.int64))
    # while-loops, not range(runtime bound): Triton 3.6's interpreter cannot take a
    # loaded value as a range bound, and the compiled code is the same.
    off = prefix_len * 0
    while off < prefix_len:
        idx = off + tl.arange(0, BLOCK)
        mask = idx < prefix_len
        # Both loads are masked by dtype, so only the prefix's own width is ever read;
        # int64 indices are stored as int32, as sglang's kernel stores them.
        lane_tag = idx * 0 + tag  # the tag per lane: a vector mask, as the interpreter needs
        v64 = tl.load(prefix64 + idx, mask=mask & (lane_tag == 1), other=0)
        v32 = tl.load(prefix32 + idx, mask=mask & (lane_tag == 0), other=0)
        tl.store(dst + idx, tl.where(lane_tag == 1, v64.to(tl.int32), v32), mask=mask)
        off += BLOCK
    extend_len = seq_len - prefix_len
    off = prefix_len * 0
    while off < extend_len:
        idx = off + tl.arange(0, BLOCK)
        mask = idx < extend_len
        slots = tl.load(out_cache_loc_ptr + start + idx, mask=mask)
        tl.store(dst + prefix_len + idx, slots.to(tl.int32), mask=mask)
        off += BLOCK


def launch_write_req_to_token(req_to_token: torch.Tensor, meta: torch.Tensor, out_cache_loc: torch.Tensor) -> None:
    """Validate tensor shapes, dtypes, devices and contiguity, then launch one program per request.

    The *values* (rows, lengths, pointers) must already be validated on the host by
    ``write_cache_indices``: a kernel cannot raise, so a bad index must never get here.
    """
    check_req_to_token(req_to_token)
    if meta.dtype != torch.int64 or meta.dim() != 2 or meta.shape[0] != META_ROWS or not meta.is_contiguous():
        raise CacheIndexError(f"'meta' must be contiguous int64 [5, bs] (got {meta.dtype} {tuple(meta.shape)})")
    if out_cache_loc.dtype not in (torch.int32, torch.int64) or out_cache_loc.dim() != 1:
        raise CacheIndexError(f"'out_cache_loc' must be 1-D int32/int64 (got {out_cache_loc.dtype})")
    if not out_cache_loc.is_contiguous():
        raise CacheIndexError("'out_cache_loc' must be contiguous")
    for name, t in (("meta", meta), ("out_cache_loc", out_cache_loc)):
        if t.device != req_to_token.device:
            raise CacheIndexError(f"'{name}' must be on {req_to_token.device} (got {t.device})")
    launch_checked(req_to_token, meta, out_cache_loc, meta.shape[1], req_to_token.device)


def check_req_to_token(req_to_token: torch.Tensor) -> None:
    """The kernel writes rows through ``row * stride(0) + column``: int32, 2-D, unit inner stride."""
    if req_to_token.dtype != torch.int32 or req_to_token.dim() != 2 or req_to_token.stride(1) != 1:
        raise CacheIndexError(
            f"'req_to_token' must be int32 [rows, len] with unit inner stride (got {req_to_token.dtype} "
            f"{tuple(req_to_token.shape)})"
        )


def launch_checked(
    req_to_token: torch.Tensor, meta: torch.Tensor, out_cache_loc: torch.Tensor, bs: int, device: torch.device
) -> None:
    """The launch alone, for callers that checked every tensor as ``launch_write_req_to_token`` does.

    ``meta``: contiguous int64 holding the [5, bs] rows back to back on ``device``, the
    tensors' device; a flat [5 * bs] is as good (the kernel takes only its address), which
    spares ``write_cache_indices`` a view per call.
    """
    if bs == 0:
        return
    args = (req_to_token, meta, out_cache_loc, bs, req_to_token.stride(0))
    with _on_device(device):
        if device.type != "cuda":  # the interpreter (CPU tensors): its own entry point
            _write_req_to_token_kernel[(bs,)](*args, BLOCK=BLOCK)
            return
        # Triton's JIT entry binds the arguments, builds their specialization key and looks
        # the kernel up on every call: half as much host time again as the compiled kernel's
        # own runner, or more (tests/bench/diag_launch.py on an H200 host, triton 3.6). For
        # this kernel the key is fully known here: the device, the three tensors' dtypes,
        # the 16-byte alignment of each pointer, and whether bs and row_stride fit int32
        # (they are not specialized on their values, but Triton types them i32 or i64 by
        # size: a kernel built for i32 would truncate a larger one). A new key goes through
        # the JIT entry once and keeps its kernel.
        key = (
            device.index,
            req_to_token.dtype,
            meta.dtype,
            out_cache_loc.dtype,
            req_to_token.data_ptr() & 15 == 0,
            meta.data_ptr() & 15 == 0,
            out_cache_loc.data_ptr() & 15 == 0,
            bs >> 31 == 0,
            args[4] >> 31 == 0,
        )
        compiled = _COMPILED.get(key)
        if compiled is not None:
            compiled[(bs, 1, 1)](*args, BLOCK)
            return
        compiled = _write_req_to_token_kernel[(bs,)](*args, BLOCK=BLOCK)
        if isinstance(compiled, CompiledKernel):
            _COMPILED[key] = compiled


#: The kernel compiled for each specialization key of launch_checked (device, dtypes, alignments, int widths).
_COMPILED: dict[tuple[Any, ...], CompiledKernel] = {}


def _on_device(device: torch.device) -> AbstractContextManager[Any]:
    """Triton launches on the *current* device: make the tensors' device current when it is not."""
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return nullcontext()


def write_req_to_token_reference(
    req_to_token: torch.Tensor,
    rows: list[int],
    prefix_lens: list[int],
    seq_lens: list[int],
    starts: list[int],
    prefix_tensors: list[torch.Tensor],
    out_cache_loc: torch.Tensor,
) -> None:
    """The same writes in plain torch, one request at a time: for backends without Triton."""
    for i, row in enumerate(rows):
        p, s = prefix_lens[i], seq_lens[i]
        if p:
            req_to_token[row, :p] = prefix_tensors[i][:p]
        if s > p:
            req_to_token[row, p:s] = out_cache_loc[starts[i] : starts[i] + s - p].to(torch.int32)
