"""The zero-copy workload of ``pinpool bench``: where reading pinned memory in place beats one copy.

Per batch size and reader count, one step stages five sampling-shaped fields from Python
lists and launches the readers: each reader is one kernel that reads all five fields
(``torch.cat`` of their bytes into device memory). Three ways to stage:
- ``copy``: a ``PinnedRingBuffer`` stage: five puts, one copy, the slot's fence;
- ``zero-copy``: a ``PinnedRingBuffer`` zero-copy stage: five puts, no copy, the readers
  read the pinned slot over PCIe, the slot's fence after them;
- ``uva-ring``: vLLM's ``UvaBufferPool`` rebuilt here (not its file): per field a
  round-robin ring of 2 pinned buffers with UVA views, written with ``np[:n] = list``, no
  per-slot guard (correct only while at most 2 steps are in flight).

Figures: host µs per step (staging and reader launches); device µs per step (the GPU
running queued steps back to back: the copy, if any, and the readers); and wrong reads
out of ``LAG_STEPS`` steps under unbounded random GPU lag.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from pinpool.bench.kit import BenchContext, Spread, Table, host_us_spread, ratio
from pinpool.bench.numa import gpu_numa_node, host_numa_node
from pinpool.bench.staging import FIELDS, field_lists
from pinpool.platform import device_alias
from pinpool.ring import PinnedRingBuffer
from pinpool.settings import PoolSettings

MODES = ("copy", "zero-copy", "uva-ring")
READERS = (1, 4)
#: Steps queued back to back behind a GPU sleep for the device figure; the ring is deeper.
DEVICE_STEPS = 32
LAG_STEPS = 200
LAG_CYCLES = 2_000_000  # ~1 ms of GPU sleep, drawn at random per lagging step

Step = Callable[[list[list[Any]]], list[torch.Tensor]]


class UvaRing:
    """vLLM's ``UvaBufferPool`` shape, one per field: ``max_concurrency`` pinned buffers, round robin, no guard."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device, depth: int = 2) -> None:
        pin = device.type == "cuda"
        self.cpu = [torch.zeros(size, dtype=dtype, pin_memory=pin) for _ in range(depth)]
        self.np = [c.numpy() for c in self.cpu]
        # UVA view of each pinned buffer (vLLM: get_accelerator_view_from_cpu_tensor); on
        # CPU the buffer itself.
        self.uva = [device_alias(c.view(torch.uint8), device).view(dtype) if pin else c for c in self.cpu]
        self.depth = depth
        self.curr = 0

    def copy_to_uva(self, x: list[Any]) -> torch.Tensor:
        self.curr = (self.curr + 1) % self.depth
        n = len(x)
        self.np[self.curr][:n] = x
        return self.uva[self.curr][:n]


def uva_stager(bs: int, device: torch.device) -> Step:
    """Stage five lists into vLLM-shaped UVA rings; returns the device-readable views."""
    rings = [UvaRing(bs, d, device) for d in FIELDS]
    return lambda lists: [r.copy_to_uva(v) for r, v in zip(rings, lists, strict=True)]


def make_step(
    mode: str, bs: int, readers: int, device: torch.device, pool: PinnedRingBuffer, lists: list[list[Any]]
) -> Callable[[], list[torch.Tensor]]:
    """One step: stage the five fields and launch ``readers`` kernels that read them all."""

    def read(fields: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.cat([f.view(torch.uint8) for f in fields]) for _ in range(readers)]

    if mode == "uva-ring":
        stage_uva = uva_stager(bs, device)
        return lambda: read(stage_uva(lists))
    zero_copy = mode == "zero-copy"

    def step() -> list[torch.Tensor]:
        with pool.stage(zero_copy=zero_copy) as st:
            fields = [st.put(v, d) for v, d in zip(lists, FIELDS, strict=True)]
            if zero_copy:
                return read(fields)  # launched before close: the slot's fence covers them
        return read(fields)

    return step


def device_us(ctx: BenchContext, step: Callable[[], Any], host_us: float) -> float | None:
    """Device µs per step with ``DEVICE_STEPS`` steps queued behind a GPU sleep, so they run back to back."""
    if not ctx.is_cuda:
        return None
    stream = torch.cuda.current_stream(ctx.device)
    start, end, awake = (torch.cuda.Event(enable_timing=True) for _ in range(3))  # type: ignore[no-untyped-call]
    ctx.synchronize()
    # ~2 GHz: sleep twice as long as the host takes to queue the steps.
    torch.cuda._sleep(int(max(2e7, host_us * DEVICE_STEPS * 4000)))  # type: ignore[no-untyped-call]
    awake.record(stream)
    start.record(stream)
    for _ in range(DEVICE_STEPS):
        step()
    end.record(stream)
    gapless = not awake.query()  # type: ignore[no-untyped-call]
    end.synchronize()  # sync-ok: benchmark clock boundary
    return start.elapsed_time(end) * 1000 / DEVICE_STEPS if gapless else None


def wrong_under_lag(ctx: BenchContext, mode: str, bs: int, pool: PinnedRingBuffer) -> int | None:
    """Steps out of ``LAG_STEPS`` whose reader saw another step's seeds, under unbounded random GPU lag."""
    if not ctx.is_cuda:
        return None
    rng = random.Random(bs)
    base = field_lists(bs)
    seen: list[tuple[torch.Tensor, int]] = []
    stage_uva = uva_stager(bs, ctx.device) if mode == "uva-ring" else None
    for n in range(LAG_STEPS):
        lists = [*base[:4], [n] * bs]
        if rng.random() < 0.5:
            torch.cuda._sleep(rng.randint(0, LAG_CYCLES))  # type: ignore[no-untyped-call]
        if stage_uva is not None:
            seen.append((stage_uva(lists)[4] + 0, n))
            continue
        with pool.stage(zero_copy=mode == "zero-copy") as st:
            fields = [st.put(v, d) for v, d in zip(lists, FIELDS, strict=True)]
            if mode == "zero-copy":
                seen.append((fields[4] + 0, n))
        if mode == "copy":
            seen.append((fields[4] + 0, n))
    ctx.synchronize()
    return sum(not bool((got == want).all()) for got, want in seen)  # sync-ok: after the sync above


def workload(ctx: BenchContext) -> list[Table]:
    slot_bytes = max(1 << 16, -(-max(ctx.batch_sizes) * 32 // 4096) * 4096)
    settings = PoolSettings.from_env(
        device=ctx.device, num_slots=DEVICE_STEPS * 2, slot_bytes=slot_bytes, zero_copy=True
    )
    pool = PinnedRingBuffer(settings)
    if not pool.platform.zero_copy_ok:
        return [Table.build("zero-copy: refused", ("reason",), [(pool.platform.reason,)])]
    rows = []
    for bs in ctx.batch_sizes:
        lists = field_lists(bs)
        for readers in READERS:
            ctx.progress(f"zero-copy bs={bs} readers={readers}")
            host: dict[str, Spread] = {}
            dev: dict[str, float | None] = {}
            for mode in MODES:
                step = make_step(mode, bs, readers, ctx.device, pool, lists)
                host[mode] = host_us_spread(ctx, step)
                dev[mode] = device_us(ctx, step, host[mode].median)
            wrong = {m: wrong_under_lag(ctx, m, bs, pool) if readers == 1 else None for m in MODES}
            rows.append(
                (
                    bs,
                    readers,
                    *(host[m] for m in MODES),
                    ratio(host["copy"], host["zero-copy"]),
                    ratio(host["uva-ring"], host["zero-copy"]),
                    *(dev[m] for m in MODES),
                    *(wrong[m] for m in MODES),
                )
            )
    stats = pool.stats()
    slab_node, gpu_node = host_numa_node(pool.host_slab.data_ptr()), gpu_numa_node(pool.device.index or 0)
    pool.close()
    notes = [
        "one step = 5 fields staged from Python lists + `readers` kernels, each reading all 5 fields "
        "(torch.cat of their bytes); host µs: median (min-max) over blocks",
        "uva-ring = vLLM's UvaBufferPool rebuilt here faithfully (per field 2 pinned buffers, round robin, "
        "np[:n] = list, a UVA view per buffer, no per-slot guard), not its file",
        f"device µs: {DEVICE_STEPS} steps queued behind a GPU sleep, run back to back (- when the sleep ended "
        "early); copy includes its H2D copy, zero-copy and uva-ring read over PCIe in every reader",
        f"wrong: steps of {LAG_STEPS} (readers=1) whose reader saw another step's values under random GPU lag "
        "with no bound on steps in flight",
        f"platform: {pool.platform.reason}; slab NUMA node {slab_node}, GPU NUMA node {gpu_node}; "
        f"pool: {stats.copies} copies, {stats.zero_copy_stages} zero-copy stages, "
        f"{stats.stalls} stalls",
    ]
    columns = (
        "bs",
        "readers",
        *(f"{m} µs" for m in MODES),
        "copy/zero-copy",
        "uva-ring/zero-copy",
        *(f"{m} dev µs" for m in MODES),
        *(f"{m} wrong" for m in MODES),
    )
    return [Table.build("zero-copy vs copy vs vLLM's UVA ring: µs per step", columns, rows, notes)]
