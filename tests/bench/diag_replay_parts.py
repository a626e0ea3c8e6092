"""Which part of the host-bound decode graph makes its launch grow with rows (a diagnostic).

python3 tests/bench/diag_replay_parts.py

Captures, per padded size, the model's forward alone, the sampler alone (static logits),
single ops of the forward, and the whole body, and prints each graph's replay() host µs
with the device idle.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from engine.graph_bench import CONFIGS
from engine.graph_loop import GraphConfig, GraphEngine
from engine.loop import EngineConfig
from sampling import Sampler
from sampling.static import StaticSamplingInfo

dev = torch.device("cuda:0")


def launch_us(fn: Callable[[], None], stream: torch.cuda.Stream, pool: bool = False, graph=None) -> float:
    if graph is None:
        with torch.cuda.stream(stream):
            fn()
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, pool=torch.cuda.graph_pool_handle() if pool else None):
            fn()
    times = []
    with torch.cuda.stream(stream):
        for _ in range(120):
            torch.cuda.synchronize()
            start = time.perf_counter()
            graph.replay()
            times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times[20:]) * 1e6


def main() -> None:
    mc = CONFIGS["host-bound"]
    print("rows  " + "  ".join(f"{k:>9}" for k in ("engine", "body+pool", "body", "forward", "sampler", "sdpa", "matmul", "sort", "gather")))
    for rows in (1, 4, 16, 64):
        cfg = EngineConfig(max_running=rows, max_prefill_tokens=1 << 16, kv_slots=rows * 160 + 1024)
        eng = GraphEngine(mc, "pool", dev, cfg, GraphConfig(sizes=(rows,), capture=False))
        g = eng.graphs
        stream = torch.cuda.Stream()
        views = g.block.views(rows)
        with g.block.stage(rows, 0, stream=stream):
            pass  # padding only: valid rows, positions and slots
        torch.cuda.synchronize()
        logits = torch.randn(rows, mc.vocab_size, device=dev)
        info = StaticSamplingInfo(views, rows, mc.vocab_size)
        sampler = Sampler()
        positions = views["positions"]

        def forward() -> None:
            g.model.forward(
                g.tokens_by_row[views["rows"]], positions, views["rows"], views["out_cache_loc"],
                g._arange[:rows], g.req_to_token, g.cache, g.width,
            )

        q = torch.randn(rows, mc.heads, 1, mc.hidden // mc.heads, device=dev, dtype=torch.bfloat16)
        kv = torch.randn(rows, mc.heads, g.width, mc.hidden // mc.heads, device=dev, dtype=torch.bfloat16)
        mask = torch.ones(rows, 1, 1, g.width, device=dev, dtype=torch.bool)
        x = torch.randn(rows, mc.hidden, device=dev, dtype=torch.bfloat16)
        w = torch.randn(mc.hidden, mc.ffn, device=dev, dtype=torch.bfloat16)
        table = torch.randn(4096, mc.hidden, device=dev, dtype=torch.bfloat16)
        idx = torch.zeros(rows, dtype=torch.int64, device=dev)
        parts = {
            "body": lambda: g.body(rows),
            "forward": forward,
            "sampler": lambda: sampler(logits, info, positions),
            "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, kv, kv, attn_mask=mask),
            "matmul": lambda: x @ w,
            "sort": lambda: torch.sort(logits, dim=-1, descending=True),
            "gather": lambda: table[idx],
        }
        engc = GraphEngine(mc, "pool", dev, cfg, GraphConfig(sizes=(rows,)))
        row = [launch_us(None, engc.forward_stream, graph=engc.graphs._graphs[rows]), launch_us(parts["body"], stream, pool=True)]
        row += [launch_us(fn, stream) for fn in parts.values()]
        print(f"{rows:4d}  " + "  ".join(f"{v:9.1f}" for v in row), flush=True)


if __name__ == "__main__":
    main()
