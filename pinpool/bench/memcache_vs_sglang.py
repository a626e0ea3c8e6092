"""``pinpool bench`` memcache rows against sglang 0.5.23's ``write_cache_indices`` caller path.

Both sides start from the same host lists and prefix tensors of the same values (sglang's
radix-cache values are int64). sglang's side is what its ``alloc_for_extend`` does: four
pinned int64 uploads, then ``write_cache_indices`` (a pinned upload of the prefix
addresses and its kernel); its own code when ``.sglang/`` holds it, else the rebuild, as
the notes say (``pinpool.bench.sglang_memcache``).

The leading columns give each call prefix tensors it has never seen, made as sglang's
scheduler makes them: ``path_device_indices`` returns a fresh ``torch.cat`` of the matched
nodes' values and ``prefix_device_indices`` slices it to the prefix length, for every
request of every batch; a request without a prefix gets sglang's one shared empty CPU
tensor. Each timed call gets its own such list, made just before it outside the timed
region, so no tensor object is seen twice. The "warm" columns hand the same list to every
call (a pattern sglang's scheduler never produces).

On CUDA both kernels run and every row checks the two ``req_to_token`` results equal. On
CPU neither kernel can run (sglang's does not run under Triton 3.6's interpreter), so both
launches are replaced by no-ops and each side's host work up to its launch is timed; the
pool's values are then checked against the torch reference writer instead.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from itertools import pairwise
from typing import Any

import numpy as np
import torch

from memcache import prefix_check, write_cache
from memcache.req_to_token import ReqToTokenPool
from memcache.write_cache import write_cache_indices
from memcache.write_kernel import META_ROWS, launch_write_req_to_token
from pinpool import PinnedRingBuffer, PoolSettings
from pinpool.bench.kit import BenchContext, Spread, Table, one_thread_on_cpu
from pinpool.bench.sglang_memcache import call_uploaded, caller_path, load

#: The issue's batch sizes (1 to 4096), whatever ``--batch-sizes`` says.
SIZES = (1, 64, 256, 1024, 4096)
MAX_LEN = 256
#: Timed calls per side and column (each its own sample; the figures are their medians).
CALLS = 200
WARMUP = 10
#: sglang's placeholder for a request without a prefix: one shared empty CPU tensor
#: (``_EMPTY_PREFIX`` in its allocation.py), never read by either kernel.
EMPTY = torch.empty((0,), dtype=torch.int64)
Prefixes = list[torch.Tensor]


def make_case(bs: int, device: torch.device, seed: int = 0) -> dict[str, Any]:
    """Half the requests with a 1-64 token int64 prefix matched over 1-3 radix nodes, every
    request 1-8 new tokens, rows in random order. ``nodes[i]``: request i's node values;
    ``prefix_tensors``: one set made from them (the bench makes a new one for each call)."""
    rng = random.Random(seed)
    prefix = [rng.choice([0, rng.randint(1, 64)]) for _ in range(bs)]
    extend = [rng.randint(1, 8) for _ in range(bs)]
    nodes = []
    for p in prefix:
        # cut points of the matched path; the last node may run past the prefix (a match
        # can end inside it: sglang slices the concatenation to prefix_len)
        cuts = sorted(rng.sample(range(1, p), min(rng.randint(0, 2), p - 1))) if p > 1 else []
        edges = [0, *cuts, p + rng.randint(0, 3)]
        path = torch.randint(1, 1 << 20, (edges[-1],), dtype=torch.int64, device=device) if p else None
        nodes.append([] if path is None else [path[a:b].clone() for a, b in pairwise(edges)])
    case = {
        "out_cache_loc": torch.randint(1, 1 << 20, (sum(extend),), dtype=torch.int64, device=device),
        "req_pool_indices": rng.sample(range(bs), bs),
        "prefix_lens": prefix,
        "seq_lens": [p + e for p, e in zip(prefix, extend, strict=True)],
        "extend_lens": extend,
        "nodes": nodes,
    }
    case["prefix_tensors"] = fresh_prefixes(case)  # one set, for scripts that time one call (diag_launch.py)
    return case


def fresh_prefixes(case: dict[str, Any]) -> Prefixes:
    """New prefix tensor objects, as sglang's radix cache makes them for one batch."""
    return [torch.cat(n)[:p] if p else EMPTY for n, p in zip(case["nodes"], case["prefix_lens"], strict=True)]


def _lists(case: dict[str, Any]) -> dict[str, Any]:
    return {k: case[k] for k in ("out_cache_loc", "req_pool_indices", "prefix_lens", "seq_lens", "extend_lens")}


def _theirs(write: Any, case: dict[str, Any], rtt: ReqToTokenPool, prefixes: Prefixes) -> None:
    caller_path(
        write,
        case["out_cache_loc"],
        case["req_pool_indices"],
        case["prefix_lens"],
        case["seq_lens"],
        case["extend_lens"],
        prefixes,
        rtt,
    )


def _ours(case: dict[str, Any], rtt: ReqToTokenPool, pool: PinnedRingBuffer, prefixes: Prefixes) -> None:
    # "triton" on CPU too: the staged path, its launch a no-op there (``_no_launches``)
    write_cache_indices(req_to_token_pool=rtt, pool=pool, prefix_tensors=prefixes, backend="triton", **_lists(case))


class _NoLaunch:
    """A Triton kernel's ``kernel[grid](*args)`` that launches nothing (CPU rows only)."""

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return lambda *args, **kwargs: None


@contextmanager
def _no_launches(write: Any) -> Iterator[None]:
    """On CPU: both sides' kernel launches replaced by no-ops, restored on exit."""
    names = [n for n in ("write_req_to_token_pool_triton", "_rebuilt_kernel") if n in write.__globals__]
    saved = [(n, write.__globals__[n]) for n in names]
    ours = vars(write_cache)["launch_checked"]
    try:
        for n in names:
            write.__globals__[n] = _NoLaunch()
        setattr(write_cache, "launch_checked", lambda *args, **kwargs: None)  # noqa: B010 (not a name mypy knows)
        yield
    finally:
        setattr(write_cache, "launch_checked", ours)  # noqa: B010
        for n, kernel in saved:
            write.__globals__[n] = kernel


def per_call_us(
    ctx: BenchContext,
    sides: dict[str, Callable[[Prefixes], None]],
    prefixes: Callable[[], Prefixes],
    release: str | None = None,
) -> dict[str, list[float]]:
    """Host µs of each of ``CALLS`` calls per side, the sides alternating call by call (and which goes
    first), each call given ``prefixes()`` made before its clock starts, on an idle device.

    Every list is kept until the last call (its release timed by neither side), except where
    ``release`` names the side whose timed call ends by dropping it, as sglang's
    ``alloc_for_extend`` drops its list on return; the other side's list is dropped untimed.
    """
    samples: dict[str, list[float]] = {name: [] for name in sides}
    held = []
    order = list(sides.items())
    for j in range(WARMUP + CALLS):
        for name, fn in order if j % 2 else order[::-1]:
            given = prefixes()
            ctx.synchronize()
            start = time.perf_counter_ns()
            fn(given)
            if name == release:
                given.clear()
            stop = time.perf_counter_ns()
            if release is None:
                held.append(given)
            del given
            if j >= WARMUP:
                samples[name].append((stop - start) / 1e3)
    return samples


def _spread(samples: list[float]) -> Spread:
    """Median with the quartiles around it (the notes say so)."""
    q1, median, q3 = statistics.quantiles(samples, n=4)
    return Spread(q1, median, q3)


def _kernel_us(ctx: BenchContext, write: Any, case: dict[str, Any], rtt: ReqToTokenPool) -> tuple[float, float]:
    """Device µs of the two kernels alone (inputs already on the device), do_bench medians."""
    from triton.testing import do_bench

    device = ctx.device
    prefixes = fresh_prefixes(case)
    cpu = [torch.tensor(case[k]) for k in ("req_pool_indices", "prefix_lens", "seq_lens", "extend_lens")]
    dev = [t.to(device) for t in cpu]
    theirs = partial(call_uploaded, write, case["out_cache_loc"], cpu, dev, prefixes, rtt)
    prefix = np.asarray(case["prefix_lens"], dtype=np.int64)
    extend = np.asarray(case["extend_lens"], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(extend)[:-1]])
    addresses = prefix_check.prefix_addresses(prefixes, prefix, rtt.device)
    meta_host = np.stack([case["req_pool_indices"], prefix, case["seq_lens"], starts, addresses]).astype(np.int64)
    meta = torch.from_numpy(meta_host).to(device)
    assert meta.shape[0] == META_ROWS
    ours = partial(launch_write_req_to_token, rtt.req_to_token, meta, case["out_cache_loc"])
    return do_bench(theirs, return_mode="median") * 1e3, do_bench(ours, return_mode="median") * 1e3


def _same(ctx: BenchContext, case: dict[str, Any], mine: ReqToTokenPool, ref: ReqToTokenPool) -> bool:
    """Whether the two sides wrote the same ``req_to_token``; on CPU, where neither kernel ran, the
    pool's torch reference writer against the rows written here request by request."""
    if ctx.is_cuda:
        ctx.synchronize()
        return torch.equal(mine.req_to_token, ref.req_to_token)
    staging = PinnedRingBuffer(PoolSettings(device=ctx.device, num_slots=2, slot_bytes=1 << 20))
    write_cache_indices(
        req_to_token_pool=mine, pool=staging, backend="torch", prefix_tensors=fresh_prefixes(case), **_lists(case)
    )
    staging.close()
    want = torch.zeros_like(mine.req_to_token)
    loc, start = case["out_cache_loc"].tolist(), 0  # sync-ok: the CPU rows' expected values, after timing
    for row, nodes, p, e in zip(
        case["req_pool_indices"], case["nodes"], case["prefix_lens"], case["extend_lens"], strict=True
    ):
        values = [v for n in nodes for v in n.tolist()][:p] + loc[start : start + e]  # sync-ok: as above
        want[row, : p + e] = torch.tensor(values, dtype=torch.int32)
        start += e
    return torch.equal(mine.req_to_token, want)


def workload(ctx: BenchContext) -> list[Table]:
    write, source = load()
    with one_thread_on_cpu(ctx):
        return _rows(ctx, write, source)


def _rows(ctx: BenchContext, write: Any, source: str) -> list[Table]:
    pool = PinnedRingBuffer(PoolSettings.from_env(device=ctx.device, num_slots=8, slot_bytes=1 << 20))
    rows = []
    for bs in SIZES:
        ctx.progress(f"sglang write_cache_indices bs={bs}")
        case = make_case(bs, ctx.device, seed=bs)
        mine, ref = ReqToTokenPool(bs, MAX_LEN, ctx.device), ReqToTokenPool(bs, MAX_LEN, ctx.device)
        sides: dict[str, Callable[[Prefixes], None]] = {
            "sglang": partial(_theirs, write, case, ref),
            "pool": partial(_ours, case, mine, pool),
        }
        warm = fresh_prefixes(case)
        new = partial(fresh_prefixes, case)
        with _no_launches(write) if not ctx.is_cuda else _nothing():
            fresh = per_call_us(ctx, sides, new)
            freed = per_call_us(ctx, sides, new, release="sglang")
            kept = per_call_us(ctx, sides, partial(list, warm))  # a new list, the same tensors
        same = _same(ctx, case, mine, ref)
        k_theirs, k_ours = _kernel_us(ctx, write, case, ref) if ctx.is_cuda else (None, None)
        theirs, ours = _spread(fresh["sglang"]), _spread(fresh["pool"])
        theirs_r, ours_r = _spread(freed["sglang"]), _spread(freed["pool"])
        theirs_w, ours_w = _spread(kept["sglang"]), _spread(kept["pool"])
        rows.append(
            (
                bs,
                theirs,
                ours,
                _x(theirs, ours),
                _x(theirs_r, ours_r),
                theirs_w,
                ours_w,
                _x(theirs_w, ours_w),
                k_theirs,
                k_ours,
                same,
            )
        )
    stats = pool.stats()
    pool.close()
    notes = [
        f"sglang side: {source}",
        f"host µs per whole call from the same host lists: median (quartiles) of {CALLS} calls per side, "
        "sides alternating call by call, each call started on an idle device; x = sglang / pool medians",
        "fresh: every call gets prefix tensors never seen before, made just before it (outside the timed "
        "region) as sglang's radix cache makes them: torch.cat of 1-3 node tensors sliced to prefix_len, "
        "sglang's shared empty CPU tensor for no prefix; half the requests have a 1-64 token prefix",
        "fresh: every list is kept alive until the row ends, so neither side's figure holds the tensors' "
        "release; x released: each list dropped as its owner drops it, sglang's inside its timed call (its "
        "alloc_for_extend drops the list on return), the pool's retained by its ring and released when a "
        "later timed call reclaims the slot",
        "warm: the same prefix tensor objects on every call (sglang's scheduler never does this)",
        f"pool made {stats.copies} copies, {stats.stalls} stalls",
    ]
    if ctx.is_cuda:
        notes.append("kernel µs: device time of each kernel alone, do_bench median; equal: req_to_token equal")
    else:
        notes.append(
            "CPU: both kernel launches are no-ops (host work up to the launch), one torch thread; equal: the "
            "pool's values against rows written here request by request (sglang's kernel cannot run here)"
        )
    columns = (
        "bs",
        "sglang fresh µs",
        "pool fresh µs",
        "x fresh",
        "x released",
        "sglang warm µs",
        "pool warm µs",
        "x warm",
        "sglang kernel µs",
        "pool kernel µs",
        "equal",
    )
    return [Table.build("memcache: write_cache_indices whole call vs sglang's caller path", columns, rows, notes)]


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _x(base: Spread, ours: Spread) -> float:
    return base.median / ours.median
