"""The staging workload of ``pinpool bench``: five sampling-shaped fields per stage.

Patterns compared in one run, on the same Python lists:
- ``sync``: a ``torch.tensor`` built straight on the device per field (pageable copy + stream sync);
- ``pinned``: per field ``torch.tensor(list, pin_memory=True).to(non_blocking=True)``
  (sglang PR #28076): no sync, one pinned allocation and one copy per field (on CPU the
  same code without pinning, which does not exist there);
- ``persistent``: one persistent pinned buffer per field, one event wait per stage, one
  copy per field (the vLLM V1 runner's shape);
- ``pool``: one ``PinnedRingBuffer`` stage: five puts, one copy.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from pinpool.bench.kit import BenchContext, Spread, Table, host_allocs, host_us_spread, one_thread_on_cpu, ratio
from pinpool.ring import PinnedRingBuffer
from pinpool.settings import PoolSettings

FIELDS: tuple[torch.dtype, ...] = (torch.float32, torch.float32, torch.int32, torch.float32, torch.int64)
MODES = ("sync", "pinned", "persistent", "pool")


def field_lists(bs: int, seed: int = 0) -> list[list[Any]]:
    """The five sampling-shaped Python lists every staging workload stages (shared with zero_copy)."""
    rng = random.Random(seed)
    return [
        [rng.uniform(0.1, 1.5) for _ in range(bs)],
        [rng.uniform(0.5, 1.0) for _ in range(bs)],
        [rng.randint(1, 100) for _ in range(bs)],
        [rng.uniform(0.0, 0.2) for _ in range(bs)],
        [rng.randint(0, 2**40) for _ in range(bs)],
    ]


def make_step(mode: str, bs: int, device: torch.device, pool: PinnedRingBuffer | None) -> Callable[[], Any]:
    """One host-side staging step of ``mode`` for batch size ``bs``."""
    lists = field_lists(bs)
    pin = device.type == "cuda"
    if mode == "sync":
        return lambda: [
            torch.tensor(v, dtype=d, device=device)  # sync-ok: the synchronous pattern under comparison
            for v, d in zip(lists, FIELDS, strict=True)
        ]
    if mode == "pinned":
        return lambda: [
            torch.tensor(v, dtype=d, pin_memory=pin).to(device, non_blocking=True)
            for v, d in zip(lists, FIELDS, strict=True)
        ]
    if mode == "persistent":
        hosts = [torch.empty(bs, dtype=d, pin_memory=pin) for d in FIELDS]
        host_np = [h.numpy() for h in hosts]
        devs = [torch.empty(bs, dtype=d, device=device) for d in FIELDS]
        event = torch.cuda.Event() if pin else None  # type: ignore[no-untyped-call]

        def persistent() -> list[torch.Tensor]:
            if event is not None:
                event.synchronize()  # sync-ok: the pattern under test waits once per stage
            for h_np, v in zip(host_np, lists, strict=True):
                h_np[:] = v
            for dv, h in zip(devs, hosts, strict=True):
                dv.copy_(h, non_blocking=True)
            if event is not None:
                event.record()
            return devs

        return persistent
    assert mode == "pool" and pool is not None

    def staged() -> list[torch.Tensor]:
        with pool.stage() as st:
            return [st.put(v, d) for v, d in zip(lists, FIELDS, strict=True)]

    return staged


def workload(ctx: BenchContext) -> list[Table]:
    with one_thread_on_cpu(ctx):
        return _tables(ctx)


def _tables(ctx: BenchContext) -> list[Table]:
    pool = PinnedRingBuffer(PoolSettings.from_env(device=ctx.device, num_slots=8, slot_bytes=1 << 20))
    modes = [m for m in MODES if m in ctx.modes]
    base = "pinned" if "pinned" in modes else "sync"
    rows = []
    for bs in ctx.batch_sizes:
        ctx.progress(f"staging bs={bs}")
        us: dict[str, Spread] = {}
        allocs: dict[str, int] = {}
        for mode in modes:
            step = make_step(mode, bs, ctx.device, pool)
            before = host_allocs()
            us[mode] = host_us_spread(ctx, step)
            allocs[mode] = host_allocs() - before
        rows.append(
            (
                bs,
                *(us.get(m) for m in MODES),
                ratio(us.get(base), us["pool"]),
                # Pinned allocations exist only on CUDA: on CPU the columns are left out.
                *(allocs.get(m) if ctx.is_cuda else None for m in MODES),
            )
        )
    stats = pool.stats()
    pool.close()
    notes = [
        f"host µs per stage of 5 fields {[str(d).removeprefix('torch.') for d in FIELDS]}: median (min-max) over "
        f"{ctx.repeats} blocks of up to {ctx.iters} stages; pool made {stats.copies} copies in {stats.stages} stages, "
        f"{stats.stalls} stalls",
        f"{base}/pool = ratio of the medians",
    ]
    columns = ("bs", *(f"{m} µs" for m in MODES), f"{base}/pool", *(f"{m} allocs" for m in MODES))
    return [Table.build("staging: host µs per stage", columns, rows, notes)]
