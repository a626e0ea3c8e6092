"""The sampling workload of ``pinpool bench``: host µs per SamplingBatchInfo build.

Baselines rebuild sglang's ``from_schedule_batch`` shape on the same requests: five
per-field tensors (``sync``: a ``torch.tensor`` built on the device; ``pinned``: PR #28076's
``pin_memory=True`` + ``non_blocking``) plus the flags computed with Python any/all.

A second table builds the batch into a stage and runs the sampler inside it
(``from_schedule_batch(stage=st)``): a zero-copy stage (no copy; the sampler reads the
pinned slot) against a ring stage (one copy, flushed before the sampler).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from pinpool import PinnedRingBuffer, PoolSettings
from pinpool.bench.kit import BenchContext, Spread, Table, host_allocs, host_us_spread, ratio
from sampling.batch_info import SamplingBatchInfo
from sampling.params import TOP_K_ALL, SamplingParams
from sampling.sampler import Sampler

VOCAB = 32_000


class _Req:
    __slots__ = ("sampling_params",)

    def __init__(self, params: SamplingParams) -> None:
        self.sampling_params = params


class _Batch:
    def __init__(self, reqs: list[_Req], device: torch.device) -> None:
        self.reqs = reqs
        self.device = device


def make_batch(bs: int, device: torch.device, seed: int = 0) -> _Batch:
    rng = random.Random(seed)
    reqs = [
        _Req(
            SamplingParams(
                temperature=rng.choice([0.0, rng.uniform(0.5, 1.2)]),
                top_p=rng.choice([1.0, 0.9]),
                top_k=rng.choice([-1, 40]),
                min_p=rng.choice([0.0, 0.05]),
                seed=rng.randint(0, 2**32),
            )
        )
        for _ in range(bs)
    ]
    return _Batch(reqs, device)


def per_field_build(batch: _Batch, pin: bool, sync: bool) -> tuple[Any, ...]:
    """sglang's per-field shape: five tensors and Python flag loops."""
    reqs, device = batch.reqs, batch.device

    def upload(values: list[Any], dtype: torch.dtype) -> torch.Tensor:
        if sync:
            return torch.tensor(values, dtype=dtype, device=device)  # sync-ok: the baseline under comparison
        return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=True)

    temperatures = upload([r.sampling_params.temperature for r in reqs], torch.float32).view(-1, 1)
    top_ps = upload([r.sampling_params.top_p for r in reqs], torch.float32)
    top_ks = upload([r.sampling_params.top_k for r in reqs], torch.int32)
    min_ps = upload([r.sampling_params.min_p for r in reqs], torch.float32)
    seeds = upload([r.sampling_params.seed for r in reqs], torch.int64)
    flags = (
        all(r.sampling_params.top_k <= 1 for r in reqs),
        any(r.sampling_params.top_p != 1.0 for r in reqs),
        any(r.sampling_params.top_k != TOP_K_ALL for r in reqs),
        any(r.sampling_params.min_p > 0 for r in reqs),
    )
    return temperatures, top_ps, top_ks, min_ps, seeds, flags


def _launch_us(ctx: BenchContext, fn: Callable[[], Any], calls: int = 20) -> Spread:
    """Host µs per call of launching ``fn`` (the GPU drained between blocks, not inside one).

    Short blocks keep the launch queue from filling, so this is the host's cost alone,
    what a decode loop pays before the GPU can start.
    """
    for _ in range(5):
        fn()
    samples = []
    for _ in range(max(ctx.repeats, 5)):
        ctx.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    ctx.synchronize()
    return Spread.of(samples)


def _device_us(fn: Callable[[], Any]) -> Spread:
    """Device µs per call: triton.testing.do_bench's min, median and max."""
    from triton.testing import do_bench

    low, mid, high = do_bench(fn, quantiles=[0.0, 0.5, 1.0])
    return Spread(low * 1e3, mid * 1e3, high * 1e3)


def draw_table(ctx: BenchContext) -> Table:
    """The deterministic draw: eager torch (about thirty launches) against one Triton kernel."""
    rows = []
    pool = PinnedRingBuffer(PoolSettings.from_env(device=ctx.device, num_slots=4, slot_bytes=1 << 20))
    for bs in (1, 64, 256):
        ctx.progress(f"sampler draw bs={bs}")
        info = SamplingBatchInfo.from_schedule_batch(
            make_batch(bs, ctx.device, seed=3), VOCAB, pool, owned=True, deterministic=True
        )
        gen = torch.Generator(device=ctx.device).manual_seed(bs)
        logits = torch.randn(bs, VOCAB, device=ctx.device, generator=gen) * 3.0
        positions = torch.arange(bs, dtype=torch.int64, device=ctx.device)
        eager, fused = Sampler(use_kernel=False), Sampler()
        same = torch.equal(eager(logits, info, positions), fused(logits, info, positions))
        host = [_launch_us(ctx, partial(s, logits, info, positions)) for s in (eager, fused)]
        device = [_device_us(partial(s, logits, info, positions)) for s in (eager, fused)]
        rows.append((bs, host[0], host[1], ratio(host[0], host[1]), device[0], device[1], same))
    pool.close()
    notes = [
        f"Sampler with deterministic=True, vocab {VOCAB}, mixed top-p/top-k/min-p/greedy rows; host µs = launching "
        "one call (blocks of 20, GPU drained between blocks), median (min-max) over the blocks; device µs = "
        "triton.testing.do_bench median (min-max)",
        "same tokens = the kernel's tokens equal the eager path's on this batch",
    ]
    columns = ("bs", "eager host µs", "kernel host µs", "x host", "eager device µs", "kernel device µs", "same tokens")
    return Table.build("sampler: deterministic draw, eager torch vs one kernel", columns, rows, notes)


#: The zero-copy table's vocabulary on CPU, where the sampler runs on the host and would
#: otherwise set the whole figure (and the run time).
CPU_VOCAB = 256
#: Calls per timed block of the zero-copy table; the ring is deeper, so no call stalls.
STAGE_CALLS = 16


def build_and_sample(
    batch: _Batch,
    vocab: int,
    pool: PinnedRingBuffer,
    sampler: Sampler,
    logits: torch.Tensor,
    positions: torch.Tensor,
    zero_copy: bool,
) -> torch.Tensor:
    """One step's sampling: the batch built into a stage, the sampler launched inside it."""
    with pool.stage(zero_copy=zero_copy) as st:
        info = SamplingBatchInfo.from_schedule_batch(batch, vocab, pool, deterministic=True, stage=st)
        if not zero_copy:
            st.flush()  # a ring stage's values land with its copy: readers after it
        return sampler(logits, info, positions)  # zero-copy: launched before close, so fenced


def zero_copy_table(ctx: BenchContext) -> Table:
    """Build + sample in one stage: a zero-copy stage against a ring (copy) stage, per bs."""
    title = "sampling: batch build + sampler inside one stage, zero-copy vs copy stage"
    vocab = VOCAB if ctx.is_cuda else CPU_VOCAB
    slot_bytes = max(1 << 16, -(-(max(ctx.batch_sizes) * 32 + 4096) // 4096) * 4096)
    settings = PoolSettings.from_env(
        device=ctx.device, num_slots=2 * STAGE_CALLS, slot_bytes=slot_bytes, zero_copy=True
    )
    pool = PinnedRingBuffer(settings)
    platform = pool.platform
    if not platform.zero_copy_ok:
        pool.close()
        note = f"zero-copy rows skipped: the platform check refused zero-copy here ({platform.reason})"
        return Table.build(title, ("bs",), [], [note])
    sampler = Sampler()
    rows = []
    for bs in ctx.batch_sizes:
        ctx.progress(f"sampling in a stage bs={bs}")
        batch = make_batch(bs, ctx.device, seed=5)
        gen = torch.Generator(device=ctx.device).manual_seed(bs)
        logits = torch.randn(bs, vocab, device=ctx.device, generator=gen) * 3.0
        positions = torch.arange(bs, dtype=torch.int64, device=ctx.device)
        steps = {
            zc: partial(build_and_sample, batch, vocab, pool, sampler, logits, positions, zc) for zc in (False, True)
        }
        same = torch.equal(steps[False](), steps[True]())  # sync-ok: a check outside the timings
        us = {zc: host_us_spread(ctx, steps[zc], iters=STAGE_CALLS) for zc in (False, True)}
        rows.append((bs, us[False], us[True], ratio(us[False], us[True]), same))
    stats = pool.stats()
    pool.close()
    notes = [
        f"one step = SamplingBatchInfo.from_schedule_batch(stage=st) (deterministic, vocab {vocab}) + Sampler "
        f"launched inside the stage; host µs per step: median (min-max) over {ctx.repeats} blocks of "
        f"{STAGE_CALLS} steps, each block ending in a device sync (so a GPU-bound step shows its GPU time)",
        "copy = a ring stage: one copy, flushed before the sampler; zero-copy = pool.stage(zero_copy=True): no "
        "copy, the sampler's kernels read the pinned slot over PCIe, the slot's fence at close after them",
        f"same tokens = zero-copy tokens equal the copy stage's; platform: {platform.reason}; pool: "
        f"{stats.copies} copies, {stats.zero_copy_stages} zero-copy stages, {stats.stalls} stalls",
    ]
    if not ctx.is_cuda:
        notes.append(f"CPU: the host path reads host memory in place, and the vocab is {CPU_VOCAB} to keep it cheap")
    columns = ("bs", "copy stage µs", "zero-copy µs", "copy/zero-copy", "same tokens")
    return Table.build(title, columns, rows, notes)


MODES = ("sync", "pinned", "pool", "owned")


def workload(ctx: BenchContext) -> list[Table]:
    pool = PinnedRingBuffer(PoolSettings.from_env(device=ctx.device, num_slots=8, slot_bytes=1 << 20))
    pin = ctx.is_cuda  # on CPU "pinned" is the same per-field code without pinning, which does not exist there
    modes = [m for m in MODES if m in ctx.modes]
    base = "pinned" if "pinned" in modes else "sync"
    rows = []
    for bs in ctx.batch_sizes:
        ctx.progress(f"sampling bs={bs}")
        batch = make_batch(bs, ctx.device)
        build = SamplingBatchInfo.from_schedule_batch
        steps: dict[str, Callable[[], Any]] = {
            "sync": partial(per_field_build, batch, pin, sync=True),
            "pinned": partial(per_field_build, batch, pin, sync=False),
            "pool": partial(build, batch, VOCAB, pool, deterministic=True),
            "owned": partial(build, batch, VOCAB, pool, owned=True, deterministic=True),
        }
        us: dict[str, Spread] = {}
        allocs: dict[str, int] = {}
        for mode in modes:
            before = host_allocs()
            us[mode] = host_us_spread(ctx, steps[mode])
            allocs[mode] = host_allocs() - before
        rows.append(
            (
                bs,
                *(us.get(m) for m in MODES),
                ratio(us.get(base), us["pool"]),
                ratio(us.get(base), us.get("owned")),
                allocs.get("pinned") if pin else None,  # pinned allocations exist only on CUDA
                allocs.get("pool") if pin else None,
            )
        )
    stats = pool.stats()
    pool.close()
    notes = [
        f"host µs per batch build (5 fields + 4 flags): median (min-max) over {ctx.repeats} blocks of up to "
        f"{ctx.iters}; pool: {stats.copies} copies for {stats.stages} builds",
        f"{base}/pool and {base}/owned = ratios of the medians; owned = a pool stage copied into batch-owned memory",
    ]
    columns = (
        "bs",
        *(f"{m} µs" for m in MODES),
        f"{base}/pool",
        f"{base}/owned",
        "pinned allocs",
        "pool allocs",
    )
    tables = [Table.build("sampling: host µs per SamplingBatchInfo build", columns, rows, notes)]
    if "pool" in modes:
        tables.append(zero_copy_table(ctx))
    if ctx.is_cuda:  # the kernel path exists only on CUDA; on CPU the sampler is the torch reference
        tables.append(draw_table(ctx))
    return tables
