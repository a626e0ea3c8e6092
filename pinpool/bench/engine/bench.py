"""The decode-loop workload of ``pinpool bench``: the reference engine in every mode.

``pool-zc`` (the decode exchange in a zero-copy stage) runs on CUDA only, where the pool's
platform check passed; a table note says when it was skipped and why.

Per mode: host µs per decode step (median iteration wall time in steady decode), GPU-idle
share (CUDA events around each step's device work), tokens/s, and, from a separate
counting pass of the same steps (in a child process, after every timing: ``run_isolated``),
syncs, copies and pinned allocations per decode step.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from typing import Any

import attrs
import torch

from pinpool import PinnedRingBuffer, PoolSettings
from pinpool.bench.engine.loop import Engine, EngineConfig
from pinpool.bench.engine.model import ModelConfig
from pinpool.bench.engine.requests import Request, Workload, make_requests
from pinpool.bench.engine.uploader import MODES, Mode
from pinpool.bench.kit import BenchContext, Spread, Table, counted_or_none, host_allocs, ratio

WARM_STEPS = 3


def sleep_cycles_per_us(device: torch.device) -> float:
    """Calibrate torch.cuda._sleep: cycles per GPU µs on this device, right now."""
    torch.cuda._sleep(1_000_000)  # warm the clocks
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()  # sync-ok: calibration, before any timed work
    return 20_000_000 / (start.elapsed_time(end) * 1e3)


#: A bench label beside the engine's modes: ``pool`` with its tokens read back by a copy
#: (``EngineConfig(land_tokens=False)``), the A/B for the sampler's landing.
READ_BACK = "pool-rb"


def _engine(mode: str, device: torch.device, running: int, gpu_work_us: float, cycles: float) -> Engine:
    # With simulated GPU work the model is SleepModel: the step is GPU-bound by construction
    # and what remains on top of the GPU time is the loop's own overhead.
    cfg = EngineConfig(
        land_tokens=mode != READ_BACK,
        max_running=running,
        max_prefill_tokens=1 << 16,
        kv_slots=running * 160 + 1024,
        simulated_model=gpu_work_us > 0,
        gpu_work_us=gpu_work_us,
        sleep_cycles_per_us=cycles,
    )
    engine_mode: Mode = "pool" if mode == READ_BACK else mode  # type: ignore[assignment]
    return Engine(ModelConfig(max_context_len=160), engine_mode, device, cfg)


def _requests(running: int, steps: int, seed: int) -> list[Request]:
    wl = Workload(num_requests=running, arrival_gap=0, new_tokens=(steps, steps), greedy_share=0.25, seed=seed)
    reqs = make_requests(wl, ModelConfig().vocab_size)
    for r in reqs:  # steady decode: nobody stops early
        r.sampling_params = attrs.evolve(r.sampling_params, stop_token_ids=())
    return reqs


def measure(
    ctx: BenchContext, mode: str, running: int, steps: int, gpu_work_us: float, cycles: float
) -> dict[str, Any]:
    cuda = ctx.is_cuda
    engine = _engine(mode, ctx.device, running, gpu_work_us, cycles)
    engine.record_gpu = cuda
    reqs = _requests(running, steps, seed=1)
    start = time.perf_counter()
    outputs = engine.run(reqs)
    ctx.synchronize()
    wall = time.perf_counter() - start
    decode = engine.times.decode_wall[WARM_STEPS:]
    host_us = statistics.median(decode) * 1e6 if decode else float("nan")
    staging = engine.times.decode_staging[WARM_STEPS:]
    waits = engine.times.decode_gpu_wait[WARM_STEPS:]
    staging_us = (
        statistics.median([s - w for s, w in zip(staging, waits, strict=True)]) * 1e6 if staging else float("nan")
    )
    wait_us = statistics.median(waits) * 1e6 if waits else float("nan")
    idle = float("nan")
    gpu_us = float("nan")
    if cuda and decode:
        gpu = [s.elapsed_time(e) * 1e3 for s, e in engine.times.gpu_events[WARM_STEPS:]]
        gpu_us = statistics.median(gpu)
        idle = max(0.0, 1.0 - sum(gpu) / (sum(decode) * 1e6))
    return {
        "host_us": host_us,
        "staging_us": staging_us,
        "wait_us": wait_us,
        "gpu_us": gpu_us,
        "idle": idle,
        "tokens_per_s": sum(len(v) for v in outputs.values()) / wall,
        "outputs": outputs,
    }


def count(device: str, mode: str, running: int, gpu_work_us: float, cycles: float) -> dict[str, float]:
    """Syncs, copies and pinned allocations per decode step, in a profiled pass of its own.

    Run through ``run_isolated`` (a child process) after every timing: a profiled pass
    leaves CUPTI attached to its process (see there).
    """
    from torch.profiler import ProfilerActivity, profile

    engine = _engine(mode, torch.device(device), running, gpu_work_us, cycles)
    engine.submit(_requests(running, 24, seed=2))
    while engine.step() != "decode" or engine.iteration < WARM_STEPS + 2:
        pass
    torch.cuda.synchronize(device)  # sync-ok: bench clock boundary, outside the counted steps
    steps = 8
    waits_before = engine.reader.waits + engine.uploader.waits
    allocs_before = host_allocs()
    previous = torch.cuda.get_sync_debug_mode()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]  # CUDA: runtime calls such as cudaMemcpyAsync
    with warnings.catch_warnings(record=True) as caught, profile(activities=activities) as prof:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                assert engine.step() == "decode"
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    implicit = sum(1 for w in caught if "synchroniz" in str(w.message))
    explicit = engine.reader.waits + engine.uploader.waits - waits_before
    copies = sum(1 for e in prof.events() if e.name.startswith("cudaMemcpy"))
    while engine.busy:
        engine.step()
    return {
        "syncs": (implicit + explicit) / steps,
        "copies": copies / steps,
        "pinned_allocs": (host_allocs() - allocs_before) / steps,
    }


def zero_copy_refusal(device: torch.device) -> str | None:
    """Why zero-copy stages are refused on ``device`` (the pool's start-up check), or None when they work."""
    pool = PinnedRingBuffer(PoolSettings.from_env(device=device, num_slots=2, slot_bytes=4096, zero_copy=True))
    pool.close()
    return None if pool.platform.zero_copy_ok else pool.platform.reason


def _modes(ctx: BenchContext) -> tuple[list[str], str | None]:
    """The modes to run, and a note on pool-zc: it runs on CUDA with ``pool``, where zero-copy passed its check.

    With ``pool``, ``pool-rb`` runs too: the same mode with its tokens read back by a copy.
    """
    modes: list[str] = [m for m in MODES if m in ctx.modes]
    if "pool" not in modes:
        return modes, None
    modes.append(READ_BACK)
    if not ctx.is_cuda:
        return (
            modes,
            "pool-zc (the decode exchange in a zero-copy stage) runs on CUDA only: a CPU pool copies plain memory",
        )
    refusal = zero_copy_refusal(ctx.device)
    if refusal is not None:
        return modes, f"pool-zc skipped: the platform check refused zero-copy stages here ({refusal})"
    modes.append("pool-zc")
    return modes, (
        "pool-zc = pool with the decode step's exchange (rows and positions up, tokens back) in a zero-copy "
        "stage: no upload copy; the req_to_token write, the forward and the sampler read rows/positions in the "
        "pinned slot over PCIe, launched before the stage closes"
    )


SPREAD_KEYS = ("host_us", "staging_us", "wait_us", "gpu_us", "tokens_per_s")


def _combine(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's spread over the rounds (the counting pass is added by the caller)."""
    first = results[0]
    if any(r["outputs"] != first["outputs"] for r in results):
        raise AssertionError("a mode's token streams changed between rounds of the same workload")
    out = dict(first)
    for key in SPREAD_KEYS:
        values = [r[key] for r in results if not math.isnan(r[key])]
        out[key] = Spread.of(values) if values else None
    for key in ("idle",):
        values = [r[key] for r in results if not math.isnan(r[key])]
        out[key] = statistics.median(values) if values else None
    return out


def workload(ctx: BenchContext) -> list[Table]:
    cuda = ctx.is_cuda
    sizes = ctx.running or ((64, 256) if cuda else (8,))
    steps = ctx.steps or (32 if cuda else 12)
    modes, zero_copy_note = _modes(ctx)
    cycles = sleep_cycles_per_us(ctx.device) if cuda else 0.0
    tables = []
    # 1 ms of GPU work is the setting; 3 ms also clears the eager sampler's ~1 ms of
    # host launches, so that row is GPU-bound beyond doubt.
    runs = [(running, 0.0) for running in sizes] + ([(sizes[0], 1000.0), (sizes[0], 3000.0)] if cuda else [])
    ctx.progress("decode loop warm-up (kernels compile once, outside the timings)")
    for mode in modes:
        measure(ctx, mode, min(sizes), 6, 0.0, cycles)
    rounds = max(1, ctx.repeats)
    timed = []
    for running, work in runs:
        per_mode: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        # Modes interleave over rounds (order rotated each round), so a drift of the host
        # during the run lands on every mode alike.
        for r in range(rounds):
            for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                ctx.progress(f"decode loop running={running} gpu_work={work:.0f}us mode={mode} round={r + 1}/{rounds}")
                per_mode[mode].append(measure(ctx, mode, running, steps, work, cycles))
        timed.append((running, work, per_mode))
    # Every timing is taken; the profiled counting passes run now, in a child process.
    jobs = [(str(ctx.device), mode, running, work, cycles) for running, work, _ in timed for mode in modes]
    if cuda:
        ctx.progress(f"decode loop: {len(jobs)} profiled counting passes in a child process")
    counts = counted_or_none(count, jobs) if cuda else None
    counted = iter(counts or [])
    for running, work, per_mode in timed:
        rows = []
        streams: dict[str, Any] = {}
        combined = {mode: _combine(per_mode[mode]) for mode in modes}
        if counts is not None:
            for mode in modes:
                combined[mode].update(next(counted))
        for mode, m in combined.items():
            streams[mode] = m["outputs"]
            rows.append(
                (
                    mode,
                    m["host_us"],
                    m["staging_us"],
                    m["wait_us"],
                    m["gpu_us"],
                    ratio(m["host_us"], m["gpu_us"]),
                    m["idle"],
                    m["tokens_per_s"],
                    m.get("syncs"),  # the counting pass runs on CUDA only: None leaves the column out
                    m.get("copies"),
                    m.get("pinned_allocs"),
                )
            )
        same = all(streams[m] == streams[modes[0]] for m in modes)
        notes = [
            f"{running} running requests, {steps} new tokens each, seeded sampling; each figure: the median over "
            f"decode steps after {WARM_STEPS} warm-up steps, then median (min-max) over {rounds} interleaved rounds "
            f"per mode; token streams identical across modes: {same}",
            "staging µs = host time moving metadata (uploads, batch builds, filters, token read-back) per decode "
            "step, less GPU-wait µs (ring stalls, event waits and reads that blocked on the GPU; sync mode's waits "
            "inside torch.tensor cannot be split out)",
        ]
        if "pinned" in combined and "pool" in combined:
            share = ratio(combined["pool"]["staging_us"], combined["pinned"]["staging_us"])
            if share is not None:
                notes[1] += f"; pool / pinned staging = {share:.2f} (medians)"
        if READ_BACK in combined:
            notes.append(
                "pool stages each decode step through one layout declared at start (pool.stage(layout, rows=bs): "
                "rows and positions up in one copy, the tokens landed in the slot by the sampler's draw kernel); "
                "pool-rb is the same mode with a "
                "read-back copy instead of the landing"
            )
            share = ratio(combined["pool"]["staging_us"], combined[READ_BACK]["staging_us"])
            if share is not None:
                notes[-1] += f"; pool / pool-rb staging = {share:.2f} (medians)"
        if zero_copy_note is not None:
            notes.append(zero_copy_note)
            if "pool-zc" in combined:
                share = ratio(combined["pool"]["staging_us"], combined["pool-zc"]["staging_us"])
                if share is not None:
                    notes[-1] += f"; pool / pool-zc staging = {share:.2f} (medians)"
        if work:
            notes.append(
                f"GPU-bound: the model is replaced by {work:.0f} µs of GPU sleep per step (torch.cuda._sleep, "
                f"{cycles:.0f} cycles/µs) plus the sampler; step/GPU is the loop's overhead on top of the GPU time"
            )
        elif cuda:
            notes.append(
                "tiny model in eager PyTorch: its ~80 kernel launches per step, not staging, set the step time; "
                "GPU µs spans the step's launches, so when the host is the bottleneck step/GPU is near 1"
            )
        title = f"decode loop: {running} running" + (f", {work:.0f} µs GPU work per step" if work else "")
        columns = (
            "mode",
            "step µs",
            "staging µs",
            "GPU-wait µs",
            "GPU µs",
            "step/GPU",
            "GPU idle",
            "tokens/s",
            "syncs/step",
            "copies/step",
            "pinned allocs/step",
        )
        tables.append(Table.build(title, columns, rows, notes))
    return tables
