"""The memcache workload of ``pinpool bench``: the write kernel and the whole call.

``baseline`` is sglang's design rebuilt here for comparison (not library code): one
program per request that sums ``extend_lens[0:pid]`` itself, with per-field uploads.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from memcache.req_to_token import ReqToTokenPool
from memcache.write_cache import write_cache_indices
from memcache.write_kernel import BLOCK, META_ROWS, launch_write_req_to_token, write_req_to_token_reference
from pinpool import PinnedRingBuffer, PoolSettings
from pinpool.bench.kit import BenchContext, Spread, Table, host_us_spread, ratio

MAX_LEN = 256
KERNEL_SIZES = (1024, 4096, 8192)


@triton.jit
def _baseline_kernel(
    req_to_token_ptr,  # int32 [rows, row_stride]
    req_pool_indices,  # int64 [bs]
    prefix_ptrs,  # int64 [bs]
    prefix_lens,  # int64 [bs]
    seq_lens,  # int64 [bs]
    extend_lens,  # int64 [bs]
    out_cache_loc,  # int64 [sum(extend)]
    row_stride,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    row = tl.load(req_pool_indices + pid)
    prefix_len = tl.load(prefix_lens + pid)
    seq_len = tl.load(seq_lens + pid)
    # sglang's design: each program walks extend_lens[0:pid] one element at a time, so
    # the grid does O(bs^2) dependent loads.
    start = tl.load(extend_lens) * 0
    i = 0
    while i < pid:
        start += tl.load(extend_lens + i)
        i += 1
    dst = req_to_token_ptr + row * row_stride
    prefix = tl.load(prefix_ptrs + pid).to(tl.pointer_type(tl.int32))
    off = prefix_len * 0
    while off < prefix_len:
        idx = off + tl.arange(0, BLOCK)
        mask = idx < prefix_len
        tl.store(dst + idx, tl.load(prefix + idx, mask=mask), mask=mask)
        off += BLOCK
    off = prefix_len * 0
    while off < seq_len - prefix_len:
        idx = off + tl.arange(0, BLOCK)
        mask = idx < seq_len - prefix_len
        tl.store(dst + prefix_len + idx, tl.load(out_cache_loc + start + idx, mask=mask).to(tl.int32), mask=mask)
        off += BLOCK


def make_case(bs: int, device: torch.device, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    prefix = [rng.choice([0, rng.randint(1, 64)]) for _ in range(bs)]
    extend = [rng.randint(1, 8) for _ in range(bs)]
    return {
        "out_cache_loc": torch.randint(1, 1 << 20, (sum(extend),), dtype=torch.int64, device=device),
        "req_pool_indices": list(range(bs)),
        "prefix_lens": prefix,
        "seq_lens": [p + e for p, e in zip(prefix, extend, strict=True)],
        "extend_lens": extend,
        # One tensor per request, as a radix cache hands them out (no sharing to dedupe).
        "prefix_tensors": [torch.randint(1, 1 << 20, (p,), dtype=torch.int32, device=device) for p in prefix],
    }


def baseline_call(case: dict[str, Any], rtt: ReqToTokenPool, mode: str) -> None:
    """sglang's shape: per-field uploads (``sync``, or ``pinned`` as after PR #28076), then its kernel.

    On CPU the kernel is replaced by the library's torch reference writer (no Triton
    there), so the comparison is of the uploads and the host-side work around them.
    """
    device = rtt.device
    pin = device.type == "cuda"

    def up(values: list[int]) -> torch.Tensor:
        if mode == "sync":
            return torch.tensor(values, dtype=torch.int64, device=device)  # sync-ok: the baseline under comparison
        return torch.tensor(values, dtype=torch.int64, pin_memory=pin).to(device, non_blocking=True)

    pointers = [t.data_ptr() for t in case["prefix_tensors"]]
    args = [up(case[k]) for k in ("req_pool_indices", "prefix_lens", "seq_lens", "extend_lens")]
    rows, prefix, seq, extend = args
    bs = len(pointers)
    if not pin:
        # CPU only (no pinning): numpy and CPU tensors, nothing on a device to wait for.
        starts = np.concatenate([[0], np.cumsum(case["extend_lens"])[:-1]]).astype(np.int64).tolist()  # sync-ok
        write_req_to_token_reference(
            rtt.req_to_token,
            rows.tolist(),  # sync-ok: CPU tensors
            prefix.tolist(),  # sync-ok: CPU tensors
            seq.tolist(),  # sync-ok: CPU tensors
            starts,
            case["prefix_tensors"],
            case["out_cache_loc"],
        )
        return
    _baseline_kernel[(bs,)](
        rtt.req_to_token, rows, up(pointers), prefix, seq, extend, case["out_cache_loc"], MAX_LEN, BLOCK=BLOCK
    )


def _kernel_table(ctx: BenchContext, pool: PinnedRingBuffer) -> Table:
    rows = []
    for bs in KERNEL_SIZES:
        ctx.progress(f"write kernel bs={bs}")
        case = make_case(bs, ctx.device)
        rtt = ReqToTokenPool(bs, MAX_LEN, ctx.device)
        extend = np.asarray(case["extend_lens"], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(extend)[:-1]])
        ptrs = [t.data_ptr() for t in case["prefix_tensors"]]
        meta_host = np.stack([case["req_pool_indices"], case["prefix_lens"], case["seq_lens"], starts, ptrs])
        meta = torch.from_numpy(meta_host.astype(np.int64)).to(ctx.device)
        assert meta.shape[0] == META_ROWS
        dev = {
            k: torch.tensor(case[k], dtype=torch.int64, device=ctx.device)  # sync-ok: set-up, outside timing
            for k in ("req_pool_indices", "prefix_lens", "seq_lens", "extend_lens")
        }
        dev_ptrs = torch.tensor(ptrs, dtype=torch.int64, device=ctx.device)  # sync-ok: set-up, outside timing
        ours_launch = partial(launch_write_req_to_token, rtt.req_to_token, meta, case["out_cache_loc"])
        base_launch = partial(
            _baseline_kernel[(bs,)],
            rtt.req_to_token,
            dev["req_pool_indices"],
            dev_ptrs,
            dev["prefix_lens"],
            dev["seq_lens"],
            dev["extend_lens"],
            case["out_cache_loc"],
            MAX_LEN,
            BLOCK=BLOCK,
        )
        ours = _device_us(ours_launch)
        base = _device_us(base_launch)
        rows.append((bs, base, ours, ratio(base, ours)))
    notes = (
        "device µs per launch, triton.testing.do_bench median (min-max); prefixes 0-64, extends 1-8 tokens; "
        "prefix-sum = sglang's design, start-offsets = this library's kernel",
    )
    columns = ("bs", "prefix-sum µs", "start-offsets µs", "prefix-sum/start-offsets")
    return Table.build("memcache: write kernel, device µs", columns, rows, notes)


def _device_us(fn: Callable[[], Any]) -> Spread:
    low, mid, high = do_bench(fn, quantiles=[0.0, 0.5, 1.0])
    return Spread(low * 1e3, mid * 1e3, high * 1e3)


MODES = ("sync", "pinned", "pool")


def workload(ctx: BenchContext) -> list[Table]:
    pool = PinnedRingBuffer(PoolSettings.from_env(device=ctx.device, num_slots=8, slot_bytes=1 << 20))
    modes = [m for m in MODES if m in ctx.modes]
    base = "pinned" if "pinned" in modes else "sync"
    tables = []
    if ctx.is_cuda:
        tables.append(_kernel_table(ctx, pool))
    rows = []
    timed = {"calls": 0}
    for bs in ctx.batch_sizes:
        ctx.progress(f"write_cache_indices bs={bs}")
        case = make_case(bs, ctx.device)
        rtt = ReqToTokenPool(bs, MAX_LEN, ctx.device)
        ours = partial(write_cache_indices, req_to_token_pool=rtt, pool=pool, **case)

        def counted(call: Callable[[], None] = ours) -> None:
            call()
            timed["calls"] += 1

        us: dict[str, Spread] = {}
        for mode in modes:
            fn = counted if mode == "pool" else partial(baseline_call, case, rtt, mode)
            us[mode] = host_us_spread(ctx, fn)
        rows.append((bs, *(us.get(m) for m in MODES), ratio(us.get(base), us["pool"])))
    stats = pool.stats()
    staged = (
        f"pool made {stats.copies} copies for {timed['calls']} calls"
        if ctx.is_cuda
        else f"{timed['calls']} pool calls timed; on CPU the torch reference writes directly and stages nothing"
    )
    notes = [
        f"host µs per whole call incl. validation: median (min-max) over {ctx.repeats} blocks; {staged}, "
        f"{stats.stalls} stalls",
        f"{base}/pool = ratio of the medians; sync and pinned = per-field uploads, then "
        + ("sglang's per-program-prefix-sum kernel" if ctx.is_cuda else "the torch reference writer"),
    ]
    columns = ("bs", *(f"{m} µs" for m in MODES), f"{base}/pool")
    tables.append(Table.build("memcache: host µs per write_cache_indices", columns, rows, notes))
    pool.close()
    return tables
