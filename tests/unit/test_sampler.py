"""Sampler on CPU: greedy, the exact filtered distribution, determinism across batches."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from pinpool import PinnedRingBuffer, PoolSettings
from sampling import BatchMismatchError, Sampler, SamplingBatchInfo, SamplingParams
from tests.fakes import Batch, Req, random_params

#: Allowed deviation of an empirical frequency from its exact probability, in standard
#: errors sqrt(p(1-p)/N). 5 sigma over 8 tokens: a false alarm about once in 10^5 runs.
SIGMAS = 5.0


def pool() -> PinnedRingBuffer:
    return PinnedRingBuffer(PoolSettings(device="cpu", num_slots=4, slot_bytes=1 << 21))


def build(params: list[SamplingParams], vocab: int, deterministic: bool = False) -> SamplingBatchInfo:
    return SamplingBatchInfo.from_schedule_batch(
        Batch([Req(p) for p in params]), vocab, pool(), owned=True, deterministic=deterministic
    )


def exact_distribution(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Reference in float64: temperature, softmax, then top-k / top-p / min-p on sorted probs."""
    z = logits.astype(np.float64) / p.temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    sorted_p = probs[order]
    keep = np.ones_like(sorted_p, dtype=bool)
    keep &= (np.cumsum(sorted_p) - sorted_p) <= p.top_p
    keep &= np.arange(len(sorted_p)) < p.top_k
    keep &= sorted_p >= sorted_p[0] * p.min_p
    out = np.zeros_like(probs)
    out[order[keep]] = sorted_p[keep]
    return out / out.sum()


def test_greedy_rows_are_argmax() -> None:
    """Catches greedy rows that sample (temperature ~0 must mean argmax, alone or mixed)."""
    rng = random.Random(0)
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0) if i % 2 == 0 else random_params(rng, 40, bias=False) for i in range(6)]
    tokens = Sampler(torch.Generator().manual_seed(1))(logits, build(params, 40))
    argmax = logits.argmax(-1)
    assert tokens[0::2].tolist() == argmax[0::2].tolist()
    all_greedy = build([SamplingParams(temperature=0.0)] * 6, 40)
    assert all_greedy.is_all_greedy
    assert Sampler()(logits, all_greedy).tolist() == argmax.tolist()


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_p=0.8, top_k=5, min_p=0.05),
        SamplingParams(temperature=1.3),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=0.5, top_k=3),
    ],
)
def test_sampler_matches_the_exact_filtered_distribution(params: SamplingParams, deterministic: bool) -> None:
    """Catches a filter applied in the wrong order or on unsorted probabilities, or a biased draw."""
    n, vocab = 40_000, 8
    row = np.array([2.0, 1.5, 1.2, 0.3, 0.0, -0.5, -1.0, -3.0], dtype=np.float32)
    logits = torch.from_numpy(np.tile(row, (n, 1)))
    if deterministic:
        reqs = [SamplingParams(**{**_fields(params), "seed": i}) for i in range(n)]
        info = build(reqs, vocab, deterministic=True)
        tokens = Sampler()(logits, info, positions=torch.full((n,), 11, dtype=torch.int64))
    else:
        tokens = Sampler(torch.Generator().manual_seed(7))(logits, build([params] * n, vocab))
    freq = np.bincount(tokens.numpy(), minlength=vocab) / n
    want = exact_distribution(row, params)
    tol = SIGMAS * np.sqrt(want * (1 - want) / n)
    assert np.all(np.abs(freq - want) <= tol + 1e-12), (freq.round(4), want.round(4))
    assert np.all(freq[want == 0] == 0)


def _fields(p: SamplingParams) -> dict[str, object]:
    return {
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": -1 if p.top_k == 1 << 30 else p.top_k,
        "min_p": p.min_p,
    }


def test_deterministic_token_ignores_batch_composition() -> None:
    """Catches noise drawn per batch (not per request): the same request must draw the same token."""
    vocab = 64
    target = SamplingParams(temperature=1.0, seed=123)
    target_logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3))
    rng = random.Random(1)
    drawn = set()
    for trial in range(12):
        bs = rng.randint(1, 17)
        others = [random_params(rng, vocab, bias=False) for _ in range(bs - 1)]
        at = rng.randrange(bs)
        params = [*others[:at], target, *others[at:]]
        logits = torch.randn(bs, vocab, generator=torch.Generator().manual_seed(trial))
        logits[at] = target_logits
        positions = torch.tensor([rng.randint(0, 500) for _ in range(bs)])
        positions[at] = 17
        tokens = Sampler()(logits, build(params, vocab, deterministic=True), positions)
        drawn.add(int(tokens[at]))
    assert len(drawn) == 1
    by_position = {
        int(Sampler()(target_logits[None], build([target], vocab, True), torch.tensor([pos]))[0]) for pos in range(40)
    }
    assert len(by_position) > 5, "the noise must change with the position"


def test_sampler_rejects_mismatched_inputs() -> None:
    """Catches logits of the wrong shape or missing positions reaching the kernels."""
    info = build([SamplingParams(seed=1)] * 2, 10, deterministic=True)
    with pytest.raises(BatchMismatchError, match=r"\(2, 10\)"):
        Sampler()(torch.zeros(3, 10), info, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(BatchMismatchError, match="positions"):
        Sampler()(torch.zeros(2, 10), info)
    assert math.isfinite(float(Sampler()(torch.zeros(2, 10), info, torch.zeros(2, dtype=torch.int64))[0]))
