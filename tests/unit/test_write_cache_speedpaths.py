"""write_cache_indices' cheaper host paths: lists packed one row at a time, the seq rule read
by the unsigned maxima, prefix tensors checked as one batch with nothing written onto them."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from memcache import CacheIndexError, ReqToTokenPool, prefix_check, write_cache, write_cache_indices
from pinpool import PinnedRingBuffer, PoolSettings

MAX_LEN = 128  # room for a prefix read at twice the width
BS = write_cache.SMALL_BATCH + 6  # the vectorised way only


def big_case(seed: int = 0, with_prefix: float = 0.5) -> dict[str, Any]:
    rng = random.Random(seed)
    prefix = [rng.randint(1, 20) if rng.random() < with_prefix else 0 for _ in range(BS)]
    extend = [rng.randint(1, 4) for _ in range(BS)]
    return {
        "out_cache_loc": torch.arange(sum(extend)),
        "req_pool_indices": rng.sample(range(BS), BS),
        "prefix_lens": prefix,
        "seq_lens": [p + e for p, e in zip(prefix, extend, strict=True)],
        "extend_lens": extend,
        "prefix_tensors": [
            torch.randint(0, 1000, (p + 1,), dtype=rng.choice([torch.int32, torch.int64])) for p in prefix
        ],
    }


def call(rtt: ReqToTokenPool, case: dict[str, Any], backend: str = "torch") -> PinnedRingBuffer:
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=1 << 16))
    write_cache_indices(req_to_token_pool=rtt, pool=pool, backend=backend, **case)  # type: ignore[arg-type]
    return pool


def written(rtt: ReqToTokenPool, case: dict[str, Any]) -> None:
    loc = case["out_cache_loc"].tolist()
    start = 0
    for i, row in enumerate(case["req_pool_indices"]):
        p, s = case["prefix_lens"][i], case["seq_lens"][i]
        assert rtt.req_to_token[row, :p].tolist() == case["prefix_tensors"][i][:p].tolist(), i
        assert rtt.req_to_token[row, p:s].tolist() == loc[start : start + s - p], i
        start += s - p


def broken(name: str, i: int, value: Any) -> dict[str, Any]:
    case = big_case(1)
    case[name] = list(case[name])
    case[name][i] = value
    return case


def bad_lists() -> list[tuple[str, dict[str, Any], str]]:
    wrap = big_case(2)  # seq - prefix == extend modulo 2**64, and the sum still matches
    wrap["prefix_lens"][:2] = [1, 1]
    wrap["seq_lens"][:2] = [-(2**63), -(2**63)]
    wrap["extend_lens"][:2] = [2**63 - 1, 2**63 - 1]
    wrap["out_cache_loc"] = torch.arange(sum(wrap["extend_lens"][2:]) + 2 * (2**63 - 1) - 2**64)
    seq = big_case(3)
    seq["seq_lens"][BS - 1] += 1  # every bound still holds: only the seq rule refuses it
    seq["out_cache_loc"] = torch.arange(sum(seq["extend_lens"]))
    short = big_case(4)
    short["prefix_lens"] = short["prefix_lens"][:-1]
    return [
        ("float in the last list", broken("extend_lens", BS - 1, 1.5), "'extend_lens' must hold integers"),
        ("too big for int64", broken("seq_lens", 3, 2**64), "'seq_lens' must hold integers"),
        ("negative prefix", broken("prefix_lens", 5, -1), "'prefix_lens' of request 5 must be >= 0 (got -1)"),
        ("seq only", seq, f"'seq_lens' of request {BS - 1} must equal prefix_len + extend_len"),
        ("wrapping lengths", wrap, f"'seq_lens' of request 0 must be >= 0 (got {-(2**63)})"),
        ("a list too short", short, f"'prefix_lens' must hold {BS} values"),
        ("repeated row", broken("req_pool_indices", 7, big_case(1)["req_pool_indices"][8]), "must not repeat a row"),
    ]


@pytest.mark.parametrize(("label", "case", "message"), bad_lists(), ids=[c[0] for c in bad_lists()])
def test_bad_lists_of_a_large_batch_raise_before_anything_is_staged(
    label: str, case: dict[str, Any], message: str
) -> None:
    """Catches the four-rows-at-once packing or the seq rule folded into the maxima letting a bad
    list through, or naming another rule, where the small pass never looks."""
    rtt = ReqToTokenPool(BS, MAX_LEN, "cpu")
    rtt.req_to_token.fill_(-7)
    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=2, slot_bytes=1 << 16))
    with pytest.raises(CacheIndexError) as info:
        write_cache_indices(req_to_token_pool=rtt, pool=pool, backend="triton", **case)
    assert message in str(info.value)
    assert pool.stats().copies == 0
    assert rtt.req_to_token.eq(-7).all()


def test_prefixes_are_read_anew_after_a_dtype_swap_or_for_a_non_tensor() -> None:
    """Catches the batched check (vectorised way) carrying a result from one call to the next
    after ``.data =`` kept the address but changed the dtype, reading past a tensor's end, or
    taking something else than a tensor."""
    case = big_case(5)
    rtt = ReqToTokenPool(BS, MAX_LEN, "cpu")
    call(rtt, case)
    i = next(j for j, p in enumerate(case["prefix_lens"]) if p)
    t = torch.arange(2 * case["prefix_lens"][i], dtype=torch.int64)
    case["prefix_tensors"][i] = t
    call(rtt, case)
    t.data = t.view(torch.float64)
    with pytest.raises(CacheIndexError, match=rf"'prefix_tensors\[{i}\]' must be an int32 or int64"):
        call(rtt, case)
    t.data = t.view(torch.int32)  # the same address, read at the new width
    call(rtt, case)
    written(rtt, case)
    need = t.numel() + 1  # the same tensor, unchanged, asked for more than it holds
    case["seq_lens"][i] += need - case["prefix_lens"][i]
    case["prefix_lens"][i] = need
    with pytest.raises(CacheIndexError, match=rf"'prefix_tensors\[{i}\]' must hold prefix_len {need} indices"):
        call(rtt, case)
    case["prefix_lens"][i] = need - 1
    case["seq_lens"][i] -= 1
    call(rtt, case)
    written(rtt, case)
    case["prefix_tensors"][i] = t.tolist()
    with pytest.raises(CacheIndexError, match=rf"'prefix_tensors\[{i}\]' must be an int32 .*\(got list\)"):
        call(rtt, case)


@pytest.mark.parametrize("with_prefix", [0.0, 1 / BS, 1.0])
def test_a_large_batch_with_no_one_or_every_prefix(with_prefix: float) -> None:
    """Catches the gather of kept prefixes mishandling one index (a lone item, not a tuple) or
    none, or an address row left with scratch values where a prefix is empty."""
    case = big_case(6, with_prefix)
    if with_prefix == 1 / BS:  # exactly one
        case = big_case(6, 0.0)
        case["prefix_lens"][9] = 3
        case["seq_lens"][9] += 3
        case["prefix_tensors"][9] = torch.arange(3)
    rtt = ReqToTokenPool(BS, MAX_LEN, "cpu")
    table, kept = write_cache._batch_meta(
        tuple(case[k] for k in ("req_pool_indices", "prefix_lens", "seq_lens", "extend_lens")),
        BS,
        case["out_cache_loc"],
        case["prefix_tensors"],
        rtt,
    )
    assert [id(t) for t in kept] == [
        id(t) for t, p in zip(case["prefix_tensors"], case["prefix_lens"], strict=True) if p
    ]
    addresses = table[4 * BS :].tolist()
    assert [a == 0 for a in addresses] == [p == 0 for p in case["prefix_lens"]]
    call(rtt, case)
    written(rtt, case)


@pytest.mark.parametrize("bs", [3, BS])  # the small pass and the vectorised way
def test_a_call_writes_no_attribute_onto_the_callers_tensors(bs: int) -> None:
    """Catches a check result kept on the caller's prefix tensors (an attribute, as the first
    version tagged them): sglang makes them anew for every call, and they are not ours to write."""
    case = big_case(8)
    if bs != BS:
        case = {k: v[:bs] if isinstance(v, list) else v for k, v in case.items()}
        case["req_pool_indices"] = list(range(bs))
        case["out_cache_loc"] = torch.arange(sum(case["extend_lens"]))
    before = [dict(vars(t)) for t in case["prefix_tensors"]]
    rtt = ReqToTokenPool(BS, MAX_LEN, "cpu")
    call(rtt, case, backend="triton")
    call(rtt, case, backend="torch")
    assert [dict(vars(t)) for t in case["prefix_tensors"]] == before == [{}] * bs


@pytest.mark.parametrize("bs", [3, BS])
def test_a_valid_batch_is_checked_by_one_batched_call_with_no_per_tensor_check(
    bs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches the prefix checks falling back to a Python loop per tensor on a valid batch (the cost
    the batched passes exist to avoid), or running more than once per call."""
    case = big_case(9, with_prefix=0.7)
    if bs != BS:
        case = {k: v[:bs] if isinstance(v, list) else v for k, v in case.items()}
        case["req_pool_indices"] = list(range(bs))
        case["out_cache_loc"] = torch.arange(sum(case["extend_lens"]))
    per_tensor: list[int] = []
    batches: list[int] = []
    batched = prefix_check.tagged_addresses

    def counting(tensors: Any, *args: Any) -> Any:
        batches.append(len(tensors))
        return batched(tensors, *args)

    monkeypatch.setattr(prefix_check, "_check_one", lambda i, *a: per_tensor.append(i))
    monkeypatch.setattr(write_cache, "tagged_addresses", counting)
    rtt = ReqToTokenPool(BS, MAX_LEN, "cpu")
    call(rtt, case, backend="triton")
    assert batches == [sum(1 for p in case["prefix_lens"] if p)]
    assert per_tensor == []
    call(rtt, case)
    written(rtt, case)
    bad = next(i for i, p in enumerate(case["prefix_lens"]) if p)
    case["prefix_tensors"][bad] = case["prefix_tensors"][bad].float()  # control: a broken batch is rechecked
    monkeypatch.setattr(prefix_check, "_check_one", lambda i, *a: per_tensor.append(i))
    with pytest.raises(CacheIndexError, match="must pass the prefix checks"):  # the stub refuses nothing
        call(rtt, case)
    assert per_tensor == [i for i, p in enumerate(case["prefix_lens"]) if p]


def test_auto_backend_reads_the_interpreter_switch_on_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches the CUDA answer, kept per device, standing in for a CPU device's."""
    cuda = torch.device("cuda", 0)
    assert write_cache._resolve_backend("auto", cuda) == "triton"
    assert write_cache._resolve_backend("auto", cuda) == "triton"
    for switch, backend in (("1", "triton"), (None, "torch"), ("1", "triton")):
        if switch is None:
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        else:
            monkeypatch.setenv("TRITON_INTERPRET", switch)
        assert write_cache._resolve_backend("auto", torch.device("cpu")) == backend
