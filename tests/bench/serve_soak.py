"""Serve soak (a script with its own output, not a test): thousands of requests through the serve loop.

Chunks of a saturating churn trace (``engine.trace``) run through one ``ServeEngine`` per
mode (host-bound model, 256 running), the engine kept across chunks, and through the eager
loop in ``sync`` mode. After every chunk: the token streams are compared with the sync
loop's, and pinned allocations (``cudaHostAlloc`` calls) and device bytes allocated are
recorded; from the second chunk on (the first warms the caches) they must not move in pool
mode (the other modes' figures are reported: their per-step pinned temporaries come from
torch's host cache, which may or may not grow).

    python3 tests/bench/serve_soak.py [--requests 5000] [--chunk 500] [--modes pool,vllm] [--json FILE]

``--device cpu --requests 60 --chunk 20`` runs the same loop on CPU (memory figures are 0 there).
The eager loop attends over the batch's longest sequence where a graph attends over the
fixed context; in bfloat16 the two can round apart, so ``--float32`` runs the host-bound
shapes in float32, and the report also says whether the modes agree with each other.
Exit status 1 when any mode's tokens differ from sync's or another mode's, or pool mode's memory moved.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import attrs
import torch

from pinpool.bench.engine import Engine
from pinpool.bench.engine.model import TinyDecoder
from pinpool.bench.engine.serve import SERVE_MODES, ServeMode
from pinpool.bench.engine.serve_bench import CONFIGS, CPU_MODEL, LOADS, build, trace_config
from pinpool.bench.engine.trace import fresh, make_trace
from pinpool.bench.kit import host_allocs


def memory(device: torch.device) -> tuple[int, int]:
    """(pinned allocations so far, device bytes allocated now)."""
    if device.type != "cuda":
        return 0, 0
    torch.cuda.synchronize(device)  # sync-ok: soak checkpoint between chunks, outside any served trace
    return host_allocs(), torch.cuda.memory_allocated(device)


def soak(device: torch.device, modes: list[ServeMode], requests: int, chunk: int, float32: bool) -> dict[str, Any]:
    model_cfg = CONFIGS["host-bound"] if device.type == "cuda" else CPU_MODEL
    if float32:
        model_cfg = attrs.evolve(model_cfg, dtype="float32")
    load = next(ld for ld in LOADS if ld.name == "saturating")
    model = TinyDecoder(model_cfg, device)
    engines = {m: build(model_cfg, m, device, load.max_running, model) for m in modes}
    sync = Engine(model_cfg, "sync", device, engines[modes[0]].cfg, model=model)
    report: dict[str, Any] = {m: {"marks": [], "same": True, "same_as_modes": True} for m in modes}
    start = time.perf_counter()
    for i in range(max(1, requests // chunk)):
        trace = make_trace(trace_config(model_cfg, load, chunk, seed=i), model_cfg.vocab_size, rid_base=i * chunk)
        want = sync.run(fresh(trace, sync.iteration))
        first = None
        for mode, engine in engines.items():
            got = engine.serve(trace).outputs
            first = got if first is None else first
            report[mode]["same"] &= got == want
            report[mode]["same_as_modes"] &= got == first
            report[mode]["marks"].append(memory(device))
        print(f"  .. chunk {i + 1}: {(i + 1) * chunk} requests, {time.perf_counter() - start:.0f} s", file=sys.stderr)
    for entry in report.values():
        later = entry["marks"][1:]
        entry["flat"] = all(m == later[0] for m in later)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--chunk", type=int, default=500)
    parser.add_argument("--modes", default=",".join(SERVE_MODES))
    parser.add_argument("--float32", action="store_true", help="the host-bound shapes in float32 (see above)")
    parser.add_argument("--json")
    args = parser.parse_args()
    modes: list[ServeMode] = [m for m in SERVE_MODES if m in args.modes.split(",")]
    report = soak(torch.device(args.device), modes, args.requests, args.chunk, args.float32)
    ok = True
    for mode, entry in report.items():
        first, last = entry["marks"][0], entry["marks"][-1]
        print(
            f"{mode}+graph: tokens identical to sync: {entry['same']}, to {modes[0]}+graph: "
            f"{entry['same_as_modes']}; pinned allocations and device bytes flat "
            f"after the first chunk: {entry['flat']} (first {first}, last {last})"
        )
        ok &= entry["same"] and entry["same_as_modes"] and (entry["flat"] or mode != "pool")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"requests": args.requests, "chunk": args.chunk, "float32": args.float32, "modes": report}, f)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
