"""``SamplingParams``: one request's sampling settings, validated and packed once.

Parameters never change after construction, so each request carries its packed 32-byte
record; building a batch is then a join of those records and one memmove into the pool.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import numpy as np

from sampling.exceptions import SamplingParamError

#: top_k meaning "no top-k filter" (sglang's convention), stored instead of -1.
TOP_K_ALL = 1 << 30
#: Below this temperature a request is greedy: stored as temperature 1.0, top_k 1.
GREEDY_EPS = 1e-6
#: Bits of the record's ``flags`` column: a batch's flags are one OR / AND reduction.
FLAG_GREEDY, FLAG_TOP_P, FLAG_TOP_K, FLAG_MIN_P, FLAG_BIAS = 1, 2, 4, 8, 16
#: Most logit-bias entries one request may carry (the record counts them in 16 bits).
MAX_BIAS_ENTRIES = 65535
#: Seed used for a request without one when deterministic sampling is on.
DEFAULT_SEED = 42

#: One request's row as the device sees it. Column views of a [bs] batch of these rows
#: are the per-request tensors; the n_bias / bias_max_token columns let the host find
#: logit-bias work with numpy instead of a Python loop.
RECORD_DTYPE = np.dtype(
    [
        ("temperature", "<f4"),
        ("top_p", "<f4"),
        ("top_k", "<i4"),
        ("min_p", "<f4"),
        ("seed", "<i8"),
        ("flags", "<u2"),
        ("n_bias", "<u2"),
        ("bias_max_token", "<i4"),
    ]
)
assert RECORD_DTYPE.itemsize == 32


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise SamplingParamError(f"'{name}' must be a real number (got {value!r})")
    return float(value)


#: The largest finite float32: temperatures and bias values are stored as float32, where
#: anything larger would become inf (and the sampler's softmax NaN) without a word.
F32_MAX = float(np.finfo(np.float32).max)


def _check_temperature(instance: Any, attribute: Any, value: Any) -> None:
    v = _number("temperature", value)
    if not math.isfinite(v) or not 0 <= v <= F32_MAX:
        raise SamplingParamError(f"'temperature' must be finite, >= 0 and fit float32 (got {value!r})")


def _check_top_p(instance: Any, attribute: Any, value: Any) -> None:
    v = _number("top_p", value)
    if not (0.0 < v <= 1.0):
        raise SamplingParamError(f"'top_p' must be in (0, 1] (got {value!r})")


def _check_top_k(instance: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise SamplingParamError(f"'top_k' must be an int (got {value!r})")
    if value != -1 and not (1 <= value <= TOP_K_ALL):
        raise SamplingParamError(f"'top_k' must be >= 1, or -1 for all tokens (got {value!r})")


def _check_min_p(instance: Any, attribute: Any, value: Any) -> None:
    v = _number("min_p", value)
    if not (0.0 <= v <= 1.0):
        raise SamplingParamError(f"'min_p' must be in [0, 1] (got {value!r})")


def _check_seed(instance: Any, attribute: Any, value: Any) -> None:
    if value is None:
        return
    # Negative seeds are allowed, as sglang allows them: the record stores the int64 as is.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not (-(2**63) <= value < 2**63):
        raise SamplingParamError(f"'seed' must be an int in [-2**63, 2**63) or None (got {value!r})")


def _check_max_new_tokens(instance: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SamplingParamError(f"'max_new_tokens' must be an int >= 1 (got {value!r})")


def _to_bias(value: Mapping[int, float] | None) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
    if value is None or len(value) == 0:
        return None
    if len(value) > MAX_BIAS_ENTRIES:
        raise SamplingParamError(f"'logit_bias' must have at most {MAX_BIAS_ENTRIES} entries (got {len(value)})")
    if not isinstance(value, Mapping):
        raise SamplingParamError(f"'logit_bias' must be a mapping of token id to float (got {type(value).__name__})")
    tokens, biases = [], []
    for token, bias in sorted(value.items()):
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or token < 0:
            raise SamplingParamError(f"'logit_bias' token ids must be ints >= 0 (got {token!r})")
        b = _number("logit_bias", bias)
        if not math.isfinite(b) or abs(b) > F32_MAX:
            raise SamplingParamError(
                f"'logit_bias' values must be finite and fit float32 (got {bias!r} for token {token})"
            )
        tokens.append(int(token))
        biases.append(b)
    return tuple(tokens), tuple(biases)


def _to_token_set(value: Iterable[int]) -> frozenset[int]:
    tokens = frozenset(value)
    bad = [t for t in tokens if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0]
    if bad:
        raise SamplingParamError(f"'stop_token_ids' must be ints >= 0 (got {bad[0]!r})")
    return tokens


@attrs.frozen(kw_only=True)
class SamplingParams:
    """Sampling settings of one request, normalised at construction.

    ``temperature`` < 1e-6 means greedy and is stored as temperature 1.0 with top_k 1;
    ``top_k=-1`` means all tokens and is stored as ``TOP_K_ALL``.
    """

    temperature: float = attrs.field(default=1.0, validator=_check_temperature)
    top_p: float = attrs.field(default=1.0, validator=_check_top_p)
    top_k: int = attrs.field(default=-1, validator=_check_top_k)
    min_p: float = attrs.field(default=0.0, validator=_check_min_p)
    seed: int | None = attrs.field(default=None, validator=_check_seed)
    #: Sorted (token ids, biases); built from a {token id: bias} mapping.
    logit_bias: tuple[tuple[int, ...], tuple[float, ...]] | None = attrs.field(default=None, converter=_to_bias)
    max_new_tokens: int = attrs.field(default=128, validator=_check_max_new_tokens)
    stop_token_ids: frozenset[int] = attrs.field(default=frozenset(), converter=_to_token_set)
    record: bytes = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        if self.temperature < GREEDY_EPS:
            object.__setattr__(self, "temperature", 1.0)
            object.__setattr__(self, "top_k", 1)
        elif self.top_k == -1:
            object.__setattr__(self, "top_k", TOP_K_ALL)
        object.__setattr__(self, "temperature", float(self.temperature))
        row = np.zeros((), RECORD_DTYPE)
        row["temperature"] = self.temperature
        row["top_p"] = self.top_p
        row["top_k"] = self.top_k
        row["min_p"] = self.min_p
        row["seed"] = DEFAULT_SEED if self.seed is None else self.seed
        row["n_bias"] = 0 if self.logit_bias is None else len(self.logit_bias[0])
        row["flags"] = (
            (FLAG_GREEDY if self.top_k <= 1 else 0)
            | (FLAG_TOP_P if self.top_p != 1.0 else 0)
            | (FLAG_TOP_K if self.top_k != TOP_K_ALL else 0)
            | (FLAG_MIN_P if self.min_p > 0 else 0)
            | (FLAG_BIAS if self.logit_bias is not None else 0)
        )
        row["bias_max_token"] = -1 if self.logit_bias is None else min(self.logit_bias[0][-1], 2**31 - 1)
        object.__setattr__(self, "record", row.tobytes())

    @property
    def is_greedy(self) -> bool:
        return self.top_k <= 1
