"""The deterministic draw's Triton kernel on CUDA, at a real vocabulary, against its reference."""

from __future__ import annotations

import random

import pytest
import torch

from pinpool import PinnedRingBuffer, PoolSettings
from sampling import (
    Sampler,
    SamplingBatchInfo,
    SamplingParams,
    draw_reference,
    hashed_uniform,
    launch_draw_sorted,
    mask_sorted_probs,
)
from tests.fakes import Batch, Req

DEV = torch.device("cuda", 0)
VOCAB = 32_000


def info_for(rng: random.Random, bs: int, flags: str) -> SamplingBatchInfo:
    params = [
        SamplingParams(
            temperature=rng.uniform(0.4, 1.5),
            top_p=rng.uniform(0.3, 0.95) if "p" in flags else 1.0,
            top_k=rng.randint(1, 2000) if "k" in flags else -1,
            min_p=rng.uniform(0.0, 0.1) if "m" in flags else 0.0,
            seed=rng.randrange(2**40),
        )
        for _ in range(bs)
    ]
    pool = PinnedRingBuffer(PoolSettings(device=DEV, num_slots=2, slot_bytes=1 << 20))
    return SamplingBatchInfo.from_schedule_batch(
        Batch([Req(p) for p in params], DEV), VOCAB, pool, owned=True, deterministic=True
    )


@pytest.mark.parametrize("flags", ["", "p", "k", "pkm"])
def test_kernel_matches_reference_at_full_vocabulary(flags: str) -> None:
    """Catches a compiled kernel (fast log, block scan, int64 wrap) that draws other tokens than torch."""
    rng = random.Random(len(flags))
    info = info_for(rng, 256, flags)
    gen = torch.Generator(device=DEV).manual_seed(7)
    logits = torch.randn(256, VOCAB, device=DEV, generator=gen) * 3.0
    probs = torch.softmax(logits / info.temperatures, dim=-1)
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True, stable=True)
    positions = torch.randint(0, 4096, (256,), device=DEV, generator=gen)
    want = draw_reference(probs_sort, probs_idx, info, positions)
    got = launch_draw_sorted(probs_sort, probs_idx, info, positions)
    # Exact agreement is expected, but a float32 near-tie may break either way: then both
    # tokens must be allowed by the filters and score equal in float64 to 1e-5.
    assert info.sampling_seed is not None
    dense = torch.zeros_like(probs).scatter_(1, probs_idx, mask_sorted_probs(probs_sort, info)).double()
    noise = hashed_uniform(info.sampling_seed, positions, VOCAB).double()
    score = dense.log() - (-noise.log()).log()
    rows = (got != want).nonzero().flatten().tolist()
    detail = [(r, int(want[r]), int(got[r]), float(score[r, want[r]]), float(score[r, got[r]])) for r in rows]
    assert len(rows) <= 2, f"{len(rows)} of 256 rows differ: {detail[:5]}"
    for _, _, _, s_want, s_got in detail:
        assert s_got > float("-inf") and abs(s_want - s_got) <= 1e-5 * max(1.0, abs(s_want)), detail


def test_sampler_on_cuda_uses_the_kernel_and_agrees_with_the_eager_path() -> None:
    """Catches the default sampler silently staying on the eager path, or the two disagreeing."""
    rng = random.Random(3)
    info = info_for(rng, 64, "pkm")
    logits = torch.randn(64, VOCAB, device=DEV) * 3.0
    positions = torch.arange(64, device=DEV)
    fused, eager = Sampler(), Sampler(use_kernel=False)
    assert fused.use_kernel
    assert torch.equal(fused(logits, info, positions), eager(logits, info, positions))
