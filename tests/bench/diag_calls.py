"""Where a decode step's host and device time goes, by CUDA call and by kernel (a diagnostic, not a test).

python3 tests/bench/diag_calls.py > $OUT/diag_calls.txt

- host: torch.profiler's CPU-side table (CUDA runtime calls and Python-visible ops) over
  decode steps of the eager loop (pool, pinned) and of the graph loop (pool, pinned);
- kernels: the device time of each kernel of the host-bound config's padded step, run as
  plain calls (the eager twin: the same kernels a capture records), per running size and
  model dtype, and the replayed step's GPU µs per dtype.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import attrs
import structlog
import torch
from torch.profiler import ProfilerActivity, profile

from engine.graph_bench import CONFIGS, _requests
from engine.graph_loop import GraphConfig, GraphEngine
from engine.loop import Engine, EngineConfig
from engine.model import ModelConfig

dev = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")  # cpu: a smoke run of the script


def _table(label: str, fn: Callable[[], object], steps: int, sort: str, rows: int = 18) -> None:
    for _ in range(6):
        fn()
    _sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        _sync()
    print(f"\n######## {label} ({steps} steps), sorted by {sort}", flush=True)
    print(prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=60), flush=True)


def _sync() -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _decoding(eng: Engine, bs: int, mc: ModelConfig) -> Engine:
    eng.submit(_requests(mc, bs, 150))
    while eng.step() != "decode":
        pass
    for _ in range(4):
        eng.step()
    return eng


def host_tables() -> None:
    tiny = CONFIGS["tiny"]
    for bs in (64, 256):
        for mode in ("pool", "pinned"):
            eng = _decoding(Engine(tiny, mode, dev, EngineConfig(max_running=bs, kv_slots=1 << 17)), bs, tiny)
            _table(f"eager {mode} bs {bs}", eng.step, 40, "self_cpu_time_total")
    hb = CONFIGS["host-bound"]
    for bs in (16,):
        for mode in ("pool", "pinned"):
            eng = _decoding(
                GraphEngine(hb, mode, dev, EngineConfig(max_running=bs, kv_slots=1 << 16), GraphConfig(sizes=(bs,))),
                bs,
                hb,
            )
            _table(f"graph {mode} bs {bs}", eng.step, 60, "self_cpu_time_total")


def kernel_tables() -> None:
    sys.argv = sys.argv[:1]  # graph_profile runs what its argv names at import
    from graph_profile import gpu_split  # type: ignore[import-not-found]

    if dev.type != "cuda":
        gpu_split = lambda mc, bs: None  # noqa: E731
    hb = CONFIGS["host-bound"]
    for dtype in ("float32", "bfloat16"):
        mc = attrs.evolve(hb, dtype=dtype)
        for bs in (1, 16, 64):
            gpu_split(mc, bs)
            eng = _decoding(
                GraphEngine(
                    mc,
                    "pool",
                    dev,
                    EngineConfig(max_running=bs, kv_slots=1 << 16),
                    GraphConfig(capture=False, sizes=(bs,)),
                ),
                bs,
                mc,
            )
            _table(f"kernels host-bound {dtype} bs {bs} (plain calls)", eng.step, 20, "self_device_time_total", rows=14)
    torch.backends.cuda.matmul.allow_tf32 = True
    print("TF32 matmuls on:", flush=True)
    for bs in (1, 16, 64):
        gpu_split(hb, bs)
    torch.backends.cuda.matmul.allow_tf32 = False


if __name__ == "__main__":
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    what = sys.argv[1:] or ["kernels", "host"]  # read before kernel_tables clears argv
    if "kernels" in what:
        kernel_tables()
    if "host" in what:
        host_tables()
