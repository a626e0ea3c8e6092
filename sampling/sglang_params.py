"""Requests whose ``sampling_params`` carry sglang's names, packed on first sight.

sglang's ``SamplingParams`` (a msgspec struct) names the seed ``sampling_seed``, keys
``logit_bias`` by strings, and allows negative seeds. ``pack_foreign`` turns a list of
such objects into pinpool's 32-byte records (``RECORD_DTYPE``), normalised as sglang's
``SamplingParams.__post_init__`` does:

- ``None`` in temperature / top_p / top_k / min_p means sglang's default;
- ``0 <= temperature < 1e-6`` is greedy: stored as temperature 1.0, top_k 1;
- ``top_k == -1`` means the whole vocabulary (``TOP_K_ALL``);
- ``logit_bias`` keys go through ``int()``; keys that collide ("1", "01") keep the last
  value, as sglang's ``{int(key): value}`` does; an empty mapping is no bias;
- a missing seed is 42, sglang's default under deterministic inference.

Why there is no per-object cache: sglang builds a batch's sampling info once, in
``prepare_for_extend``, from requests it has just admitted, so nearly every object is new.
The only repeats are the one chunked-prefill request a scheduler carries from batch to
batch (``Scheduler.chunked_req``) and retracted requests coming back, at most a few per
batch; a cache keyed by object would pay its bookkeeping on every miss to save them.

How a batch is read: one pass per field over the params objects (``map`` with an
``attrgetter``, the same attribute reads sglang's list comprehensions make), each list
converted at C speed by ``struct``, then a fixed number of numpy operations for the
whole batch. No Python object is made per request. A list holding anything but plain
numbers (None, a bool, a numpy scalar, a string) goes through the checked conversion,
which applies the same rules value by value and names the first bad one.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from itertools import compress, repeat
from operator import attrgetter, is_not
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
_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "sampling_seed": DEFAULT_SEED}
_FIELDS = (*_DEFAULTS, "logit_bias")
_FIELDS_NO_SEED = tuple(f for f in _FIELDS if f != "sampling_seed")
_GET = {name: attrgetter(name) for name in _FIELDS}
#: Element types the fast conversion takes as they are; anything else is checked one by one.
_FLOAT_KINDS = frozenset({float, int})
_INT_KINDS = frozenset({int})
_SEED_KINDS = frozenset({int, type(None)})
#: ``map(_SEED_OR_DEFAULT, seeds, seeds)`` swaps None for the default seed at C speed.
_SEED_OR_DEFAULT = {None: DEFAULT_SEED}.get
#: Lower and upper bounds of the (temperature, top_p, min_p) rows, checked in one comparison.
#: top_p must be > 0: its bound is the smallest positive double. NaN fails both sides.
_LO = np.array([[0.0], [np.nextafter(0.0, 1.0)], [0.0]])
_HI = np.array([[F32_MAX], [1.0], [1.0]])
#: The right-hand sides of the flag comparisons (see ``_pack_vectorised``).
_K_BELOW = np.array([[2], [TOP_K_ALL]])
_P_NOT = np.array([[1.0], [0.0]])
_FLOAT_RULES = (
    ("temperature", "must be finite, >= 0 and fit float32"),
    ("top_p", "must be in (0, 1]"),
    ("min_p", "must be in [0, 1]"),
)

#: Up to this many objects are packed one by one in Python: numpy's fixed cost per
#: operation (some 30 of them) would otherwise be most of a small prefill batch's build.
#: Held equal to the vectorised packer by ``test_small_and_numpy_packers_give_the_same_bytes``.
SMALL_BATCH = 8
_RECORD = struct.Struct("<ffifqHHi")  # RECORD_DTYPE's layout, field for field
# The vectorised packer packs the four flags below as bits 0-3 of one byte.
assert (FLAG_GREEDY, FLAG_TOP_P, FLAG_TOP_K, FLAG_MIN_P) == (1, 2, 4, 8)


def _fields(seeds: bool) -> tuple[str, ...]:
    return _FIELDS if seeds else _FIELDS_NO_SEED


def _missing_field(objs: Sequence[Any], name: str) -> SamplingParamError:
    i = next(i for i, o in enumerate(objs) if not hasattr(o, name))
    return SamplingParamError(
        f"'sampling_params' of request {i} must carry sglang's field '{name}' (got {type(objs[i]).__name__})"
    )


def _scalar(i: int, name: str, value: Any, integral: bool) -> Any:
    """One field of one object: None as sglang's default, strict types, an int field's range."""
    if value is None:
        value = _DEFAULTS[name]
    if integral and isinstance(value, (float, np.floating)) and float(value).is_integer():
        value = int(value)  # 40.0 is accepted as 40, as sglang's int conversion does
    kinds = (int, np.integer) if integral else (int, float, np.integer, np.floating)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, kinds):
        what = "an int" if integral else "a real number"
        raise SamplingParamError(f"'{name}' of request {i} must be {what} (got {value!r})")
    if integral and not -(2**63) <= value < 2**63:
        raise SamplingParamError(f"'{name}' of request {i} must be in [-2**63, 2**63) (got {value!r})")
    if integral:
        return int(value)
    try:
        return float(value)
    except OverflowError:  # an int beyond any double
        raise SamplingParamError(f"'{name}' of request {i} must be finite and fit float32 (got {value!r})") from None


def _checked(name: str, values: list[Any], integral: bool) -> list[Any]:
    """``values`` converted one by one by ``_scalar``'s rules (the path for anything unusual)."""
    return [_scalar(i, name, v, integral) for i, v in enumerate(values)]


def _floats(cols: list[list[Any]]) -> np.ndarray[Any, Any]:
    """float64 [3, n]: the temperature, top_p and min_p lists."""
    joined = cols[0] + cols[1] + cols[2]
    if set(map(type, joined)) <= _FLOAT_KINDS:
        out = np.empty(len(joined), np.float64)
        try:  # struct converts plain numbers at half array.array's cost per value
            struct.pack_into(f"{len(joined)}d", out.data, 0, *joined)
        except (struct.error, OverflowError):  # an int beyond any double: the checked path names it
            pass
        else:
            return out.reshape(3, -1)
    names = ("temperature", "top_p", "min_p")
    return np.array([_checked(name, col, False) for name, col in zip(names, cols, strict=True)], np.float64)


def _ints(top_k: list[Any], seeds: list[Any]) -> np.ndarray[Any, Any]:
    """int64 [2, n]: the top_k and seed lists (a None seed as the default)."""
    kinds = set(map(type, seeds))
    if kinds <= _SEED_KINDS:
        if type(None) in kinds:
            seeds = list(map(_SEED_OR_DEFAULT, seeds, seeds))
        if set(map(type, top_k)) <= _INT_KINDS:
            out = np.empty(2 * len(seeds), np.int64)
            try:  # plain ints only (checked above, so no bools): struct packs them exactly or refuses
                struct.pack_into(f"{len(out)}q", out.data, 0, *top_k, *seeds)
            except (struct.error, OverflowError):  # beyond int64: the checked path names it
                pass
            else:
                return out.reshape(2, -1)
    return np.array([_checked("top_k", top_k, True), _checked("sampling_seed", seeds, True)], np.int64)


def _bias(i: int, value: Any) -> Bias | None:
    # sglang's bias is a dict of str keys to floats: the exact type checks come first, the
    # general ones (a Mapping, numpy numbers) only when those fail.
    if type(value) is not dict and not isinstance(value, Mapping):
        raise SamplingParamError(
            f"'logit_bias' of request {i} must be a mapping of token id to float (got {type(value).__name__})"
        )
    if not value:
        return None
    merged: dict[int, float] = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError, OverflowError):
            raise SamplingParamError(f"'logit_bias' keys of request {i} must be token ids (got {key!r})") from None
        if token < 0 or type(key) is bool:
            raise SamplingParamError(f"'logit_bias' token ids of request {i} must be ints >= 0 (got {key!r})")
        if type(bias) is not float and (
            isinstance(bias, (bool, np.bool_)) or not isinstance(bias, (int, float, np.integer, np.floating))
        ):
            raise SamplingParamError(f"'logit_bias' values of request {i} must be real numbers (got {bias!r})")
        try:
            number = float(bias)
        except OverflowError:  # an int beyond any double
            number = math.inf
        if not -F32_MAX <= number <= F32_MAX:  # NaN fails both sides
            raise SamplingParamError(
                f"'logit_bias' values of request {i} must be finite and fit float32 (got {bias!r} for token {token})"
            )
        merged[token] = number  # last one wins on collision, as sglang's dict does
    if len(merged) > MAX_BIAS_ENTRIES:
        raise SamplingParamError(
            f"'logit_bias' of request {i} must have at most {MAX_BIAS_ENTRIES} entries (got {len(merged)})"
        )
    tokens = sorted(merged)
    return tuple(tokens), tuple(map(merged.__getitem__, tokens))


def _biases(raw: list[Any]) -> dict[int, Bias]:
    """{request index: bias} for the requests that carry a non-empty one."""
    out = {}
    if raw.count(None) != len(raw):
        for i in compress(range(len(raw)), map(is_not, raw, repeat(None))):
            bias = _bias(i, raw[i])
            if bias is not None:
                out[i] = bias
    return out


def _pack_small(
    objs: Sequence[Any], out: np.ndarray[Any, Any] | None, seeds: bool = True
) -> tuple[np.ndarray[Any, Any], dict[int, Bias]]:
    """``pack_foreign`` for a few objects (or a batch mixing pinpool's own ``SamplingParams`` with
    sglang-named ones), with the same rules and messages, in plain Python."""
    records, biases = [], {}
    for i, o in enumerate(objs):
        if type(o) is SamplingParams:  # a native request in a mixed batch: its own record
            records.append(o.record)
            if o.logit_bias is not None:
                biases[i] = o.logit_bias
            continue
        try:
            raw = (o.temperature, o.top_p, o.top_k, o.min_p, o.sampling_seed if seeds else None, o.logit_bias)
        except AttributeError:
            name = next(f for f in _fields(seeds) if not hasattr(o, f))
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
        flags = (
            (FLAG_GREEDY if top_k <= 1 else 0)
            | (FLAG_TOP_P if top_p != 1.0 else 0)
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


def _first_bad_float(floats: np.ndarray[Any, Any]) -> SamplingParamError:
    bad = ~((floats >= _LO) & (floats <= _HI))
    row = int(np.flatnonzero(bad.any(axis=1))[0])
    i = int(np.flatnonzero(bad[row])[0])
    name, rule = _FLOAT_RULES[row]
    return SamplingParamError(f"'{name}' of request {i} {rule} (got {floats[row, i].item()!r})")  # sync-ok: numpy


def _pack_vectorised(
    objs: Sequence[Any], out: np.ndarray[Any, Any] | None, seeds: bool = True
) -> tuple[np.ndarray[Any, Any], dict[int, Bias]]:
    n = len(objs)
    fields = _fields(seeds)
    try:
        columns = [list(map(_GET[f], objs)) for f in fields]
    except AttributeError:
        if SamplingParams in set(map(type, objs)):  # pinpool's own params have no 'sampling_seed'
            return _pack_small(objs, out, seeds)
        raise _missing_field(objs, next(f for f in fields if not all(hasattr(o, f) for o in objs))) from None
    if seeds:
        temp_l, top_p_l, top_k_l, min_p_l, seed_l, bias_l = columns
    else:
        (temp_l, top_p_l, top_k_l, min_p_l, bias_l), seed_l = columns, [DEFAULT_SEED] * n
    floats = _floats([temp_l, top_p_l, min_p_l])  # writable: each owns its memory
    ints = _ints(top_k_l, seed_l)
    if not ((floats >= _LO) & (floats <= _HI)).all():
        raise _first_bad_float(floats)
    top_k = ints[0]
    top_k[top_k == -1] = TOP_K_ALL  # in place: a bad value below is still the one given
    # Valid top_k is 1..TOP_K_ALL: top_k - 1 read as unsigned is below TOP_K_ALL exactly then.
    if not ((top_k - 1).view(np.uint64) < TOP_K_ALL).all():
        i = int(np.flatnonzero((top_k - 1).view(np.uint64) >= TOP_K_ALL)[0])
        raise SamplingParamError(f"'top_k' of request {i} must be >= 1, or -1 for all tokens (got {int(top_k[i])})")
    biases = _biases(bias_l)
    greedy = floats[0] < GREEDY_EPS  # sglang's SamplingParams.__post_init__, vectorised
    floats[0][greedy] = 1.0
    top_k[greedy] = 1
    rec = np.empty(n, RECORD_DTYPE) if out is None else out
    # The record's 32-bit words: temperature, top_p, top_k, min_p (f32, f32, i32, f32), the
    # seed (two words), flags | n_bias << 16, bias_max_token. Written as columns of word views.
    words = rec.view(np.int32).reshape(n, 8)
    reals = words.view(np.float32)
    reals[:, 0:2] = floats[0:2].T
    reals[:, 3] = floats[2]
    words[:, 2] = top_k
    words.view(np.int64)[:, 2] = ints[1]
    words[:, 7] = -1
    # FLAG_GREEDY, FLAG_TOP_P, FLAG_TOP_K, FLAG_MIN_P are bits 0-3: four rows of bools packed,
    # written two rows a comparison. With top_k in [1, TOP_K_ALL] and top_p, min_p in [0, 1]
    # (checked above): greedy is top_k < 2 and the top_k flag top_k < TOP_K_ALL; the top_p flag
    # is top_p != 1.0 and the min_p flag min_p != 0.0 (the doubles, as sglang compares them).
    bits = np.empty((4, n), np.bool_)
    np.less(top_k, _K_BELOW, out=bits[0::2])
    np.not_equal(floats[1:], _P_NOT, out=bits[1::2])
    words[:, 6] = np.packbits(bits, axis=0, bitorder="little")[0]
    if biases:
        at = list(biases)
        rec["flags"][at] |= FLAG_BIAS
        rec["n_bias"][at] = [len(b[0]) for b in biases.values()]
        rec["bias_max_token"][at] = [min(b[0][-1], 2**31 - 1) for b in biases.values()]
    return rec, biases


def pack_foreign(
    objs: Sequence[Any], out: np.ndarray[Any, Any] | None = None, *, seeds: bool = True
) -> tuple[np.ndarray[Any, Any], dict[int, Bias]]:
    """Validate, normalise and pack sglang-named params: (RECORD_DTYPE [n] records, {index: bias}).

    ``out``: where to write the records (RECORD_DTYPE [n]; a fresh array by default).
    ``seeds=False``: leave ``sampling_seed`` unread and store the default seed, for a batch
    that samples without seeds (sglang reads them only under deterministic inference).
    Raises ``SamplingParamError`` naming the field, the request and the value, before
    anything is written. Where several values are bad, a batch of up to ``SMALL_BATCH``
    names the first bad request; a larger one the first bad value of the first field it
    checks (types, then temperature, top_p, min_p, top_k, then the biases).
    """
    # Mixed with pinpool's own SamplingParams (their seed is ``seed``, their bias sorted
    # tuples), each native object gives its own record, one by one (``_pack_small``). With
    # seeds, no type pass is needed to find them: they have no ``sampling_seed``, so the
    # vectorised path's reads fail on them and send the batch there (and ``_pack_small``
    # tells them apart itself).
    if not seeds and SamplingParams in set(map(type, objs)):
        return _pack_small(objs, out, seeds)
    if len(objs) <= SMALL_BATCH:
        try:
            return _pack_small(objs, out, seeds)
        except OverflowError:  # a value struct cannot pack: the vectorised path's checks name it
            pass
    return _pack_vectorised(objs, out, seeds)
