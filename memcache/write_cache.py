"""``write_cache_indices``: fill request rows of ``req_to_token`` from prefixes and new KV slots.

Every check runs on the host, on the host copies of the lengths, before anything is
staged or launched. The per-request metadata (rows, prefix lengths, sequence lengths,
start offsets into ``out_cache_loc`` and the prefix tensors' tagged addresses) then
lands in one copy from the pool, and the kernel reads it from there.

Two ways to the same metadata, chosen by batch size (measured on the CPU machine):
- up to ``SMALL_BATCH`` requests given as lists: ``struct`` makes them exact unsigned
  ints, the other rules are C-level builtins over those (``max``, ``set``, ``map``), and
  the metadata is built as the bytes staged. numpy's fixed cost per operation
  (some 25 operations) would be most of such a call. It decides only "all valid";
  anything else goes the vectorised way, which raises the one error message for each rule.
- otherwise the checks are vectorised: int lists are packed by ``struct`` into one int64
  table (about three times faster a value than ``array.array``), and the length rules take a few
  numpy calls (unsigned maxima, two subtractions, a count of rows).
Either way each list is packed by a compiled ``struct.Struct`` of its own: ``pack(*list)``
turns the list into the call's arguments once, where one call for all four lists (or
``pack_into`` with its leading arguments) builds them twice (20% of the packing).
Either way the prefix tensors of the requests with a prefix are checked as one batch
(``memcache.prefix_check``): a C-level pass per rule, nothing kept between calls and
nothing written onto the caller's tensors, which sglang makes anew for every call. The
small pass uses the same batched check, numpy and all: a builtins-only variant measured
3-8% cheaper per whole call at bs 1-64 and 9-14% dearer at 256-1024 (CPU machine, fresh
tensors, same run), too little for a second implementation to keep equal.
"""

from __future__ import annotations

import array
import functools
import os
import struct
from collections.abc import Sequence
from itertools import accumulate, compress
from operator import add, itemgetter
from typing import Any, Literal

import numpy as np
import torch

from memcache.exceptions import CacheIndexError
from memcache.prefix_check import tagged_addresses
from memcache.req_to_token import ReqToTokenPool
from memcache.write_kernel import META_ROWS, check_req_to_token, launch_checked, write_req_to_token_reference
from pinpool import PinnedRingBuffer

Backend = Literal["auto", "triton", "torch"]
IntsLike = Sequence[int] | np.ndarray[Any, Any]
#: Batches up to this size go through the plain-Python pass: dearer per request than the
#: vectorised way, which pays more numpy calls whatever the size (on the CPU machine the
#: plain pass measured 12% cheaper at 64 and 11% dearer at 128).
SMALL_BATCH = 64
_NAMES = ("req_pool_indices", "prefix_lens", "seq_lens", "extend_lens")
_max = np.maximum.reduce
_any = np.logical_or.reduce
_accumulate = np.add.accumulate
_INDEX_DTYPES = (torch.int32, torch.int64)
#: The CUDA devices ``_resolve_backend`` has seen.
_CUDA_DEVICES: set[torch.device] = set()


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


@functools.lru_cache(maxsize=64)
def _layouts(bs: int) -> tuple[struct.Struct, struct.Struct]:
    """A row of ``bs`` native 64-bit ints, signed and unsigned (compiled once, not parsed per call)."""
    return struct.Struct(f"{bs}q"), struct.Struct(f"{bs}Q")


def _resolve_backend(backend: Backend, device: torch.device) -> str:
    if backend not in ("auto", "triton", "torch"):
        raise CacheIndexError(f"'backend' must be 'auto', 'triton' or 'torch' (got {backend!r})")
    if backend != "auto":
        return backend
    # Triton needs a GPU, or its interpreter on CPU tensors (TRITON_INTERPRET=1).
    if device in _CUDA_DEVICES:  # a set lookup, cheaper than reading device.type
        return "triton"
    if device.type == "cuda":
        _CUDA_DEVICES.add(device)
        return "triton"
    return "triton" if os.environ.get("TRITON_INTERPRET") == "1" else "torch"


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
        small = _small_batch_packed(lengths, bs, out_cache_loc, prefix_tensors, req_to_token_pool)
    meta_src, kept = (
        small if small is not None else _batch_meta(lengths, bs, out_cache_loc, prefix_tensors, req_to_token_pool)
    )
    chosen = _resolve_backend(backend, device)
    if chosen == "torch":
        table = np.frombuffer(meta_src, np.int64) if isinstance(meta_src, bytes) else meta_src
        flat = table.tolist()  # sync-ok: numpy host array
        rows_l, prefix_l, seq_l, starts_l = (flat[k * bs : (k + 1) * bs] for k in range(4))
        write_req_to_token_reference(
            req_to_token, rows_l, prefix_l, seq_l, starts_l, list(prefix_tensors), out_cache_loc
        )
        return
    # The launcher's checks, made before the stage so that a refusal stages nothing; the
    # launch below repeats none: meta is built here, on the pool's device, and out_cache_loc
    # passed the launcher's dtype, shape and contiguity checks above, and its device check
    # against req_to_token_pool.device, which must then be req_to_token's.
    check_req_to_token(req_to_token)
    if req_to_token_pool.device != device:
        raise CacheIndexError(f"'out_cache_loc' must be on {device} (got {out_cache_loc.device})")
    with pool.stage() as st:
        meta_host, meta = st.reserve(META_ROWS * bs, torch.int64, name="write_cache_indices metadata")
        if isinstance(meta_src, bytes):
            meta_host.data.cast("B")[:] = meta_src
        else:
            meta_host[:] = meta_src
        # Rule 5 (retain): the kernel dereferences these addresses; keep the tensors alive until
        # the slot's fence, recorded on exit after the launch below, has passed. Only those
        # with a prefix are read, and one list (built here, never changed) holds them all.
        st.retain(kept)
        st.flush()
        launch_checked(req_to_token, meta, out_cache_loc, bs, device)


def _check_lengths(
    table: np.ndarray[Any, Any], out_cache_loc: torch.Tensor, req_to_token_pool: ReqToTokenPool
) -> np.ndarray[Any, Any]:
    """Every length rule on ``table`` (rows 0-3 the lengths); returns the running sum of extend_lens.

    Row 4 is scratch here; once every rule has passed it holds zeros.
    """
    if not isinstance(out_cache_loc, torch.Tensor) or out_cache_loc.dim() != 1:
        raise CacheIndexError(f"'out_cache_loc' must be a 1-D tensor (got {type(out_cache_loc).__name__})")
    if out_cache_loc.device != req_to_token_pool.device:
        raise CacheIndexError(f"'out_cache_loc' must be on {req_to_token_pool.device} (got {out_cache_loc.device})")
    if out_cache_loc.dtype not in (torch.int32, torch.int64):
        raise CacheIndexError(f"'out_cache_loc' must be int32 or int64 (got {out_cache_loc.dtype})")
    if not out_cache_loc.is_contiguous():  # refused here, before a slot is claimed, not by the launcher
        raise CacheIndexError("'out_cache_loc' must be contiguous (got a strided view): pass .contiguous()")
    rows, prefix, seq, extend, gap = table
    ends: np.ndarray[Any, Any] = _accumulate(extend)
    if rows.size == 0:
        if out_cache_loc.shape[0]:
            raise CacheIndexError(f"'out_cache_loc' must be empty for an empty batch (got {out_cache_loc.shape[0]})")
        return ends
    size, max_len = req_to_token_pool.size, req_to_token_pool.max_context_len
    # The valid case pays few numpy calls (each a fixed cost whatever the size: most of the
    # check up to bs 1024), as ufunc methods (ndarray.max/.any/.cumsum add a Python layer);
    # only a failing batch goes through the per-rule checks that name the request and
    # value. Read as unsigned, a negative value is >= 2**63, so one max bounds each row
    # from both sides. The rules put prefix and extend in [0, seq] too, so bounding all
    # three by max_len refuses nothing they accept; with every length in [0, max_len],
    # seq - prefix - extend cannot wrap around int64, and is 0 everywhere exactly when
    # seq = prefix + extend: row 4 holds it, so the same max also reads that rule.
    np.subtract(seq, prefix, out=gap)
    np.subtract(gap, extend, out=gap)
    top_row, top_prefix, top_seq, top_extend, top_gap = _max(table.view(np.uint64), axis=1).tolist()  # sync-ok: numpy
    if top_row >= size or max(top_prefix, top_seq, top_extend) > max_len or top_gap:
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
        # Not reached (see above); here so that a gap in that argument refuses, never accepts.
        raise CacheIndexError(f"lengths must lie in [0, max_context_len {max_len}]")
    total = int(ends[-1])
    if total != out_cache_loc.shape[0]:
        raise CacheIndexError(
            f"'out_cache_loc' must hold sum(extend_lens) = {total} slots (got {out_cache_loc.shape[0]})"
        )
    if rows.size > 1 and _repeats(rows, top_row):
        raise CacheIndexError("'req_pool_indices' must not repeat a row within one batch")
    return ends


def _repeats(rows: np.ndarray[Any, Any], top_row: int) -> bool:
    """Whether a row repeats; ``rows`` are in [0, top_row]."""
    if top_row < 16 * rows.size:  # counting costs O(top_row): 3-4x cheaper than sorting while rows are dense
        return bool(_max(np.bincount(rows)) > 1)
    ordered = rows.copy()
    ordered.sort()
    return bool(_any(ordered[1:] == ordered[:-1]))


def _small_batch_meta(
    lengths: tuple[Any, Any, Any, Any],
    bs: int,
    out_cache_loc: torch.Tensor,
    prefix_tensors: Sequence[torch.Tensor],
    req_to_token_pool: ReqToTokenPool,
) -> tuple[list[int], list[torch.Tensor]] | None:
    """``_small_batch_packed``'s metadata as a list of ints (for comparing it with ``_batch_meta``'s)."""
    small = _small_batch_packed(lengths, bs, out_cache_loc, prefix_tensors, req_to_token_pool)
    return None if small is None else (list(struct.unpack(f"{META_ROWS * bs}q", small[0])), small[1])


def _small_batch_packed(
    lengths: tuple[Any, Any, Any, Any],
    bs: int,
    out_cache_loc: torch.Tensor,
    prefix_tensors: Sequence[torch.Tensor],
    req_to_token_pool: ReqToTokenPool,
) -> tuple[bytes, list[torch.Tensor]] | None:
    """The metadata [5 * bs] as staged (native int64) and the prefix tensors read, or None unless the
    batch is plainly valid.

    None sends the call the vectorised way, whose checks raise the error for each rule:
    this pass must never accept what those refuse. Prefix tensor errors are raised here,
    as there, after every length rule has passed.
    """
    rows, prefix, seq, extend = lengths
    if (
        type(rows) is not list
        or type(prefix) is not list
        or type(seq) is not list
        or type(extend) is not list
        or len(rows) != bs
        or len(prefix) != bs
        or len(seq) != bs
        or len(extend) != bs
        or not _loc_ok(out_cache_loc, req_to_token_pool)
    ):
        return None
    row = _layouts(bs)[1]
    try:  # exact ints, as the vectorised way reads them, and unsigned: every rule's ">= 0" at C speed
        packed = (row.pack(*rows), row.pack(*prefix), row.pack(*seq), row.pack(*extend))
    except struct.error:
        return None
    rows, prefix, seq, extend = map(row.unpack, packed)
    # The other rules as C-level passes over exact Python ints (no wrap-around). prefix and
    # extend are then in [0, seq], so every value is below 2**63 and its bytes read the same
    # as int64 (the kernel's type).
    if bs and (
        max(rows) >= req_to_token_pool.size
        or max(seq) > req_to_token_pool.max_context_len
        or seq != tuple(map(add, prefix, extend))
        or len(set(rows)) != bs
    ):
        return None
    starts = list(accumulate(extend, initial=0))  # in [0, sum(extend)]: the same bytes unsigned
    if starts.pop() != out_cache_loc.numel():  # the last running sum is the total (numel: 1-D here)
        return None
    kept = list(compress(prefix_tensors, prefix))  # only a request with a prefix reads its tensor
    read = list(compress(range(bs), prefix))
    tagged = tagged_addresses(kept, read, list(compress(prefix, prefix)), req_to_token_pool.device)
    if len(kept) != bs:
        addresses = np.zeros(bs, np.int64)  # an empty prefix stages 0, never read
        addresses[read] = tagged
        tagged = addresses
    # one join: the metadata is copied once (concatenating the rows copied it three times)
    meta = b"".join([packed[0], packed[1], packed[2], row.pack(*starts), tagged.tobytes()])
    return meta, kept


def _loc_ok(out_cache_loc: torch.Tensor, req_to_token_pool: ReqToTokenPool) -> bool:
    return (
        isinstance(out_cache_loc, torch.Tensor)
        and out_cache_loc.dim() == 1
        and out_cache_loc.device == req_to_token_pool.device
        and out_cache_loc.dtype in _INDEX_DTYPES  # (one read of the dtype)
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
    table = np.empty((META_ROWS, bs), dtype=np.int64)  # rows 0-3 all written below, row 4 by _check_lengths
    rows, prefix, seq, extend = lengths
    packed = False
    if (
        type(rows) is list
        and type(prefix) is list
        and type(seq) is list
        and type(extend) is list
        and len(rows) == len(prefix) == len(seq) == len(extend) == bs
    ):
        row = _layouts(bs)[0]
        try:  # a scheduler's lists, exactly or not at all (pack then a copy: see the module notes)
            if bs:  # (a view of no bytes cannot be cast)
                buf = table.data.cast("B")
                buf[: 8 * bs] = row.pack(*rows)
                buf[8 * bs : 16 * bs] = row.pack(*prefix)
                buf[16 * bs : 24 * bs] = row.pack(*seq)
                buf[24 * bs : 32 * bs] = row.pack(*extend)
            packed = True
        except struct.error:
            pass
    if not packed:  # one by one, so that _ints names the problem
        for k, (name, values) in enumerate(zip(_NAMES, lengths, strict=True)):
            if type(values) is list and len(values) == bs:
                try:
                    _layouts(bs)[0].pack_into(table.data, 8 * bs * k, *values)
                    continue
                except struct.error:
                    pass
            table[k] = _ints(name, values, bs)
    ends = _check_lengths(table, out_cache_loc, req_to_token_pool)
    # Only requests with a prefix are looked at: an empty one is never read (the kernel's
    # prefix loop does not run), so its tensor may be any placeholder.
    prefix = table[1]
    prefixed = prefix.nonzero()[0]  # sync-ok: numpy host array, no device
    rows = prefixed.tolist()  # sync-ok: numpy host array
    # one C-level gather (an itemgetter of one index returns the item, not a tuple)
    kept = list(itemgetter(*rows)(prefix_tensors)) if len(rows) > 1 else [prefix_tensors[i] for i in rows]
    tagged = tagged_addresses(kept, rows, prefix[prefixed], req_to_token_pool.device)
    # extend_lens becomes the exclusive prefix sum: where each request's slots begin
    np.subtract(ends, table[3], out=table[3])
    table[4][prefixed] = tagged
    return table.reshape(-1), kept
