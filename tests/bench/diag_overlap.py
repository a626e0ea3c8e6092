"""Where an overlapped graph-decode step's host time goes (a diagnostic, not a test).

python3 tests/bench/diag_overlap.py > $OUT/diag_overlap.txt

The bench's host pass times each step with the device idle at its start; in the
overlapped run the pool+graph step at 64 running measured longer than both its host pass
and its GPU time. Here, per mode, the overlapped run's own phases (median µs per step),
its counted GPU waits, and then the CUDA runtime calls of the same steps (torch.profiler,
CPU side), so the phase and the call that grow show.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import structlog
import torch
from torch.profiler import ProfilerActivity, profile

from pinpool.bench.engine import graph_loop
from pinpool.bench.engine.graph_bench import CONFIGS, _requests
from pinpool.bench.engine.graph_loop import GraphConfig, GraphEngine
from pinpool.bench.engine.loop import EngineConfig
from pinpool.bench.engine.requests import accept_all

dev = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")  # cpu: a smoke run
STEPS = 100
LABELS = (
    ("pool land", "pool", True),
    ("pool rb", "pool", False),
    ("pinned", "pinned", True),
    ("sglang", "sglang", True),
)
_spent: dict[str, float] = {}


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _spent[name] = _spent.get(name, 0.0) + time.perf_counter() - start

    return run


def _sync() -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _engine(mode: str, land: bool, running: int) -> GraphEngine:
    cfg = EngineConfig(max_running=running, max_prefill_tokens=1 << 16, kv_slots=running * 160 + 1024)
    gcfg = GraphConfig(capture=dev.type == "cuda", sizes=(running,), land_tokens=land)
    return GraphEngine(CONFIGS["host-bound"], mode, dev, cfg, gcfg)  # type: ignore[arg-type]


def overlapped(label: str, mode: str, land: bool, running: int, events: bool = True) -> None:
    eng = _engine(mode, land, running)
    eng.record_gpu = events and dev.type == "cuda"
    for name in ("_admit", "_decode", "_consume", "_launch_prefill_free"):
        if hasattr(eng, name):
            setattr(eng, name, _timed(name.strip("_"), getattr(eng, name)))
    graph_loop.accept_all = _timed("accept", accept_all)
    eng.graphs.replay = _timed("graph.replay", eng.graphs.replay)  # type: ignore[method-assign]
    eng.submit(_requests(CONFIGS["host-bound"], running, STEPS))
    rows: dict[str, list[float]] = {}
    seen = 0
    while eng.busy:
        before = dict(eng.phases.by_site)
        _spent.clear()
        read_before = eng.staging.by_site.get("read", 0.0)
        waited = eng.gpu_wait_seconds()
        start = time.perf_counter()
        kind = eng.step()
        wall = time.perf_counter() - start
        if kind != "decode":
            continue
        seen += 1
        if seen <= 6 or not eng.running:
            continue
        sample = {k: v - before.get(k, 0.0) for k, v in eng.phases.by_site.items()}
        sample["read"] = eng.staging.by_site.get("read", 0.0) - read_before
        sample["waits"] = eng.gpu_wait_seconds() - waited
        sample["wall"] = wall
        sample.update(_spent)
        sample["other"] = wall - sum(sample[k] for k in ("stage", "replay", "readback", "read") if k in sample)
        for k, v in sample.items():
            rows.setdefault(k, []).append(v * 1e6)
    _sync()
    gpu = [s.elapsed_time(e) * 1e3 for s, e in eng.times.gpu_events[6:]] if eng.record_gpu else [float("nan")]
    cols = ("wall", "stage", "replay", "readback", "read", "other", "waits", "admit", "decode", "consume", "accept")
    line = "  ".join(f"{k} {statistics.median(rows[k]):7.1f}" for k in cols if k in rows)
    label += "" if eng.record_gpu else " -ev"
    print(f"{running:4d} {label:13s} {line}  gpu {statistics.median(gpu):7.1f}  steps {len(rows['wall'])}", flush=True)


def calls(label: str, mode: str, land: bool, running: int) -> None:
    eng = _engine(mode, land, running)
    eng.submit(_requests(CONFIGS["host-bound"], running, STEPS))
    for _ in range(10):
        eng.step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(40):
            eng.step()
        _sync()
    print(f"\n######## overlapped {label}, {running} running, 40 steps (CPU side)", flush=True)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=22, max_name_column_width=50), flush=True)
    while eng.busy:
        eng.step()


def cprofiled(mode: str, land: bool, running: int) -> None:
    import cProfile
    import io
    import pstats

    eng = _engine(mode, land, running)
    eng.record_gpu = dev.type == "cuda"
    eng.submit(_requests(CONFIGS["host-bound"], running, STEPS))
    for _ in range(10):
        eng.step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(60):
        eng.step()
    prof.disable()
    _sync()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(32)
    print(f"\n######## cProfile, overlapped {mode} land={land}, {running} running, 60 steps", flush=True)
    print(out.getvalue(), flush=True)
    while eng.busy:
        eng.step()


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    print("running mode       median µs per step in the overlapped run (phases of the graph loop; other = rest)")
    for running in (16, 64):
        for _ in range(2):  # two rounds, interleaved
            for label, mode, land in LABELS:
                overlapped(label, mode, land, running)
            overlapped("pool land", "pool", True, running, events=False)
            overlapped("sglang", "sglang", True, running, events=False)
    cprofiled("pool", True, 64)
    cprofiled("sglang", True, 64)
    for label, mode, land in LABELS[:2]:
        calls(label, mode, land, 64)


if __name__ == "__main__":
    main()
