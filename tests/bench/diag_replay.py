"""Why a replay's host launch costs more at 16 and 64 rows than at 1 (a diagnostic, not a test).

python3 tests/bench/diag_replay.py > $OUT/diag_replay.txt

For the host-bound config, per padded size: the host µs of ``graph.replay()`` with the
device idle (median of 200), and the kernels, memsets and copies one eager step of the same
body launches (torch.profiler), so a size whose graph holds more or costlier nodes shows.
"""

from __future__ import annotations

import collections
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from engine.graph_bench import CONFIGS
from engine.graph_loop import GraphConfig, GraphEngine
from engine.loop import EngineConfig

dev = torch.device("cuda:0")
SIZES = (1, 16, 64)


def main() -> None:
    for rows in SIZES:
        cfg = EngineConfig(max_running=rows, max_prefill_tokens=1 << 16, kv_slots=rows * 160 + 1024)
        eng = GraphEngine(CONFIGS["host-bound"], "pool", dev, cfg, GraphConfig(sizes=(rows,)))
        graphs = eng.graphs
        stream = eng.forward_stream
        assert stream is not None
        times = []
        with torch.cuda.stream(stream):
            for _ in range(220):
                torch.cuda.synchronize()
                start = time.perf_counter()
                graphs.replay(rows)
                times.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        launch = statistics.median(times[20:]) * 1e6
        with torch.cuda.stream(stream):
            graphs.body(rows)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                graphs.body(rows)
                torch.cuda.synchronize()
        kinds: collections.Counter[str] = collections.Counter()
        names: collections.Counter[str] = collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                names[e.name[:90]] += 1
            elif e.name.startswith("cuda") or e.name.startswith("cu"):
                kinds[e.name] += 1
        print(f"## rows {rows}: replay() host µs median {launch:.1f}; runtime calls of one eager body: {dict(kinds)}")
        for name, n in sorted(names.items()):
            print(f"   {n:3d}  {name}")
        print(flush=True)


if __name__ == "__main__":
    main()
