"""``SamplingBatchInfo.from_schedule_batch(stage=st)`` on CPU: a batch built into the caller's
open stage (zero-copy or ring) equals the normal build, lives only for its stage, and bad
combinations are refused with typed errors."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from pinpool import PinnedRingBuffer, PoolSettings, PoolStateError, StaleLeaseError
from pinpool.testing import LaggingGpu
from sampling import Sampler, SamplingBatchInfo
from tests.fakes import Batch, Req, random_params
from tests.unit.test_sglang_params import pair

VOCAB = 60
TENSORS = ("columns", "temperatures", "top_ps", "top_ks", "min_ps", "sampling_seed", "logit_bias")
FLAGS = ("is_all_greedy", "is_any_greedy", "need_top_p_sampling", "need_top_k_sampling", "need_min_p_sampling")


def make_pool(num_slots: int = 4) -> PinnedRingBuffer:
    return PinnedRingBuffer(PoolSettings(device="cpu", num_slots=num_slots, slot_bytes=1 << 18, zero_copy=True))


def make_batch(kind: str, bs: int, seed: int = 0) -> Batch:
    """``bs`` requests with native params, or sglang-named ones (a plain object, as sglang's callers pass)."""
    rng = random.Random(seed)
    if kind == "native":
        return Batch([Req(random_params(rng, VOCAB)) for _ in range(bs)])
    return Batch([Req(pair(rng)[0]) for _ in range(bs)])  # type: ignore[arg-type]


def assert_same(a: SamplingBatchInfo, b: SamplingBatchInfo) -> None:
    for name in TENSORS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name
    for flag in FLAGS:
        assert getattr(a, flag) == getattr(b, flag), flag


def build(batch: Batch, pool: PinnedRingBuffer, **kw: Any) -> SamplingBatchInfo:
    return SamplingBatchInfo.from_schedule_batch(batch, VOCAB, pool, deterministic=True, **kw)


@pytest.mark.parametrize("kind", ["native", "sglang"])
@pytest.mark.parametrize("zero_copy", [True, False])
@pytest.mark.parametrize("bs", [1, 999])
def test_a_batch_built_into_a_stage_equals_the_normal_build_and_samples_the_same(
    kind: str, zero_copy: bool, bs: int
) -> None:
    """Catches a stage= build that writes columns or bias entries at other offsets than the normal
    build, or lands them outside the caller's stage (a second copy, or none for a ring stage)."""
    pool = make_pool()
    batch = make_batch(kind, bs, seed=bs)
    reference = build(batch, pool, owned=True)
    logits = torch.randn(bs, VOCAB, generator=torch.Generator().manual_seed(bs)) * 3
    positions = torch.arange(bs)
    want = Sampler()(logits, reference, positions)
    copies = pool.stats().copies
    with pool.stage(zero_copy=zero_copy) as st:
        info = build(batch, pool, stage=st)
        if not zero_copy:
            st.flush()
        assert_same(info, reference)
        assert torch.equal(Sampler()(logits, info, positions), want)
    assert info.lease is st and info.stage_bound
    assert pool.stats().copies == copies + (not zero_copy)  # the caller's stage's one copy, or none
    if zero_copy:  # the columns are the pinned slot itself
        assert pool.host_slab.data_ptr() <= info.columns.data_ptr() < pool.host_slab.data_ptr() + pool.host_slab.numel()


def test_a_zero_copy_built_batch_is_refused_after_its_stage_closed() -> None:
    """Catches a zero-copy-built batch sampled after close, when no fence covers the reader and the
    host may already rewrite its slot."""
    pool = make_pool()
    params_batch = Batch([Req(random_params(random.Random(1), VOCAB, bias=False)) for _ in range(3)])
    params_batch.reqs[0] = Req(random_params(random.Random(2), VOCAB))
    biased = Batch([Req(pair(random.Random(4))[0])])  # type: ignore[arg-type]
    with pool.stage(zero_copy=True) as st:
        info = build(params_batch, pool, stage=st)
        info.check_live()
    logits = torch.zeros(3, VOCAB)
    with pytest.raises(StaleLeaseError, match="after its stage closed"):
        Sampler()(logits, info, torch.arange(3))
    with pool.stage(zero_copy=True) as st:
        with_bias = build(biased, pool, stage=st)
    if with_bias.sparse_logit_bias is not None:
        with pytest.raises(StaleLeaseError):
            with_bias.apply_logits_bias(torch.zeros(1, VOCAB))
        with pytest.raises(StaleLeaseError):
            _ = with_bias.logit_bias


def test_a_ring_stage_built_batch_is_refused_before_the_stage_copy_is_issued() -> None:
    """Catches the sampler reading a ring stage's device views before its copy: they hold old bytes."""
    pool = make_pool()
    with pool.stage() as st:
        info = build(make_batch("native", 4), pool, stage=st)
        with pytest.raises(StaleLeaseError, match=r"before its copy was issued"):
            info.check_live()
        st.flush()
        info.check_live()
    info.check_live()  # the ring lease: live until the slot is recycled, like the normal build


def test_filter_and_merge_of_a_stage_bound_batch_are_refused() -> None:
    """Catches filter/merge of a batch that lives only for its stage: after close they would gather
    from a rewritten slot, and inside a ring stage they would read values not yet copied."""
    pool = make_pool()
    running = build(make_batch("native", 5), pool, owned=True)
    with pool.stage(zero_copy=True) as st:
        bound = build(make_batch("native", 3, seed=1), pool, stage=st)
        with pytest.raises(PoolStateError, match="lives only for that stage"):
            bound.filter_batch([0], keep_indices_device=torch.tensor([0]))
        with pytest.raises(PoolStateError, match="merge_batch"):
            running.merge_batch(bound)
        with pytest.raises(PoolStateError, match="merge_batch"):
            bound.merge_batch(running)
    assert len(running) == 5 and len(bound) == 3


def test_bad_stage_combinations_are_refused_with_typed_errors() -> None:
    """Catches a stage= build combined with owned memory, into a closed or flushed stage, or into a
    stage of another pool (whose slot this pool's fence does not guard)."""
    pool, other = make_pool(), make_pool()
    batch = make_batch("native", 2)
    with pool.stage(zero_copy=True) as st, pytest.raises(PoolStateError, match="owned=True"):
        build(batch, pool, stage=st, owned=True)
    with pool.stage(owned=4096) as st, pytest.raises(PoolStateError, match="an owned stage"):
        build(batch, pool, stage=st)
    for zero_copy in (True, False):
        with pool.stage(zero_copy=zero_copy) as st:
            pass
        with pytest.raises(PoolStateError, match="'stage' must be open"):
            build(batch, pool, stage=st)
        with pool.stage(zero_copy=zero_copy) as st:
            st.flush()
            with pytest.raises(PoolStateError, match="flushed"):
                build(batch, pool, stage=st)
        with other.stage(zero_copy=zero_copy) as st, pytest.raises(PoolStateError, match="another pool"):
            build(batch, pool, stage=st)


def test_the_default_build_is_not_stage_bound() -> None:
    """Catches the stage= rules leaking into the normal build (filter/merge refused, reads refused)."""
    pool = make_pool()
    info = build(make_batch("native", 3), pool)
    assert not info.stage_bound and info.lease is not None
    info.check_live()
    info.filter_batch([2, 0])
    assert len(info) == 2


def test_zero_copy_built_batch_stays_intact_for_a_lagging_reader() -> None:
    """Catches a stage= build whose columns are not in the caller's zero-copy slot (or not covered by
    its fence): a reader queued inside the stage, run late, would see a later stage's bytes."""
    gpu = LaggingGpu(max_lag=6, seed=3)
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=1 << 14, zero_copy=True), transport=gpu)
    for step in range(30):
        batch = make_batch("native", 1 + step % 7, seed=step)
        with pool.stage(zero_copy=True) as st:
            info = build(batch, pool, stage=st)
            gpu.enqueue_check(info.columns, info.columns.numpy().copy(), f"step {step} columns")
    gpu.drain()
    assert gpu.mismatches == []
    assert pool.stats().copies == 0
