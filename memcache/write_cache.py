"""``write_cache_indices``: fill request rows of ``req_to_token`` from prefixes and new KV slots.

Every check runs on the host, on the host copies of the lengths, before anything is
staged or launched. The per-request metadata (rows, prefix lengths, sequence lengths,
start offsets into ``out_cache_loc`` and the prefix tensors' tagged addresses) then
lands in one copy from the pool, and the kernel reads it from there.

Two ways to the same metadata, chosen by batch size (measured on the CPU machine):
- up to ``SMALL_BATCH`` requests given as lists, one plain-Python pass checks every rule
  and builds the metadata as a list: numpy's fixed cost (about 1 µs an operation, some
  twenty operations) is most of a small call. It decides only "all valid"; anything
  else goes the vectorised way, which raises the one error message for each rule.
- otherwise the checks are vectorised: int lists are packed by ``struct`` straight into
  one int64 table (13 against 30 ns a value for ``array.array``), the length rules are
  numpy masks.
Either way, each prefix tensor's attribute checks run once per tensor object
(``memcache.prefix_check``), kept on each tensor.
"""

from __future__ import annotations

import array
import os
import struct
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch

from memcache.exceptions import CacheIndexError
from memcache.prefix_check import checked_prefixes
from memcache.req_to_token import ReqToTokenPool
from memcache.write_kernel import META_ROWS, launch_write_req_to_token, write_req_to_token_reference
from pinpool import PinnedRingBuffer

Backend = Literal["auto", "triton", "torch"]
IntsLike = Sequence[int] | np.ndarray[Any, Any]
#: Batches up to this size go through the plain-Python pass (it costs about 0.3 µs a
#: request; the vectorised checks cost about 20 µs whatever the size, on the CPU machine;
#: at 64 the plain pass measured 8% cheaper there, at 128 10% dearer).
SMALL_BATCH = 64
_NAMES = ("req_pool_indices", "prefix_lens", "seq_lens", "extend_lens")


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
    lengths = (req_pool_indices, prefix_lens, seq_lens, extend_lens)
    bs = len(prefix_tensors)
    small = None
    if bs <= SMALL_BATCH:
        small = _small_batch_meta(lengths, bs, out_cache_loc, prefix_tensors, req_to_token_pool)
    meta_list, kept = (
        small if small is not None else _batch_meta(lengths, bs, out_cache_loc, prefix_tensors, req_to_token_pool)
    )
    chosen = _resolve_backend(backend, device)
    if chosen == "torch":
        flat = meta_list if isinstance(meta_list, list) else meta_list.tolist()  # sync-ok: numpy host array
        rows_l, prefix_l, seq_l, starts_l = (flat[k * bs : (k + 1) * bs] for k in range(4))
        write_req_to_token_reference(
            req_to_token, rows_l, prefix_l, seq_l, starts_l, list(prefix_tensors), out_cache_loc
        )
        return
    with pool.stage() as st:
        meta_host, meta = st.reserve(META_ROWS * bs, torch.int64, name="write_cache_indices metadata")
        if isinstance(meta_list, list):
            struct.pack_into(f"{META_ROWS * bs}q", meta_host.data, 0, *meta_list)
        else:
            meta_host[:] = meta_list
        # Rule 5 (retain): the kernel dereferences these addresses; keep the tensors alive until
        # the slot's fence, recorded on exit after the launch below, has passed. Only those
        # with a prefix are read, and one list (built here, never changed) holds them all.
        st.retain(kept)
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
    if not out_cache_loc.is_contiguous():  # refused here, before a slot is claimed, not by the launcher
        raise CacheIndexError("'out_cache_loc' must be contiguous (got a strided view): pass .contiguous()")
    if rows.size == 0:
        if out_cache_loc.shape[0]:
            raise CacheIndexError(f"'out_cache_loc' must be empty for an empty batch (got {out_cache_loc.shape[0]})")
        return
    size, max_len = req_to_token_pool.size, req_to_token_pool.max_context_len
    # One combined mask first: the common, valid case pays one reduction, and only a
    # failing batch goes through the per-rule checks that name the request and value.
    # seq >= 0 matters beyond its own rule: with every length in [0, max_len] no
    # difference or sum below can wrap around int64 and pass a check it should fail.
    bad_any = (
        (rows < 0)
        | (rows >= size)
        | (prefix < 0)
        | (seq < 0)
        | (extend < 0)
        | (seq - prefix != extend)
        | (seq > max_len)
    )
    if bad_any.any():
        checks = (
            ((rows < 0) | (rows >= size), "req_pool_indices", rows, f"must be in [0, {size})"),
            (prefix < 0, "prefix_lens", prefix, "must be >= 0"),
            (seq < 0, "seq_lens", seq, "must be >= 0"),
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


def _small_batch_meta(
    lengths: tuple[Any, Any, Any, Any],
    bs: int,
    out_cache_loc: torch.Tensor,
    prefix_tensors: Sequence[torch.Tensor],
    req_to_token_pool: ReqToTokenPool,
) -> tuple[list[int], list[torch.Tensor]] | None:
    """The flat metadata [5 * bs] and the prefix tensors read, or None unless the batch is plainly valid.

    None sends the call the vectorised way, whose checks raise the error for each rule:
    this pass must never accept what those refuse. Prefix tensor errors are raised here,
    as there, after every length rule has passed.
    """
    if any(type(v) is not list or len(v) != bs for v in lengths) or not _loc_ok(out_cache_loc, req_to_token_pool):
        return None
    layout = f"{4 * bs}q"
    try:  # exact int64 values, as the vectorised way reads them, or not at all
        values = struct.unpack(layout, struct.pack(layout, *lengths[0], *lengths[1], *lengths[2], *lengths[3]))
    except struct.error:
        return None
    rows, prefix, seq, extend = values[:bs], values[bs : 2 * bs], values[2 * bs : 3 * bs], values[3 * bs :]
    size, max_len = req_to_token_pool.size, req_to_token_pool.max_context_len
    starts, total = [], 0
    for r, p, s, e in zip(rows, prefix, seq, extend, strict=True):
        if r < 0 or r >= size or p < 0 or e < 0 or s - p != e or s > max_len:
            return None
        starts.append(total)
        total += e
    if total != out_cache_loc.shape[0] or len(set(rows)) != bs:
        return None
    prefixed = [i for i, p in enumerate(prefix) if p]
    tagged, kept = checked_prefixes(prefix_tensors, prefixed, [prefix[i] for i in prefixed], req_to_token_pool.device)
    addresses = [0] * bs
    for i, a in zip(prefixed, tagged, strict=True):
        addresses[i] = a
    return [*rows, *prefix, *seq, *starts, *addresses], kept


def _loc_ok(out_cache_loc: torch.Tensor, req_to_token_pool: ReqToTokenPool) -> bool:
    return (
        isinstance(out_cache_loc, torch.Tensor)
        and out_cache_loc.dim() == 1
        and out_cache_loc.device == req_to_token_pool.device
        and (out_cache_loc.dtype is torch.int32 or out_cache_loc.dtype is torch.int64)
        and out_cache_loc.is_contiguous()
    )


def _batch_meta(
    lengths: tuple[Any, Any, Any, Any],
    bs: int,
    out_cache_loc: torch.Tensor,
    prefix_tensors: Sequence[torch.Tensor],
    req_to_token_pool: ReqToTokenPool,
) -> tuple[np.ndarray[Any, Any], list[torch.Tensor]]:
    """The flat metadata, int64 [5 * bs], and the prefix tensors read; raises ``CacheIndexError``."""
    table = np.empty((META_ROWS, bs), dtype=np.int64)
    layout = f"{bs}q"
    for k, (name, values) in enumerate(zip(_NAMES, lengths, strict=True)):
        if type(values) is list and len(values) == bs:
            try:  # packed straight into the table, exactly or not at all
                struct.pack_into(layout, table.data, 8 * bs * k, *values)
                continue
            except struct.error:
                pass  # _ints names the problem
        table[k] = _ints(name, values, bs)
    rows, prefix, seq, extend = table[0], table[1], table[2], table[3]
    _check_lengths(rows, prefix, seq, extend, out_cache_loc, req_to_token_pool)
    prefixed = np.flatnonzero(prefix)
    tagged, kept = checked_prefixes(
        prefix_tensors,
        prefixed.tolist(),  # sync-ok: numpy host array
        prefix[prefixed].tolist(),  # sync-ok: numpy host array
        req_to_token_pool.device,
    )
    if bs:
        # extend_lens becomes the exclusive prefix sum: where each request's slots begin
        ends = np.cumsum(extend)
        table[3, 1:] = ends[:-1]
        table[3, 0] = 0
    table[4] = 0
    table[4, prefixed] = tagged
    return table.reshape(-1), kept
