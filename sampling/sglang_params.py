"""Requests whose ``sampling_params`` carry sglang's names, packed once and cached.

sglang's ``SamplingParams`` (a msgspec struct) names the seed ``sampling_seed``, keys
``logit_bias`` by strings, and allows negative seeds. ``pack_foreign`` turns a list of
such objects into pinpool's 32-byte records (``RECORD_DTYPE``) in a handful of numpy
operations, normalised as sglang's ``SamplingParams.__post_init__`` does:

- ``None`` in temperature / top_p / top_k / min_p means sglang's default;
- ``0 <= temperature < 1e-6`` is greedy: stored as temperature 1.0, top_k 1;
- ``top_k == -1`` means the whole vocabulary (``TOP_K_ALL``);
- ``logit_bias`` keys go through ``int()``; keys that collide ("1", "01") keep the last
  value, as sglang's ``{int(key): value}`` does;
- a missing seed is 42, sglang's default under deterministic inference.

``ForeignParamsCache`` keeps each object's packed record, so a request seen again
(chunked prefill, retraction, an engine that rebuilds per step) costs a dict lookup.
sglang never writes these six fields after construction (0.5.23: no assignment outside
``sampling_params.py``), which is what makes the cache sound.
"""

from __future__ import annotations

import array
import math
import struct
from collections.abc import Mapping, Sequence
from operator import attrgetter
from typing import Any

import numpy as np

from sampling.exceptions import SamplingParamError
from sampling.params import (
    DEFAULT_SEED,
    F32_MAX,
    FLAG_BIAS,
    FLAG_GREEDY,
    FLAG_MIN_P,
    FLAG_TOP_K,
    FLAG_TOP_P,
    GREEDY_EPS,
    MAX_BIAS_ENTRIES,
    RECORD_DTYPE,
    TOP_K_ALL,
    SamplingParams,
)

#: A request's logit bias as (token ids, values), sorted by token id.
Bias = tuple[tuple[int, ...], tuple[float, ...]]
_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "sampling_seed": DEFAULT_SEED}
_GET = {name: attrgetter(name) for name in (*_DEFAULTS, "logit_bias")}


def _column(objs: Sequence[Any], name: str, integral: bool) -> np.ndarray[Any, Any]:
    """One attribute of every object as float64 (or int64 when ``integral``), None as sglang's default."""
    get = _GET[name]
    try:
        # array.array converts at C speed and strictly: None, strings and (for 'q') floats or
        # ints out of int64 range raise, and take the checked path below.
        if name == "sampling_seed":  # most requests have none: keep that on the fast path
            values = [DEFAULT_SEED if v is None else v for v in map(get, objs)]
        else:
            values = list(map(get, objs))
        # array.array takes True (and numpy's True, through __float__ / __index__) as 1: a
        # bool is never a sampling parameter, so the checked path below refuses it, as the
        # small-batch path does (one C-level pass).
        seen = set(map(type, values))
        if bool in seen or np.bool_ in seen:
            raise TypeError("bool")
        fast = array.array("q" if integral else "d", values)
        return np.frombuffer(fast, np.int64 if integral else np.float64)
    except (TypeError, OverflowError, AttributeError):
        pass
    try:
        values = list(map(get, objs))
    except AttributeError:
        i = next(i for i, o in enumerate(objs) if not hasattr(o, name))
        raise SamplingParamError(
            f"'sampling_params' of request {i} must carry sglang's field '{name}' (got {type(objs[i]).__name__})"
        ) from None
    # Rare path: None (sglang's "use the default"), or a value of the wrong type.
    default = _DEFAULTS.get(name)
    clean = []
    for i, v in enumerate(values):
        if v is None and default is not None:
            v = default
        if integral and isinstance(v, (float, np.floating)) and float(v).is_integer():
            v = int(v)  # 40.0 is accepted as 40, as the fast path and sglang's int conversion do
        kinds = (int, np.integer) if integral else (int, float, np.integer, np.floating)
        if isinstance(v, bool) or not isinstance(v, kinds):
            what = "an int" if integral else "a real number"
            raise SamplingParamError(f"'{name}' of request {i} must be {what} (got {v!r})")
        if integral and not -(2**63) <= v < 2**63:
            raise SamplingParamError(f"'{name}' of request {i} must be in [-2**63, 2**63) (got {v!r})")
        clean.append(v)
    return np.array(clean, dtype=np.int64 if integral else np.float64)


#: Up to this many objects are packed one by one in Python: numpy's per-call overhead
#: (about 30 calls) would otherwise dominate a small prefill batch.
SMALL_BATCH = 16
_RECORD = struct.Struct("<ffifqHHi")  # RECORD_DTYPE's layout, field for field


def _scalar(i: int, name: str, value: Any, integral: bool) -> Any:
    """One field of one object, by ``_column``'s rules (None as sglang's default, strict types)."""
    if value is None:
        value = _DEFAULTS[name]
    if integral and isinstance(value, (float, np.floating)) and float(value).is_integer():
        value = int(value)
    kinds = (int, np.integer) if integral else (int, float, np.integer, np.floating)
    if isinstance(value, bool) or not isinstance(value, kinds):
        what = "an int" if integral else "a real number"
        raise SamplingParamError(f"'{name}' of request {i} must be {what} (got {value!r})")
    if integral and not -(2**63) <= value < 2**63:
        raise SamplingParamError(f"'{name}' of request {i} must be in [-2**63, 2**63) (got {value!r})")
    return int(value) if integral else float(value)


def _pack_small(objs: Sequence[Any], out: np.ndarray[Any, Any] | None) -> tuple[np.ndarray[Any, Any], dict[int, Bias]]:
    """``pack_foreign`` for a few objects, with the same rules and messages, in plain Python."""
    records, biases = [], {}
    for i, o in enumerate(objs):
        try:
            raw = (o.temperature, o.top_p, o.top_k, o.min_p, o.sampling_seed, o.logit_bias)
        except AttributeError:
            name = next(f for f in (*_DEFAULTS, "logit_bias") if not hasattr(o, f))
            raise SamplingParamError(
                f"'sampling_params' of request {i} must carry sglang's field '{name}' (got {type(o).__name__})"
            ) from None
        temp = _scalar(i, "temperature", raw[0], False)
        top_p = _scalar(i, "top_p", raw[1], False)
        top_k = _scalar(i, "top_k", raw[2], True)
        min_p = _scalar(i, "min_p", raw[3], False)
        seed = _scalar(i, "sampling_seed", raw[4], True)
        if not math.isfinite(temp) or not 0 <= temp <= F32_MAX:
            raise SamplingParamError(
                f"'temperature' of request {i} must be finite, >= 0 and fit float32 (got {temp!r})"
            )
        if not 0 < top_p <= 1:
            raise SamplingParamError(f"'top_p' of request {i} must be in (0, 1] (got {top_p!r})")
        if not 0 <= min_p <= 1:
            raise SamplingParamError(f"'min_p' of request {i} must be in [0, 1] (got {min_p!r})")
        if top_k != -1 and not 1 <= top_k <= TOP_K_ALL:
            raise SamplingParamError(f"'top_k' of request {i} must be >= 1, or -1 for all tokens (got {top_k!r})")
        bias = None if raw[5] is None else _bias(i, raw[5])
        if temp < GREEDY_EPS:
            temp, top_k = 1.0, 1
        elif top_k == -1:
            top_k = TOP_K_ALL
        top_p32 = _F32.unpack(_F32.pack(top_p))[0]  # flags read the stored float32, as the numpy path does
        flags = (
            (FLAG_GREEDY if top_k <= 1 else 0)
            | (FLAG_TOP_P if top_p32 != 1.0 else 0)
            | (FLAG_TOP_K if top_k != TOP_K_ALL else 0)
            | (FLAG_MIN_P if min_p > 0 else 0)
            | (FLAG_BIAS if bias is not None else 0)
        )
        n_bias, last = (0, -1) if bias is None else (len(bias[0]), min(bias[0][-1], 2**31 - 1))
        records.append(_RECORD.pack(temp, top_p, top_k, min_p, seed, flags, n_bias, last))
        if bias is not None:
            biases[i] = bias
    rec = np.frombuffer(b"".join(records), RECORD_DTYPE)
    if out is None:
        return rec.copy(), biases
    out[:] = rec
    return out, biases


_F32 = struct.Struct("<f")


def _check(bad: np.ndarray[Any, Any], name: str, rule: str, values: np.ndarray[Any, Any]) -> None:
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise SamplingParamError(f"'{name}' of request {i} {rule} (got {values[i].item()!r})")  # sync-ok: numpy


def _bias(i: int, value: Any) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
    if value is None or (isinstance(value, Mapping) and len(value) == 0):
        return None
    if not isinstance(value, Mapping):
        raise SamplingParamError(
            f"'logit_bias' of request {i} must be a mapping of token id to float (got {type(value).__name__})"
        )
    merged: dict[int, float] = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise SamplingParamError(f"'logit_bias' keys of request {i} must be token ids (got {key!r})") from None
        if isinstance(key, bool) or token < 0:
            raise SamplingParamError(f"'logit_bias' token ids of request {i} must be ints >= 0 (got {key!r})")
        if isinstance(bias, bool) or not isinstance(bias, (int, float, np.integer, np.floating)):
            raise SamplingParamError(f"'logit_bias' values of request {i} must be real numbers (got {bias!r})")
        value = float(bias)
        if not math.isfinite(value) or abs(value) > F32_MAX:
            raise SamplingParamError(
                f"'logit_bias' values of request {i} must be finite and fit float32 (got {bias!r} for token {token})"
            )
        merged[token] = value  # last one wins on collision, as sglang's dict does
    if len(merged) > MAX_BIAS_ENTRIES:
        raise SamplingParamError(
            f"'logit_bias' of request {i} must have at most {MAX_BIAS_ENTRIES} entries (got {len(merged)})"
        )
    tokens = sorted(merged)
    return tuple(tokens), tuple(merged[t] for t in tokens)


def pack_foreign(
    objs: Sequence[Any], out: np.ndarray[Any, Any] | None = None
) -> tuple[np.ndarray[Any, Any], dict[int, Bias]]:
    """Validate, normalise and pack sglang-named params: (RECORD_DTYPE [n] records, {index: bias}).

    ``out``: where to write the records (RECORD_DTYPE [n]; a fresh array by default).
    Raises ``SamplingParamError`` naming the field, the request and the value, before
    anything is written.
    """
    n = len(objs)
    if n <= SMALL_BATCH:
        try:
            return _pack_small(objs, out)
        except OverflowError:  # a float beyond float32 (or a seed beyond int64): the checked path says which
            pass
    temp = _column(objs, "temperature", integral=False)
    top_p = _column(objs, "top_p", integral=False)
    top_k = _column(objs, "top_k", integral=True)
    min_p = _column(objs, "min_p", integral=False)
    seed = _column(objs, "sampling_seed", integral=True)
    _check(
        ~np.isfinite(temp) | (temp < 0) | (temp > F32_MAX), "temperature", "must be finite, >= 0 and fit float32", temp
    )
    _check(~((top_p > 0) & (top_p <= 1)), "top_p", "must be in (0, 1]", top_p)
    _check(~((min_p >= 0) & (min_p <= 1)), "min_p", "must be in [0, 1]", min_p)
    _check((top_k != -1) & ((top_k < 1) | (top_k > TOP_K_ALL)), "top_k", "must be >= 1, or -1 for all tokens", top_k)
    try:
        raw = list(map(_GET["logit_bias"], objs))
    except AttributeError:
        i = next(i for i, o in enumerate(objs) if not hasattr(o, "logit_bias"))
        raise SamplingParamError(
            f"'sampling_params' of request {i} must carry sglang's field 'logit_bias' (got {type(objs[i]).__name__})"
        ) from None
    biases = {}
    for i in [i for i, b in enumerate(raw) if b is not None]:
        bias = _bias(i, raw[i])
        if bias is not None:
            biases[i] = bias
    greedy = temp < GREEDY_EPS  # sglang's SamplingParams.__post_init__, vectorised
    temp[greedy] = 1.0
    top_k[greedy] = 1
    top_k[top_k == -1] = TOP_K_ALL
    rec = np.zeros(n, RECORD_DTYPE) if out is None else out
    rec["temperature"] = temp
    rec["top_p"] = top_p
    rec["top_k"] = top_k
    rec["min_p"] = min_p
    rec["seed"] = seed
    rec["n_bias"] = 0
    rec["bias_max_token"] = -1
    flags: np.ndarray[Any, Any] = np.where(top_k <= 1, FLAG_GREEDY, 0) | np.where(top_k != TOP_K_ALL, FLAG_TOP_K, 0)
    flags |= np.where(rec["top_p"] != 1.0, FLAG_TOP_P, 0) | np.where(min_p > 0, FLAG_MIN_P, 0)
    if biases:
        at = list(biases)
        flags[at] |= FLAG_BIAS
        rec["n_bias"][at] = [len(b[0]) for b in biases.values()]
        rec["bias_max_token"][at] = [min(b[0][-1], 2**31 - 1) for b in biases.values()]
    rec["flags"] = flags
    return rec, biases


class ForeignParamsCache:
    """Packed records of params objects, by id: one bounded table.

    ``_table`` holds up to ``limit`` records (more only for a single larger batch);
    ``_rows`` maps id(object) to its row, and ``_objects`` holds each object itself, so
    its id cannot be reused while its row lives: a hit by id is a hit on the same object.
    When full, the table is cleared (the one rule) and refilled with the batch at hand, so
    a running batch repacks at most once per ``limit`` new requests. Native
    ``SamplingParams`` in a mixed batch take a row too, from their own record.
    """

    def __init__(self, limit: int = 1 << 15) -> None:
        self.limit = limit
        self._table = np.zeros(limit, RECORD_DTYPE)
        self._rows: dict[int, int] = {}
        self._objects: list[Any] = []
        self._biases: dict[int, Bias] = {}  # row -> bias

    def __len__(self) -> int:
        return len(self._objects)

    def clear(self) -> None:
        """Forget every entry (benchmarks use it to time the first sight of each object)."""
        self._rows.clear()
        self._objects.clear()
        self._biases.clear()

    def records(self, objs: Sequence[Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """(RECORD_DTYPE [n] records of ``objs``, their int64 rows), packing and caching the ones not seen yet."""
        get = self._rows.get
        try:  # array.array refuses the None of a miss: the hit path is one C-level pass
            at = np.frombuffer(array.array("q", map(get, map(id, objs))), np.int64)  # type: ignore[type-var]
        except TypeError:
            at = self._fill(objs, list(map(get, map(id, objs))))
        return self._table.take(at), at

    def bias(self, row: int | np.integer[Any]) -> Bias | None:
        """The (token ids, values) of the object at ``row`` (from ``records``), or None."""
        return self._biases.get(int(row))

    def _fill(self, objs: Sequence[Any], rows: list[int | None]) -> np.ndarray[Any, Any]:
        # Comprehensions and C-level map/zip: a prefill batch is all misses, so this is its
        # per-request cost. The common case (all new, distinct, none native) skips the rest.
        ids = list(map(id, objs))
        all_new = rows.count(None) == len(rows)
        new = (
            dict(zip(ids, objs, strict=True))
            if all_new
            else {i: o for i, o, r in zip(ids, objs, rows, strict=True) if r is None}
        )
        if len(self._objects) + len(new) > len(self._table):
            self.clear()  # the batch's own objects become the table
            new, all_new = dict(zip(ids, objs, strict=True)), True
            if len(new) > len(self._table):  # one batch larger than the bound: the table grows to it
                self._table = np.zeros(len(new), RECORD_DTYPE)
        unique = list(new.values())
        start, end = len(self._objects), len(self._objects) + len(unique)
        mixed = any(issubclass(kind, SamplingParams) for kind in set(map(type, unique)))
        if mixed:  # natives of a mixed batch: their own records
            foreign = [o for o in unique if not isinstance(o, SamplingParams)]
            natives = [o for o in unique if isinstance(o, SamplingParams)]
            unique = foreign + natives
            biases = pack_foreign(foreign, self._table[start : start + len(foreign)])[1] if foreign else {}
            own = np.frombuffer(b"".join([o.record for o in natives]), RECORD_DTYPE)
            self._table[start + len(foreign) : end] = own
            biases.update({len(foreign) + j: o.logit_bias for j, o in enumerate(natives) if o.logit_bias})
        else:
            biases = pack_foreign(unique, self._table[start:end])[1]  # raises before anything is cached
        self._objects.extend(unique)
        self._biases.update({start + j: b for j, b in biases.items()})
        if all_new and len(unique) == len(ids) and not mixed:  # rows are start, start + 1, ... in order
            self._rows.update(zip(ids, range(start, end), strict=True))
            return np.arange(start, end, dtype=np.int64)
        self._rows.update(zip(map(id, unique), range(start, end), strict=True))
        return np.frombuffer(array.array("q", [self._rows[i] for i in ids]), np.int64)


#: The process's table (one pool per worker process; a pool is not thread-safe either).
FOREIGN_PARAMS = ForeignParamsCache()
