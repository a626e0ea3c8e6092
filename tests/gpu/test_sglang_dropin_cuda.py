"""Issue 13 on CUDA: sglang-shaped builds, the sparse logit-bias kernel, int64 prefixes, batch-independence.

Every feature runs under a side stream while the default stream lags (``torch.cuda._sleep``),
so work enqueued on the wrong stream reads memory before it lands and the values differ;
and, with two GPUs, with the other device current (Triton launches on the current
device). Results are read after the side stream's ``synchronize()``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import pytest
import torch

from memcache import ReqToTokenPool, write_cache_indices
from pinpool import PinnedRingBuffer, PoolSettings
from pinpool.bench.sglang_memcache import caller_path
from pinpool.bench.sglang_memcache import load as load_write
from pinpool.bench.sglang_sampling import SglangBatch, SglangParams, SglangReq
from pinpool.bench.sglang_sampling import load as load_build
from sampling import (
    Sampler,
    SamplingBatchInfo,
    SamplingParams,
    apply_logit_bias_reference,
    launch_apply_logit_bias,
    mask_sorted_probs,
)

DEV = torch.device("cuda", 0)
LAG = 20_000_000  # about 10 ms of GPU sleep on the default stream
FIELDS = ("temperatures", "top_ps", "top_ks", "min_ps", "sampling_seed", "logit_bias")
TWO_GPUS = torch.cuda.device_count() >= 2
PLACES = ["side stream", pytest.param("other device current", marks=pytest.mark.skipif(not TWO_GPUS, reason="one GPU"))]


@contextmanager
def elsewhere(place: str) -> Iterator[torch.cuda.Stream]:
    """Run the body on a side stream of DEV while DEV's default stream lags; for "other device
    current", with cuda:1 current as well. Yields the side stream (synchronize it before reading)."""
    torch.cuda.synchronize(DEV)
    with torch.cuda.device(DEV):
        torch.cuda._sleep(LAG)  # the default stream lags: anything wrongly queued there lands late
    side = torch.cuda.Stream(DEV)
    other = torch.cuda.device(1) if place == "other device current" else nullcontext()
    # The stream first: entering it makes its device current; the other device after.
    with torch.cuda.stream(side), other:
        yield side


def sglang_batch(rng: random.Random, bs: int, vocab: int) -> SglangBatch:
    reqs = []
    for i in range(bs):
        bias = None
        if i % 17 == 0:
            bias = {str(rng.randrange(vocab)): rng.uniform(-5, 5) for _ in range(5)}
        p = SglangParams(
            temperature=rng.choice([0.0, rng.uniform(0.3, 1.5)]),
            top_p=rng.choice([1.0, rng.uniform(0.2, 1.0)]),
            top_k=rng.choice([-1, rng.randint(1, vocab)]),
            min_p=rng.choice([0.0, rng.uniform(0.0, 0.3)]),
            sampling_seed=rng.choice([None, rng.randint(-(2**63), 2**63 - 1)]),
            logit_bias=bias,
        )
        reqs.append(SglangReq(p))
    return SglangBatch(reqs, DEV)


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize(("bs", "vocab"), [(1, 7), (999, 1000), (4097, 32_000)])
def test_sglang_shaped_build_equals_sglangs_own(place: str, bs: int, vocab: int) -> None:
    """Catches sglang-shaped params staged wrong on the device, a non-contiguous tensor, or the
    build's copy queued on another stream than its readers."""
    batch = sglang_batch(random.Random(bs), bs, vocab)
    want = load_build()[0](batch, vocab)
    torch.cuda.synchronize()
    pool = PinnedRingBuffer(PoolSettings(device=DEV, num_slots=4, slot_bytes=1 << 21))
    with elsewhere(place) as side:
        info = SamplingBatchInfo.from_schedule_batch(batch, vocab, pool, deterministic=True)
        got = {name: getattr(info, name).clone() for name in FIELDS}  # read on the side stream
    side.synchronize()
    for name in FIELDS:
        assert got[name].is_contiguous() and getattr(info, name).is_contiguous(), name
        assert torch.equal(got[name], getattr(want, name).to(got[name].dtype).view(got[name].shape)), name
    assert info.is_all_greedy == want.is_all_greedy and info.max_top_k == want.max_top_k


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize(("bs", "vocab", "n"), [(1, 7, 1), (3, 999, 257), (64, 32_000, 4097)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_kernel_equals_reference_bit_for_bit(place: str, bs: int, vocab: int, n: int, dtype: Any) -> None:
    """Catches the sparse bias kernel adding at the wrong cell, rounding bfloat16 differently from
    torch, or launching in another device's context."""
    rng = random.Random(n)
    cells = sorted(rng.sample(range(bs * vocab), n))
    rows = torch.tensor([c // vocab for c in cells], dtype=torch.int32, device=DEV)
    tokens = torch.tensor([c % vocab for c in cells], dtype=torch.int32, device=DEV)
    values = torch.randn(n, device=DEV) * 5
    logits = (torch.randn(bs, vocab, device=DEV) * 3).to(dtype)
    want = apply_logit_bias_reference(logits.clone(), rows, tokens, values)
    torch.cuda.synchronize()
    with elsewhere(place) as side:
        got = launch_apply_logit_bias(logits.clone(), rows, tokens, values)
    side.synchronize()
    assert torch.equal(got, want)


@pytest.mark.parametrize("place", PLACES)
def test_sampler_with_sparse_bias_equals_the_dense_add(place: str) -> None:
    """Catches the sampler's sparse bias path disagreeing with sglang's dense [bs, vocab] add."""
    vocab, bs = 1000, 999
    batch = sglang_batch(random.Random(5), bs, vocab)
    pool = PinnedRingBuffer(PoolSettings(device=DEV, num_slots=4, slot_bytes=1 << 21))
    info = SamplingBatchInfo.from_schedule_batch(batch, vocab, pool, owned=True, deterministic=True)
    logits = torch.randn(bs, vocab, device=DEV) * 3
    positions = torch.arange(bs, device=DEV)
    dense = info.logit_bias
    assert dense is not None
    want = Sampler()(logits + dense, _without_bias(info), positions)
    torch.cuda.synchronize()
    with elsewhere(place) as side:
        got = Sampler()(logits, info, positions)
    side.synchronize()
    assert torch.equal(got, want)


def _without_bias(info: SamplingBatchInfo) -> Any:
    class View:
        def __getattr__(self, name: str) -> Any:
            return None if name == "logit_bias" else getattr(info, name)

        def __len__(self) -> int:
            return len(info)

    return View()


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("bs", [1, 999, 4097])
def test_int64_and_int32_prefixes_equal_the_reference_and_sglangs_call(place: str, bs: int) -> None:
    """Catches an int64 radix-cache prefix read at int32 width on the GPU, a result that differs
    from sglang's write_cache_indices, or the metadata copy on another stream than the kernel."""
    rng = random.Random(bs)
    prefix = [rng.choice([0, rng.randint(1, 600)]) for _ in range(bs)]
    extend = [rng.randint(0, 9) for _ in range(bs)]
    case: dict[str, Any] = {
        "out_cache_loc": torch.randint(1, 1 << 30, (sum(extend),), dtype=torch.int64, device=DEV),
        "req_pool_indices": rng.sample(range(bs + 3), bs),
        "prefix_lens": prefix,
        "seq_lens": [p + e for p, e in zip(prefix, extend, strict=True)],
        "extend_lens": extend,
        "prefix_tensors": [
            torch.randint(1, 1 << 30, (p + 2,), dtype=rng.choice([torch.int32, torch.int64]), device=DEV)
            for p in prefix
        ],
    }
    want = ReqToTokenPool(bs + 3, 700, DEV)
    write_cache_indices(req_to_token_pool=want, pool=_pool(), backend="torch", **case)
    got = ReqToTokenPool(bs + 3, 700, DEV)
    torch.cuda.synchronize()
    with elsewhere(place) as side:
        write_cache_indices(req_to_token_pool=got, pool=_pool(), **case)
        result = got.req_to_token.clone()
    side.synchronize()
    assert torch.equal(result, want.req_to_token)
    theirs = ReqToTokenPool(bs + 3, 700, DEV)
    as64 = {**case, "prefix_tensors": [t.long() for t in case["prefix_tensors"]]}  # sglang reads int64 only
    caller_path(load_write()[0], *(as64[k] for k in _ARGS), theirs)
    torch.cuda.synchronize()
    assert torch.equal(theirs.req_to_token, want.req_to_token)


_ARGS = ("out_cache_loc", "req_pool_indices", "prefix_lens", "seq_lens", "extend_lens", "prefix_tensors")


def _pool() -> PinnedRingBuffer:
    return PinnedRingBuffer(PoolSettings(device=DEV, num_slots=4, slot_bytes=1 << 21))


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("neighbour", [SamplingParams(top_p=0.5), SamplingParams(top_k=5), SamplingParams(min_p=0.1)])
def test_top_p_one_row_is_batch_independent_on_the_gpu(place: str, neighbour: SamplingParams) -> None:
    """Catches the draw kernel dropping a top_p = 1 row's tail (float32 running sum past 1.0) once a
    neighbour turns a filter on: same support and same seeded token alone and in the batch."""
    vocab = 32_000
    target = SamplingParams(seed=-3)
    pool = _pool()
    alone = SamplingBatchInfo.from_schedule_batch(
        SglangBatch([_Req(target)], DEV), vocab, pool, owned=True, deterministic=True
    )  # type: ignore[list-item]
    mixed = SamplingBatchInfo.from_schedule_batch(
        SglangBatch([_Req(neighbour), _Req(target)], DEV),
        vocab,
        pool,
        owned=True,
        deterministic=True,  # type: ignore[list-item]
    )
    gen = torch.Generator(device=DEV).manual_seed(3)
    row = torch.randn(vocab, device=DEV, generator=gen) * 2
    logits = torch.stack([torch.randn(vocab, device=DEV, generator=gen), row])
    sorted_alone = torch.softmax(row[None], -1).sort(dim=-1, descending=True, stable=True).values
    sorted_mixed = torch.softmax(logits, -1).sort(dim=-1, descending=True, stable=True).values
    torch.cuda.synchronize()
    with elsewhere(place) as side:
        tokens_alone = [Sampler()(row[None], alone, torch.tensor([p], device=DEV)) for p in range(16)]
        tokens_mixed = [Sampler()(logits, mixed, torch.tensor([0, p], device=DEV)) for p in range(16)]
        support_alone = mask_sorted_probs(sorted_alone, alone)[0] > 0
        support_mixed = mask_sorted_probs(sorted_mixed, mixed)[1] > 0
    side.synchronize()
    assert torch.equal(support_alone, support_mixed) and bool(support_mixed.all())
    assert [int(t[0]) for t in tokens_alone] == [int(t[1]) for t in tokens_mixed]


class _Req:
    def __init__(self, params: SamplingParams) -> None:
        self.sampling_params = params
