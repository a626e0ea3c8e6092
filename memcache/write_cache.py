"""``write_cache_indices``: fill request rows of ``req_to_token`` from prefixes and new KV slots.

Every check runs on the host, on the host copies of the lengths, before anything is
staged or launched. The per-request metadata (rows, prefix lengths, sequence lengths,
start offsets into ``out_cache_loc`` and the prefix tensors' tagged addresses) then
lands in one copy from the pool, and the kernel reads it from there.

Host cost per request is what limits a large batch, so the checks are vectorised: int
lists become int64 arrays through ``array.array`` (C speed), the length rules are numpy
masks, and each prefix tensor's attribute checks run once per tensor object
(``memcache.prefix_check``), kept on each tensor.
"""

from __future__ import annotations

import array
import os
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch

from memcache.exceptions import CacheIndexError
from memcache.prefix_check import prefix_addresses
from memcache.req_to_token import ReqToTokenPool
from memcache.write_kernel import META_ROWS, launch_write_req_to_token, write_req_to_token_reference
from pinpool import PinnedRingBuffer

Backend = Literal["auto", "triton", "torch"]
IntsLike = Sequence[int] | np.ndarray[Any, Any]


def _ints(name: str, values: IntsLike | torch.Tensor, bs: int) -> np.ndarray[Any, Any]:
    if type(values) is list:
        try:  # a scheduler's list of Python ints: array.array converts at C speed, exactly or not at all
            arr = np.frombuffer(array.array("q", values), np.int64) if values else np.zeros(0, np.int64)
        except (TypeError, OverflowError):
            arr = np.asarray(values)
    elif isinstance(values, torch.Tensor):
        if values.device.type != "cpu":  # reading a device tensor here would be a host sync
            raise CacheIndexError(
                f"'{name}' must be host values (a list, numpy array or CPU tensor; got {values.device})"
            )
        arr = values.numpy()
    else:
        arr = np.asarray(values)
    if arr.ndim != 1 or arr.shape[0] != bs:
        raise CacheIndexError(f"'{name}' must hold {bs} values, one per request (got shape {arr.shape})")
    if arr.size and arr.dtype.kind not in "iu":
        raise CacheIndexError(f"'{name}' must hold integers (got dtype {arr.dtype})")
    return arr.astype(np.int64, copy=False)


def _first_bad(mask: np.ndarray[Any, Any]) -> int:
    return int(np.flatnonzero(mask)[0])


def _resolve_backend(backend: Backend, device: torch.device) -> str:
    if backend not in ("auto", "triton", "torch"):
        raise CacheIndexError(f"'backend' must be 'auto', 'triton' or 'torch' (got {backend!r})")
    if backend != "auto":
        return backend
    # Triton needs a GPU, or its interpreter on CPU tensors (TRITON_INTERPRET=1).
    return "triton" if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else "torch"


def write_cache_indices(
    out_cache_loc: torch.Tensor,
    req_pool_indices: IntsLike | torch.Tensor,
    prefix_lens: IntsLike | torch.Tensor,
    seq_lens: IntsLike | torch.Tensor,
    extend_lens: IntsLike | torch.Tensor,
    prefix_tensors: Sequence[torch.Tensor],
    req_to_token_pool: ReqToTokenPool,
    pool: PinnedRingBuffer,
    *,
    backend: Backend = "auto",
) -> None:
    """Write ``req_to_token[row, :prefix_len] = prefix`` and ``[prefix_len:seq_len] = new slots``.

    Host arguments: ``req_pool_indices``, ``prefix_lens``, ``seq_lens``, ``extend_lens``
    (one int per request: lists, numpy arrays or CPU tensors, such as sglang's ``*_cpu``).
    ``out_cache_loc`` holds the new slots of all requests back to back;
    ``prefix_tensors[i]`` (int32, or int64 as sglang's radix cache holds them, on the
    pool's device) holds request i's prefix. int64 indices are stored as int32, as
    sglang's kernel stores them: KV slot indices are below 2**31.
    """
    req_to_token = req_to_token_pool.req_to_token
    device = req_to_token.device
    if device != pool.device:
        raise CacheIndexError(f"'pool' must stage for {device}, the req_to_token device (got {pool.device})")
    bs = len(prefix_tensors)
    rows = _ints("req_pool_indices", req_pool_indices, bs)
    prefix = _ints("prefix_lens", prefix_lens, bs)
    seq = _ints("seq_lens", seq_lens, bs)
    extend = _ints("extend_lens", extend_lens, bs)
    _check_lengths(rows, prefix, seq, extend, out_cache_loc, req_to_token_pool)
    pointers = prefix_addresses(prefix_tensors, prefix, device)
    starts = np.zeros(bs, dtype=np.int64)
    np.cumsum(extend[:-1], out=starts[1:])  # exclusive prefix sum: where each request's slots begin
    chosen = _resolve_backend(backend, device)
    if chosen == "torch":
        host = (rows, prefix, seq, starts)
        rows_l, prefix_l, seq_l, starts_l = (a.tolist() for a in host)  # sync-ok: numpy host arrays
        write_req_to_token_reference(
            req_to_token, rows_l, prefix_l, seq_l, starts_l, list(prefix_tensors), out_cache_loc
        )
        return
    with pool.stage() as st:
        meta_host, meta = st.reserve(META_ROWS * bs, torch.int64, name="write_cache_indices metadata")
        table = meta_host.reshape(META_ROWS, bs)
        table[0], table[1], table[2], table[3] = rows, prefix, seq, starts
        table[4] = pointers
        # Invariant 6: the kernel dereferences these addresses; keep the tensors alive until
        # the slot's fence, recorded on exit after the launch below, has passed.
        st.retain(tuple(prefix_tensors))
        st.flush()
        launch_write_req_to_token(req_to_token, meta.view(META_ROWS, bs), out_cache_loc)


def _check_lengths(
    rows: np.ndarray[Any, Any],
    prefix: np.ndarray[Any, Any],
    seq: np.ndarray[Any, Any],
    extend: np.ndarray[Any, Any],
    out_cache_loc: torch.Tensor,
    req_to_token_pool: ReqToTokenPool,
) -> None:
    if not isinstance(out_cache_loc, torch.Tensor) or out_cache_loc.dim() != 1:
        raise CacheIndexError(f"'out_cache_loc' must be a 1-D tensor (got {type(out_cache_loc).__name__})")
    if out_cache_loc.device != req_to_token_pool.device:
        raise CacheIndexError(f"'out_cache_loc' must be on {req_to_token_pool.device} (got {out_cache_loc.device})")
    if out_cache_loc.dtype not in (torch.int32, torch.int64):
        raise CacheIndexError(f"'out_cache_loc' must be int32 or int64 (got {out_cache_loc.dtype})")
    if rows.size == 0:
        if out_cache_loc.shape[0]:
            raise CacheIndexError(f"'out_cache_loc' must be empty for an empty batch (got {out_cache_loc.shape[0]})")
        return
    size, max_len = req_to_token_pool.size, req_to_token_pool.max_context_len
    # One combined mask first: the common, valid case pays one reduction, and only a
    # failing batch goes through the per-rule checks that name the request and value.
    bad_any = (rows < 0) | (rows >= size) | (prefix < 0) | (extend < 0) | (seq - prefix != extend) | (seq > max_len)
    if bad_any.any():
        checks = (
            ((rows < 0) | (rows >= size), "req_pool_indices", rows, f"must be in [0, {size})"),
            (prefix < 0, "prefix_lens", prefix, "must be >= 0"),
            (extend < 0, "extend_lens", extend, "must be >= 0"),
            (seq - prefix != extend, "seq_lens", seq, "must equal prefix_len + extend_len"),
            (seq > max_len, "seq_lens", seq, f"must be <= max_context_len {max_len}"),
        )
        for bad, name, values, rule in checks:
            if bad.any():
                i = _first_bad(bad)
                raise CacheIndexError(f"'{name}' of request {i} {rule} (got {int(values[i])})")
    total = int(extend.sum())
    if total != out_cache_loc.shape[0]:
        raise CacheIndexError(
            f"'out_cache_loc' must hold sum(extend_lens) = {total} slots (got {out_cache_loc.shape[0]})"
        )
    if rows.size > 1:
        ordered = np.sort(rows)
        if (ordered[1:] == ordered[:-1]).any():
            raise CacheIndexError("'req_pool_indices' must not repeat a row within one batch")
