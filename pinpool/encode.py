"""User values written straight into a pinned host view, exactly or not at all: a conversion that
would change a value (1.5 into int32, NaN into an integer, 1e39 into float32) raises."""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pinpool.cache import BoundedCache
from pinpool.exceptions import DeviceMismatchError, StagingTypeError, StagingValueError

_TWINS = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64")
#: bfloat16 has no numpy twin: it is written through torch.
NUMPY_DTYPE: dict[torch.dtype, np.dtype[Any]] = {getattr(torch, name): np.dtype(name) for name in _TWINS}
SUPPORTED_DTYPES: frozenset[torch.dtype] = frozenset([*NUMPY_DTYPE, torch.bfloat16])
_INT_RANGE = {d: (int(np.iinfo(d).min), int(np.iinfo(d).max)) for d in NUMPY_DTYPE.values() if d.kind in "iu"}
TORCH_DTYPE: dict[np.dtype[Any], torch.dtype] = {v: k for k, v in NUMPY_DTYPE.items()}


def int_in_range(value: Any, low: int, high: int | None = None) -> bool:
    """Whether ``value`` is an int (not a bool, nor a numpy integer) with ``low <= value`` (``<= high``)."""
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, int)):
        return False
    return low <= value and (high is None or value <= high)


def check_dtype(dtype: Any, name: str) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or dtype not in SUPPORTED_DTYPES:
        allowed = ", ".join(sorted(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES))
        raise StagingTypeError(f"'{name}' dtype must be one of {allowed} (got {dtype!r})")
    return dtype


def as_source(values: Any, dtype: torch.dtype | None, name: str) -> tuple[Any, torch.dtype, tuple[int, ...]]:
    """``values``, not yet copied, as (a numpy array, CPU bfloat16 tensor or flat sequence, dtype, shape)."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise DeviceMismatchError(
                f"'{name}' must be a CPU tensor (got one on {values.device}); device data needs no staging"
            )
        target = check_dtype(values.dtype if dtype is None else dtype, name)
        src = values.detach()
        return (src.numpy() if src.dtype in NUMPY_DTYPE else src), target, tuple(src.shape)
    if isinstance(values, np.ndarray):
        return values, check_dtype(TORCH_DTYPE.get(values.dtype) if dtype is None else dtype, name), values.shape
    if isinstance(values, (bytes, bytearray, memoryview)):
        target = check_dtype(torch.uint8 if dtype is None else dtype, name)
        raw = memoryview(values).cast("B")
        if target not in NUMPY_DTYPE or len(raw) % target.itemsize:
            raise StagingValueError(
                f"'{name}' bytes must be a whole number of {target} elements ({target.itemsize} bytes each) "
                f"(got {len(raw)})"
            )
        arr = np.frombuffer(raw, dtype=NUMPY_DTYPE[target])
        return arr, target, arr.shape
    if dtype is None:
        raise StagingTypeError(f"'{name}' needs an explicit dtype for a {type(values).__name__} value")
    target = check_dtype(dtype, name)
    if isinstance(values, Sequence) and not isinstance(values, str):
        if len(values) and isinstance(values[0], (list, tuple, np.ndarray)):
            arr = _from_python(values, name)
            return arr, target, arr.shape
        return values, target, (len(values),)
    if isinstance(values, (int, float, bool, np.generic)):
        return [values], target, ()
    raise StagingTypeError(
        f"'{name}' must be a list, tuple, numpy array, CPU tensor or bytes-like object (got {type(values).__name__})"
    )


def _from_python(values: Any, name: str) -> np.ndarray[Any, Any]:
    try:
        return np.asarray(values)
    except (ValueError, TypeError) as exc:
        raise StagingValueError(f"'{name}' must be a rectangular array of numbers ({exc})") from exc


def write(dst: np.ndarray[Any, Any] | torch.Tensor, src: Any, target: torch.dtype, name: str) -> None:
    """Write ``src`` into the flat host view ``dst`` (numel already matched) or raise."""
    if target is torch.bfloat16:
        _write_bf16(dst, src, name)
        return
    assert isinstance(dst, np.ndarray)
    if isinstance(src, np.ndarray):
        _write_array(dst, src, name)
        return
    write_list(dst, src, target, name)


_STRUCT_CODE = {torch.int64: "q", torch.int32: "i", torch.float32: "f", torch.float64: "d"}
#: A scheduler's ad-hoc lists repeat a few (dtype, length) pairs step after step: each packer is made once.
PACKERS: BoundedCache[tuple[torch.dtype, int], struct.Struct] = BoundedCache()


def packer_for(dtype: torch.dtype, numel: int) -> struct.Struct | None:
    """The cached packer of a ``numel``-long list of ``dtype`` (None if struct lacks it); ``pack_into`` checks each
    element. When it raises, maybe after a partial write past the committed bytes, the caller uses ``write``."""
    code = _STRUCT_CODE.get(dtype)
    return None if code is None else PACKERS.put((dtype, numel), struct.Struct(f"={numel}{code}"))


def write_list(dst: np.ndarray[Any, Any], src: Any, target: torch.dtype, name: str) -> None:
    """Write a flat Python sequence, parsed by numpy in C straight into the slot, or raise."""
    kind = dst.dtype.kind
    if kind == "f":
        try:
            with np.errstate(over="ignore"):  # raised below, typed
                dst[:] = src
        except OverflowError as exc:  # an int too large for any float (10**400)
            raise StagingValueError(f"'{name}' holds a number too large for {target} ({exc})") from exc
        except (ValueError, TypeError) as exc:
            raise StagingValueError(f"'{name}' must hold only numbers ({exc})") from exc
        # Narrowing can overflow to inf silently: a finite sum (cheaper than isfinite) rules it out.
        if dst.dtype.itemsize < 8 and not math.isfinite(np.add.reduce(dst, dtype=np.float64)):
            _check_float_range(np.asarray(src, dtype=np.float64), dst.dtype, name)
        return
    if kind in "iu":
        # numpy truncates 1.5 silently; the builtin sum stays an int only if every element is one.
        try:
            dst[:] = src
            exact = isinstance(sum(src), (int, np.integer))
        except (OverflowError, ValueError, TypeError):
            exact = False
        if exact:
            return
        # An int past int64 makes numpy parse the list as float64, where 2**63 == 2**63 - 1: check ints here.
        lo, hi = _INT_RANGE[dst.dtype]
        for value in src:
            if isinstance(value, int) and not lo <= value <= hi:
                raise StagingValueError(f"'{name}' must fit {dst.dtype} [{lo}, {hi}] (got {value})")
    # Bools and every rejected case: parse, then check what the cast would change.
    _write_array(dst, _from_python(src, name), name)


def _write_array(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any], name: str) -> None:
    flat = src.reshape(-1)
    if flat.dtype == dst.dtype or (
        flat.dtype.kind == dst.dtype.kind == "i" and flat.dtype.itemsize <= dst.dtype.itemsize
    ):
        np.copyto(dst, flat)
        return
    kind, want = flat.dtype.kind, dst.dtype
    if kind not in "biuf":
        raise StagingTypeError(f"'{name}' must hold numbers (got numpy dtype {flat.dtype})")
    if want.kind in "iu":
        if kind == "f":
            finite = np.isfinite(flat)
            if not finite.all():
                raise StagingValueError(f"'{name}' must be finite for {want} (got {flat[~finite][0]})")
            if not (flat == np.trunc(flat)).all():
                bad = flat[flat != np.trunc(flat)][0]
                raise StagingValueError(f"'{name}' must hold whole numbers for {want} (got {bad})")
        if kind != "b" and flat.size and not np.can_cast(flat.dtype, want):
            lo, hi = _INT_RANGE[want]
            # Floats compare against hi + 1 (exact in float64, which rounds hi up to it): "> hi" passes 2**63.
            outside = (flat < lo) | ((flat >= hi + 1) if kind == "f" else (flat > hi))
            if outside.any():
                raise StagingValueError(f"'{name}' must fit {want} [{lo}, {hi}] (got {flat[outside][0]})")
    elif want.kind == "b":
        if kind != "b" and not ((flat == 0) | (flat == 1)).all():
            raise StagingValueError(f"'{name}' must hold only 0/1 for bool (got {flat[(flat != 0) & (flat != 1)][0]})")
    elif want.kind == "f" and kind == "f" and want.itemsize < flat.dtype.itemsize:
        _check_float_range(flat, want, name)
    np.copyto(dst, flat, casting="unsafe")


def _check_float_range(src: np.ndarray[Any, Any], want: np.dtype[Any], name: str) -> None:
    limit = np.finfo(want).max
    over = np.isfinite(src) & (np.abs(src) > limit)
    if over.any():
        raise StagingValueError(f"'{name}' must fit {want} (|x| <= {limit:.4g}) (got {src[over][0]})")


def _write_bf16(dst: np.ndarray[Any, Any] | torch.Tensor, src: Any, name: str) -> None:
    assert isinstance(dst, torch.Tensor)
    try:
        value = src if isinstance(src, torch.Tensor) else torch.as_tensor(np.asarray(src))
    except (ValueError, TypeError) as exc:
        raise StagingValueError(f"'{name}' must hold only numbers ({exc})") from exc
    if not (value.is_floating_point() or value.dtype in (torch.bool, torch.int8, torch.uint8, torch.int16)):
        value64 = value.to(torch.float64)
        if not torch.equal(value64.to(torch.bfloat16).to(torch.float64), value64):
            raise StagingValueError(f"'{name}' integers must be exact in bfloat16")
    dst.copy_(value.reshape(-1))
