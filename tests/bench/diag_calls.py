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

from pinpool.bench.engine.graph_bench import CONFIGS, _requests
from pinpool.bench.engine.graph_loop import GraphConfig, GraphEngine
from pinpool.bench.engine.loop import Engine, EngineConfig
from pinpool.bench.engine.model import ModelConfig

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


def _median_us(fn: Callable[[], object], n: int = 200) -> float:
    import statistics
    import time

    times = []
    for _ in range(n):
        _sync()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
    _sync()
    return statistics.median(times)


def replay_costs() -> None:
    """Host µs of one replay per padded size (device idle before each), its graph's node count,
    and the host µs of each piece of the pool mode's stage, read-back and close."""
    import os
    import tempfile

    from pinpool.cuda import use_stream

    hb = CONFIGS["host-bound"]
    for bs in (1, 4, 16, 64):
        eng = GraphEngine(hb, "pool", dev, EngineConfig(max_running=bs, kv_slots=1 << 16), GraphConfig(sizes=(bs,)))
        rows = eng.graphs.padded(bs)
        nodes = -1
        if dev.type == "cuda":
            graph = eng.graphs._graphs[rows]
            with use_stream(eng.forward_stream):
                replay_us = _median_us(graph.replay)
            g2 = torch.cuda.CUDAGraph()
            g2.enable_debug_mode()
            s = eng.forward_stream
            with torch.cuda.graph(g2, stream=s):
                eng.graphs.body(rows)
            path = os.path.join(tempfile.mkdtemp(), "g.dot")
            g2.debug_dump(path)
            text = open(path).read() if os.path.exists(path) else ""  # noqa: SIM115
            nodes = sum(1 for line in text.splitlines() if "label=" in line and "->" not in line)
            kinds: dict[str, int] = {}
            for word in ("KERNEL", "MEMSET", "MEMCPY", "HOST", "GRAPH", "EVENT"):
                kinds[word] = text.count(f"{word}\\n") + text.count(f'"{word}')
            print(f"bs {bs}: replay host {replay_us:.1f} us, graph nodes ~{nodes} {kinds}", flush=True)
        eng.submit(_requests(hb, bs, 100))
        while eng.step() != "decode":
            pass
        for _ in range(3):
            eng.step()
        reqs = eng.running
        block = eng.graphs.block
        batch = eng._batch
        pieces: dict[str, list[float]] = {}
        import time

        with use_stream(eng.forward_stream):
            for _ in range(100):
                _sync()
                t0 = time.perf_counter()
                st = block.stage(rows, bs, stream=eng.upload_stream)
                t1 = time.perf_counter()
                st.put_image(batch.image)
                t2 = time.perf_counter()
                landing = st.landing("token_dst") if eng.land_tokens else None  # addresses written at open
                t3 = time.perf_counter()
                st.flush()
                t4 = time.perf_counter()
                st.close()
                t5 = time.perf_counter()
                spans = (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)
                for k, v in zip(("stage", "put_image", "landing", "flush", "close"), spans, strict=True):
                    pieces.setdefault(k, []).append(v * 1e6)
                assert landing is None or landing.armed
        import statistics

        medians = {k: round(statistics.median(v), 1) for k, v in pieces.items()}
        print(f"bs {bs} pieces (median us):", medians, flush=True)
        del reqs


if __name__ == "__main__":
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    what = sys.argv[1:] or ["kernels", "host"]  # read before kernel_tables clears argv
    if "kernels" in what:
        kernel_tables()
    if "host" in what:
        host_tables()
    if "replay" in what:
        replay_costs()
