"""write_cache_indices on CUDA: bit-exact against the reference, no sync, one copy, lifetimes."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from memcache import CacheIndexError, ReqToTokenPool, write_cache_indices
from pinpool import PinnedRingBuffer, PoolSettings, Stage
from pinpool.testing import no_sync

DEV = torch.device("cuda", 0)
MAX_LEN = 128
SLEEP_CYCLES = 200_000_000  # ~0.1 s: the kernel is still queued when the host frees the prefixes


def make_case(rng: random.Random, bs: int, size: int) -> dict[str, Any]:
    rows = rng.sample(range(size), bs)
    prefix = [rng.choice([0, rng.randint(1, 96)]) for _ in range(bs)]
    extend = [rng.choice([0, rng.randint(1, MAX_LEN - p)]) for p in prefix]
    return {
        "out_cache_loc": torch.randint(1, 1 << 30, (sum(extend),), dtype=torch.int64, device=DEV),
        "req_pool_indices": rows,
        "prefix_lens": prefix,
        "seq_lens": [p + e for p, e in zip(prefix, extend, strict=True)],
        "extend_lens": extend,
        "prefix_tensors": [torch.randint(1, 1 << 30, (p,), dtype=torch.int32, device=DEV) for p in prefix],
    }


def pool() -> PinnedRingBuffer:
    return PinnedRingBuffer(PoolSettings(device=DEV, num_slots=4, slot_bytes=1 << 20))


@pytest.mark.parametrize("bs", [1, 3, 999, 4097, 8192])
def test_kernel_matches_reference_bit_for_bit(bs: int) -> None:
    """Catches a start offset or pointer error that only shows at large batch sizes."""
    rng = random.Random(bs)
    case = make_case(rng, bs, bs + 7)
    want = ReqToTokenPool(bs + 7, MAX_LEN, DEV)
    got = ReqToTokenPool(bs + 7, MAX_LEN, DEV)
    want.req_to_token.fill_(-7)
    got.req_to_token.fill_(-7)
    write_cache_indices(req_to_token_pool=want, pool=pool(), backend="torch", **case)
    write_cache_indices(req_to_token_pool=got, pool=pool(), backend="triton", **case)
    assert torch.equal(got.req_to_token, want.req_to_token)


def test_call_makes_no_sync_and_one_memcpy() -> None:
    """Catches a pageable pointer upload or per-field copies in the hot path."""
    rng = random.Random(0)
    case = make_case(rng, 999, 1024)
    rtt = ReqToTokenPool(1024, MAX_LEN, DEV)
    p = pool()
    write_cache_indices(req_to_token_pool=rtt, pool=p, **case)  # compile
    torch.cuda.synchronize()
    with no_sync():
        write_cache_indices(req_to_token_pool=rtt, pool=p, **case)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        write_cache_indices(req_to_token_pool=rtt, pool=p, **case)
        torch.cuda.synchronize()
    assert sum(1 for e in prof.events() if e.name.startswith("cudaMemcpyAsync")) == 1


def _free_prefixes_while_lagging(retain: bool, monkeypatch: pytest.MonkeyPatch) -> bool:
    if not retain:
        monkeypatch.setattr(Stage, "retain", lambda self, *objs: None)
    rng = random.Random(1)
    side = torch.cuda.Stream(DEV)
    with torch.cuda.stream(side):  # the caller's tensors come from another stream's pool
        case = make_case(rng, 64, 64)
    side.synchronize()
    expected = [t.cpu() for t in case["prefix_tensors"]]
    rtt = ReqToTokenPool(64, MAX_LEN, DEV)
    torch.cuda._sleep(SLEEP_CYCLES)  # the write kernel queues behind this
    staging = pool()  # held: the pool owns the retained prefixes until its slot fence passes
    write_cache_indices(req_to_token_pool=rtt, pool=staging, **case)
    sizes = [t.numel() for t in case["prefix_tensors"]]
    del case["prefix_tensors"]
    with torch.cuda.stream(side):  # without retain, these reuse the freed blocks at once
        clobber = [torch.full((n,), -1, dtype=torch.int32, device=DEV) for n in sizes]
    torch.cuda.synchronize()
    del clobber
    ok = True
    for i, row in enumerate(case["req_pool_indices"]):
        p = case["prefix_lens"][i]
        ok &= bool(torch.equal(rtt.req_to_token[row, :p].cpu(), expected[i][:p]))
    return ok


def test_prefixes_freed_right_after_the_call_do_not_corrupt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches prefix tensors released before the kernel that dereferences them ran (rule 5)."""
    assert _free_prefixes_while_lagging(True, monkeypatch)


def test_control_without_retain_the_prefixes_are_clobbered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches a lifetime test whose set-up could never expose the hazard."""
    assert not _free_prefixes_while_lagging(False, monkeypatch)


def test_the_kept_kernel_is_chosen_by_dtype_and_alignment_call_after_call() -> None:
    """Catches the launcher's kept kernels (launch_checked skips Triton's JIT entry after the
    first call per key) running a kernel built for another out_cache_loc dtype or pointer
    alignment: each call here alternates int32 / int64 slots and 16-byte-aligned / offset
    views, repeatedly, and is compared with the reference writer."""
    rng = random.Random(7)
    p = pool()
    for rep in range(3):
        for dtype in (torch.int64, torch.int32):
            for shift in (0, 1):
                case = make_case(rng, 37, 64)
                slots = case["out_cache_loc"].to(dtype)
                backing = torch.empty(slots.numel() + shift, dtype=dtype, device=DEV)
                backing[shift:] = slots
                case["out_cache_loc"] = backing[shift:]  # shift 1: 4 or 8 bytes off 16-byte alignment
                want = ReqToTokenPool(64, MAX_LEN, DEV)
                got = ReqToTokenPool(64, MAX_LEN, DEV)
                write_cache_indices(req_to_token_pool=want, pool=p, backend="torch", **case)
                write_cache_indices(req_to_token_pool=got, pool=p, backend="triton", **case)
                assert torch.equal(got.req_to_token, want.req_to_token), (rep, dtype, shift)


def test_fresh_radix_style_prefixes_each_call_match_the_reference_and_stay_untouched() -> None:
    """Catches the batched prefix check on CUDA (device read by index) refusing sglang's fresh
    ``torch.cat(nodes)[:p]`` prefixes, accepting a CPU tensor or one of another device for a
    prefix, or writing an attribute onto the caller's tensors."""
    rng = random.Random(11)
    p = pool()
    base = make_case(rng, 300, 300)
    nodes = [[t[: len(t) // 2].long(), t[len(t) // 2 :].long()] for t in base["prefix_tensors"]]
    for _ in range(3):  # new tensor objects every call, as sglang's radix cache makes them
        case = dict(base)
        case["prefix_tensors"] = [torch.cat(n)[: len(t)] for n, t in zip(nodes, base["prefix_tensors"], strict=True)]
        want = ReqToTokenPool(300, MAX_LEN, DEV)
        got = ReqToTokenPool(300, MAX_LEN, DEV)
        write_cache_indices(req_to_token_pool=want, pool=p, backend="torch", **case)
        write_cache_indices(req_to_token_pool=got, pool=p, **case)
        assert torch.equal(got.req_to_token, want.req_to_token)
        assert all(vars(t) == {} for t in case["prefix_tensors"])
    i = next(j for j, n in enumerate(base["prefix_lens"]) if n)
    others = [base["prefix_tensors"][i].cpu()]
    if torch.cuda.device_count() > 1:
        others.append(base["prefix_tensors"][i].to("cuda:1"))
    for other in others:
        case = dict(base)
        case["prefix_tensors"] = list(base["prefix_tensors"])
        case["prefix_tensors"][i] = other
        with pytest.raises(CacheIndexError, match=rf"'prefix_tensors\[{i}\]' must be an int32 or int64 tensor on"):
            write_cache_indices(req_to_token_pool=ReqToTokenPool(300, MAX_LEN, DEV), pool=p, **case)
