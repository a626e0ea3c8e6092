"""write_cache_indices: the Triton kernel (interpreted on CPU) against the torch reference,
and every validation case raising before anything is staged or launched."""

from __future__ import annotations

import gc
import os
import random
import weakref
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
    rng: random.Random,
    bs: int,
    size: int,
    *,
    empty_prefix: bool = False,
    zero_extend: bool = False,
    dtypes: tuple[torch.dtype, ...] = (torch.int32,),
) -> dict[str, Any]:
    rows = rng.sample(range(size), bs)  # random order, no repeats
    prefix, extend = [], []
    for _ in range(bs):
        p = 0 if empty_prefix or rng.random() < 0.3 else rng.randint(1, 40)
        e = 0 if zero_extend or rng.random() < 0.2 else rng.randint(1, MAX_LEN - p)
        prefix.append(p)
        extend.append(e)
    prefix_tensors = [torch.randint(1, 10_000, (p + rng.randint(0, 3),), dtype=rng.choice(dtypes)) for p in prefix]
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
    [
        (1, {}),
        (3, {}),
        (999, {}),
        (5, {"empty_prefix": True}),
        (4, {"zero_extend": True}),
        (1, {"dtypes": (torch.int64,)}),
        (257, {"dtypes": (torch.int32, torch.int64)}),
    ],
)
def test_triton_kernel_matches_reference_bit_for_bit(bs: int, flags: dict[str, bool]) -> None:
    """Catches an off-by-one start offset, a prefix read through the wrong pointer or at the wrong
    width (int64 radix-cache prefixes next to int32 ones), or a stray write."""
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
        (
            "prefix dtype",
            {**ok, "prefix_tensors": [t.float(), t]},
            "'prefix_tensors[0]' must be an int32 or int64 tensor on cpu (got torch.float32",
        ),
        ("prefix not a tensor", {**ok, "prefix_tensors": [[0, 1, 2], t]}, "(got list)"),
        ("device lengths", {**ok, "prefix_lens": torch.tensor([2, 0], device="meta")}, "must be host values"),
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
        (  # int64 wrap-around: seq - prefix == extend and sum(extend) == 3 both hold modulo 2**64
            "wrapping lengths",
            {
                "req_pool_indices": [0, 1, 2],
                "prefix_lens": [1, 1, 0],
                "seq_lens": [-(2**63), -(2**63), 5],
                "extend_lens": [2**63 - 1, 2**63 - 1, 5],
                "out_cache_loc": torch.arange(3),
                "prefix_tensors": [t, t, t],
            },
            f"'seq_lens' of request 0 must be >= 0 (got {-(2**63)})",
        ),
        ("strided loc", {**ok, "out_cache_loc": torch.arange(6)[::2]}, "'out_cache_loc' must be contiguous"),
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
    """Catches prefix tensors released while the kernel that reads their addresses may be queued
    (and anything else keeping them alive past that slot's reclaim)."""
    case: dict[str, Any] = {
        "out_cache_loc": torch.arange(3),
        "req_pool_indices": [4, 0, 2],
        "prefix_lens": [2, 2, 2],
        "seq_lens": [3, 3, 3],
        "extend_lens": [1, 1, 1],
        "prefix_tensors": [torch.arange(2, dtype=d) for d in (torch.int32, torch.int64, torch.int32)],
    }
    refs = [weakref.ref(t) for t in case["prefix_tensors"]]
    rtt = ReqToTokenPool(8, MAX_LEN, "cpu")
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=1 << 16))
    write_cache_indices(req_to_token_pool=rtt, pool=pool, backend="triton", **case)
    del case
    gc.collect()
    assert all(r() is not None for r in refs)  # the slot that staged their addresses is still in use
    for _ in range(2):  # the next lap reclaims that slot
        with pool.stage() as st:
            st.put([1], torch.int32)
    gc.collect()
    assert all(r() is None for r in refs)


def test_a_check_is_redone_when_the_tensor_changes() -> None:
    """Catches a check result carried over from an earlier call for a tensor whose storage was
    swapped (set_ to a shorter one), or for a new tensor that reuses a freed one's id."""
    rtt = ReqToTokenPool(8, MAX_LEN, "cpu")
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=4096))
    t = torch.arange(4, dtype=torch.int64)
    args: dict[str, Any] = {
        "out_cache_loc": torch.arange(1, 2),
        "req_pool_indices": [0],
        "prefix_lens": [4],
        "seq_lens": [5],
        "extend_lens": [1],
        "prefix_tensors": [t],
    }
    write_cache_indices(req_to_token_pool=rtt, pool=pool, backend="torch", **args)
    t.set_(torch.arange(3, dtype=torch.int64))
    with pytest.raises(CacheIndexError, match=r"must hold prefix_len 4 indices \(got 3\)"):
        write_cache_indices(req_to_token_pool=rtt, pool=pool, backend="torch", **args)
    del t, args["prefix_tensors"]
    gc.collect()
    args["prefix_tensors"] = [torch.arange(4, dtype=torch.float64)]  # may reuse the freed id
    with pytest.raises(CacheIndexError, match="int32 or int64"):
        write_cache_indices(req_to_token_pool=rtt, pool=pool, backend="torch", **args)


def test_cpu_tensor_and_numpy_lengths_are_accepted() -> None:
    """Catches sglang's *_cpu int64 tensors (or numpy arrays) refused, or read differently from lists."""
    import numpy as np

    rng = random.Random(5)
    case = make_case(rng, 6, 9, dtypes=(torch.int64,))
    want, _ = run(case, "torch", 9)
    case["prefix_lens"] = torch.tensor(case["prefix_lens"])
    case["seq_lens"] = np.asarray(case["seq_lens"], dtype=np.int32)
    got, _ = run(case, "torch", 9)
    assert torch.equal(got, want)


@needs_interpreter
@pytest.mark.parametrize("bs", [1, 6, 65])
def test_int64_prefixes_match_sglangs_own_call(bs: int) -> None:
    """Catches int64 radix-cache prefixes written differently from sglang's write_cache_indices, e.g. read at
    int32 width. Against the rebuild: sglang's own kernel does not run under every Triton interpreter (3.6 fails
    on it), so the comparison with its real code is the GPU test in tests/gpu/test_sglang_dropin_cuda.py."""
    from pinpool.bench.sglang_memcache import caller_path, rebuild

    rng = random.Random(40 + bs)
    size = bs + 3
    case = make_case(rng, bs, size, dtypes=(torch.int64,))
    want, _ = run(case, "triton", size)
    for write in (rebuild,):
        rtt = ReqToTokenPool(size, MAX_LEN, "cpu")
        rtt.req_to_token.fill_(-7)
        caller_path(
            write,
            case["out_cache_loc"],
            case["req_pool_indices"],
            case["prefix_lens"],
            case["seq_lens"],
            case["extend_lens"],
            case["prefix_tensors"],
            rtt,
        )
        assert torch.equal(rtt.req_to_token, want)


@pytest.mark.parametrize("bs", [0, 1, 7, 48, 64])
def test_small_batch_pass_builds_the_vectorised_metadata(bs: int) -> None:
    """Catches the plain-Python pass for small batches (lists only) building metadata that differs from
    the vectorised checks' (a start offset, a row order or a tagged address), or keeping other tensors alive."""
    from memcache import write_cache

    assert bs <= write_cache.SMALL_BATCH
    rng = random.Random(70 + bs)
    size = bs + 4
    case = make_case(rng, bs, size, dtypes=(torch.int32, torch.int64))
    rtt = ReqToTokenPool(size, MAX_LEN, "cpu")
    names = ("req_pool_indices", "prefix_lens", "seq_lens", "extend_lens")
    lengths = tuple(case[k] for k in names)
    args = (lengths, bs, case["out_cache_loc"], case["prefix_tensors"], rtt)
    small = write_cache._small_batch_meta(*args)
    assert small is not None
    table, kept = write_cache._batch_meta(*args)
    assert small[0] == table.tolist()
    assert [id(t) for t in small[1]] == [id(t) for t in kept]
    with_prefix = [t for p, t in zip(case["prefix_lens"], case["prefix_tensors"], strict=True) if p]
    assert [id(t) for t in kept] == [id(t) for t in with_prefix]


@pytest.mark.parametrize(("label", "kwargs", "message"), bad_cases(), ids=[c[0] for c in bad_cases()])
def test_bad_inputs_raise_the_same_on_the_vectorised_path(label: str, kwargs: dict[str, Any], message: str) -> None:
    """Catches a rule only the small-batch pass enforces: each bad case, given as numpy arrays where it was
    lists (which the small pass never takes), must raise the same message."""
    import numpy as np

    arrays: dict[str, Any] = {
        k: np.asarray(v) if isinstance(v, list) and k != "prefix_tensors" else v for k, v in kwargs.items()
    }
    if label == "float lengths":
        arrays["extend_lens"] = np.asarray([1.5, 2])
    rtt = ReqToTokenPool(8, MAX_LEN, "cpu")
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=4096))
    with pytest.raises(CacheIndexError) as info:
        write_cache_indices(req_to_token_pool=rtt, pool=pool, backend="triton", **arrays)
    assert message in str(info.value)
    assert pool.stats().copies == 0
