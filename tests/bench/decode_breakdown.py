"""Where a decode step's staging time goes, per site and mode (a diagnostic, not a test).

python3 tests/bench/decode_breakdown.py > $OUT/breakdown.txt

For each mode: median host µs per decode step at each staging site (step upload, token
read-back, read of the previous step), in the loop as it runs, in the loop with the GPU
drained before each step, and the same upload called in a tight loop outside the engine.
"""

from __future__ import annotations

import cProfile
import io
import logging
import pstats
import statistics
import time

import structlog
import torch

from pinpool.bench.engine.bench import READ_BACK, _engine, _requests
from pinpool.bench.engine.uploader import MODES

DEV = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
SITES = ("decode.upload", "decode.readback", "read")


def _sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def per_step(mode: str, running: int, drain: bool, steps: int = 40) -> dict[str, float]:
    engine = _engine(mode, DEV, running, 0.0, 0.0)
    engine.submit(_requests(running, steps, seed=1))
    samples: dict[str, list[float]] = {s: [] for s in (*SITES, "wall")}
    seen = 0
    while engine.busy:
        if drain:
            _sync()
        before = dict(engine.staging.by_site)
        start = time.perf_counter()
        kind = engine.step()
        wall = time.perf_counter() - start
        if kind != "decode":
            continue
        seen += 1
        if seen <= 3:
            continue
        for s in SITES:
            samples[s].append(engine.staging.by_site.get(s, 0.0) - before.get(s, 0.0))
        samples["wall"].append(wall)
    _sync()
    return {k: statistics.median(v) * 1e6 for k, v in samples.items() if v}


def isolated(mode: str, running: int, calls: int = 300) -> float:
    engine = _engine(mode, DEV, running, 0.0, 0.0)
    rows, pos = list(range(running)), list(range(100, 100 + running))
    fields = [(rows, torch.int64), (pos, torch.int64)]
    for _ in range(50):
        engine.uploader.upload("step", fields)
    _sync()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        engine.uploader.upload("step", fields)
        times.append(time.perf_counter() - start)
    _sync()
    return statistics.median(times) * 1e6


def profile_pool(running: int) -> str:
    engine = _engine("pool", DEV, running, 0.0, 0.0)
    engine.submit(_requests(running, 60, seed=1))
    for _ in range(10):
        engine.step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(40):
        engine.step()
    prof.disable()
    _sync()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    return out.getvalue()


def pool_calls(mode: str, running: int, steps: int = 60) -> str:
    """Median µs per step of each pool call of the decode exchange, in the loop as it runs."""
    from pinpool import cuda as transport
    from pinpool import readback, ring, stage
    from pinpool.bench.engine import readback as engine_readback
    from pinpool.bench.engine import uploader

    spent: dict[str, float] = {}
    patched: list[tuple[object, str, object]] = []

    def wrap(owner: object, attr: str, label: str) -> None:
        fn = getattr(owner, attr)

        def timed(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - start

        patched.append((owner, attr, fn))
        setattr(owner, attr, timed)

    for owner, attr in (
        (ring.PinnedRingBuffer, "stage"),
        (stage.Stage, "put"),
        (stage.Stage, "land"),
        (stage.Stage, "landing"),
        (stage.Stage, "flush"),
        (stage.Stage, "close"),
        (stage.Stage, "readback"),
        (engine_readback.TokenReader, "wrap"),
        (engine_readback.TokenReader, "start"),
        (uploader.Uploader, "upload"),
        (transport.CudaTransport, "copy"),
        (transport._CudaFence, "record"),
        (transport._CudaFence, "query"),
        (readback.Readback, "tolist"),
        (readback.Landing, "tolist"),
    ):
        wrap(owner, attr, f"{owner.__name__}.{attr}")  # type: ignore[attr-defined]
    try:
        engine = _engine(mode, DEV, running, 0.0, 0.0)
        wrap(engine, "_launch_decode", "launch")
        engine.submit(_requests(running, steps, seed=1))
        samples: dict[str, list[float]] = {}
        seen = 0
        while engine.busy:
            spent.clear()
            if engine.step() != "decode":
                continue
            seen += 1
            if seen <= 3:
                continue
            for k, v in spent.items():
                samples.setdefault(k, []).append(v * 1e6)
        _sync()
    finally:
        for owner, attr, fn in patched:
            if isinstance(owner, type):
                setattr(owner, attr, fn)
    return f"{running:7d} {mode:8s} " + "  ".join(f"{k} {statistics.median(v):.1f}" for k, v in sorted(samples.items()))


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    for mode in MODES:  # warm-up: kernels compile once
        per_step(mode, 64, False, steps=8)
    print("running mode        variant   " + "  ".join(f"{s:>15}" for s in (*SITES, "wall")) + "   isolated upload")
    for running in (64, 256):
        for mode in (*MODES, READ_BACK):  # pool-rb: pool with a read-back copy instead of its landing
            iso = isolated(mode, running)
            for drain in (False, True):
                r = per_step(mode, running, drain)
                cells = "  ".join(f"{r.get(s, float('nan')):15.1f}" for s in (*SITES, "wall"))
                print(f"{running:7d} {mode:11s} {'drained' if drain else 'loop':8s}  {cells}   {iso:8.1f}")
    print("\n######## each pool call of the decode exchange, median µs per step in the loop")
    print("(launch: the step's kernels, for scale)")
    for running in (64, 256):
        for mode in ("pool", READ_BACK, "pool-zc", "pinned"):
            print(pool_calls(mode, running), flush=True)
    print("\n######## cProfile, pool mode, 64 running, 40 steps\n" + profile_pool(64))


if __name__ == "__main__":
    main()
