"""Diagnostics for the graph loop (a script, not a test; run on the GPU machine).

python3 tests/bench/graph_profile.py --split    # replayed GPU µs: whole step, model alone, sampler alone
python3 tests/bench/graph_profile.py --modes    # host / step / GPU µs per mode for candidate model configs
python3 tests/bench/graph_profile.py --stage    # host µs of each mode's staging call alone
python3 tests/bench/graph_profile.py --host     # cProfile of 60 graph decode steps, pool and pinned
"""

import cProfile
import pstats
import sys

import torch

from pinpool.bench.engine.graph_bench import _requests
from pinpool.bench.engine.graph_loop import GraphConfig, GraphEngine
from pinpool.bench.engine.loop import EngineConfig
from pinpool.bench.engine.model import ModelConfig

dev = torch.device("cuda:0")


def gpu_split(mc: ModelConfig, bs: int) -> None:
    """Replay times of three graphs: the whole step, the model alone, the sampler alone."""
    from sampling import Sampler
    from sampling.static import StaticSamplingInfo

    eng = GraphEngine(
        mc, "pool", dev, EngineConfig(max_running=bs, kv_slots=bs * 160 + 1024), GraphConfig(capture=True, sizes=(bs,))
    )
    g = eng.graphs
    rows = g.padded(bs)
    views = g.block.views(rows)
    info = StaticSamplingInfo(views, rows, mc.vocab_size)
    s = torch.cuda.Stream()
    holder = {}

    def model() -> None:
        toks = g.tokens_by_row[views["rows"]]
        holder["logits"] = g.model.forward(
            toks,
            views["positions"],
            views["rows"],
            views["out_cache_loc"],
            g._arange[:rows],
            g.req_to_token,
            g.cache,
            g.width,
        )

    def sampler() -> None:
        Sampler()(holder["logits"], info, views["positions"])

    graphs = {}
    for name, fn in (("model", model), ("sampler", sampler)):
        with torch.cuda.stream(s):
            fn()
            fn()
        s.synchronize()
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr, stream=s):
            fn()
        graphs[name] = gr
    out = []
    for name, fn in (
        ("step", lambda: g.replay(rows)),
        ("model", graphs["model"].replay),
        ("sampler", graphs["sampler"].replay),
    ):
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(20):
                fn()
            b.record()
        b.synchronize()
        out.append(f"{name} {a.elapsed_time(b) * 1e3 / 20:.0f} us")
    print(f"{mc.hidden}x{mc.layers} vocab {mc.vocab_size} bs {bs} (replayed graphs): " + ", ".join(out), flush=True)


def host_profile(mode: str, bs: int) -> None:
    mc = ModelConfig(max_context_len=160)
    eng = GraphEngine(mc, mode, dev, EngineConfig(max_running=bs, kv_slots=bs * 160 + 1024))
    eng.submit(_requests(mc, bs, 100))
    for _ in range(20):
        eng.step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(60):
        eng.step()
    prof.disable()
    print(f"== host profile {mode}+graph bs {bs}: 60 steps")
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(22)


CANDIDATES = {
    "tiny": ModelConfig(max_context_len=160),
    "tiny-v4k": ModelConfig(max_context_len=160, vocab_size=4096),
    "tiny-1l-v4k": ModelConfig(max_context_len=160, vocab_size=4096, layers=1),
    "micro": ModelConfig(max_context_len=160, vocab_size=2048, layers=1, hidden=128, heads=2, ffn=256),
}
if "--split" in sys.argv:
    for mc in CANDIDATES.values():
        for bs in (1, 16, 64):
            gpu_split(mc, bs)
if "--modes" in sys.argv:
    from pinpool.bench.engine.graph_bench import measure
    from pinpool.bench.kit import BenchContext

    ctx = BenchContext(device=dev, batch_sizes=(1,), iters=1, verbose=False)
    for name, mc in CANDIDATES.items():
        for bs in (1, 16, 64):
            line = []
            for label in ("pinned+graph", "sglang+graph", "pool+graph"):
                m = measure(ctx, label, mc, bs, 40)
                line.append(f"{label}: host {m['host_us']:.0f} step {m['step_us']:.0f} gpu {m['gpu_us']:.0f}")
            print(name, bs, " | ".join(line), flush=True)
        print(name, "phases of pool+graph at 64:", {k: round(v, 1) for k, v in m["phases"].items()}, flush=True)


def stage_micro(mode: str, bs: int, iters: int = 400) -> None:
    """Host µs of one mode's staging call alone (the device keeps up: tiny copies), median and p10/p90."""
    import statistics
    import time

    from pinpool.cuda import use_stream

    mc = CANDIDATES["micro"]
    eng = GraphEngine(mc, mode, dev, EngineConfig(max_running=bs, kv_slots=1 << 20), GraphConfig(sizes=(bs,)))
    eng.submit(_requests(mc, bs, 8))
    while eng.step() != "decode":
        pass
    reqs, rows = eng.running, eng.graphs.padded(bs)
    fn = {"pool": eng._stage_pool, "pinned": eng._stage_pinned, "sglang": eng._stage_sglang}[mode]
    times = []
    with use_stream(eng.forward_stream):
        for i in range(iters):
            if mode == "pool":
                eng._batch.positions[:] = 60
            elif mode == "sglang" and i % 50 == 0:
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = fn(reqs, bs, rows)
            times.append((time.perf_counter() - t) * 1e6)
            if mode == "pool":
                out[0].close()  # _stage_pool hands back its flushed stage open (the loop closes it after the replay)
            if i % 8 == 7:
                eng.forward_stream.synchronize()
    times.sort()
    print(
        f"stage micro {mode} bs {bs}: median {statistics.median(times):.1f} us, p10 {times[len(times) // 10]:.1f}, "
        f"p90 {times[9 * len(times) // 10]:.1f}",
        flush=True,
    )


if "--stage" in sys.argv:
    for bs in (1, 16, 64):
        for mode in ("pinned", "sglang", "pool"):
            stage_micro(mode, bs)
if "--host" in sys.argv:
    host_profile("pool", 16)
    host_profile("pinned", 16)
