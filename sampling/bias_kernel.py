# mypy: disallow-untyped-defs=False, disallow-untyped-decorators=False, disallow-incomplete-defs=False
# (Triton kernels take untyped pointer arguments; the launcher below is typed and checked.)
"""Sparse logit bias: one kernel adds (row, token, value) entries to the logits in place.

The entries come from the requests' ``logit_bias`` mappings, landed by the batch's one
copy; no dense ``[bs, vocab]`` tensor is built on the host, and none on the device
unless a caller reads ``SamplingBatchInfo.logit_bias``. Each (row, token) pair appears at
most once (a request's mapping has unique keys, and rows are distinct), so the adds do
not race and need no atomics.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import triton
import triton.language as tl

from sampling.exceptions import BatchMismatchError

BLOCK = 256
_LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _apply_bias_kernel(
    logits_ptr,  # float32 | float16 | bfloat16 [bs, row_stride], unit inner stride
    rows_ptr,  # int32 [n]: batch row of each entry, in [0, bs)
    tokens_ptr,  # int32 [n]: token id of each entry, in [0, vocab)
    values_ptr,  # float32 [n]
    n,
    row_stride,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    rows = tl.load(rows_ptr + offs, mask=inside, other=0).to(tl.int64)
    tokens = tl.load(tokens_ptr + offs, mask=inside, other=0).to(tl.int64)
    values = tl.load(values_ptr + offs, mask=inside, other=0.0)
    where = logits_ptr + rows * row_stride + tokens
    old = tl.load(where, mask=inside, other=0.0)
    tl.store(where, (old.to(tl.float32) + values).to(old.dtype), mask=inside)


def on_device(device: torch.device) -> AbstractContextManager[Any]:
    """Make ``device`` current for a Triton launch, when it is not already.

    Triton launches on the *current* device's stream, where torch ops follow their tensors:
    with another GPU current, a launch for tensors on this one would run in the wrong
    context. The check costs one runtime query; the switch happens only when needed.
    """
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return nullcontext()


def _check(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, values: torch.Tensor) -> None:
    if logits.dtype not in _LOGIT_DTYPES or logits.dim() != 2 or (logits.shape[1] > 1 and logits.stride(1) != 1):
        raise BatchMismatchError(
            f"'logits' must be float32/float16/bfloat16 [bs, vocab] with unit inner stride (got {logits.dtype} "
            f"{tuple(logits.shape)}, strides {logits.stride()})"
        )
    overlapping = logits.shape[0] > 1 and logits.stride(0) < logits.shape[1]
    if overlapping:  # an expanded (stride-0) or overlapping view: one row's entries would land on others
        raise BatchMismatchError(
            f"'logits' rows must not overlap (got strides {logits.stride()} for shape {tuple(logits.shape)}): "
            "pass a contiguous tensor"
        )
    n = rows.shape[0] if rows.dim() == 1 else -1
    for name, t, dtype in (
        ("rows", rows, torch.int32),
        ("tokens", tokens, torch.int32),
        ("values", values, torch.float32),
    ):
        if t.dtype != dtype or t.dim() != 1 or t.shape[0] != n or not t.is_contiguous():
            raise BatchMismatchError(
                f"'{name}' must be contiguous {dtype} [n] with n = len(rows) = {n} (got {t.dtype} {tuple(t.shape)})"
            )
        if t.device != logits.device:
            raise BatchMismatchError(f"'{name}' must be on the logits' device {logits.device} (got {t.device})")


def launch_apply_logit_bias(
    logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    """Add ``values`` at (``rows``, ``tokens``) of ``logits`` in place; returns ``logits``.

    Validates shapes, dtypes, devices and contiguity. The entries' *values* (row < bs,
    token < vocab) are checked on the host when the batch is built: a kernel cannot raise.
    """
    _check(logits, rows, tokens, values)
    n = rows.shape[0]
    if n:
        with on_device(logits.device):
            _apply_bias_kernel[(triton.cdiv(n, BLOCK),)](logits, rows, tokens, values, n, logits.stride(0), BLOCK=BLOCK)
    return logits


def apply_logit_bias_reference(
    logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    """The same adds in plain torch (one ``index_put_``): the kernel's oracle and the CPU path."""
    _check(logits, rows, tokens, values)
    if rows.shape[0]:
        added = logits[rows.long(), tokens.long()].float() + values
        logits.index_put_((rows.long(), tokens.long()), added.to(logits.dtype))
    return logits
