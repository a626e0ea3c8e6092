"""Sampling from a batch built into a zero-copy stage on CUDA: the same tokens as a copy-built
batch, on the current stream, on a side stream under GPU lag with the ring reused, and with
another device current. A control launches the sampler after the stage closed (its fence
then precedes the readers) and must see wrong tokens."""

from __future__ import annotations

import random

import pytest
import torch

from pinpool import DeviceMismatchError, PinnedRingBuffer, PoolSettings
from sampling import Sampler, SamplingBatchInfo, SamplingParams
from tests.fakes import Batch, Req, random_params

DEV = torch.device("cuda", 0)
VOCAB = 1000
STEPS = 40
#: GPU sleep before the sampler of a lagging step: ~1 ms at ~2 GHz, far longer than the
#: host takes to build and launch the next steps, so the GPU falls behind the host.
LAG_CYCLES = 20_000_000  # about 10 ms on an H200: far above the host's time per step


def zero_copy_pool(device: torch.device = DEV, num_slots: int = 4) -> PinnedRingBuffer:
    pool = PinnedRingBuffer(PoolSettings(device=device, num_slots=num_slots, slot_bytes=1 << 20, zero_copy=True))
    if not pool.platform.zero_copy_ok:
        pytest.skip(f"zero-copy refused on this host: {pool.platform.reason}")
    return pool


def step_batch(step: int, bs: int, device: torch.device = DEV) -> Batch:
    """Sampled rows (no greedy) with seeds of this step only: another step's values give other tokens."""
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=step * 100_003 + i) for i in range(bs)]
    return Batch([Req(p) for p in params], device)


def build(batch: Batch, pool: PinnedRingBuffer, **kw: object) -> SamplingBatchInfo:
    return SamplingBatchInfo.from_schedule_batch(batch, VOCAB, pool, deterministic=True, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("bs", [1, 999, 1024, 4097])
def test_zero_copy_built_batch_samples_the_copy_built_tokens(bs: int) -> None:
    """Catches a stage= build whose zero-copy columns or bias entries differ from the copied ones on
    the device (a wrong offset, a UVA view of the wrong bytes), seen through the sampled tokens."""
    pool = zero_copy_pool()
    rng = random.Random(bs)
    batch = Batch([Req(random_params(rng, VOCAB)) for _ in range(bs)], DEV)
    logits = torch.randn(bs, VOCAB, device=DEV, generator=torch.Generator(DEV).manual_seed(bs)) * 3
    positions = torch.arange(bs, device=DEV)
    sampler = Sampler()
    want = sampler(logits, build(batch, pool, owned=True), positions)
    with pool.stage(zero_copy=True) as st:
        zero_copy = sampler(logits, build(batch, pool, stage=st), positions)
    with pool.stage() as st:
        info = build(batch, pool, stage=st)
        st.flush()
        copied = sampler(logits, info, positions)
    assert torch.equal(zero_copy, want)
    assert torch.equal(copied, want)


def run_side_stream_steps(pool: PinnedRingBuffer, launch_after_close: bool) -> list[int]:
    """``STEPS`` steps, each a zero-copy build on a side stream and a lagging sampler there; the
    steps whose tokens differ from a copy-built reference."""
    bs = 64
    side = torch.cuda.Stream(DEV)  # type: ignore[no-untyped-call]
    logits = torch.randn(bs, VOCAB, device=DEV, generator=torch.Generator(DEV).manual_seed(7)) * 3
    positions = torch.arange(bs, device=DEV)
    sampler = Sampler()
    want = [sampler(logits, build(step_batch(n, bs), pool, owned=True), positions) for n in range(STEPS)]
    side.wait_stream(torch.cuda.current_stream(DEV))  # logits, positions and want are ready there
    rng = random.Random(0)
    got = []
    for n in range(STEPS):
        with pool.stage(zero_copy=True, stream=side) as st:
            info = build(step_batch(n, bs), pool, stage=st)
            if not launch_after_close:
                with torch.cuda.stream(side):
                    torch.cuda._sleep(rng.randint(0, LAG_CYCLES))  # type: ignore[no-untyped-call]
                    got.append(sampler(logits, info, positions))
        if launch_after_close:  # planted bug: the reader queued after the slot's fence
            info.lease = None  # bypass the refusal the test exists to justify
            with torch.cuda.stream(side):
                torch.cuda._sleep(LAG_CYCLES)  # type: ignore[no-untyped-call]
                got.append(sampler(logits, info, positions))
    torch.cuda.synchronize()
    return [n for n in range(STEPS) if not torch.equal(got[n], want[n])]


def test_side_stream_sampler_under_lag_sees_its_own_step_with_the_ring_reused() -> None:
    """Catches a zero-copy slot rewritten while a lagging sampler on the stage's (side) stream has
    yet to read it: with 2 slots every step reuses a slot a recent step's sampler reads."""
    pool = zero_copy_pool(num_slots=2)
    assert run_side_stream_steps(pool, launch_after_close=False) == []
    assert pool.stats().stalls > 0, "the GPU never fell behind: the test did not exercise reuse"


def test_control_a_sampler_launched_after_close_reads_a_later_step() -> None:
    """Catches a side-stream test that cannot see a reader outside the fence: it must fail then."""
    wrong = run_side_stream_steps(zero_copy_pool(num_slots=2), launch_after_close=True)
    assert wrong, "no step read another step's values: the lag did not expose the planted bug"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_zero_copy_build_and_sample_with_another_device_current() -> None:
    """Catches a zero-copy build or sampler that follows the current device (cuda:1) instead of the
    pool's (cuda:0): views, kernels or the fence on the wrong device."""
    pool = zero_copy_pool()
    bs = 257
    batch = step_batch(3, bs)
    logits = torch.randn(bs, VOCAB, device=DEV, generator=torch.Generator(DEV).manual_seed(3)) * 3
    positions = torch.arange(bs, device=DEV)
    want = Sampler()(logits, build(batch, pool, owned=True), positions)
    with torch.cuda.device(1):
        with pool.stage(zero_copy=True) as st:
            got = Sampler()(logits, build(batch, pool, stage=st), positions)
        assert torch.cuda.current_device() == 1
    torch.cuda.synchronize(DEV)
    assert got.device == DEV and torch.equal(got, want)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_stage_of_a_pool_on_another_device_is_refused() -> None:
    """Catches a batch for cuda:0 built into a cuda:1 pool's stage (its views live on cuda:1)."""
    pool0, pool1 = zero_copy_pool(DEV), zero_copy_pool(torch.device("cuda", 1))
    with pool1.stage(zero_copy=True) as st, pytest.raises(DeviceMismatchError, match="stage of the pool on cuda:0"):
        build(step_batch(0, 2), pool0, stage=st)
