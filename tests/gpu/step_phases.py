"""Host µs of each call a decode step's staging makes, timed inside the running loop (diagnostic).

python3 tests/gpu/step_phases.py

The engine's decode step is re-run with a clock read between the calls of its pool and
pinned staging paths, so each call's cost is seen where it runs: after the model's and
sampler's launches. Clock reads add ~0.1 µs per phase.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import defaultdict
from typing import Any

import structlog
import torch

from engine.bench import _engine, _requests
from engine.loop import Engine
from engine.readback import Pending

DEV = torch.device("cuda", 0)


def instrument(engine: Engine, phases: dict[str, list[float]]) -> None:
    clock = time.perf_counter

    def decode() -> Pending:
        reqs, bs = engine.running, len(engine.running)
        out_cache_loc = engine.kv.alloc(bs)
        rows, positions = [r.row for r in reqs], [r.seq_len for r in reqs]
        t = [clock()]
        if engine.mode == "pool":
            st = engine.pool.stage()
            t.append(clock())
            rows_d = st.put(rows, torch.int64)
            t.append(clock())
            positions_d = st.put(positions, torch.int64)
            t.append(clock())
            st.flush()
            t.append(clock())
            names = ["stage()", "put rows", "put positions", "flush"]
        else:
            rows_d = torch.tensor(rows, dtype=torch.int64, pin_memory=True).to(DEV, non_blocking=True)
            t.append(clock())
            positions_d = torch.tensor(positions, dtype=torch.int64, pin_memory=True).to(DEV, non_blocking=True)
            t.append(clock())
            names = ["rows up", "positions up"]
        engine._launch_decode(reqs, bs, rows_d, positions_d, out_cache_loc)
        assert engine.last_tokens is not None
        t.append(clock())
        if engine.mode == "pool":
            handle = st.readback(engine.last_tokens)
            t.append(clock())
            st.close()
            t.append(clock())
            names += ["(model)", "readback", "close"]

            def pending() -> list[int]:
                start = clock()
                handle.ready()
                mid = clock()
                values: list[int] = handle.tolist()
                phases["read: query"].append(mid - start)
                phases["read: tolist"].append(clock() - mid)
                return values
        else:
            host = torch.empty(bs, dtype=torch.int64, pin_memory=True)
            t.append(clock())
            host.copy_(engine.last_tokens, non_blocking=True)
            t.append(clock())
            event: Any = torch.cuda.Event()  # type: ignore[no-untyped-call]
            t.append(clock())
            event.record()
            t.append(clock())
            names += ["(model)", "empty pinned", "copy back", "Event()", "record"]

            def pending() -> list[int]:
                start = clock()
                if not event.query():
                    event.synchronize()
                mid = clock()
                values: list[int] = host.tolist()
                phases["read: query"].append(mid - start)
                phases["read: tolist"].append(clock() - mid)
                return values

        for name, a, b in zip(names, t[:-1], t[1:], strict=True):
            phases[name].append(b - a)
        return pending

    engine._decode = decode  # type: ignore[method-assign]


def time_cuda_calls(engine: Engine, phases: dict[str, list[float]]) -> None:
    """Time the pool's copy and fence-record calls inside flush and readback (one frame more each)."""
    transport: Any = engine.pool._transport
    copy = transport.copy
    clock = time.perf_counter

    def timed_copy(dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        start = clock()
        copy(dst, src, stream)
        phases["  of which copy " + ("up" if dst.is_cuda else "back")].append(clock() - start)

    transport.copy = timed_copy
    engine.pool._fences = [_TimedFence(f, phases["  of which record"]) for f in engine.pool._fences]


class _TimedFence:
    """Forwards to the pool's fence, timing each record."""

    def __init__(self, inner: Any, samples: list[float]) -> None:
        self.inner, self.samples = inner, samples

    def record(self, stream: Any) -> None:
        start = time.perf_counter()
        self.inner.record(stream)
        self.samples.append(time.perf_counter() - start)

    def query(self) -> bool:
        return bool(self.inner.query())

    def synchronize(self) -> None:
        self.inner.synchronize()


def run(mode: str, running: int, steps: int = 48) -> dict[str, float]:
    phases: dict[str, list[float]] = defaultdict(list)
    engine = _engine(mode, DEV, running, 0.0, 0.0)  # type: ignore[arg-type]
    instrument(engine, phases)
    if mode == "pool":
        time_cuda_calls(engine, phases)
    engine.submit(_requests(running, steps, seed=1))
    while engine.busy:
        engine.step()
    torch.cuda.synchronize()
    return {k: statistics.median(v[4:]) * 1e6 for k, v in phases.items()}


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    for running in (64, 256):
        for mode in ("pinned", "pool", "pinned", "pool"):
            r = run(mode, running)
            staged = sum(v for k, v in r.items() if k != "(model)" and not k.startswith(" "))
            cells = "  ".join(f"{k} {v:.1f}" for k, v in r.items() if k != "(model)")
            print(f"{running:4d} {mode:7s} staged {staged:6.1f} µs = {cells}")


if __name__ == "__main__":
    main()
