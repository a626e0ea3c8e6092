"""Long runs on a GPU (a script with its own output, not a test):

1. ring soak: N stages of random sizes and dtypes under random GPU lag, read on two
   registered consumer streams that lag too; every value verified on the device by a
   weighted checksum; pinned and device memory checked flat from stage 1,000 on.
2. decode soak: the reference loop for M decode steps with requests joining and
   leaving, in pool mode and in sync mode; token streams compared, memory checked flat.
3. graph soak: the graph loop (``engine.graph_loop``) for M decode steps in pool mode,
   the block copied on the scheduler's stream and replayed on the forward stream behind
   random GPU lag, each replay logging the step it read (``check_steps``); against
   pinned+graph without lag: token streams compared, every step's log checked, memory
   checked flat.

    python3 tests/bench/soak.py [--stages 100000] [--decode-steps 20000] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from typing import Any

import numpy as np
import structlog
import torch

from pinpool import PinnedRingBuffer, PoolSettings
from pinpool.bench.engine import Engine, EngineConfig, ModelConfig, Workload, make_requests

DEV = torch.device("cuda", 0)
DTYPES = [torch.float32, torch.int32, torch.int64, torch.float16, torch.uint8]
SIZES = [1, 3, 17, 256, 999, 1024, 4097]


def memory() -> tuple[int, int, int]:
    host = torch.cuda.host_memory_stats()
    return host.get("num_host_alloc", 0), host.get("allocated_bytes.all.current", 0), torch.cuda.memory_allocated(DEV)


def ring_soak(stages: int, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    pool = PinnedRingBuffer(PoolSettings(device=DEV, num_slots=4, slot_bytes=1 << 17))
    consumers = [torch.cuda.Stream(DEV), torch.cuda.Stream(DEV)]
    for c in consumers:
        pool.register_consumer_stream(c)
    weights = torch.arange(1, 4098, device=DEV, dtype=torch.float64)
    got = torch.zeros(stages, dtype=torch.float64, device=DEV)
    want = np.zeros(stages, dtype=np.float64)
    staged = torch.cuda.Event()
    checkpoints: dict[int, tuple[int, int, int]] = {}
    start = time.perf_counter()
    for i in range(stages):
        if rng.random() < 0.02:
            torch.cuda._sleep(rng.randint(0, 4_000_000))  # the staging stream lags up to ~2 ms: the ring laps
        dtype, n = rng.choice(DTYPES), rng.choice(SIZES)
        values = (
            np.random.default_rng(i)
            .integers(0, 100, n)
            .astype(
                {
                    torch.float32: np.float32,
                    torch.int32: np.int32,
                    torch.int64: np.int64,
                    torch.float16: np.float16,
                    torch.uint8: np.uint8,
                }[dtype]
            )
        )
        with pool.stage() as st:
            view = st.put(values if rng.random() < 0.5 else values.tolist(), dtype)
        want[i] = float((values.astype(np.float64) * np.arange(1, n + 1)).sum())
        staged.record()
        consumer = consumers[i % 2]
        consumer.wait_event(staged)
        with torch.cuda.stream(consumer):
            if rng.random() < 0.05:
                torch.cuda._sleep(rng.randint(0, 400_000))  # a consumer lags behind the ring
            got[i] = (view.double() * weights[:n]).sum()
        if i in (1_000, stages // 2, stages - 1):
            torch.cuda.synchronize()
            checkpoints[i] = memory()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    bad = int((got.cpu().numpy() != want).sum())
    stats = pool.stats()
    first, last = checkpoints[1_000], checkpoints[stages - 1]
    return {
        "stages": stages,
        "wrong_values": bad,
        "stalls": stats.stalls,
        "longest_stall_ms": stats.max_stall_seconds * 1e3,
        "stall_seconds": stats.stall_seconds,
        "copies": stats.copies,
        "pinned_allocs_1000_to_end": last[0] - first[0],
        "pinned_bytes_1000_to_end": last[1] - first[1],
        "device_bytes_1000_to_end": last[2] - first[2],
        "seconds": seconds,
    }


def decode_soak(steps: int) -> dict[str, Any]:
    cfg = ModelConfig()
    result: dict[str, Any] = {"decode_steps": steps}
    streams = {}
    for mode in ("pool", "sync"):
        engine = Engine(cfg, mode, DEV, EngineConfig(max_running=32))
        wl = Workload(num_requests=steps, arrival_gap=1.5, new_tokens=(8, 40), seed=9)  # ~1.04 decodes each
        engine.submit(make_requests(wl, cfg.vocab_size))
        decodes, marks = 0, {}
        start = time.perf_counter()
        while engine.busy:
            decodes += engine.step() == "decode"
            if decodes in (1_000, steps) and decodes not in marks:
                torch.cuda.synchronize()
                marks[decodes] = memory()
        torch.cuda.synchronize()
        streams[mode] = {r: tuple(v) for r, v in _outputs(engine).items()}
        result[f"{mode}_decode_steps"] = decodes
        result[f"{mode}_seconds"] = time.perf_counter() - start
        if mode == "pool" and 1_000 in marks and steps in marks:
            result["pool_pinned_allocs_1000_to_end"] = marks[steps][0] - marks[1_000][0]
            result["pool_device_bytes_1000_to_end"] = marks[steps][2] - marks[1_000][2]
            result["pool_readback_waits"] = engine.pool.stats().readback_waits
    result["requests"] = len(streams["pool"])
    result["tokens"] = sum(len(v) for v in streams["pool"].values())
    result["streams_identical"] = streams["pool"] == streams["sync"]
    return result


def graph_soak(steps: int) -> dict[str, Any]:
    from pinpool.bench.engine.graph import CHECK_STEPS
    from pinpool.bench.engine.graph_loop import GraphConfig, GraphEngine

    steps = min(steps, CHECK_STEPS - 1)
    cfg = ModelConfig()
    result: dict[str, Any] = {"graph_decode_steps": steps}
    streams = {}
    runs = {
        "pool": GraphConfig(lag_cycles=400_000, lag_seed=3, check_steps=True, upload_stream="schedule"),
        "pinned": GraphConfig(),
    }
    for mode, graph_cfg in runs.items():
        engine = GraphEngine(cfg, mode, DEV, EngineConfig(max_running=32), graph_cfg)  # type: ignore[arg-type]
        wl = Workload(num_requests=steps, arrival_gap=1.5, new_tokens=(8, 40), seed=11)
        engine.submit(make_requests(wl, cfg.vocab_size))
        decodes, marks = 0, {}
        start = time.perf_counter()
        while engine.busy and decodes < steps:
            decodes += engine.step() == "decode"
            if decodes in (1_000, steps) and decodes not in marks:
                torch.cuda.synchronize()
                marks[decodes] = memory()
        while engine.busy:  # past the step budget: finish what runs, admit nothing new
            engine.waiting.clear()
            engine.step()
        torch.cuda.synchronize()
        streams[mode] = {r.rid: tuple(r.output) for r in engine.submitted if r.done}
        result[f"graph_{mode}_seconds"] = time.perf_counter() - start
        if mode == "pool":
            n = engine.replays
            seen = engine.graphs.seen_steps[1 : n + 1].tolist()
            positions = engine.graphs.seen_positions[1 : n + 1].tolist()
            result["graph_replays"] = n
            result["graph_steps_logged_right"] = seen == list(range(1, n + 1))
            result["graph_positions_logged_right"] = positions == engine.expected_positions[:n]
            result["graph_stalls"] = engine.pool.stats().stalls
            if 1_000 in marks and steps in marks:
                result["graph_pinned_allocs_1000_to_end"] = marks[steps][0] - marks[1_000][0]
                result["graph_device_bytes_1000_to_end"] = marks[steps][2] - marks[1_000][2]
    common = streams["pool"].keys() & streams["pinned"].keys()
    result["graph_requests"] = len(common)
    result["graph_streams_identical"] = bool(common) and all(streams["pool"][r] == streams["pinned"][r] for r in common)
    return result


def _outputs(engine: Engine) -> dict[int, list[int]]:
    return engine.finished_outputs  # every submitted request has finished by now


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", type=int, default=100_000)
    parser.add_argument("--decode-steps", type=int, default=20_000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    ring = ring_soak(args.stages)
    print("ring soak:", json.dumps(ring), flush=True)
    decode = decode_soak(args.decode_steps)
    print("decode soak:", json.dumps(decode), flush=True)
    graph = graph_soak(args.decode_steps)
    print("graph soak:", json.dumps(graph), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ring": ring, "decode": decode, "graph": graph}, f, indent=2)
    graph_ok = (
        graph["graph_streams_identical"] and graph["graph_steps_logged_right"] and graph["graph_positions_logged_right"]
    )
    ok = ring["wrong_values"] == 0 and decode["streams_identical"] and graph_ok
    print("\n== soak summary")
    print(
        f"ring   : {ring['stages']} stages, {ring['wrong_values']} wrong, {ring['stalls']} stalls "
        f"(longest {ring['longest_stall_ms']:.2f} ms), pinned allocs 1000->end {ring['pinned_allocs_1000_to_end']}, "
        f"device bytes 1000->end {ring['device_bytes_1000_to_end']}, {ring['seconds']:.1f} s"
    )
    print(
        f"decode : {decode.get('pool_decode_steps')} pool / {decode.get('sync_decode_steps')} sync decode steps, "
        f"{decode['requests']} requests, identical streams {decode['streams_identical']}, pinned allocs 1000->end "
        f"{decode.get('pool_pinned_allocs_1000_to_end')}, device bytes 1000->end "
        f"{decode.get('pool_device_bytes_1000_to_end')}"
    )
    print(
        f"graph  : {graph['graph_replays']} pool+graph replays behind random lag ({graph['graph_stalls']} stalls), "
        f"{graph['graph_requests']} requests compared with pinned+graph, identical streams "
        f"{graph['graph_streams_identical']}, every replay read its own step {graph['graph_steps_logged_right']} "
        f"(positions {graph['graph_positions_logged_right']}), pinned allocs 1000->end "
        f"{graph.get('graph_pinned_allocs_1000_to_end')}, device bytes 1000->end "
        f"{graph.get('graph_device_bytes_1000_to_end')}"
    )
    print("SOAK", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
