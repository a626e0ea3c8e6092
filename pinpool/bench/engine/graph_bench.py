"""The graph-decode workload of ``pinpool bench``: decode replayed as CUDA graphs, per staging mode.

Three model configs with random weights (``CONFIGS``):

- ``host-bound``: a draft-sized model (hidden 128, 1 layer, 2k vocabulary, bfloat16), whose
  replayed step is short enough that the host's per-step work (schedule, stage, replay
  launch, read-back) can set the pace: small and draft models on fast GPUs;
- ``tiny``: the reference loop's model (hidden 256, 2 layers, 32k vocabulary);
- ``GPU-bound``: hidden 1024, 16 layers, where the replay outlasts the host's work.

``PINPOOL_GRAPH_CONFIGS=host-bound,tiny`` runs a subset; ``--running`` sets the sizes.

Modes: ``pinned+graph``, ``sglang+graph``, ``pool+graph`` (``engine.graph_loop``), and
the eager loop in ``pinned`` and ``pool`` (``engine.loop``) on the tiny model. Per mode:

- host µs: host time per decode step less the time it waited for the GPU (read-backs
  and ring stalls): the host's own work;
- step µs: wall time per decode step (with overlap, the slower of host and GPU);
- GPU µs: CUDA events around the step's device work on the forward stream;
- GPU idle: 1 - (GPU time / wall time) over the timed steps;
- tokens/s: running x 1e6 / step µs (steady decode);
- copies/step, H2D/step, syncs/step: a separate profiled pass of the same loop, in a child
  process after every timing (a profiled pass leaves CUPTI attached: ``run_isolated``).

Every figure is the median over decode steps after a warm-up, then median (min-max) over
rounds that interleave the modes. Token streams are compared across all modes.
"""

from __future__ import annotations

import math
import os
import statistics
import time
import warnings
from typing import Any

import attrs
import torch

from pinpool.bench.engine.graph_loop import GraphConfig, GraphEngine, GraphMode
from pinpool.bench.engine.loop import Engine, EngineConfig
from pinpool.bench.engine.model import ModelConfig, TinyDecoder
from pinpool.bench.engine.requests import Request, Workload, make_requests
from pinpool.bench.kit import BenchContext, Spread, Table, counted_or_none, ratio

WARM_STEPS = 4
CONFIGS = {
    # A draft-sized model: one layer, a 2k vocabulary, bfloat16 as served. Its replayed
    # step (model and sampler) is the shortest the graph gets, so the host's per-step work
    # decides. In float32, cuBLAS took a GEMM kernel for each of the layer's two addmm
    # products (attention out, FFN down) at 16 rows long enough that the step outlasted
    # every host step; in bfloat16 it is shorter than any (tests/bench/diag_calls.py).
    "host-bound": ModelConfig(
        hidden=128, layers=1, heads=2, ffn=256, vocab_size=2048, max_context_len=160, dtype="bfloat16"
    ),
    # The reference loop's tiny model (2 layers, hidden 256, 32k vocabulary).
    "tiny": ModelConfig(max_context_len=160),
    "GPU-bound": ModelConfig(hidden=1024, layers=16, heads=16, ffn=4096, max_context_len=160),
}
#: (config, running sizes, eager modes too): what a CUDA run measures.
PLAN: tuple[tuple[str, tuple[int, ...], bool], ...] = (
    ("host-bound", (1, 16, 64), False),
    ("tiny", (1, 16, 64), True),
    ("GPU-bound", (16, 64), False),
)
#: (label, graph mode or None for the eager loop, eager mode)
MODES: tuple[tuple[str, GraphMode | None, str], ...] = (
    ("pinned+graph", "pinned", "pinned"),
    ("sglang+graph", "sglang", "pinned"),
    ("pool+graph", "pool", "pool"),
    ("pinned eager", None, "pinned"),
    ("pool eager", None, "pool"),
)
_models: dict[tuple[ModelConfig, str], TinyDecoder] = {}


def _model(cfg: ModelConfig, device: torch.device) -> TinyDecoder:
    key = (cfg, str(device))
    if key not in _models:
        _models.clear()  # one config's weights at a time
        _models[key] = TinyDecoder(cfg, device)
    return _models[key]


def _engine(label: str, model_cfg: ModelConfig, device: torch.device, running: int) -> Engine:
    cfg = EngineConfig(max_running=running, max_prefill_tokens=1 << 16, kv_slots=running * 160 + 1024)
    _, graph_mode, eager = next(m for m in MODES if m[0] == label)
    model = _model(model_cfg, device)
    if graph_mode is None:
        return Engine(model_cfg, eager, device, cfg, model=model)  # type: ignore[arg-type]
    # Every request arrives at once and none stops early, so every step runs at ``running``:
    # only that graph is captured (capturing the other sizes changes no step's cost).
    graph_cfg = GraphConfig(capture=device.type == "cuda", sizes=(running,))
    return GraphEngine(model_cfg, graph_mode, device, cfg, graph_cfg, model=model)


def _requests(model_cfg: ModelConfig, running: int, steps: int) -> list[Request]:
    wl = Workload(num_requests=running, arrival_gap=0, new_tokens=(steps, steps), greedy_share=0.25, seed=1)
    reqs = make_requests(wl, model_cfg.vocab_size)
    for r in reqs:  # steady decode: nobody stops early
        r.sampling_params = attrs.evolve(r.sampling_params, stop_token_ids=())
    return reqs


def measure(ctx: BenchContext, label: str, model_cfg: ModelConfig, running: int, steps: int) -> dict[str, Any]:
    engine = _engine(label, model_cfg, ctx.device, running)
    engine.record_gpu = ctx.is_cuda
    ctx.synchronize()  # sync-ok: bench clock boundary, outside the timed steps
    outputs = engine.run(_requests(model_cfg, running, steps))
    ctx.synchronize()  # sync-ok: bench clock boundary, outside the timed steps
    # A short run (CI's CPU smoke) keeps every step rather than none.
    warm = WARM_STEPS if len(engine.times.decode_wall) > WARM_STEPS else 0
    walls = engine.times.decode_wall[warm:]
    waits = engine.times.decode_gpu_wait[warm:]
    step_us = statistics.median(walls) * 1e6
    overlapped_host_us = statistics.median(w - g for w, g in zip(walls, waits, strict=True)) * 1e6
    gpu_us = idle = float("nan")
    if ctx.is_cuda:
        gpu = [s.elapsed_time(e) * 1e3 for s, e in engine.times.gpu_events[warm:]]
        gpu_us = statistics.median(gpu)
        idle = max(0.0, 1.0 - sum(gpu) / (sum(walls) * 1e6))
    host_us, phases = host_pass(ctx, label, model_cfg, running, steps)
    return {
        "host_us": host_us,
        "overlapped_host_us": overlapped_host_us,
        "step_us": step_us,
        "gpu_us": gpu_us,
        "idle": idle,
        "tokens_per_s": running * 1e6 / step_us,
        "outputs": outputs,
        "phases": phases,
    }


def host_pass(
    ctx: BenchContext, label: str, model_cfg: ModelConfig, running: int, steps: int
) -> tuple[float, dict[str, float]]:
    """Host µs per decode step with the device idle at each step's start, and its phases.

    In the overlapped run a host that gets ahead blocks inside CUDA calls (a full launch
    queue, a pinned allocation), which no wait counter sees: there, wall minus counted
    waits still holds GPU time. Here each step starts after a device synchronize, so its
    wall time is the host's own work: schedule, stage, replay launch, read-back, and the
    read of the previous step's tokens (already landed).
    """
    engine = _engine(label, model_cfg, ctx.device, running)
    engine.submit(_requests(model_cfg, running, steps + WARM_STEPS + 4))
    while engine.step() != "decode" or engine.iteration < WARM_STEPS + 2:
        pass
    phases_before = dict(engine.phases.by_site) if isinstance(engine, GraphEngine) else {}
    read_before = engine.staging.by_site.get("read", 0.0)
    walls = []
    for _ in range(steps):
        ctx.synchronize()  # sync-ok: bench clock boundary, outside the timed steps
        start = time.perf_counter()
        kind = engine.step()
        walls.append(time.perf_counter() - start)
        assert kind == "decode", kind
    n = len(walls)
    phases = {}
    if isinstance(engine, GraphEngine):
        phases = {k: (v - phases_before.get(k, 0.0)) / n * 1e6 for k, v in engine.phases.by_site.items()}
    phases["read"] = (engine.staging.by_site.get("read", 0.0) - read_before) / n * 1e6
    while engine.busy:
        engine.step()
    return statistics.median(walls) * 1e6, phases


def count(device: str, label: str, config: str, running: int) -> dict[str, float]:
    """Copies, host-to-device copies and syncs per decode step, in a profiled pass of its own.

    Run through ``run_isolated`` (a child process), never beside the timings: see there.
    """
    from torch.profiler import ProfilerActivity, profile

    model_cfg = CONFIGS[config]
    engine = _engine(label, model_cfg, torch.device(device), running)
    engine.submit(_requests(model_cfg, running, 24))
    while engine.step() != "decode" or engine.iteration < WARM_STEPS + 2:
        pass
    torch.cuda.synchronize(device)  # sync-ok: bench clock boundary, outside the timed steps
    steps = 8
    waits_before = engine.reader.waits + engine.uploader.waits
    previous = torch.cuda.get_sync_debug_mode()
    with (
        warnings.catch_warnings(record=True) as caught,
        profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof,
    ):
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                kind = engine.step()
                assert kind == "decode", kind
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    implicit = sum(1 for w in caught if "synchroniz" in str(w.message))
    explicit = engine.reader.waits + engine.uploader.waits - waits_before
    events = prof.events()
    copies = sum(1 for e in events if e.name.startswith("cudaMemcpy"))
    h2d = sum(1 for e in events if "HtoD" in e.name)
    while engine.busy:
        engine.step()
    return {"copies": copies / steps, "h2d": h2d / steps, "syncs": (implicit + explicit) / steps}


def _spread(results: list[dict[str, Any]], key: str) -> Spread | None:
    values = [r[key] for r in results if not math.isnan(r[key])]
    return Spread.of(values) if values else None


def workload(ctx: BenchContext) -> list[Table]:
    cuda = ctx.is_cuda
    steps = ctx.steps or (48 if cuda else 10)
    # At most 5 rounds (--repeats): each round captures and runs every mode again. A host
    # hiccup during one round moves a median of 3 rounds; a median of 5 needs three.
    rounds = max(1, min(ctx.repeats, 5))
    plan = list(PLAN) if cuda else [("tiny", (4,), True)]
    only = os.environ.get("PINPOOL_GRAPH_CONFIGS")
    if only:
        plan = [p for p in plan if p[0] in only.split(",")]
    if ctx.running is not None:
        plan = [(name, ctx.running, eager) for name, _, eager in plan]
    timed: list[tuple[str, int, dict[str, list[dict[str, Any]]]]] = []
    for config, sizes, eager in plan:
        model_cfg = CONFIGS[config]
        labels = [m[0] for m in MODES if eager or m[1] is not None]
        ctx.progress(f"graph decode {config}: warm-up (compiles and captures outside the timings)")
        for label in labels:
            measure(ctx, label, model_cfg, min(sizes), 6)
        for running in sizes:
            per_mode: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
            for r in range(rounds):
                for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
                    ctx.progress(f"graph decode {config} running={running} {label} round {r + 1}/{rounds}")
                    per_mode[label].append(measure(ctx, label, model_cfg, running, steps))
            timed.append((config, running, per_mode))
    # Every timing is taken; the profiled counting passes run now, in a child process.
    jobs = [(str(ctx.device), label, config, running) for config, running, per_mode in timed for label in per_mode]
    if cuda:
        ctx.progress(f"graph decode: {len(jobs)} profiled counting passes in a child process")
    all_counts = counted_or_none(count, jobs) if cuda else None
    counted = iter(all_counts or [])
    tables = []
    for config, running, per_mode in timed:
        counts = {label: next(counted) for label in per_mode} if all_counts is not None else {}
        tables.append(_table(config, running, steps, rounds, per_mode, counts))
    return tables


def _table(
    config: str,
    running: int,
    steps: int,
    rounds: int,
    per_mode: dict[str, list[dict[str, Any]]],
    counts: dict[str, dict[str, float]],
) -> Table:
    rows = []
    first = next(iter(per_mode.values()))[0]["outputs"]
    same = all(r["outputs"] == first for results in per_mode.values() for r in results)
    med = {
        label: {k: statistics.median(r[k] for r in res) for k in ("host_us", "tokens_per_s")}
        for label, res in per_mode.items()
    }
    for label, results in per_mode.items():
        c = counts.get(label, {})
        rows.append(
            (
                label,
                _spread(results, "host_us"),
                _spread(results, "overlapped_host_us"),
                _spread(results, "step_us"),
                _spread(results, "gpu_us"),
                statistics.median(r["idle"] for r in results) if not math.isnan(results[0]["idle"]) else None,
                _spread(results, "tokens_per_s"),
                c.get("copies"),
                c.get("h2d"),
                c.get("syncs"),
            )
        )
    notes = [
        f"{config} model ({CONFIGS[config].hidden} hidden, {CONFIGS[config].layers} layers), {running} running, "
        f"{steps} new tokens each, seeded sampling; median over decode steps after {WARM_STEPS} warm-up steps, "
        f"then median (min-max) over {rounds} interleaved rounds; token streams identical across all modes and "
        f"rounds: {same}",
    ]
    pool = med["pool+graph"]
    for peer in ("pinned+graph", "sglang+graph"):
        notes.append(
            f"pool+graph vs {peer}: tokens/s {ratio(pool['tokens_per_s'], med[peer]['tokens_per_s']):.2f}x, "
            f"host µs {ratio(pool['host_us'], med[peer]['host_us']):.2f}x (medians)"
        )
    phase_line = []
    for label, results in per_mode.items():
        phases = results[0]["phases"]
        if phases:
            keys = sorted(set().union(*(r["phases"] for r in results)))
            phase_line.append(
                label
                + ": "
                + ", ".join(f"{k} {statistics.median(r['phases'].get(k, 0.0) for r in results):.1f}" for k in keys)
            )
    notes.append(
        "host µs = one decode step's host work (schedule, stage, replay launch, read-back, reading the previous "
        "step's tokens) timed with the device idle at its start; host µs (overlapped) = wall minus counted GPU "
        "waits in the timed run, which still holds blocking inside CUDA calls when the GPU is the bottleneck"
    )
    notes.append("host µs by phase (mean per step of the host pass, median over rounds): " + "; ".join(phase_line))
    columns = (
        "mode",
        "host µs",
        "host µs (overlapped)",
        "step µs",
        "GPU µs",
        "GPU idle",
        "tokens/s",
        "copies/step",
        "H2D/step",
        "syncs/step",
    )
    return Table.build(f"graph decode: {config}, {running} running", columns, rows, notes)
