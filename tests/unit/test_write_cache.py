"""write_cache_indices: the Triton kernel (interpreted on CPU) against the torch reference,
and every validation case raising before anything is staged or launched."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
import torch

from memcache import CacheIndexError, ReqToTokenPool, write_cache_indices
from pinpool import PinnedRingBuffer, PoolSettings

MAX_LEN = 64
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton compiles for the GPU on this machine; tests/gpu checks the kernel on the device",
)


def make_case(
    rng: random.Random, bs: int, size: int, *, empty_prefix: bool = False, zero_extend: bool = False
) -> dict[str, Any]:
    rows = rng.sample(range(size), bs)  # random order, no repeats
    prefix, extend = [], []
    for _ in range(bs):
        p = 0 if empty_prefix or rng.random() < 0.3 else rng.randint(1, 40)
        e = 0 if zero_extend or rng.random() < 0.2 else rng.randint(1, MAX_LEN - p)
        prefix.append(p)
        extend.append(e)
    prefix_tensors = [torch.randint(1, 10_000, (p + rng.randint(0, 3),), dtype=torch.int32) for p in prefix]
    out_cache_loc = torch.randint(1, 10_000, (sum(extend),), dtype=torch.int64)
    seq = [p + e for p, e in zip(prefix, extend, strict=True)]
    return {
        "out_cache_loc": out_cache_loc,
        "req_pool_indices": rows,
        "prefix_lens": prefix,
        "seq_lens": seq,
        "extend_lens": extend,
        "prefix_tensors": prefix_tensors,
    }


def run(case: dict[str, Any], backend: str, size: int) -> tuple[torch.Tensor, PinnedRingBuffer]:
    rtt = ReqToTokenPool(size, MAX_LEN, "cpu")
    rtt.req_to_token.fill_(-7)  # poison: every written cell must change, every other must not
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=1 << 18))
    write_cache_indices(req_to_token_pool=rtt, pool=pool, backend=backend, **case)  # type: ignore[arg-type]
    return rtt.req_to_token, pool


@needs_interpreter
@pytest.mark.parametrize(
    ("bs", "flags"),
    [(1, {}), (3, {}), (999, {}), (5, {"empty_prefix": True}), (4, {"zero_extend": True})],
)
def test_triton_kernel_matches_reference_bit_for_bit(bs: int, flags: dict[str, bool]) -> None:
    """Catches an off-by-one start offset, a prefix read through the wrong pointer, or a stray write."""
    rng = random.Random(bs)
    size = bs + 5
    case = make_case(rng, bs, size, **flags)
    want, _ = run(case, "torch", size)
    got, pool = run(case, "triton", size)
    assert torch.equal(got, want)
    assert pool.stats().copies == 1
    row = case["req_pool_indices"][0]
    p, s = case["prefix_lens"][0], case["seq_lens"][0]
    assert want[row, :p].tolist() == case["prefix_tensors"][0][:p].tolist()
    assert want[row, s:].eq(-7).all()


def bad_cases() -> list[tuple[str, dict[str, Any], str]]:
    t = torch.arange(4, dtype=torch.int32)
    ok: dict[str, Any] = {
        "out_cache_loc": torch.arange(1, 4),
        "req_pool_indices": [0, 1],
        "prefix_lens": [2, 0],
        "seq_lens": [3, 2],
        "extend_lens": [1, 2],
        "prefix_tensors": [t, t],
    }
    return [
        (
            "extend mismatch",
            {**ok, "seq_lens": [4, 2]},
            "'seq_lens' of request 0 must equal prefix_len + extend_len (got 4)",
        ),
        ("sum mismatch", {**ok, "out_cache_loc": torch.arange(1, 5)}, "sum(extend_lens) = 3 slots (got 4)"),
        (
            "too long",
            {
                **ok,
                "prefix_lens": [2, 0],
                "seq_lens": [3, MAX_LEN + 1],
                "extend_lens": [1, MAX_LEN + 1],
                "out_cache_loc": torch.arange(MAX_LEN + 2),
            },
            f"'seq_lens' of request 1 must be <= max_context_len {MAX_LEN} (got {MAX_LEN + 1})",
        ),
        (
            "row out of range",
            {**ok, "req_pool_indices": [0, 8]},
            "'req_pool_indices' of request 1 must be in [0, 8) (got 8)",
        ),
        (
            "negative row",
            {**ok, "req_pool_indices": [-1, 1]},
            "'req_pool_indices' of request 0 must be in [0, 8) (got -1)",
        ),
        ("repeated row", {**ok, "req_pool_indices": [1, 1]}, "must not repeat a row"),
        (
            "short prefix",
            {**ok, "prefix_lens": [5, 0], "seq_lens": [6, 2]},
            "'prefix_tensors[0]' must hold prefix_len 5 indices (got 4)",
        ),
        ("prefix dtype", {**ok, "prefix_tensors": [t.long(), t]}, "'prefix_tensors[0]' must be an int32 tensor"),
        ("prefix strided", {**ok, "prefix_tensors": [torch.arange(8, dtype=torch.int32)[::2], t]}, "contiguous"),
        ("prefix device", {**ok, "prefix_tensors": [torch.empty(4, dtype=torch.int32, device="meta"), t]}, "on cpu"),
        ("lengths count", {**ok, "prefix_lens": [2]}, "'prefix_lens' must hold 2 values"),
        ("float lengths", {**ok, "extend_lens": [1.5, 2]}, "'extend_lens' must hold integers"),
        ("loc dtype", {**ok, "out_cache_loc": torch.arange(3.0)}, "'out_cache_loc' must be int32 or int64"),
        (
            "negative prefix",
            {**ok, "prefix_lens": [-1, 0], "seq_lens": [0, 2]},
            "'prefix_lens' of request 0 must be >= 0 (got -1)",
        ),
    ]


@pytest.mark.parametrize(("label", "kwargs", "message"), bad_cases(), ids=[c[0] for c in bad_cases()])
def test_bad_inputs_raise_before_anything_is_staged(label: str, kwargs: dict[str, Any], message: str) -> None:
    """Catches a bad index reaching the kernel (a kernel cannot raise: it corrupts memory)."""
    rtt = ReqToTokenPool(8, MAX_LEN, "cpu")
    rtt.req_to_token.fill_(-7)
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=4096))
    with pytest.raises(CacheIndexError) as info:
        write_cache_indices(req_to_token_pool=rtt, pool=pool, backend="triton", **kwargs)
    assert message in str(info.value)
    assert pool.stats().copies == 0
    assert rtt.req_to_token.eq(-7).all()


@needs_interpreter
def test_prefix_tensors_are_retained_until_the_slot_is_reclaimed() -> None:
    """Catches prefix tensors released while the kernel that reads their addresses may be queued."""
    rng = random.Random(0)
    case = make_case(rng, 3, 8)
    rtt = ReqToTokenPool(8, MAX_LEN, "cpu")
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=1 << 16))
    write_cache_indices(req_to_token_pool=rtt, pool=pool, backend="triton", **case)
    retained = [t for group in pool._retained[0] for t in group]
    assert all(any(t is r for r in retained) for t in case["prefix_tensors"])
