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

from pinpool import Field, Layout, PinnedRingBuffer, PoolSettings
from pinpool.readback import Landing

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


def _landing_write_pair(pool: PinnedRingBuffer, bs: int) -> tuple[float, float]:
    """An eager step's landing addresses and handle: written whole (every row live), or sliced to the live rows."""
    layout = Layout([Field("a", torch.int64), Field.landing("out", torch.int64)], max_rows=bs)
    with pool.stage(layout, rows=bs) as st:
        st.put("a", list(range(bs)))
        placed, mem, n = st._placed, st._mem, bs * 8
        assert placed is not None
        addresses, column, landed = placed.landed[0]

        def whole() -> object:
            addresses[:] = column
            return Landing(pool, mem, landed, False)

        def sliced() -> object:
            addresses[:n] = column[:n]
            return Landing(pool, mem, landed[:bs], False)

        times = _median_us(whole), _median_us(sliced)
        st.flush()
    return times


def main() -> None:
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    pool = PinnedRingBuffer(PoolSettings(device=device, num_slots=8, slot_bytes=1 << 20))
    zc_pool = PinnedRingBuffer(PoolSettings(device=device, num_slots=8, slot_bytes=1 << 20, zero_copy=True))
    rows = []
    for bs in BS:
        values = list(range(1000, 1000 + bs))
        # struct packs a list straight into the slot; a tuple takes numpy's list parse and its checks.
        fast = _median_us(_stage_with(pool, values))
        general = _median_us(_stage_with(pool, tuple(values)))
        rows.append((f"list put, bs {bs}", fast, general, "test_pack_list.py"))
    for bs in BS:
        # A layout field's live rows: struct packs a list into the field; a tuple takes ``Placed.put``.
        layout = Layout([Field("ids", torch.int64)], max_rows=bs)
        values = list(range(1000, 1000 + bs))

        def field_put(v: object, layout: Layout = layout, bs: int = bs) -> Callable[[], object]:
            def step() -> object:
                with pool.stage(layout, rows=bs) as st:
                    return st.put("ids", v)

            return step

        rows.append(
            (
                f"layout field put, bs {bs}",
                _median_us(field_put(values)),
                _median_us(field_put(tuple(values))),
                "test_pack_list.py",
            )
        )
    if zc_pool.can_land:
        for bs in BS:
            fast, general = _landing_write_pair(zc_pool, bs)
            rows.append((f"eager landing write, bs {bs}", fast, general, "test_landing.py (live below and at rows)"))
    src = torch.arange(64, dtype=torch.int64, device=device)
    mem = pool._slots[0]

    def readback_miss() -> object:
        mem.views.clear()
        return mem.readback_views(src, 0, pool.device)

    rows.append(
        (
            "read-back views (kept)",
            _median_us(lambda: mem.readback_views(src, 0, pool.device)),
            _median_us(readback_miss),
            "test_readback.py",
        )
    )
    transport = pool.transport
    if hasattr(transport, "capturing"):  # the CUDA transport; the host path captures nothing
        fast = _median_us(lambda: transport.resolve_for_stage(None))
        general = _median_us(lambda: (s := transport.resolve_stream(None), transport.capturing(s)))
        rows.append(("stream + capture question", fast, general, "test_use_stream.py"))
    print(f"== fast paths vs their general paths, µs per call ({device})")
    print(f"{'path':28} {'fast':>8} {'general':>8} {'general/fast':>13}  held equal by")
    for name, fast, general, test in rows:
        print(f"{name:28} {fast:8.2f} {general:8.2f} {general / fast:13.2f}  {test}")
    pool.close()
    zc_pool.close()


if __name__ == "__main__":
    main()
