"""SamplingParams: one bad value per rule, normalisation, and the packed record."""

from __future__ import annotations

import numpy as np
import pytest

from sampling import DEFAULT_SEED, RECORD_DTYPE, TOP_K_ALL, SamplingParamError, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "'temperature' must be finite, >= 0 and fit float32 (got -0.1)"),
        ({"temperature": float("nan")}, "'temperature' must be finite, >= 0 and fit float32 (got nan)"),
        ({"temperature": float("inf")}, "'temperature' must be finite, >= 0 and fit float32 (got inf)"),
        ({"temperature": "hot"}, "'temperature' must be a real number (got 'hot')"),
        ({"top_p": 0.0}, "'top_p' must be in (0, 1] (got 0.0)"),
        ({"top_p": 1.5}, "'top_p' must be in (0, 1] (got 1.5)"),
        ({"top_k": 0}, "'top_k' must be >= 1, or -1 for all tokens (got 0)"),
        ({"top_k": -2}, "'top_k' must be >= 1, or -1 for all tokens (got -2)"),
        ({"top_k": 2.5}, "'top_k' must be an int (got 2.5)"),
        ({"min_p": -0.01}, "'min_p' must be in [0, 1] (got -0.01)"),
        ({"min_p": 1.01}, "'min_p' must be in [0, 1] (got 1.01)"),
        ({"seed": 2**63}, "'seed' must be an int in [-2**63, 2**63) or None (got 9223372036854775808)"),
        ({"seed": 1.0}, "'seed' must be an int in [-2**63, 2**63) or None (got 1.0)"),
        ({"logit_bias": {-3: 1.0}}, "'logit_bias' token ids must be ints >= 0 (got -3)"),
        ({"logit_bias": {3: float("nan")}}, "'logit_bias' values must be finite and fit float32 (got nan for token 3)"),
        ({"logit_bias": [1, 2]}, "'logit_bias' must be a mapping"),
        ({"max_new_tokens": 0}, "'max_new_tokens' must be an int >= 1 (got 0)"),
    ],
)
def test_each_rule_rejects_one_bad_value(kwargs: dict[str, object], message: str) -> None:
    """Catches a parameter that would reach the sampler out of range (NaN temperature, top_p 0)."""
    with pytest.raises(SamplingParamError) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_greedy_and_all_tokens_are_normalised() -> None:
    """Catches greedy requests sampled at temperature ~0 (division blow-up) instead of top_k 1."""
    greedy = SamplingParams(temperature=1e-7, top_k=50)
    assert (greedy.temperature, greedy.top_k, greedy.is_greedy) == (1.0, 1, True)
    everything = SamplingParams(top_k=-1)
    assert everything.top_k == TOP_K_ALL
    assert not everything.is_greedy


def test_record_packs_the_normalised_values() -> None:
    """Catches a record layout that disagrees with the fields the device reads."""
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=7, logit_bias={9: 2.0, 3: -1.0})
    row = np.frombuffer(p.record, RECORD_DTYPE)[0]
    assert row["temperature"] == np.float32(0.7)
    assert row["top_p"] == np.float32(0.9)
    assert (row["top_k"], row["seed"], row["n_bias"], row["bias_max_token"]) == (40, 7, 2, 9)
    assert row["min_p"] == np.float32(0.05)
    assert np.frombuffer(SamplingParams().record, RECORD_DTYPE)[0]["seed"] == DEFAULT_SEED
    assert p.logit_bias == ((3, 9), (-1.0, 2.0))
