import statistics, time
import torch
from engine.graph_bench import CONFIGS
from engine.graph_loop import GraphConfig, GraphEngine
from engine.loop import EngineConfig
dev = torch.device("cuda:0")
def stats(t):
    t = sorted(x * 1e6 for x in t[20:])
    return f"min {t[0]:5.1f} med {statistics.median(t):5.1f} p90 {t[int(len(t)*0.9)]:5.1f}"
for rows in (1, 16, 64):
    cfg = EngineConfig(max_running=rows, max_prefill_tokens=1 << 16, kv_slots=rows * 160 + 1024)
    eng = GraphEngine(CONFIGS["host-bound"], "pool", dev, cfg, GraphConfig(sizes=(rows,)))
    graph = eng.graphs._graphs[rows]
    stream = eng.forward_stream
    out = {}
    with torch.cuda.stream(stream):
        for name in ("sync", "sync+sleep", "spaced", "sync-stream", "sync", "event"):
            times = []
            ev = torch.cuda.Event()
            for _ in range(200):
                if name == "sync":
                    torch.cuda.synchronize()
                elif name == "sync+sleep":
                    torch.cuda.synchronize(); time.sleep(0.0005)
                elif name == "spaced":
                    t = time.perf_counter()
                    while time.perf_counter() - t < 0.0008: pass
                elif name == "sync-stream":
                    stream.synchronize()
                elif name == "event":
                    ev.record(); ev.synchronize()
                s = time.perf_counter(); graph.replay(); times.append(time.perf_counter() - s)
            torch.cuda.synchronize()
            print(f"rows {rows:3d} {name:12s} {stats(times)}", flush=True)
    del eng, graph
