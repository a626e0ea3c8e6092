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
batch (``Scheduler.chunked_req``) and retracted requests coming back. A model of sglang's
admission (``tests/bench/diag_repeats.py``) puts them at 0.3-0.6% of the objects read with
8192-token chunks, 10-16% with 2048, plus up to 6% retracted ones under a tight KV pool:
at most one chunked request per batch (often alone in it), at most five repeats. A
cache keyed by object would pay its bookkeeping on every miss to save those few.

How a batch is read: one pass per field over the params objects (``map`` with an
``attrgetter``, the same attribute reads sglang's list comprehensions make), one type pass
over the values, one ``struct`` call converting them all at C speed, then some twenty numpy
operations for the whole batch (one comparison checks every range, one more gives every
flag). No Python object is made per request. Values that are not plain numbers (None, a
bool, a numpy scalar, a string) go through the checked conversion, which applies the same
rules value by value and names the first bad one. Up to ``SMALL_BATCH`` requests are packed
one by one in plain Python instead, where numpy's fixed cost per operation would dominate.
"""

from __future__ import annotations

import math
import struct
import sys
from collections.abc import Sequence
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
    RECORD_DTYPE,
    TOP_K_ALL,
    SamplingParams,
)
from sampling.sglang_rules import (
    DEFAULTS,
    Bias,
    check_bias,
    check_biases,
    checked,
    missing_field,
    out_of_range,
    scalar,
)

_FIELDS = (*DEFAULTS, "logit_bias")
_FIELDS_NO_SEED = tuple(f for f in _FIELDS if f != "sampling_seed")
_GET = {name: attrgetter(name) for name in _FIELDS}
#: Element types the fast conversion takes as they are; anything else is checked one by one.
_FLOAT_KINDS = frozenset({float, int})
_INT_KINDS = frozenset({int})
#: Bounds of the vectorised packer's grid rows (temperature, top_p, top_k, min_p), top_k's
#: once -1 is read as TOP_K_ALL. top_p must be > 0: its bound is the smallest positive double.
#: NaN fails both sides.
_LO = np.array([[0.0], [np.nextafter(0.0, 1.0)], [1.0], [0.0]])
_HI = np.array([[F32_MAX], [1.0], [float(TOP_K_ALL)], [1.0]])
#: The lower bounds of a grid that needs no normalising (no greedy temperature, so no top_k
#: -1 either: sglang's own params arrive so), then just past the upper bounds: one ``>=``
#: against both says whether the grid is in range and done.
_BOUNDS = np.array([[[GREEDY_EPS], [np.nextafter(0.0, 1.0)], [1.0], [0.0]], np.nextafter(_HI, np.inf)])
_TOP_K_ALL_F = np.array(float(TOP_K_ALL))
_ONE = np.array(1.0)
#: The flag comparisons' right-hand sides, for rows top_p, top_k, min_p, top_k (``!=``).
_FLAG_NE = np.array([[1.0], [1.0], [0.0], [float(TOP_K_ALL)]])
#: Bytes (top_p, not greedy, min_p, top_k) of a uint32 times this put their bits at 25, 24,
#: 27, 26: flags bits 1, 0, 3, 2 once shifted down by 24. The other products land below bit
#: 20 (no carry reaches bit 24) or past bit 31 (dropped).
_FLAG_MAGIC = np.uint32((1 << 25) + (1 << 16) + (1 << 11) + (1 << 2))
_GREEDY_BIT = np.uint32(1 << 24)
#: Up to this many objects are packed one by one in Python (``_pack_small``): below it,
#: numpy's fixed cost per operation (some 20 of them) outweighs Python's per request. On a
#: 2-core CI host the two cross near 28 requests; at 20 the small packer is 17% faster, at
#: 8 2.2 times. Held equal to the vectorised packer by ``test_every_path_packs_the_same_bytes``
#: and ``test_small_and_numpy_packers_give_the_same_bytes``.
SMALL_BATCH = 20
_INT64_END = 2**63
_RECORD = struct.Struct("<ffifqHHi")  # RECORD_DTYPE's layout, field for field
# The vectorised packer puts the four flags below at bits 0-3 (``_FLAG_MAGIC``), of a
# little-endian uint32's bytes.
assert (FLAG_GREEDY, FLAG_TOP_P, FLAG_TOP_K, FLAG_MIN_P) == (1, 2, 4, 8)
assert sys.byteorder == "little"


def _fields(seeds: bool) -> tuple[str, ...]:
    return _FIELDS if seeds else _FIELDS_NO_SEED


def _row_checked(i: int, raw: tuple[Any, ...]) -> tuple[tuple[Any, ...], Bias | None]:
    """Request ``i``'s record values and bias from its raw fields, each value through ``scalar``:
    the small packer's general path, for any value its fast test does not take."""
    temp = scalar(i, "temperature", raw[0], False)
    top_p = scalar(i, "top_p", raw[1], False)
    top_k = scalar(i, "top_k", raw[2], True)
    min_p = scalar(i, "min_p", raw[3], False)
    seed = scalar(i, "sampling_seed", raw[4], True)
    if not math.isfinite(temp) or not 0 <= temp <= F32_MAX:
        raise out_of_range(0, i, temp)
    if not 0 < top_p <= 1:
        raise out_of_range(1, i, top_p)
    if not 0 <= min_p <= 1:
        raise out_of_range(3, i, min_p)
    if top_k != -1 and not 1 <= top_k <= TOP_K_ALL:
        raise out_of_range(2, i, top_k)
    bias = None if raw[5] is None else check_bias(i, raw[5])
    if temp < GREEDY_EPS:
        temp, top_k = 1.0, 1
    elif top_k == -1:
        top_k = TOP_K_ALL
    flags = (
        (FLAG_GREEDY if top_k <= 1 else 0)
        | (FLAG_TOP_P if top_p != 1.0 else 0)
        | (FLAG_TOP_K if top_k != TOP_K_ALL else 0)
        | (FLAG_MIN_P if min_p > 0 else 0)
    )
    return (temp, top_p, top_k, min_p, seed, flags), bias


def _pack_small(
    objs: Sequence[Any], out: np.ndarray[Any, Any] | None, seeds: bool = True
) -> tuple[np.ndarray[Any, Any], dict[int, Bias]]:
    """``pack_foreign`` for a few objects (or a batch mixing pinpool's own ``SamplingParams`` with
    sglang-named ones), with the same rules and messages, in plain Python.

    A request whose values are plain floats and ints (a float field may hold an int), in range
    and needing no normalisation (as sglang's own params arrive), is packed by the fast test
    below; any other goes through ``_row_checked``, which applies every rule value by value.
    """
    buf = bytearray(32 * len(objs))  # written to ``out`` only once every request has passed
    pack_into = _RECORD.pack_into
    biases = {}
    for i, o in enumerate(objs):
        if type(o) is SamplingParams:  # a native request in a mixed batch: its own record
            buf[32 * i : 32 * i + 32] = o.record
            if o.logit_bias is not None:
                biases[i] = o.logit_bias
            continue
        try:
            temp, top_p, top_k, min_p = o.temperature, o.top_p, o.top_k, o.min_p
            seed = o.sampling_seed if seeds else None
            raw_bias = o.logit_bias
        except AttributeError:
            name = next(f for f in _fields(seeds) if not hasattr(o, f))
            raise SamplingParamError(
                f"'sampling_params' of request {i} must carry sglang's field '{name}' (got {type(o).__name__})"
            ) from None
        fast = (
            (type(temp) is float or type(temp) is int)
            and (type(top_p) is float or type(top_p) is int)
            and type(top_k) is int
            and (type(min_p) is float or type(min_p) is int)
            and GREEDY_EPS <= temp <= F32_MAX
            and 0 < top_p <= 1
            and 0 <= min_p <= 1
            and 1 <= top_k <= TOP_K_ALL
            and (seed is None or type(seed) is int)
        )
        if fast and raw_bias is not None and seed is not None and not -_INT64_END <= seed < _INT64_END:
            fast = False  # the checked path names a seed beyond int64 before any bias error
        if fast:
            flags = (top_k == 1) | (top_p != 1.0) << 1 | (top_k != TOP_K_ALL) << 2 | (min_p != 0) << 3
            values: tuple[Any, ...] = (temp, top_p, top_k, min_p, DEFAULT_SEED if seed is None else seed, flags)
            bias = None if raw_bias is None else check_bias(i, raw_bias)
        else:
            values, bias = _row_checked(i, (temp, top_p, top_k, min_p, seed, raw_bias))
        try:
            if bias is None:
                pack_into(buf, 32 * i, *values, 0, -1)
            else:
                pack_into(buf, 32 * i, *values[:5], values[5] | FLAG_BIAS, len(bias[0]), min(bias[0][-1], 2**31 - 1))
        except struct.error:  # a seed beyond int64 (without a bias, the fast test leaves its range to struct)
            _row_checked(i, (temp, top_p, top_k, min_p, seed, raw_bias))
            raise
        if bias is not None:
            biases[i] = bias
    rec = np.frombuffer(buf, RECORD_DTYPE)
    if out is None:
        return rec, biases
    out[:] = rec
    return out, biases


def _first_bad(grid: np.ndarray[Any, Any], top_k: list[Any]) -> SamplingParamError:
    """The error for the first value of ``grid`` (rows temperature, top_p, top_k, min_p) out of its
    range, the rows taken in the order temperature, top_p, min_p, top_k."""
    bad = ~((grid >= _LO) & (grid <= _HI))
    row = next(r for r in (0, 1, 3, 2) if bad[r].any())
    i = int(np.flatnonzero(bad[row])[0])
    # top_k: the int as given, not its double; the others a number of the host grid
    value = top_k[i] if row == 2 else grid[row, i].item()  # sync-ok: a numpy host array, no device read
    return out_of_range(row, i, value)


def _grid_checked(
    temp: list[Any], top_p: list[Any], top_k: list[Any], min_p: list[Any], seeds: list[Any] | None
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any] | None, list[Any]]:
    """The checked conversion: (grid, seeds, top_k as exact ints), each value through ``scalar``,
    fields in the order the errors name them (temperature, top_p, min_p, top_k, sampling_seed)."""
    temp, top_p, min_p = (checked(f, c, False) for f, c in (("temperature", temp), ("top_p", top_p), ("min_p", min_p)))
    top_k = checked("top_k", top_k, True)
    wide = None if seeds is None else np.array(checked("sampling_seed", seeds, True), np.int64)
    return np.array([temp, top_p, top_k, min_p], np.float64), wide, top_k


def _pack_vectorised(
    objs: Sequence[Any], out: np.ndarray[Any, Any] | None, seeds: bool = True
) -> tuple[np.ndarray[Any, Any], dict[int, Bias]]:
    fields = _fields(seeds)
    try:
        columns = [list(map(_GET[f], objs)) for f in fields]
    except AttributeError:
        if SamplingParams in set(map(type, objs)):  # pinpool's own params have no 'sampling_seed'
            return _pack_small(objs, out, seeds)
        raise missing_field(objs, next(f for f in fields if not all(hasattr(o, f) for o in objs))) from None
    grid, ints, top_k_ints = _read_columns(columns, seeds)
    _check_and_normalise(grid, top_k_ints)
    biases = check_biases(columns[-1])  # checked too, before anything is written
    rec = np.empty(len(objs), RECORD_DTYPE) if out is None else out
    _write_records(rec, grid, ints, biases, fresh=out is None)
    return rec, biases


def _read_columns(columns: list[list[Any]], seeds: bool) -> tuple[Any, Any, Any]:
    """(the float64 grid [5, n], the int64 [2, n] top_k and seeds, top_k as given) from the field lists.

    One buffer: the grid (temperature, top_p, top_k, min_p: the record's first four words, and
    top_k again for the flags' comparison), then top_k and the seeds as int64. Plain floats (or
    ints) in the float fields and plain ints in the int fields, checked by one type pass each,
    are converted by one struct call (top_k as int64, then copied into the grid); anything else
    (None, a bool, a numpy scalar, a string) goes through the checked conversion, which names
    the bad value.
    """
    temp_l, top_p_l, top_k_l, min_p_l = columns[:4]
    n = len(temp_l)
    buf = np.empty((7, n), np.float64)
    grid = buf[:5]
    ints = np.ndarray((2, n), np.int64, buf, 40 * n)
    seed_l = [DEFAULT_SEED if s is None else s for s in columns[4]] if seeds else []  # as scalar's default
    float_kinds = [*map(type, temp_l), *map(type, top_p_l), *map(type, min_p_l)]
    int_kinds = [*map(type, top_k_l), *map(type, seed_l)]
    plain = (float_kinds.count(float) == 3 * n or set(float_kinds) <= _FLOAT_KINDS) and int_kinds.count(int) == len(
        int_kinds
    )
    top_k_ints = top_k_l
    if plain:
        try:  # plain numbers only (no bools): struct converts them exactly, or refuses beyond int64 or any double
            struct.pack_into(
                f"{2 * n}d{8 * n}x{n}d{8 * n}x{len(int_kinds)}q",
                buf.data,
                0,
                *temp_l,
                *top_p_l,
                *min_p_l,
                *top_k_l,
                *seed_l,
            )
        except (struct.error, OverflowError):
            plain = False
        else:
            grid[2:5:2] = ints[0]
    if not plain:
        checked, seed_col, top_k_ints = _grid_checked(temp_l, top_p_l, top_k_l, min_p_l, columns[4] if seeds else None)
        grid[:4] = checked
        grid[4] = grid[2]
        if seed_col is not None:
            ints[1] = seed_col
    if not seeds:
        ints[1] = DEFAULT_SEED
    return grid, ints, top_k_ints


def _check_and_normalise(grid: np.ndarray[Any, Any], top_k_ints: Any) -> None:
    """Raise for the first bad value, then normalise as sglang does (-1: all tokens; greedy)."""
    # Every value in range and nothing to normalise (sglang's own params arrive normalised):
    # temperature >= GREEDY_EPS (not greedy), top_k in [1, TOP_K_ALL] (no -1). One comparison
    # against both bounds: every value at least its lower one, none past its upper one.
    n = grid.shape[1]
    if np.greater_equal(grid[:4], _BOUNDS).tobytes() != b"\x01" * (4 * n) + b"\x00" * (4 * n):
        top_k = grid[2]
        np.copyto(top_k, _TOP_K_ALL_F, where=top_k == -1)  # -1: all tokens; a bad value stays as given
        if not ((grid[:4] >= _LO) & (grid[:4] <= _HI)).all():
            raise _first_bad(grid[:4], top_k_ints)
        np.copyto(grid[0:3:2], _ONE, where=grid[0] < GREEDY_EPS)  # greedy: temperature 1.0, top_k 1
        grid[4] = top_k


def _write_records(
    rec: np.ndarray[Any, Any],
    grid: np.ndarray[Any, Any],
    ints: np.ndarray[Any, Any],
    biases: dict[int, Bias],
    fresh: bool,
) -> None:
    """The checked, normalised values into ``rec`` (RECORD_DTYPE [n]; ``fresh``: made here, contiguous)."""
    n = len(rec)
    # The record's 32-bit words: temperature, top_p, top_k, min_p (f32, f32, i32, f32), the
    # seed (two words), flags | n_bias << 16, bias_max_token. Written as columns of word views
    # (native words: a little-endian host, as RECORD_DTYPE's byte order and the flag bytes below).
    words = np.ndarray((n, 8), np.int32, rec) if fresh else rec.view(np.int32).reshape(n, 8)
    words.view(np.float32)[:, :4] = grid[:4].T
    words[:, 2] = grid[2]
    words.view(np.int64)[:, 2] = ints[1]
    # The flags, from one comparison of the doubles (as sglang compares them; top_k, top_p and
    # min_p in range, checked above): each request's four bytes are top_p != 1, top_k != 1 (not
    # greedy), min_p != 0, top_k != TOP_K_ALL. Read as one little-endian uint32, a multiply
    # moves each byte's bit to its flag's place in the top byte (see ``_FLAG_MAGIC``); greedy
    # is flipped back by an xor.
    quad = np.empty((n, 4), np.bool_)
    np.not_equal(grid[1:], _FLAG_NE, out=quad.T)
    bytes4 = np.ndarray((n,), np.uint32, quad)
    np.multiply(bytes4, _FLAG_MAGIC, out=bytes4)
    np.bitwise_xor(bytes4, _GREEDY_BIT, out=bytes4)
    np.right_shift(bytes4, 24, out=words.view(np.uint32)[:, 6])
    words[:, 7] = -1
    if biases:
        at = list(biases)
        rec["flags"][at] |= FLAG_BIAS
        rec["n_bias"][at] = [len(b[0]) for b in biases.values()]
        rec["bias_max_token"][at] = [min(b[0][-1], 2**31 - 1) for b in biases.values()]


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
