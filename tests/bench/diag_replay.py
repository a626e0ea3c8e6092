"""A decode graph's replay() host cost before and after a profiled pass in the same process (a diagnostic).

python3 tests/bench/diag_replay.py > $OUT/diag_replay.txt

Per padded size of the host-bound config: the host µs of ``replay()`` with the device
idle (median of 200), then one eager step under ``torch.profiler`` (CUDA activity), then
the same timing again. Once a pass has traced CUDA activity, CUPTI stays attached to the
process and every CUDA runtime call after it carries its overhead; the bench therefore
runs its counting passes in a child process after every timing (``run_isolated``).
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pinpool.bench.engine.graph_bench import CONFIGS
from pinpool.bench.engine.graph_loop import GraphConfig, GraphEngine
from pinpool.bench.engine.loop import EngineConfig

dev = torch.device("cuda:0")
SIZES = (1, 16, 64)


def replay_us(eng: GraphEngine, rows: int) -> float:
    times = []
    with torch.cuda.stream(eng.forward_stream):
        for _ in range(220):
            torch.cuda.synchronize()
            start = time.perf_counter()
            eng.graphs.replay(rows)
            times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times[20:]) * 1e6


def main() -> None:
    engines = {}
    before = {}
    for rows in SIZES:  # no profiler has run in this process yet
        cfg = EngineConfig(max_running=rows, max_prefill_tokens=1 << 16, kv_slots=rows * 160 + 1024)
        engines[rows] = GraphEngine(CONFIGS["host-bound"], "pool", dev, cfg, GraphConfig(sizes=(rows,)))
        before[rows] = replay_us(engines[rows], rows)
    with torch.cuda.stream(engines[1].forward_stream), profile(activities=[ProfilerActivity.CUDA]):
        engines[1].graphs.body(1)
        torch.cuda.synchronize()
    print("rows  replay() host µs before a profiled pass  after it")
    for rows in SIZES:
        print(f"{rows:4d}  {before[rows]:40.1f}  {replay_us(engines[rows], rows):8.1f}", flush=True)


if __name__ == "__main__":
    main()
