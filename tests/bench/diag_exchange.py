"""A/B of the eager decode exchange's host cost, in the loop as it runs (a diagnostic, not a test).

python3 tests/bench/diag_exchange.py > $OUT/diag_exchange.txt

Variants of the reference engine's decode-step exchange (rows and positions up, tokens
landed back), each measured as ``pinpool bench``'s decode workload measures staging:
host µs per decode step spent staging, less GPU waits, median over steps, then median
over interleaved rounds:

- ``pinned``: the PR #28076 pattern (the reference);
- ``pool``: the engine's pool mode as shipped (``pool.stage(step_layout, rows=bs)``: a layout
  declared once, a ``put`` per field, the landing field's addresses written at open);
- ``pool-min``: the same CUDA calls (current stream, capture query, one copy, one fence
  record, one fence query) with the Python around them cut to the minimum, inline in the
  engine: the floor any Python-level rework of the exchange could reach.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from typing import Any

import structlog
import torch

from pinpool.bench.engine.bench import _engine, _requests
from pinpool.bench.engine.loop import Engine
from pinpool.cuda import _current_stream_of, _is_capturing, _query, _record
from pinpool.transport import wait_for_streams

DEV = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _min_decode(self: Engine) -> Any:
    """The decode step with the exchange inlined (pool mode, tokens landed): same CUDA calls, least Python."""
    reqs, bs = self.running, len(self.running)
    out_cache_loc = self.kv.alloc(bs)
    rows, positions = [r.row for r in reqs], [r.seq_len for r in reqs]
    pool: Any = self.pool
    with self.staging("decode.upload"):
        sid = _current_stream_of(pool._transport.index)[0]
        stream = pool._transport._current
        if stream is None or stream.stream_id != sid:
            stream = pool._transport.resolve_stream(None)
        if self._min_guard and _is_capturing is not None and _is_capturing():
            raise RuntimeError("capturing")
        slot = pool._next_slot
        fence = pool._slots[slot].fence
        if not fence.passed and not fence.query():
            fence.synchronize()
        last = pool._slots[slot].last_user
        if last is not stream and last.stream_id != sid:
            wait_for_streams(pool._transport, stream, ((last, pool._slots[slot].handoff),))
        pool._slots[slot].last_user = stream
        pool._generation += 1
        pool._slots[slot].generation = pool._generation
        plan = self._min_plans.get((slot, bs))
        if plan is None:
            plan = self._min_plans[(slot, bs)] = _plan(pool, slot, bs)
        packer, base, col_at, column, _end, dst, src, rows_d, pos_d, land_to, values = plan
        host_bytes = pool._slots[slot].host_bytes
        packer.pack_into(host_bytes, base, *rows, *positions)
        host_bytes[col_at : col_at + len(column)] = column
        dst.copy_(src, True)
    self._launch_decode(reqs, bs, rows_d, pos_d, out_cache_loc, land_to)
    with self.staging("decode.readback"):
        fence.passed = False
        _record(fence, stream)
        pool._next_slot = (slot + 1) % pool._num_slots
        generation = pool._generation
    reader: Any = self.reader

    def read() -> list[int]:
        if pool._slots[slot].generation != generation:
            raise RuntimeError("stale")
        if not fence.passed:
            if not _query(fence):
                start = time.perf_counter()
                fence.synchronize()
                reader._wait_seconds += time.perf_counter() - start  # a GPU wait, as the pool counts one
            fence.passed = True
        out: list[int] = values.tolist()
        return out

    return read


def _plan(pool: Any, slot: int, bs: int) -> tuple[Any, ...]:
    """Where the minimal exchange writes in ``slot`` for ``bs`` rows (built once per slot and size)."""
    import struct

    import numpy as np

    mem = pool._slots[slot]  # SlotMemory: the slot's pinned bytes and its device mirror
    align = pool.settings.alignment
    up = 16 * bs
    col = (up + align - 1) // align * align
    end = col + 8 * bs
    tail = (pool.settings.slot_bytes - 8 * bs) // align * align
    addr0 = mem.host_raw.data_ptr() + tail
    column = (np.arange(bs, dtype=np.int64) * 8 + addr0).tobytes()  # int64 landings carry tag 0
    dev64 = mem.device_raw.view(torch.int64)
    return (
        struct.Struct(f"={2 * bs}q"),
        mem.host_base,
        mem.host_base + col,
        column,
        end,
        mem.device_raw[:end],
        mem.host_raw[:end],
        dev64[:bs],
        dev64[bs : 2 * bs],
        dev64[col // 8 : col // 8 + bs],
        mem.host[torch.int64][tail // 8 : tail // 8 + bs],
    )


def _build(variant: str, running: int, steps: int) -> Engine:
    mode = "pinned" if variant == "pinned" else "pool"
    engine = _engine(mode, DEV, running, 0.0, 0.0)
    if variant.startswith("pool-min"):
        engine._min_guard = variant == "pool-min"  # type: ignore[attr-defined]
        engine._min_plans = {}  # type: ignore[attr-defined]
        engine._decode = _min_decode.__get__(engine)  # type: ignore[method-assign]
    return engine


def measure(variant: str, running: int, steps: int = 32) -> tuple[float, list[int]]:
    engine = _build(variant, running, steps)
    reqs = _requests(running, steps, seed=1)
    engine.run(reqs)
    torch.cuda.synchronize(DEV)  # sync-ok: diagnostic clock boundary
    staging = engine.times.decode_staging[3:]
    waits = engine.times.decode_gpu_wait[3:]
    us = statistics.median([s - w for s, w in zip(staging, waits, strict=True)]) * 1e6
    tokens = [t for r in reqs for t in r.output]
    return us, tokens


VARIANTS = ("pinned", "pool", "pool-min")


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    for v in VARIANTS:
        measure(v, 64, 6)  # warm-up: kernels compile once
    print(f"staging µs per decode step (median over steps, then over {rounds} interleaved rounds)")
    print(f"{'running':>7} " + " ".join(f"{v:>14}" for v in VARIANTS) + "   ratios to pinned")
    for running in (64, 256):
        got: dict[str, list[float]] = {v: [] for v in VARIANTS}
        streams: dict[str, list[int]] = {}
        for r in range(rounds):
            order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
            for v in order:
                us, tokens = measure(v, running)
                got[v].append(us)
                streams[v] = tokens
        med = {v: statistics.median(xs) for v, xs in got.items()}
        same = all(streams[v] == streams["pinned"] for v in VARIANTS)
        print(
            f"{running:>7} "
            + " ".join(f"{med[v]:>14.1f}" for v in VARIANTS)
            + "   "
            + " ".join(f"{v} {med[v] / med['pinned']:.2f}" for v in VARIANTS[1:])
            + f"   tokens identical: {same}"
        )
        print("        spreads: " + "; ".join(f"{v} {min(xs):.1f}-{max(xs):.1f}" for v, xs in got.items()))
    t0 = time.perf_counter()
    print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
