"""Same-run A/B of each fast path the core keeps, against the general path it stands beside.

Each row times one call both ways on this machine (median of 2000, after a warm-up) and
prints general ÷ fast: a fast path stays where that figure is at least 1.15. The tests that
hold each pair equal are named in the last column. Run on the device (CUDA pool) or on CPU.

    python3 tests/bench/diag_fast_paths.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from pinpool import PinnedRingBuffer, PoolSettings

BS = (1, 64, 1024)


def _median_us(fn: Callable[[], object], n: int = 2000) -> float:
    for _ in range(200):
        fn()
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def _stage_with(pool: PinnedRingBuffer, value: object) -> Callable[[], object]:
    def step() -> object:
        with pool.stage() as st:
            return st.put(value, torch.int64)

    return step


def main() -> None:
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    pool = PinnedRingBuffer(PoolSettings(device=device, num_slots=8, slot_bytes=1 << 20))
    rows = []
    for bs in BS:
        values = list(range(1000, 1000 + bs))
        # struct packs a list straight into the slot; a tuple takes numpy's list parse and its checks.
        fast = _median_us(_stage_with(pool, values))
        general = _median_us(_stage_with(pool, tuple(values)))
        rows.append((f"list put, bs {bs}", fast, general, "test_pack_list.py"))
    transport = pool.transport
    if hasattr(transport, "resolve_for_stage"):
        fast = _median_us(lambda: transport.resolve_for_stage(None))
        general = _median_us(lambda: (s := transport.resolve_stream(None), transport.capturing(s)))
        rows.append(("stream + capture question", fast, general, "test_use_stream.py"))
    print(f"== fast paths vs their general paths, µs per call ({device})")
    print(f"{'path':28} {'fast':>8} {'general':>8} {'general/fast':>13}  held equal by")
    for name, fast, general, test in rows:
        print(f"{name:28} {fast:8.2f} {general:8.2f} {general / fast:13.2f}  {test}")
    pool.close()


if __name__ == "__main__":
    main()
