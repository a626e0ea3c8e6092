"""Sampling on CUDA: one copy per build, no host sync through build, filter, merge and sampling."""

from __future__ import annotations

import random

import torch
from torch.profiler import ProfilerActivity, profile

from pinpool import PinnedRingBuffer, PoolSettings
from pinpool.testing import no_sync
from sampling import Sampler, SamplingBatchInfo
from tests.fakes import Batch, Req, random_params

DEV = torch.device("cuda", 0)
VOCAB = 1000


def batch(rng: random.Random, bs: int) -> Batch:
    return Batch([Req(random_params(rng, VOCAB)) for _ in range(bs)], DEV)


def test_build_filter_merge_sample_make_no_host_sync() -> None:
    """Catches a .item(), a pageable upload or a multinomial host check in the sampling path."""
    rng = random.Random(0)
    pool = PinnedRingBuffer(PoolSettings(device=DEV, num_slots=8, slot_bytes=1 << 20))
    sampler = Sampler()
    a, b = batch(rng, 999), batch(rng, 3)
    keep = list(range(0, 999, 2))
    keep_device = torch.tensor(keep, device=DEV)
    logits = torch.randn(len(keep) + 3, VOCAB, device=DEV)
    positions = torch.arange(len(keep) + 3, device=DEV)
    for _ in range(3):  # warm-up: kernels compiled, allocator blocks cached
        info = SamplingBatchInfo.from_schedule_batch(a, VOCAB, pool, owned=True, deterministic=True)
        info.filter_batch(keep, keep_device)
        info.merge_batch(SamplingBatchInfo.from_schedule_batch(b, VOCAB, pool, owned=True, deterministic=True))
        sampler(logits, info, positions)
    torch.cuda.synchronize()
    with no_sync():
        info = SamplingBatchInfo.from_schedule_batch(a, VOCAB, pool, owned=True, deterministic=True)
        info.filter_batch(keep, keep_device)
        info.merge_batch(SamplingBatchInfo.from_schedule_batch(b, VOCAB, pool, owned=True, deterministic=True))
        tokens = sampler(logits, info, positions)
        ring_info = SamplingBatchInfo.from_schedule_batch(a, VOCAB, pool)
        sampler(torch.randn(999, VOCAB, device=DEV), ring_info)
    assert tokens.shape == (len(keep) + 3,)
    assert int(tokens.max()) < VOCAB


def test_one_memcpy_per_batch_build() -> None:
    """Catches a build that uploads field by field (five copies, as PR #28076 still does)."""
    rng = random.Random(1)
    pool = PinnedRingBuffer(PoolSettings(device=DEV, num_slots=8, slot_bytes=1 << 20))
    batches = [batch(rng, bs) for bs in (1, 3, 999, 4097)]
    for bt in batches:
        SamplingBatchInfo.from_schedule_batch(bt, VOCAB, pool, deterministic=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for bt in batches:
            SamplingBatchInfo.from_schedule_batch(bt, VOCAB, pool, deterministic=True)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert sum(1 for n in names if n.startswith("cudaMemcpyAsync")) == len(batches)


def test_gpu_values_match_the_cpu_build() -> None:
    """Catches a device-side layout difference between the CUDA and CPU paths."""
    rng = random.Random(2)
    params = [random_params(rng, VOCAB) for _ in range(4097)]
    gpu_pool = PinnedRingBuffer(PoolSettings(device=DEV, num_slots=4, slot_bytes=1 << 20))
    cpu_pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=4, slot_bytes=1 << 20))
    g = SamplingBatchInfo.from_schedule_batch(Batch([Req(p) for p in params], DEV), VOCAB, gpu_pool, deterministic=True)
    c = SamplingBatchInfo.from_schedule_batch(Batch([Req(p) for p in params]), VOCAB, cpu_pool, deterministic=True)
    for name in ("temperatures", "top_ps", "top_ks", "min_ps", "sampling_seed", "logit_bias"):
        assert torch.equal(getattr(g, name).cpu(), getattr(c, name)), name
    assert (g.is_all_greedy, g.need_top_p_sampling, g.need_top_k_sampling, g.need_min_p_sampling) == (
        c.is_all_greedy,
        c.need_top_p_sampling,
        c.need_top_k_sampling,
        c.need_min_p_sampling,
    )


def test_deterministic_tokens_ignore_batch_composition_on_gpu() -> None:
    """Catches batch-dependent noise on the device path."""
    rng = random.Random(3)
    target = random_params(rng, VOCAB, bias=False)
    target_logits = torch.randn(VOCAB, device=DEV)
    pool = PinnedRingBuffer(PoolSettings(device=DEV, num_slots=4, slot_bytes=1 << 20))
    drawn = set()
    for bs in (1, 2, 17, 256):
        others = [random_params(rng, VOCAB, bias=False) for _ in range(bs - 1)]
        params = [*others, target]
        logits = torch.randn(bs, VOCAB, device=DEV)
        logits[-1] = target_logits
        positions = torch.randint(0, 100, (bs,), device=DEV)
        positions[-1] = 33
        info = SamplingBatchInfo.from_schedule_batch(
            Batch([Req(p) for p in params], DEV), VOCAB, pool, deterministic=True
        )
        drawn.add(int(Sampler()(logits, info, positions)[-1]))
    assert len(drawn) == 1


def test_sglang_style_bare_cuda_device_is_accepted() -> None:
    """Catches ScheduleBatch.device == "cuda" (sglang's value) refused by a pool on the current device."""
    rng = random.Random(5)
    pool = PinnedRingBuffer(PoolSettings(device="cuda", num_slots=4, slot_bytes=1 << 16))
    assert pool.device == torch.device("cuda", torch.cuda.current_device())
    info = SamplingBatchInfo.from_schedule_batch(Batch([Req(random_params(rng, VOCAB))], "cuda"), VOCAB, pool)  # type: ignore[arg-type]
    assert info.temperatures.device == pool.device
