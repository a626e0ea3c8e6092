"""sglang's per-value rules for its ``SamplingParams`` fields, shared by both packers of ``sglang_params``.

``None`` as sglang's default, strict number types, each field's range (and the message that
names a value outside it), and a logit bias's keys and values. Each rule checks one value and
names it; the packers decide when to call them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from itertools import compress, repeat
from operator import is_not
from typing import Any

import numpy as np

from sampling.exceptions import SamplingParamError
from sampling.params import DEFAULT_SEED, F32_MAX, MAX_BIAS_ENTRIES

#: A request's logit bias as (token ids, values), sorted by token id.
Bias = tuple[tuple[int, ...], tuple[float, ...]]
#: What ``None`` in each number field means, as in sglang's ``SamplingParams`` (seed: its deterministic default).
DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "sampling_seed": DEFAULT_SEED}
#: The vectorised packer's grid rows (``sglang_params._pack_vectorised``): names and range rules.
RULES = {
    0: ("temperature", "must be finite, >= 0 and fit float32"),
    1: ("top_p", "must be in (0, 1]"),
    2: ("top_k", "must be >= 1, or -1 for all tokens"),
    3: ("min_p", "must be in [0, 1]"),
}


def out_of_range(row: int, i: int, value: Any) -> SamplingParamError:
    """Request ``i``'s value of grid row ``row`` broke that row's range rule."""
    name, rule = RULES[row]
    return SamplingParamError(f"'{name}' of request {i} {rule} (got {value!r})")


def missing_field(objs: Sequence[Any], name: str) -> SamplingParamError:
    i = next(i for i, o in enumerate(objs) if not hasattr(o, name))
    return SamplingParamError(
        f"'sampling_params' of request {i} must carry sglang's field '{name}' (got {type(objs[i]).__name__})"
    )


def scalar(i: int, name: str, value: Any, integral: bool) -> Any:
    """One field of one object: None as sglang's default, strict types, an int field's range."""
    if value is None:
        value = DEFAULTS[name]
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


def checked(name: str, values: list[Any], integral: bool) -> list[Any]:
    """``values`` converted one by one by ``scalar``'s rules (the path for anything unusual)."""
    return [scalar(i, name, v, integral) for i, v in enumerate(values)]


def check_bias(i: int, value: Any) -> Bias | None:
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


def check_biases(raw: list[Any]) -> dict[int, Bias]:
    """{request index: bias} for the requests that carry a non-empty one."""
    out = {}
    if raw.count(None) != len(raw):
        for i in compress(range(len(raw)), map(is_not, raw, repeat(None))):
            bias = check_bias(i, raw[i])
            if bias is not None:
                out[i] = bias
    return out
