# mypy: disallow-untyped-defs=False, disallow-untyped-decorators=False, disallow-incomplete-defs=False
# (the rebuilt Triton kernel takes untyped pointer arguments; the Python around it is typed.)
"""sglang's ``write_cache_indices`` and its caller's uploads, for side-by-side checks and benchmarks.

Lab code, not library code. ``load()`` execs sglang 0.5.23's own
``python/sglang/srt/mem_cache/allocation.py`` and the kernel file it imports
(``sglang/kernels/ops/memory/common.py``) from ``.sglang/`` (extracted from the PyPI wheel;
ignored by git, nothing of it is copied here), with the modules it imports for other
functions stubbed, ``attention_backends()`` answering ("triton", "triton") and pinning on
for CUDA. Without ``.sglang/`` (CI), ``load()`` returns ``rebuild``: the same steps written
here from reading those files (a pinned uint64 upload of the prefix addresses, then one
program per request that loads the int64 prefix through its address and sums
``extend_lens[0:pid]`` itself), stated as a rebuild wherever it is used.

``caller_path`` is what sglang's ``alloc_for_extend`` does around the call: pinned int64
uploads of the per-request lists, then the function.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from pinpool.bench.sglang_files import exec_file, sglang_dir, stub

_ALLOCATION = Path("sglang/srt/mem_cache/allocation.py")
_KERNELS = Path("sglang/kernels/ops/memory/common.py")
WriteFn = Callable[..., None]


def _pin(device: Any = None) -> bool:
    return torch.cuda.is_available() and torch.device(device or "cuda").type == "cuda"


def load() -> tuple[WriteFn, str]:
    """(write_cache_indices with sglang's 11-argument signature, where it came from)."""
    root = sglang_dir(_ALLOCATION, _KERNELS)
    if root is None:
        return rebuild, "rebuild (no .sglang/: written here from sglang 0.5.23's source, not its code)"
    false = lambda *a, **k: False  # noqa: E731
    stub(
        "sglang.srt.utils",
        is_cpu=false,
        is_hip=false,
        is_npu=false,
        is_xpu=false,
        is_cuda=lambda: True,
        support_triton=lambda backend: True,
        next_power_of_2=lambda n: 1 << max(0, (n - 1).bit_length()),
    )
    stub("sglang.srt.utils.common", is_pin_memory_available=_pin)
    stub("sglang.srt.runtime_context", attention_backends=lambda: ("triton", "triton"))
    for name in (
        "sglang.srt.hardware_backend.npu.dsv4.dsv4_common_hooks",
        "sglang.srt.mem_cache.allocator.page_interleave",
        "sglang.srt.mem_cache.base_prefix_cache",
        "sglang.srt.mem_cache.common",
        "sglang.srt.mem_cache.memory_pool",
        "sglang.srt.managers.schedule_batch",
        "sglang.kernels.ops.memory",
    ):
        stub(name)
    exec_file("sglang.kernels.ops.memory.common", root / _KERNELS)
    module = exec_file("sglang.srt.mem_cache.allocation", root / _ALLOCATION)
    fn: WriteFn = module.write_cache_indices
    return fn, f"sglang 0.5.23's own write_cache_indices and kernel ({root / _ALLOCATION})"


@triton.jit
def _rebuilt_kernel(
    req_to_token_ptr,  # int32 [rows, row_stride]
    req_pool_indices,  # int64 [bs]
    prefix_ptrs,  # uint64 [bs]: address of each int64 prefix
    prefix_lens,  # int64 [bs]
    seq_lens,  # int64 [bs]
    extend_lens,  # int64 [bs]
    out_cache_loc,  # int64 [sum(extend)]
    row_stride: tl.constexpr,
):
    BLOCK: tl.constexpr = 512
    pid = tl.program_id(0)
    row = tl.load(req_pool_indices + pid)
    prefix_len = tl.load(prefix_lens + pid)
    seq_len = tl.load(seq_lens + pid)
    prefix = tl.load(prefix_ptrs + pid).to(tl.pointer_type(tl.int64))
    # while loops over loaded bounds (not range): Triton 3.6's interpreter cannot range over them.
    off = prefix_len * 0
    while off < prefix_len:
        offs = tl.arange(0, BLOCK) + off
        mask = offs < prefix_len
        tl.store(req_to_token_ptr + row * row_stride + offs, tl.load(prefix + offs, mask=mask), mask=mask)
        off += BLOCK
    start = tl.cast(0, tl.int64)
    i = pid * 0
    while i < pid:  # the per-program prefix sum: O(bs) loads in each of bs programs
        start += tl.load(extend_lens + i)
        i += 1
    off = prefix_len * 0
    while off < seq_len - prefix_len:
        offs = tl.arange(0, BLOCK) + off
        mask = offs < seq_len - prefix_len
        value = tl.load(out_cache_loc + start + offs, mask=mask)
        tl.store(req_to_token_ptr + row * row_stride + offs + prefix_len, value, mask=mask)
        off += BLOCK


def rebuild(
    out_cache_loc: torch.Tensor,
    req_pool_indices_tensor: torch.Tensor,
    req_pool_indices_cpu: torch.Tensor,
    prefix_lens_tensor: torch.Tensor,
    prefix_lens_cpu: torch.Tensor,
    seq_lens_tensor: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    extend_lens_tensor: torch.Tensor,
    extend_lens_cpu: torch.Tensor,
    prefix_tensors: list[torch.Tensor],
    req_to_token_pool: Any,
) -> None:
    """sglang 0.5.23's write_cache_indices on its Triton branch, rebuilt (see the module doc)."""
    device = req_to_token_pool.device
    pointers = torch.tensor([t.data_ptr() for t in prefix_tensors], dtype=torch.uint64, pin_memory=_pin(device))
    pointers = pointers.to(device, non_blocking=True)
    rtt = req_to_token_pool.req_to_token
    _rebuilt_kernel[(req_pool_indices_tensor.shape[0],)](
        rtt,
        req_pool_indices_tensor,
        pointers,
        prefix_lens_tensor,
        seq_lens_tensor,
        extend_lens_tensor,
        out_cache_loc,
        rtt.shape[1],
    )


def caller_path(
    write: WriteFn,
    out_cache_loc: torch.Tensor,
    req_pool_indices: list[int],
    prefix_lens: list[int],
    seq_lens: list[int],
    extend_lens: list[int],
    prefix_tensors: list[torch.Tensor],
    req_to_token_pool: Any,
) -> None:
    """sglang's alloc_for_extend around the call: pinned int64 uploads of the lists, then ``write``."""
    device = req_to_token_pool.device
    pin = _pin(device)
    cpu = [
        torch.tensor(v, dtype=torch.int64, pin_memory=pin)
        for v in (req_pool_indices, prefix_lens, seq_lens, extend_lens)
    ]
    dev = [t.to(device, non_blocking=True) for t in cpu]
    call_uploaded(write, out_cache_loc, cpu, dev, prefix_tensors, req_to_token_pool)


def call_uploaded(
    write: WriteFn,
    out_cache_loc: torch.Tensor,
    cpu: list[torch.Tensor],
    dev: list[torch.Tensor],
    prefix_tensors: Any,
    req_to_token_pool: Any,
) -> None:
    """``write`` with sglang's argument order, from lists already uploaded (each as a device and host tensor)."""
    write(
        out_cache_loc,
        dev[0],
        cpu[0],
        dev[1],
        cpu[1],
        dev[2],
        cpu[2],
        dev[3],
        cpu[3],
        prefix_tensors,
        req_to_token_pool,
    )
