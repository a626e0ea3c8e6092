"""Checking the prefix tensors ``write_cache_indices`` hands to its kernel, once per tensor.

The kernel dereferences each prefix tensor's address, so each must be a 1-D contiguous
int32 or int64 tensor on the right device, holding at least ``prefix_len`` indices. The
full check reads six tensor attributes in Python. A radix cache hands the same tensors
out again and again, so its result is kept on the tensor itself, as an attribute (as
FSDP and Megatron tag parameters): it lives and dies with the tensor, needs no table and
no bound, and a later call re-reads only the address and the dtype. A tensor whose storage
was swapped (``set_``, a growing ``resize_``, ``.data =``, a pickled copy) has another
address or dtype and is checked again. Not seen: shrinking in place without moving
(``resize_`` to fewer elements); the kernel's reads then stay inside the tensor's
allocation. Radix caches never do either.

The attribute is named for the device the check was made for (``CHECKED`` + "cpu",
"cuda0", ...): a call for another device reads another name, finds nothing and checks the
tensor for its own device, with no per-tensor comparison of devices (about 5% of the pass).

The re-reads stay one pass over the tensors: C-level ``map``s over the batch, one per
attribute and each a pass of its own, measured faster alone (240 against 345 ns a tensor)
but slower inside a whole call at bs 1024-4096, each pass missing the cache on every
tensor again. The pass is one comprehension, valid only while every tensor is seen
unchanged (a miss raises out of it and the call redoes the batch in a plain loop that
checks what it must); its two tensor reads (the address, the dtype) are some 80% of it.
Where every tensor is read (``checked_kept``: no placeholders), the reads are ``map``s
zipped into that one pass, each tensor still read once and left. The kept result holds
the tagged address as the 8 bytes staged, so a batch's addresses are one ``b"".join``.

The address handed to the kernel carries the dtype in bit 0 (set: int64). Element
addresses of int32 and int64 tensors are 4- and 8-aligned, so bit 0 is free; the check
refuses a tensor where it is not.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from operator import attrgetter
from typing import Any, NoReturn

import numpy as np
import torch

from memcache.exceptions import CacheIndexError

#: Bit 0 of a staged prefix address: the prefix is int64 (else int32).
INT64_TAG = 1
#: The start of the attribute holding a tensor's check result for one device, an
#: ``Entry``; ``checked_attr`` gives the whole name.
CHECKED = "_pinpool_prefix_check_"
#: The address staged for an empty prefix (never read).
ZERO = bytes(8)

#: What was checked (address, dtype), then the tagged address as the 8 bytes staged
#: (native int64: a batch's row is one ``b"".join``, 4x cheaper than converting ints) and
#: the length.
Entry = tuple[int, torch.dtype, bytes, int]


def checked_attr(device: torch.device) -> str:
    """The attribute a tensor's check result for ``device`` is kept in."""
    return _slot(device)[1]


def prefix_addresses(
    prefix_tensors: Sequence[torch.Tensor], prefix_lens: np.ndarray[Any, Any], device: torch.device
) -> np.ndarray[Any, Any]:
    """int64 [bs] tagged addresses for the kernel (0 for an empty prefix); raises ``CacheIndexError``."""
    lens = prefix_lens.tolist()  # sync-ok: numpy host array
    tagged = checked_prefixes(prefix_tensors, range(len(lens)), lens, device)
    return np.frombuffer(b"".join(tagged), dtype=np.int64).copy()


def checked_prefixes(
    tensors: Sequence[torch.Tensor], rows: Iterable[int], needs: Sequence[int], device: torch.device
) -> list[bytes]:
    """The tagged address of each ``tensors[j]``, request ``rows[j]``'s prefix of ``needs[j]`` indices.

    ``needs`` must be exact ints >= 0 (already checked). An empty prefix is never read (the
    kernel's prefix loop does not run), so its tensor may be any placeholder: it is not
    looked at and gets ``ZERO``. Raises ``CacheIndexError`` for the first request, in
    order, whose tensor fails a check. ``rows`` is read only then.
    """
    slot = _slot(device)
    name = slot[1]
    seen: Sequence[Any] = tensors  # their attribute is read by name (a tensor, or whatever the caller passed)
    try:
        if len(seen) != len(needs):  # (zip's strict= is a keyword call, 0.15 µs) the loop raises
            raise _Recheck
        # The call where every tensor was seen before, unchanged: one comprehension (its
        # appends cost less than a loop's); anything else raises out of it and goes the
        # loop below, from the start.
        return [
            (e[2] if (e := getattr(t, name))[0] == t.data_ptr() and e[1] is t.dtype and e[3] >= n else _recheck())
            if n
            else ZERO
            for t, n in zip(seen, needs)  # noqa: B905 (lengths compared above: strict= costs a keyword call)
        ]
    except _STALE:
        pass
    return _checked_loop(seen, rows, needs, device, slot)


def checked_kept(
    tensors: Sequence[torch.Tensor], rows: Iterable[int], needs: Sequence[int], device: torch.device
) -> list[bytes]:
    """``checked_prefixes`` for tensors that are all read: every ``needs[j]`` >= 1.

    No placeholder is skipped, so each tensor's reads are C-level ``map``s zipped into the
    one pass: 8-10% cheaper a tensor than the comprehension above at bs 256-4096 (measured).
    """
    slot = _slot(device)
    seen: Sequence[Any] = tensors
    try:
        return [
            tagged if address == now and dtype is kind and numel >= n else _recheck()
            for (address, dtype, tagged, numel), now, kind, n in zip(
                map(slot[2], seen), map(_address, seen), map(_dtype, seen), needs, strict=True
            )
        ]
    except _STALE:
        pass
    return _checked_loop(seen, rows, needs, device, slot)


def _checked_loop(
    seen: Sequence[Any], rows: Iterable[int], needs: Sequence[int], device: torch.device, slot: _Slot
) -> list[bytes]:
    key, name, _ = slot
    tagged = []
    for t, i, need in zip(seen, rows, needs, strict=True):
        if not need:
            tagged.append(ZERO)
            continue
        e: Any = getattr(t, name, None)
        try:
            fresh = e is not None and e[0] == t.data_ptr() and e[1] is t.dtype
        except (AttributeError, TypeError, IndexError):
            fresh = False
        if not fresh:
            e = _check(i, t, device, key, name)
        if e[3] < need:
            raise CacheIndexError(f"'prefix_tensors[{i}]' must hold prefix_len {need} indices (got {e[3]})")
        tagged.append(e[2])
    return tagged


class _Recheck(Exception):
    """A kept check result that no longer describes its tensor, or a prefix too short for it."""


#: What the all-seen passes raise when a tensor has no kept result or another one (none
#: kept, stale, short, another layout, or not a tensor): the loop then checks the batch.
_STALE = (AttributeError, TypeError, IndexError, ValueError, _Recheck)
_address = torch.Tensor.data_ptr
_dtype = attrgetter("dtype")
#: A device's key (-1 CPU, the CUDA index, -2 other), its attribute name and a getter of it.
_Slot = tuple[int, str, Callable[[Any], Any]]
#: Device -> slot, for the devices that name one (reading ``device.type`` costs 0.4 µs).
_SLOTS: dict[torch.device, _Slot] = {}


def _recheck() -> NoReturn:
    raise _Recheck


def forget(t: torch.Tensor) -> None:
    """Drop ``t``'s kept check results (benchmarks use it to time a first sight)."""
    for name in [name for name in getattr(t, "__dict__", ()) if name.startswith(CHECKED)]:
        delattr(t, name)


def _check(i: int, t: Any, device: torch.device, key: int, name: str) -> Entry:
    # C-level attribute reads only: this runs once per tensor, for every prefix of a prefill.
    try:
        dtype = t.dtype
        on_device = t.is_cpu if key == -1 else t.get_device() == key
    except AttributeError:  # not a tensor
        on_device, dtype = False, None
    if not on_device or (dtype is not torch.int32 and dtype is not torch.int64):
        got = f"{t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise CacheIndexError(f"'prefix_tensors[{i}]' must be an int32 or int64 tensor on {device} (got {got})")
    if t.dim() != 1 or not t.is_contiguous():
        raise CacheIndexError(f"'prefix_tensors[{i}]' must be 1-D and contiguous (got shape {tuple(t.shape)})")
    address = t.data_ptr()
    if address & INT64_TAG:
        raise CacheIndexError(f"'prefix_tensors[{i}]' must start at an even address (got {address:#x})")
    tagged = address | (INT64_TAG if dtype is torch.int64 else 0)
    entry = (address, dtype, tagged.to_bytes(8, sys.byteorder), t.numel())
    try:  # noqa: SIM105 (contextlib.suppress costs 0.3 µs a call here, measured: once per prefix tensor)
        setattr(t, name, entry)
    except AttributeError:  # a tensor type without attributes is checked on every call
        pass
    return entry


def _slot(device: torch.device) -> _Slot:
    """The device's slot; a bare "cuda" means the current device."""
    slot = _SLOTS.get(device)
    if slot is not None:
        return slot
    if device.type == "cpu":
        key, suffix = -1, "cpu"
    elif device.type == "cuda":
        key = device.index if device.index is not None else torch.cuda.current_device()
        suffix = f"cuda{key}"
    else:  # no tensor passes the check for it: nothing is ever kept under this name
        key, suffix = -2, "other"
    slot = (key, CHECKED + suffix, attrgetter(CHECKED + suffix))
    if device.type != "cuda" or device.index is not None:  # the current device may change: never kept
        _SLOTS[device] = slot
    return slot
