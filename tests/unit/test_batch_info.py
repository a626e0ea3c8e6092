"""SamplingBatchInfo on the CPU fallback: staged values, flags, filter, merge, bias, leases."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from pinpool import PinnedRingBuffer, PoolSettings, PoolStateError, StaleLeaseError
from sampling import TOP_K_ALL, BatchMismatchError, SamplingBatchInfo, SamplingParams
from tests.fakes import Batch, Req, random_params

VOCAB = 50


def make_pool(num_slots: int = 4) -> PinnedRingBuffer:
    return PinnedRingBuffer(PoolSettings(device="cpu", num_slots=num_slots, slot_bytes=1 << 18))


def expected_columns(params: list[SamplingParams]) -> dict[str, list[float]]:
    return {
        "temperature": [np.float32(p.temperature) for p in params],
        "top_p": [np.float32(p.top_p) for p in params],
        "top_k": [p.top_k for p in params],
        "min_p": [np.float32(p.min_p) for p in params],
        "seed": [42 if p.seed is None else p.seed for p in params],
    }


def dense_bias(params: list[SamplingParams]) -> torch.Tensor:
    out = torch.zeros(len(params), VOCAB)
    for i, p in enumerate(params):
        if p.logit_bias:
            for token, value in zip(*p.logit_bias, strict=True):
                out[i, token] += value
    return out


def assert_matches(info: SamplingBatchInfo, params: list[SamplingParams]) -> None:
    cols = expected_columns(params)
    assert info.temperatures.shape == (len(params), 1)
    assert info.temperatures[:, 0].tolist() == cols["temperature"]
    assert info.top_ps.tolist() == cols["top_p"]
    assert info.top_ks.tolist() == cols["top_k"]
    assert info.top_ks.dtype == torch.int32
    assert info.min_ps.tolist() == cols["min_p"]
    assert info.sampling_seed is not None
    assert info.sampling_seed.tolist() == cols["seed"]
    assert info.is_all_greedy == all(p.top_k <= 1 for p in params)
    assert info.need_top_p_sampling == any(p.top_p != 1.0 for p in params)
    assert info.need_top_k_sampling == any(p.top_k != TOP_K_ALL for p in params)
    assert info.need_min_p_sampling == any(p.min_p > 0 for p in params)
    if any(p.logit_bias for p in params):
        assert info.logit_bias is not None
        assert torch.equal(info.logit_bias, dense_bias(params))
    else:
        assert info.logit_bias is None


@pytest.mark.parametrize("bs", [1, 3, 999, 4097])
@pytest.mark.parametrize("owned", [False, True])
def test_staged_values_equal_the_inputs(bs: int, owned: bool) -> None:
    """Catches a column read at the wrong record offset, or a bias entry in the wrong row."""
    rng = random.Random(bs)
    params = [random_params(rng, VOCAB) for _ in range(bs)]
    pool = make_pool()
    info = SamplingBatchInfo.from_schedule_batch(
        Batch([Req(p) for p in params]), VOCAB, pool, owned=owned, deterministic=True
    )
    assert_matches(info, params)
    assert pool.stats().copies == 1
    assert (info.lease is None) == owned


def test_filter_and_merge_match_a_from_scratch_build() -> None:
    """Catches rows kept out of order, flags not recomputed, or bias rows misaligned."""
    rng = random.Random(0)
    a = [random_params(rng, VOCAB) for _ in range(7)]
    b = [random_params(rng, VOCAB, bias=False) for _ in range(5)]
    pool = make_pool()
    info = SamplingBatchInfo.from_schedule_batch(Batch([Req(p) for p in a]), VOCAB, pool, deterministic=True)
    keep = [6, 0, 3]
    info.filter_batch(keep)
    assert_matches(info, [a[i] for i in keep])
    other = SamplingBatchInfo.from_schedule_batch(Batch([Req(p) for p in b]), VOCAB, pool, deterministic=True)
    info.merge_batch(other)
    assert_matches(info, [a[i] for i in keep] + b)
    info.filter_batch(np.array([7]), keep_indices_device=torch.tensor([7]))
    assert_matches(info, [b[4]])


@pytest.mark.parametrize("owned", [False, True])
def test_merge_combines_the_flags_and_filter_reduces_them_anew(owned: bool) -> None:
    """Catches merge_batch's combined flags wrong (an OR taken for the AND, or one side's bits
    kept), or filter_batch keeping the flags of rows it dropped."""
    pool = make_pool()
    greedy = [SamplingParams(temperature=0.0) for _ in range(3)]
    sampled = [SamplingParams(temperature=0.7, top_p=0.9, min_p=0.1, top_k=40)]

    def build(params: list[SamplingParams]) -> SamplingBatchInfo:
        return SamplingBatchInfo.from_schedule_batch(
            Batch([Req(p) for p in params]), VOCAB, pool, owned=owned, deterministic=True
        )

    info = build(greedy[:2])
    info.merge_batch(build(greedy[2:]))
    assert info.is_all_greedy and info.is_any_greedy and not info.need_top_p_sampling
    info.merge_batch(build(sampled))
    assert_matches(info, greedy + sampled)
    assert not info.is_all_greedy and info.is_any_greedy and info.need_min_p_sampling
    info.filter_batch([0, 2])
    assert info.is_all_greedy and not info.need_top_p_sampling and not info.need_min_p_sampling
    info.filter_batch([])
    info.merge_batch(build(sampled))
    assert not info.is_any_greedy and not info.is_all_greedy and info.need_top_k_sampling


def test_filter_bad_indices_and_merge_mismatch_raise() -> None:
    """Catches an out-of-range keep index reaching index_select, or batches of two vocabularies merged."""
    pool = make_pool()
    info = SamplingBatchInfo.from_schedule_batch(Batch([Req(SamplingParams())] * 3), VOCAB, pool)
    with pytest.raises(BatchMismatchError, match=r"in \[0, 3\)"):
        info.filter_batch([0, 3])
    other = SamplingBatchInfo.from_schedule_batch(Batch([Req(SamplingParams())]), VOCAB + 1, pool)
    with pytest.raises(BatchMismatchError, match="vocab_size"):
        info.merge_batch(other)
    assert len(info) == 3


def test_bias_token_outside_the_vocabulary_is_refused_before_staging() -> None:
    """Catches a bias index past the vocabulary reaching the scatter kernel."""
    pool = make_pool()
    batch = Batch([Req(SamplingParams()), Req(SamplingParams(logit_bias={VOCAB: 1.0}))])
    with pytest.raises(BatchMismatchError, match=f"got {VOCAB} in request 1"):
        SamplingBatchInfo.from_schedule_batch(batch, VOCAB, pool)
    assert pool.stats().copies == 0


def test_apply_logits_bias_adds_in_place() -> None:
    """Catches a bias applied to the wrong rows or not at all."""
    pool = make_pool()
    params = [SamplingParams(logit_bias={1: 3.0}), SamplingParams(), SamplingParams(logit_bias={0: -2.0, 4: 1.0})]
    info = SamplingBatchInfo.from_schedule_batch(Batch([Req(p) for p in params]), 5, pool)
    logits = torch.zeros(3, 5)
    info.apply_logits_bias(logits)
    assert logits.tolist() == [[0, 3, 0, 0, 0], [0, 0, 0, 0, 0], [-2, 0, 0, 0, 1]]
    with pytest.raises(BatchMismatchError, match="shape"):
        info.apply_logits_bias(torch.zeros(3, 4))


def test_ring_batch_used_after_recycle_raises_stale_lease() -> None:
    """Catches a per-step batch kept across steps without an owned stage (reads recycled memory)."""
    pool = make_pool(num_slots=2)
    info = SamplingBatchInfo.from_schedule_batch(Batch([Req(SamplingParams(top_p=0.5))]), VOCAB, pool)
    for _ in range(2):
        with pool.stage() as st:
            st.put([1.0], torch.float32)
    with pytest.raises(StaleLeaseError, match=r"recycled.*owned="):  # says how to keep it longer
        info.filter_batch([0])


@pytest.mark.parametrize("num_slots", [2, 4])
def test_filter_of_a_ring_batch_at_its_last_live_claim_keeps_its_rows(num_slots: int) -> None:
    """Catches filter_batch staging its indices through a ring claim that recycles the batch's own slot.

    The batch is live (num_slots - 2 claims since it), so the filter's own claim is the one
    that reuses its slot: a ring stage there overwrites the columns before the gather reads them.
    """
    pool = make_pool(num_slots=num_slots)
    params = [SamplingParams(temperature=0.5, top_p=0.5, seed=11), SamplingParams(temperature=2.0, top_p=0.25, seed=22)]
    info = SamplingBatchInfo.from_schedule_batch(Batch([Req(p) for p in params]), VOCAB, pool)
    for _ in range(num_slots - 1):
        with pool.stage() as st:
            st.put([7.0] * 16, torch.float32)
    info.filter_batch([1])
    want = SamplingBatchInfo.from_schedule_batch(Batch([Req(params[1])]), VOCAB, pool, owned=True)
    assert info.temperatures.tolist() == want.temperatures.tolist() == [[2.0]]
    assert info.top_ps.tolist() == want.top_ps.tolist()


def test_a_filter_of_a_stale_ring_batch_raises_before_it_stages_anything() -> None:
    """Catches filter_batch claiming a slot (and so moving the ring on) before it finds its batch stale."""
    pool = make_pool(num_slots=2)
    info = SamplingBatchInfo.from_schedule_batch(Batch([Req(SamplingParams(top_p=0.5))] * 2), VOCAB, pool)
    for _ in range(2):
        with pool.stage() as st:
            st.put([1.0], torch.float32)
    claims = pool.claims
    with pytest.raises(StaleLeaseError):
        info.filter_batch([0])
    assert pool.claims == claims


@pytest.mark.parametrize("owned", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_an_empty_batch_builds_and_then_merges_and_filters(owned: bool, deterministic: bool) -> None:
    """Catches sglang's idle path broken: ``ScheduleBatch.prepare_for_idle`` builds from no requests,
    and the running batch later merges into that empty info and filters it."""
    pool = make_pool()
    empty = SamplingBatchInfo.from_schedule_batch(Batch([]), VOCAB, pool, owned=owned, deterministic=deterministic)
    assert len(empty) == 0 and empty.temperatures.shape == (0, 1) and empty.top_ks.shape == (0,)
    assert empty.is_all_greedy and not empty.is_any_greedy and not empty.need_top_p_sampling
    assert empty.logit_bias is None and (empty.sampling_seed is not None) == deterministic
    assert empty.max_top_k is None  # sglang's: None for no requests
    assert pool.stats().copies == 0
    empty.filter_batch([])
    assert len(empty) == 0
    rng = random.Random(5)
    params = [random_params(rng, VOCAB) for _ in range(5)]
    empty.merge_batch(
        SamplingBatchInfo.from_schedule_batch(
            Batch([Req(p) for p in params]), VOCAB, pool, owned=True, deterministic=deterministic
        )
    )
    assert len(empty) == 5
    if deterministic:
        assert_matches(empty, params)
    empty.filter_batch([4, 1])
    want = SamplingBatchInfo.from_schedule_batch(
        Batch([Req(params[4]), Req(params[1])]), VOCAB, pool, owned=True, deterministic=deterministic
    )
    for name in ("temperatures", "top_ps", "top_ks", "min_ps"):
        assert torch.equal(getattr(empty, name), getattr(want, name)), name
    empty.filter_batch([])
    assert len(empty) == 0 and empty.logit_bias is None and empty.top_ps.shape == (0,)
    assert empty.max_top_k is None


def test_device_errors() -> None:
    """Catches a batch staged for one device into a pool of another."""
    pool = make_pool()
    with pytest.raises(ValueError, match="pool's device"):
        SamplingBatchInfo.from_schedule_batch(Batch([Req(SamplingParams())], torch.device("meta")), VOCAB, pool)


def test_a_bare_cuda_batch_device_means_the_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches sglang's ScheduleBatch.device == "cuda" refused by a pool on cuda:<current>."""
    from sampling.host_records import same_device as _same_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert _same_device("cuda", torch.device("cuda", 1))
    assert not _same_device("cuda", torch.device("cuda", 0))
    assert _same_device("cuda:0", torch.device("cuda", 0))
    assert not _same_device("cpu", torch.device("cuda", 1))
    assert not _same_device("gpu", torch.device("cuda", 1))
    assert _same_device("cpu", torch.device("cpu"))


SAMPLING_TENSORS = {
    "temperatures": (torch.float32, 2),
    "top_ps": (torch.float32, 1),
    "top_ks": (torch.int32, 1),
    "min_ps": (torch.float32, 1),
    "sampling_seed": (torch.int64, 1),
}


def assert_contiguous(info: SamplingBatchInfo) -> None:
    for name, (dtype, dim) in SAMPLING_TENSORS.items():
        t = getattr(info, name)
        assert t.is_contiguous(), f"{name} is strided {t.stride()}"
        assert t.dtype == dtype and t.dim() == dim and t.shape[0] == len(info), name
    assert info.temperatures.shape == (len(info), 1)


@pytest.mark.parametrize("owned", [False, True])
def test_every_sampling_tensor_is_contiguous_with_sglangs_shape(owned: bool) -> None:
    """Catches a strided column view (kernels such as FlashInfer's sampling ops need contiguous
    inputs) after a build, a filter or a merge."""
    rng = random.Random(11)
    pool = make_pool()
    a = [random_params(rng, VOCAB) for _ in range(999)]
    info = SamplingBatchInfo.from_schedule_batch(
        Batch([Req(p) for p in a]), VOCAB, pool, owned=owned, deterministic=True
    )
    assert_contiguous(info)
    info.filter_batch(list(range(0, 999, 3)))
    assert_contiguous(info)
    other = SamplingBatchInfo.from_schedule_batch(Batch([Req(p) for p in a[:5]]), VOCAB, pool, deterministic=True)
    info.merge_batch(other)
    assert_contiguous(info)
    assert_matches(info, a[0:999:3] + a[:5])


def test_filter_with_repeated_and_reordered_rows_keeps_each_rows_bias() -> None:
    """Catches sparse bias entries renumbered to the wrong row when keep_indices reorders or repeats rows."""
    pool = make_pool()
    params = [
        SamplingParams(logit_bias={1: 1.0, 3: 2.0}),
        SamplingParams(),
        SamplingParams(logit_bias={0: -1.0}),
        SamplingParams(logit_bias={4: 5.0}),
    ]
    info = SamplingBatchInfo.from_schedule_batch(Batch([Req(p) for p in params]), VOCAB, pool, deterministic=True)
    keep = [3, 0, 0, 1]
    info.filter_batch(keep)
    assert_matches(info, [params[i] for i in keep])
    info.filter_batch([3])  # a row without bias: the sparse entries go away
    assert info.sparse_logit_bias is None and info.logit_bias is None


def test_the_sampler_never_builds_the_dense_bias() -> None:
    """Catches the per-step [bs, vocab] bias matrix coming back through the sampler's path."""
    from sampling import Sampler

    pool = make_pool()
    params = [SamplingParams(logit_bias={2: 50.0}, temperature=0.0), SamplingParams(temperature=0.0)]
    info = SamplingBatchInfo.from_schedule_batch(Batch([Req(p) for p in params]), VOCAB, pool)
    logits = torch.zeros(2, VOCAB)
    logits[:, 7] = 1.0
    assert Sampler()(logits, info).tolist() == [2, 7]
    assert logits[0, 2].item() == 0.0  # the caller's logits are not changed
    assert info._dense_bias is None  # white-box: nothing built the dense matrix


def _biased(pool: PinnedRingBuffer, temps: list[float], biased: set[int]) -> SamplingBatchInfo:
    reqs = [
        Req(SamplingParams(temperature=t, logit_bias={i: 10.0} if i in biased else None)) for i, t in enumerate(temps)
    ]
    return SamplingBatchInfo.from_schedule_batch(Batch(reqs), 8, pool, owned=True)


def test_a_filter_that_fails_leaves_the_batch_as_it_was() -> None:
    """Catches filter_batch replacing the columns before its bias copy raised: a batch of 2 rows with
    3 rows of views and a bias entry on row 2 (the kernel would then write past the logits)."""
    pool = make_pool()
    info = _biased(pool, [0.5, 0.6, 0.7], {0, 2})
    before = (info.temperatures.clone(), info.sparse_logit_bias.rows.tolist())  # type: ignore[union-attr]
    with pool.stage(), pytest.raises(PoolStateError):  # the bias copy cannot open a stage inside one
        info.filter_batch([2, 1], torch.tensor([2, 1]))
    assert len(info) == 3
    assert torch.equal(info.temperatures, before[0])
    assert info.sparse_logit_bias.rows.tolist() == before[1]  # type: ignore[union-attr]


def test_a_merge_that_fails_leaves_the_batch_as_it_was() -> None:
    """Catches merge_batch growing the batch's rows while its views and bias entries stay the old ones."""
    pool = make_pool()
    a, b = _biased(pool, [0.5], {0}), _biased(pool, [0.9, 1.1], {1})
    with pool.stage(), pytest.raises(PoolStateError):
        a.merge_batch(b)
    assert len(a) == 1 and a.temperatures.numel() == 1
    assert a.sparse_logit_bias.rows.tolist() == [0]  # type: ignore[union-attr]


@pytest.mark.parametrize("keep", [[0.9, 2.7], [True, False, True], [1, 2**64]])
def test_filter_refuses_indices_that_are_not_integers(keep: list[object]) -> None:
    """Catches floats truncated to other rows, a bool mask read as the indices 1, 0, 1, or an int
    beyond int64 wrapped into range."""
    info = _biased(make_pool(), [0.5, 0.6, 0.7], set())
    with pytest.raises(BatchMismatchError, match="'keep_indices' must be integer row indices"):
        info.filter_batch(keep)
    assert len(info) == 3


def test_a_stage_of_another_pool_is_refused_before_anything_is_reserved_in_it() -> None:
    """Catches a refused stage= build that still grew the caller's stage (bytes copied for nothing)."""
    p1, p2 = make_pool(), make_pool()
    with p2.stage() as st:
        st.put([1, 2, 3], torch.int32)
        before = st.used_bytes
        with pytest.raises(PoolStateError, match="'stage' must be a stage of 'pool'"):
            SamplingBatchInfo.from_schedule_batch(Batch([Req(SamplingParams())] * 5), VOCAB, p1, stage=st)
        assert st.used_bytes == before


def test_an_empty_build_still_refuses_a_stage_it_could_not_be_built_into() -> None:
    """Catches the idle path skipping the stage= checks: an owned build into a caller's stage, or a
    closed stage, is refused for no requests as for some."""
    pool = make_pool()
    with pool.stage() as st, pytest.raises(PoolStateError, match="cannot be combined with owned memory"):
        SamplingBatchInfo.from_schedule_batch(Batch([]), VOCAB, pool, owned=True, stage=st)
    with pytest.raises(PoolStateError, match="must be open and not yet flushed"):
        SamplingBatchInfo.from_schedule_batch(Batch([]), VOCAB, pool, stage=st)


@pytest.mark.parametrize("owned", [False, True])
def test_a_chain_of_filters_and_merges_matches_a_from_scratch_build(owned: bool) -> None:
    """Catches an edit that leaves the batch's pieces (what merge_batch joins) stale: pieces of the
    block before a filter, or a ring slot's cached ones from another batch; over sglang-named and
    native requests, with and without bias, through empty batches."""
    from tests.unit.test_sglang_params import pair

    rng = random.Random(9)
    pool = make_pool(num_slots=8)

    def build(reqs: list[Req]) -> SamplingBatchInfo:
        return SamplingBatchInfo.from_schedule_batch(Batch(reqs), VOCAB, pool, owned=owned, deterministic=True)

    def fresh(n: int) -> tuple[list[Req], list[SamplingParams]]:
        pairs: list[tuple[Any, SamplingParams]] = []
        while len(pairs) < n:  # pair() draws bias tokens from a larger vocabulary
            raw, native = pair(rng)
            if native.logit_bias is None or native.logit_bias[0][-1] < VOCAB:
                pairs.append((raw, native))
        return [Req(raw if rng.random() < 0.5 else native) for raw, native in pairs], [p for _, p in pairs]

    reqs, params = fresh(6)
    info = build(reqs)
    for _ in range(40):
        if rng.random() < 0.5:
            keep = [rng.randrange(len(params)) for _ in range(rng.randint(0, len(params)))] if params else []
            info.filter_batch(keep, torch.tensor(keep, dtype=torch.int64) if rng.random() < 0.5 else None)
            params = [params[i] for i in keep]
        else:
            reqs, new = fresh(rng.choice([0, 1, 3, 6]))
            info.merge_batch(build(reqs))
            params += new
        if params:
            assert_matches(info, params)
        else:
            assert len(info) == 0 and info.temperatures.shape == (0, 1)


@pytest.mark.parametrize("keep", [[-1], [0, 3], [2**32], [2**32 + 1], [2**63], [1, -3], [2**64 - 1]])
@pytest.mark.parametrize("as_array", [False, True])
def test_filter_refuses_indices_out_of_range(keep: list[int], as_array: bool) -> None:
    """Catches an index past the batch, or a negative one (numpy's take would count it from the end),
    reaching index_select or picking a row silently, whatever path converts the list."""
    info = _biased(make_pool(), [0.5, 0.6, 0.7], set())
    indices = np.array(keep, dtype=np.uint64 if max(keep) >= 2**63 else np.int64) if as_array else keep
    with pytest.raises(BatchMismatchError, match=r"'keep_indices' must be in \[0, 3\)"):
        info.filter_batch(indices)
    assert len(info) == 3


@pytest.mark.parametrize("keep", [[-1], [2**32 + 1], [0, -(2**32) + 2]])
def test_a_refused_index_is_named_as_given(keep: list[int]) -> None:
    """Catches an index converted through a narrower dtype first: numpy 1.x wraps -1 to 4294967295 and
    2**32 + 1 to 1 (a valid row), so the refusal named the wrong value or the filter kept a wrong row."""
    info = _biased(make_pool(), [0.5, 0.6, 0.7], set())
    with pytest.raises(BatchMismatchError, match=rf"got \[{', '.join(map(str, keep))}\]"):
        info.filter_batch(keep)
    assert len(info) == 3


def test_a_ring_batch_filtered_to_no_rows_stages_nothing_and_stays_usable() -> None:
    """Catches filter_batch([]) on a ring batch asking the pool for an owned stage of 0 bytes (refused)."""
    pool = make_pool()
    info = SamplingBatchInfo.from_schedule_batch(Batch([Req(SamplingParams(temperature=0.5))]), VOCAB, pool)
    claims = pool.claims
    info.filter_batch([])
    assert len(info) == 0 and info.temperatures.shape == (0, 1)
    assert pool.claims == claims
