"""``pinpool bench`` memcache rows against sglang 0.5.23's ``write_cache_indices`` caller path.

Both sides start from the same host lists and the same int64 prefix tensors (sglang's
radix-cache values are int64). sglang's side is what its ``alloc_for_extend`` does: four
pinned int64 uploads, then ``write_cache_indices`` (a pinned upload of the prefix
addresses and its kernel); its own code when ``.sglang/`` holds it, else the rebuild, as
the notes say (``memcache.sglang_ref``). Every row checks the two ``req_to_token`` results
are equal.
"""

from __future__ import annotations

import random
from functools import partial
from typing import Any

import numpy as np
import torch

from memcache import prefix_check
from memcache.req_to_token import ReqToTokenPool
from memcache.sglang_ref import call_uploaded, caller_path, load
from memcache.write_cache import write_cache_indices
from memcache.write_kernel import META_ROWS, launch_write_req_to_token
from pinpool import PinnedRingBuffer, PoolSettings
from pinpool.bench.kit import BenchContext, Spread, Table, host_us_spread

#: The issue's batch sizes (1 to 4096), whatever ``--batch-sizes`` says.
SIZES = (1, 64, 256, 1024, 4096)
MAX_LEN = 256


def make_case(bs: int, device: torch.device, seed: int = 0) -> dict[str, Any]:
    """Half the requests with a 1-64 token int64 prefix (one tensor each, as a radix cache hands
    them out), every request 1-8 new tokens, rows in random order."""
    rng = random.Random(seed)
    prefix = [rng.choice([0, rng.randint(1, 64)]) for _ in range(bs)]
    extend = [rng.randint(1, 8) for _ in range(bs)]
    return {
        "out_cache_loc": torch.randint(1, 1 << 20, (sum(extend),), dtype=torch.int64, device=device),
        "req_pool_indices": rng.sample(range(bs), bs),
        "prefix_lens": prefix,
        "seq_lens": [p + e for p, e in zip(prefix, extend, strict=True)],
        "extend_lens": extend,
        "prefix_tensors": [torch.randint(1, 1 << 20, (p,), dtype=torch.int64, device=device) for p in prefix],
    }


def _theirs(write: Any, case: dict[str, Any], rtt: ReqToTokenPool) -> None:
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


def _kernel_us(ctx: BenchContext, write: Any, case: dict[str, Any], rtt: ReqToTokenPool) -> tuple[float, float]:
    """Device µs of the two kernels alone (inputs already on the device), do_bench medians."""
    from triton.testing import do_bench

    device = ctx.device
    cpu = [torch.tensor(case[k]) for k in ("req_pool_indices", "prefix_lens", "seq_lens", "extend_lens")]
    dev = [t.to(device) for t in cpu]
    theirs = partial(call_uploaded, write, case["out_cache_loc"], cpu, dev, case["prefix_tensors"], rtt)
    prefix = np.asarray(case["prefix_lens"], dtype=np.int64)
    extend = np.asarray(case["extend_lens"], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(extend)[:-1]])
    addresses = prefix_check.prefix_addresses(case["prefix_tensors"], prefix, rtt.device)
    meta_host = np.stack([case["req_pool_indices"], prefix, case["seq_lens"], starts, addresses]).astype(np.int64)
    meta = torch.from_numpy(meta_host).to(device)
    assert meta.shape[0] == META_ROWS
    ours = partial(launch_write_req_to_token, rtt.req_to_token, meta, case["out_cache_loc"])
    return do_bench(theirs, return_mode="median") * 1e3, do_bench(ours, return_mode="median") * 1e3


def workload(ctx: BenchContext) -> list[Table]:
    if not ctx.is_cuda:
        return []  # both kernels need a GPU (Triton); tests/unit covers the CPU paths
    write, source = load()
    pool = PinnedRingBuffer(PoolSettings.from_env(device=ctx.device, num_slots=8, slot_bytes=1 << 20))
    rows = []
    for bs in SIZES:
        ctx.progress(f"sglang write_cache_indices bs={bs}")
        case = make_case(bs, ctx.device, seed=bs)
        mine, ref = ReqToTokenPool(bs, MAX_LEN, ctx.device), ReqToTokenPool(bs, MAX_LEN, ctx.device)
        write_cache_indices(req_to_token_pool=mine, pool=pool, **case)
        _theirs(write, case, ref)
        same = torch.equal(mine.req_to_token, ref.req_to_token)
        theirs = host_us_spread(ctx, partial(_theirs, write, case, ref))
        ours = host_us_spread(ctx, partial(write_cache_indices, req_to_token_pool=mine, pool=pool, **case))

        def cold(case: dict[str, Any] = case, rtt: ReqToTokenPool = mine) -> None:
            for t in case["prefix_tensors"]:
                prefix_check.forget(t)  # every prefix checked in full, as on its first use
            write_cache_indices(req_to_token_pool=rtt, pool=pool, **case)

        first = host_us_spread(ctx, cold)
        k_theirs, k_ours = _kernel_us(ctx, write, case, ref)
        rows.append((bs, theirs, ours, first, _x(theirs, ours), _x(theirs, first), k_theirs, k_ours, same))
    stats = pool.stats()
    pool.close()
    notes = (
        f"sglang side: {source}",
        "host µs per whole call from the same host lists, median (min-max) over the repeats; x = sglang / pool medians",
        "pool: prefix checks kept on each tensor (a radix cache hands the same tensors out again); "
        "cold: every prefix checked in full (the 'forget' time is inside the figure, so cold is an upper bound)",
        f"kernel µs: device time of each kernel alone, do_bench median; pool made {stats.copies} copies, "
        f"{stats.stalls} stalls",
    )
    columns = ("bs", "sglang µs", "pool µs", "cold µs", "x", "x cold", "sglang kernel µs", "pool kernel µs", "equal")
    return [Table("memcache: write_cache_indices whole call vs sglang's caller path", columns, tuple(rows), notes)]


def _x(base: Spread, ours: Spread) -> float:
    return base.median / ours.median
