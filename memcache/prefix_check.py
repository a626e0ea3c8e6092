"""Checking the prefix tensors ``write_cache_indices`` hands to its kernel, a batch at a time.

The kernel dereferences each prefix tensor's address, so each must be a 1-D contiguous
int32 or int64 tensor on the right device, holding at least ``prefix_len`` indices, at an
even address (bit 0 carries the dtype, below).

sglang's scheduler hands every call new tensor objects (its radix cache makes each prefix
as a fresh ``torch.cat`` of the matched nodes), so nothing is kept between calls and
nothing is written onto the caller's tensors. Each rule is one C-level ``map`` over the
whole batch, reduced to one set, one ``all`` or one numpy array: no Python code runs per
tensor on a valid batch. The data pointer, the one read sglang makes per tensor, comes
first; each other rule costs about as much again on tensors just made (first touches of
their metadata), and far less on tensors seen before. Only a batch that breaks a rule
goes through ``_check_one`` request by request, which raises the error for the first
request, in order, that breaks one.

The address handed to the kernel carries the dtype in bit 0 (set: int64). Element
addresses of int32 and int64 tensors are 4- and 8-aligned, so bit 0 is free; the check
refuses a tensor where it is not.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import Any, NoReturn

import numpy as np
import torch

from memcache.exceptions import CacheIndexError

#: Bit 0 of a staged prefix address: the prefix is int64 (else int32).
INT64_TAG = 1
#: The dtypes the kernel reads and the tag each one's address carries; a lookup of any
#: other dtype raises KeyError, so the tag pass is the dtype check too.
_TAGS = {torch.int32: 0, torch.int64: INT64_TAG}
#: What a pass over a batch raises when some item breaks a rule on the way: not a tensor
#: (TypeError from the unbound method), another dtype (KeyError), an address beyond int64.
_BROKEN = (TypeError, KeyError, AttributeError, OverflowError, RuntimeError, ValueError)
_address = torch.Tensor.data_ptr
_dtype = attrgetter("dtype")
_dim = torch.Tensor.dim
_contiguous = torch.Tensor.is_contiguous
_numel = torch.Tensor.numel
_is_cpu = attrgetter("is_cpu")
_get_device = torch.Tensor.get_device
_any = np.logical_or.reduce
_or = np.bitwise_or.reduce
#: Device -> the key its tensors' ``get_device()`` returns (-1 CPU, the CUDA index, -2
#: for another type, which no tensor passes); a bare "cuda" is resolved on each call.
_KEYS: dict[torch.device, int] = {}


def tagged_addresses(
    tensors: Sequence[Any], rows: Sequence[int], needs: Sequence[int] | np.ndarray[Any, Any], device: torch.device
) -> np.ndarray[Any, Any]:
    """int64 [n]: each ``tensors[j]``'s address with its dtype tag; the prefix of request ``rows[j]``.

    Every tensor here is read: ``needs[j]`` (exact ints, >= 1) indices of it. Raises
    ``CacheIndexError`` for the first request, in order, whose tensor breaks a rule;
    ``rows`` is read only then.
    """
    n = len(tensors)
    if n == 0:
        return np.zeros(0, np.int64)
    key = _key(device)
    try:
        addresses = np.fromiter(map(_address, tensors), np.int64, n)
        tags = np.fromiter(map(_TAGS.__getitem__, map(_dtype, tensors)), np.int64, n)
        # on the device: CUDA tensors by index (an int, where .device builds an object);
        # a CPU target by is_cpu (a meta tensor's get_device() is -1 as well)
        ok = (
            (all(map(_is_cpu, tensors)) if key == -1 else set(map(_get_device, tensors)) == {key})
            and set(map(_dim, tensors)) == {1}
            and all(map(_contiguous, tensors))
            and not _any(np.less(np.fromiter(map(_numel, tensors), np.int64, n), needs))
            and not _or(addresses) & INT64_TAG
        )
    except _BROKEN:
        ok = False
    if not ok:
        _refuse(tensors, rows, needs, key, device)
    return np.bitwise_or(addresses, tags, out=addresses)


def prefix_addresses(
    prefix_tensors: Sequence[torch.Tensor], prefix_lens: np.ndarray[Any, Any], device: torch.device
) -> np.ndarray[Any, Any]:
    """int64 [bs] tagged addresses for the kernel (0 for an empty prefix, whose tensor is never read)."""
    rows = np.flatnonzero(prefix_lens)
    out = np.zeros(len(prefix_tensors), np.int64)
    kept = [prefix_tensors[i] for i in rows.tolist()]  # sync-ok: numpy host array
    out[rows] = tagged_addresses(kept, rows.tolist(), prefix_lens[rows], device)  # sync-ok: numpy host array
    return out


def _refuse(tensors: Sequence[Any], rows: Sequence[int], needs: Any, key: int, device: torch.device) -> NoReturn:
    """Raise the error for the first request whose tensor breaks a rule."""
    for t, i, need in zip(tensors, rows, needs, strict=True):
        _check_one(i, t, int(need), key, device)
    # Not reached while the batch's rules are exactly the per-tensor ones; here so that a
    # gap between them refuses, never accepts.
    raise CacheIndexError(f"'prefix_tensors' of requests {list(rows)} must pass the prefix checks")


def _check_one(i: int, t: Any, need: int, key: int, device: torch.device) -> None:
    """Request ``i``'s prefix tensor, read for ``need`` indices, alone; raises ``CacheIndexError``."""
    try:
        dtype = t.dtype
        on_device = t.is_cpu if key == -1 else t.get_device() == key
    except AttributeError:  # not a tensor
        on_device, dtype = False, None
    if not isinstance(t, torch.Tensor) or not on_device or dtype not in _TAGS:
        got = f"{t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise CacheIndexError(f"'prefix_tensors[{i}]' must be an int32 or int64 tensor on {device} (got {got})")
    if t.dim() != 1 or not t.is_contiguous():
        raise CacheIndexError(f"'prefix_tensors[{i}]' must be 1-D and contiguous (got shape {tuple(t.shape)})")
    address = t.data_ptr()
    if address & INT64_TAG:
        raise CacheIndexError(f"'prefix_tensors[{i}]' must start at an even address (got {address:#x})")
    if t.numel() < need:
        raise CacheIndexError(f"'prefix_tensors[{i}]' must hold prefix_len {need} indices (got {t.numel()})")


def _key(device: torch.device) -> int:
    """What ``get_device()`` returns for a tensor on ``device``; a bare "cuda" means the current device."""
    key = _KEYS.get(device)
    if key is not None:
        return key
    if device.type == "cpu":
        key = -1
    elif device.type == "cuda":
        key = device.index if device.index is not None else torch.cuda.current_device()
    else:
        key = -2
    if device.type != "cuda" or device.index is not None:  # the current device may change: never kept
        _KEYS[device] = key
    return key
