"""The ``serve`` workload of ``pinpool bench``: continuous batching under request churn, per staging mode.

A seeded trace (``engine.trace``: Poisson arrivals counted in loop iterations, lognormal
prompts, Pareto outputs) is served by ``engine.serve.ServeEngine`` in four modes:
``pinned+graph``, ``sglang+graph``, ``vllm+graph`` and ``pool+graph``. Configs (``CONFIGS``):

- ``host-bound``: the draft-sized model of ``decode_graph`` (hidden 128, 1 layer, 2k vocabulary);
- ``GPU-bound``: a 0.6B-shaped model (hidden 1024, 28 layers, 152k vocabulary, float32).

Loads (``LOADS``): three arrival rates at 256 running, light to saturating, and a
1024-running saturating load for the host-bound config (its KV cache is small). On CPU
every config is replaced by tiny shapes and a short trace (``CPU_MODEL``): the CI smoke.

One table per (config, load), a row per mode; ``x pool tok/s`` is pool+graph's output
tok/s over the row's (the summary's headline). Latencies come from each iteration's host
clock (``engine.serve``); figures are per round, then median (min-max) over rounds that
interleave the modes, each round on engines built and captured once per config. Columns:
``host µs/step`` is the median launching iteration's host time less its counted GPU
waits (a host blocked inside a CUDA call, a full launch queue, still counts as host time);
``GPU idle`` is 1 - (CUDA-event time of prefills and replays) / wall; ``H2D copies/step`` and
``H2D bytes/step`` come from a profiled pass in a child process (UVA reads are not copies
and are not counted). Knobs: ``PINPOOL_SERVE_CONFIGS=host-bound`` runs a subset,
``PINPOOL_SERVE_LOADS=light,saturating`` too, ``PINPOOL_SERVE_REQUESTS`` sets requests per
256-running trace (the 1024 load takes four times as many), ``PINPOOL_SERVE_DTYPE`` the
model's dtype, ``PINPOOL_SERVE_COUNTS=0`` leaves out the counting passes.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from typing import Any

import attrs
import numpy as np
import torch

from pinpool.bench.engine.graph import DEFAULT_SIZES
from pinpool.bench.engine.graph_bench import CONFIGS as GRAPH_CONFIGS
from pinpool.bench.engine.graph_loop import GraphConfig
from pinpool.bench.engine.loop import EngineConfig
from pinpool.bench.engine.model import ModelConfig, TinyDecoder
from pinpool.bench.engine.requests import Request
from pinpool.bench.engine.serve import PHASES, SERVE_MODES, ServeEngine, ServeMode, ServeRun
from pinpool.bench.engine.trace import TraceConfig, make_trace
from pinpool.bench.kit import BenchContext, Spread, Table, counted_or_none, ratio

CONFIGS = {
    "host-bound": GRAPH_CONFIGS["host-bound"],
    # float32: in bfloat16 this model's streams differed between rounds of every mode, pinned+graph's
    # too (a rounding difference flips a 152k-way argmax; the staging is not involved), and the
    # token check is the bench's proof that the modes compute the same thing.
    "GPU-bound": ModelConfig(
        hidden=1024, layers=28, heads=16, ffn=3072, vocab_size=151_936, max_context_len=160, dtype="float32"
    ),
}
#: Every config on CPU: the CI smoke runs the loop, not the model.
CPU_MODEL = ModelConfig(hidden=32, layers=1, heads=2, ffn=64, vocab_size=256, max_context_len=40)


@attrs.frozen
class Load:
    name: str
    rate: float  # mean arrivals per loop iteration
    max_running: int
    configs: tuple[str, ...] = ("host-bound", "GPU-bound")


#: A request lives about 1.5x its output length in iterations (prefills take every third),
#: about 27 iterations at the trace's lengths: 0.5 arrivals per iteration keeps about 14
#: running, 3 about 80, 16 asks for about 430 and queues at 256.
LOADS = (
    Load("light", 0.5, 256),
    Load("medium", 3.0, 256),
    Load("saturating", 16.0, 256),
    Load("saturating-1024", 64.0, 1024, ("host-bound",)),
)
LABELS: dict[ServeMode, str] = {m: f"{m}+graph" for m in SERVE_MODES}
_SIZES_1024 = (*DEFAULT_SIZES, 320, 384, 448, 512, 640, 768, 896)


def trace_config(model_cfg: ModelConfig, load: Load, num_requests: int, seed: int = 0) -> TraceConfig:
    """The trace of a load, its lengths scaled down to fit a small (CPU) context."""
    if model_cfg.max_context_len >= 160:
        return TraceConfig(num_requests=num_requests, rate=load.rate, max_context_len=160, seed=seed)
    ctx = model_cfg.max_context_len
    return TraceConfig(
        num_requests=num_requests,
        rate=load.rate,
        prompt_median=6,
        prompt_bounds=(2, ctx // 2),
        output_min=2,
        output_cap=ctx // 3,
        max_context_len=ctx,
        seed=seed,
    )


def build(
    model_cfg: ModelConfig,
    mode: ServeMode,
    device: torch.device,
    max_running: int,
    model: Any,
    capture: bool | None = None,
) -> ServeEngine:
    """The bench's engine for one mode; ``capture=False``: the same padded steps as plain calls (None: on CUDA)."""
    cfg = EngineConfig(
        max_running=max_running,
        max_prefill_tokens=1 << 14,
        kv_slots=max_running * model_cfg.max_context_len + 4096,
    )
    capture = device.type == "cuda" if capture is None else capture
    graph_cfg = GraphConfig(capture=capture, sizes=_SIZES_1024 if max_running > 256 else DEFAULT_SIZES)
    return ServeEngine(model_cfg, mode, device, cfg, graph_cfg, model=model)


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


def figures(run: ServeRun, num_requests: int) -> dict[str, Any]:
    """One round's row: rates, latency percentiles (ms), host µs, GPU idle."""
    return {
        "tok_s": run.output_tokens / run.elapsed,
        "req_s": num_requests / run.elapsed,
        "ttft50": _pct(run.ttft, 50),
        "ttft99": _pct(run.ttft, 99),
        "tpot50": _pct(run.tpot, 50),
        "tpot99": _pct(run.tpot, 99),
        "itl99": _pct(run.itl, 99),
        "host_us": statistics.median(run.host) * 1e6,
        "idle": max(0.0, 1.0 - run.gpu_busy / run.elapsed) if run.gpu_busy is not None else float("nan"),
        "phases": {k: v * 1e6 for k, v in run.phases.items()},
        "outputs": run.outputs,
    }


def count(device: str, config: str, mode: ServeMode, load: Load, num_requests: int) -> dict[str, float]:
    """H2D copies and bytes per iteration, from a profiled serve of a short trace (run in a child process)."""
    from torch.profiler import ProfilerActivity, profile

    model_cfg = CONFIGS[config]
    dev = torch.device(device)
    engine = build(model_cfg, mode, dev, load.max_running, TinyDecoder(model_cfg, dev))
    trace = make_trace(trace_config(model_cfg, load, num_requests, seed=7), model_cfg.vocab_size)
    engine.serve(trace)  # warm: compiles and allocator blocks outside the profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # the copies are CUDA events: no CPU op trace
        run = engine.serve(trace)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    h2d = [e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    nbytes = sum(int(e.get("args", {}).get("bytes", 0)) for e in h2d)
    return {"copies": len(h2d) / run.iterations, "bytes": nbytes / run.iterations}


def _only(env: str, names: list[str]) -> list[str]:
    """``names``, or those of them listed in ``env`` (comma-separated) when it is set."""
    chosen = os.environ.get(env)
    return [n for n in names if n in chosen.split(",")] if chosen else names


def _plan(ctx: BenchContext) -> tuple[list[str], list[Load], int]:
    configs = _only("PINPOOL_SERVE_CONFIGS", list(CONFIGS))
    names = _only("PINPOOL_SERVE_LOADS", [ld.name for ld in LOADS])
    loads = [ld for ld in LOADS if ld.name in names]
    requests = int(os.environ.get("PINPOOL_SERVE_REQUESTS", "0")) or (1024 if ctx.is_cuda else 32)
    if not ctx.is_cuda:
        # The CI smoke: the tiny model, one config, a light and a saturating load.
        running = ctx.running[0] if ctx.running else 4
        configs = configs[:1]
        loads = [Load(ld.name, ld.rate / 4, running) for ld in loads if ld.name in ("light", "saturating")]
    return configs, loads, requests


def workload(ctx: BenchContext) -> list[Table]:
    configs, loads, requests = _plan(ctx)
    # At least 3 rounds on a GPU, at most 5 (--repeats): each round serves every trace in every mode.
    rounds = max(3, min(ctx.repeats, 5)) if ctx.is_cuda else 1
    tables = []
    for config in configs:
        model_cfg = CONFIGS[config] if ctx.is_cuda else CPU_MODEL
        if os.environ.get("PINPOOL_SERVE_DTYPE"):  # e.g. float32: is a difference in the streams rounding?
            model_cfg = attrs.evolve(model_cfg, dtype=os.environ["PINPOOL_SERVE_DTYPE"])
        model = TinyDecoder(model_cfg, ctx.device)
        for max_running in sorted({ld.max_running for ld in loads if config in ld.configs}):
            mine = [ld for ld in loads if ld.max_running == max_running and config in ld.configs]
            tables += _serve_config(ctx, config, model_cfg, model, max_running, mine, requests, rounds)
    return tables


def _serve_config(
    ctx: BenchContext,
    config: str,
    model_cfg: ModelConfig,
    model: TinyDecoder,
    max_running: int,
    loads: list[Load],
    requests: int,
    rounds: int,
) -> list[Table]:
    """Every load at one running maximum, on one engine per mode built and captured once (freed on return)."""
    ctx.progress(f"serve {config}: building and capturing {len(SERVE_MODES)} engines at {max_running} running")
    engines = {m: build(model_cfg, m, ctx.device, max_running, model) for m in SERVE_MODES}
    for engine in engines.values():
        engine.record_gpu = ctx.is_cuda
    tables = []
    for load in loads:
        n = requests * max(1, max_running // 256)
        trace = make_trace(trace_config(model_cfg, load, n), model_cfg.vocab_size)
        # Each engine serves the trace once untimed: every prefill shape and graph size it will
        # meet runs first outside the timings (Triton compiles, cuBLAS picks, the allocator
        # grows), so the mode that opens round 1 pays no first-time cost.
        ctx.progress(f"serve {config}, {load.name}: warming every mode on the trace ({n} requests)")
        for engine in engines.values():
            engine.serve(trace)
        per_mode = _rounds(ctx, config, load, engines, trace, rounds)
        # A short trace: the profile counts per iteration, and a 28-layer model's trace is large.
        counts = _counts(ctx, config, load, min(n, 128 if config == "host-bound" else 32))
        source = engines["vllm"].source_note or ""
        tables.append(_table(config, load, model_cfg, n, rounds, per_mode, counts, source))
    return tables


def _rounds(
    ctx: BenchContext, config: str, load: Load, engines: dict[ServeMode, ServeEngine], trace: list[Request], rounds: int
) -> dict[ServeMode, list[dict[str, Any]]]:
    per_mode: dict[ServeMode, list[dict[str, Any]]] = {m: [] for m in engines}
    modes = list(engines)
    for r in range(rounds):
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
            ctx.progress(f"serve {config}, {load.name}: {LABELS[mode]} round {r + 1}/{rounds}")
            ctx.synchronize()  # sync-ok: bench clock boundary, outside the served trace
            per_mode[mode].append(figures(engines[mode].serve(trace), len(trace)))
    return per_mode


def _counts(ctx: BenchContext, config: str, load: Load, n: int) -> dict[ServeMode, dict[str, float]]:
    if not ctx.is_cuda or os.environ.get("PINPOOL_SERVE_COUNTS") == "0":
        return {}
    jobs = [(str(ctx.device), config, m, load, n) for m in SERVE_MODES]
    counted = counted_or_none(count, jobs)
    return dict(zip(SERVE_MODES, counted, strict=True)) if counted is not None else {}


def _differences(per_mode: dict[ServeMode, list[dict[str, Any]]], first: dict[int, list[int]]) -> str:
    """Which rounds' streams differ from pinned+graph's first round: requests differing, the first one and where."""
    said = []
    for mode, results in per_mode.items():
        for r, result in enumerate(results):
            outputs = result["outputs"]
            bad = sorted(rid for rid in first if outputs.get(rid) != first[rid])
            if bad:
                a, b = first[bad[0]], outputs.get(bad[0], [])
                at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                said.append(f"{LABELS[mode]} round {r + 1}: {len(bad)} requests, first {bad[0]} at token {at}")
    return "; ".join(said) or "the same requests, other keys"


def _spread(results: list[dict[str, Any]], key: str) -> Spread | None:
    values = [r[key] for r in results if np.isfinite(r[key])]
    return Spread.of(values) if values else None


COLUMNS = (
    "mode",
    "output tok/s",
    "request/s",
    "x pool tok/s",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "TPOT p50 ms",
    "TPOT p99 ms",
    "ITL p99 ms",
    "host µs/step",
    "GPU idle",
    "H2D copies/step",
    "H2D bytes/step",
)
_RATES = ("tok_s", "req_s")
_LATENCIES = ("ttft50", "ttft99", "tpot50", "tpot99", "itl99", "host_us")


def _table(
    config: str,
    load: Load,
    model_cfg: ModelConfig,
    n: int,
    rounds: int,
    per_mode: dict[ServeMode, list[dict[str, Any]]],
    counts: dict[ServeMode, dict[str, float]],
    source: str,
) -> Table:
    first = per_mode["pinned"][0]["outputs"]
    identical = all(r["outputs"] == first for results in per_mode.values() for r in results)
    same = "True" if identical else f"False ({_differences(per_mode, first)})"
    med = {m: {k: statistics.median(r[k] for r in res) for k in ("tok_s", "tpot99")} for m, res in per_mode.items()}
    pool = med["pool"]
    rows = []
    for mode, results in per_mode.items():
        idle = [r["idle"] for r in results if np.isfinite(r["idle"])]
        c = counts.get(mode, {})
        rows.append(
            (
                LABELS[mode],
                *(_spread(results, k) for k in _RATES),
                ratio(pool["tok_s"], med[mode]["tok_s"]),
                *(_spread(results, k) for k in _LATENCIES),
                statistics.median(idle) if idle else None,
                c.get("copies"),
                c.get("bytes"),
            )
        )
    tokens = sum(len(t) for t in first.values())
    notes = [
        f"{config} model ({model_cfg.hidden} hidden, {model_cfg.layers} layers, {model_cfg.vocab_size} vocabulary), "
        f"{n} requests arriving at {load.rate:g} per iteration (Poisson), {tokens} output tokens, at most "
        f"{load.max_running} running; per round, then median (min-max) over {rounds} interleaved rounds; token "
        f"streams identical across all modes and rounds: {same}",
        f"vllm+graph: {source}",
        "x pool tok/s = pool+graph's output tok/s over the row's (medians); host µs/step = the median launching "
        "iteration's host time less its counted GPU waits",
    ]
    for peer in ("pinned", "sglang", "vllm"):
        notes.append(
            f"pool+graph vs {LABELS[peer]}: output tok/s {_x(ratio(pool['tok_s'], med[peer]['tok_s']))}, "
            f"TPOT p99 {_x(ratio(pool['tpot99'], med[peer]['tpot99']))} (medians)"
        )
    split = [
        f"{LABELS[m]}: " + ", ".join(f"{k} {statistics.median(r['phases'][k] for r in res):.1f}" for k in PHASES)
        for m, res in per_mode.items()
    ]
    notes.append(
        "host µs per iteration by phase (schedule = admission, prefill launch and token bookkeeping; read = "
        "read-back launch and reading the tokens), median over rounds: " + "; ".join(split)
    )
    return Table.build(f"serve: {config}, {load.name}", COLUMNS, rows, notes)


def _x(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"
