"""What every ``pinpool bench`` workload shares: the context, result tables, host timing.

Workloads register under the ``pinpool.bench`` entry-point group (see pyproject.toml),
so sampling and memcache add theirs without pinpool importing them.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch


@attrs.frozen
class BenchContext:
    device: torch.device
    batch_sizes: tuple[int, ...]
    iters: int
    repeats: int = 3
    #: Print progress lines to stderr (long runs); tables go to stdout.
    verbose: bool = True
    #: Staging modes to run (workloads skip the ones they cannot show on this device).
    modes: tuple[str, ...] = ("sync", "pinned", "persistent", "pool")
    #: Decode-loop settings: new tokens per request and running-batch sizes (None: defaults).
    steps: int | None = None
    running: tuple[int, ...] | None = None

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def progress(self, message: str) -> None:
        if self.verbose:
            print(f"  .. {message}", file=sys.stderr, flush=True)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)  # sync-ok: benchmark clock boundary, outside any hot path


@attrs.frozen
class Table:
    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]
    notes: tuple[str, ...] = ()

    def render(self) -> str:
        cells = [[_fmt(v) for v in row] for row in self.rows]
        widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(self.columns)]
        line = "  ".join(c.rjust(w) for c, w in zip(self.columns, widths, strict=True))
        out = [f"== {self.title}", line, "-" * len(line)]
        out += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)

    def as_json(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "notes": list(self.notes),
            "rows": [dict(zip(self.columns, r, strict=True)) for r in self.rows],
        }


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


@attrs.frozen
class Spread:
    """Host µs per call over the repeats: every figure is shown with its spread, not alone."""

    min: float
    median: float
    max: float

    @classmethod
    def of(cls, samples: list[float]) -> Spread:
        return cls(min(samples), statistics.median(samples), max(samples))


def host_us_spread(ctx: BenchContext, fn: Callable[[], Any], iters: int | None = None) -> Spread:
    """Host µs per call of ``fn`` in each of ``ctx.repeats`` blocks: min, median, max.

    Each block synchronises before reading the clock at both ends, so queued device work
    from one block cannot hide in the next (one sync per block, amortised over iters).
    """
    n = iters or ctx.iters
    for _ in range(max(3, n // 10)):
        fn()
    samples = []
    for _ in range(ctx.repeats):
        ctx.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        ctx.synchronize()
        samples.append((time.perf_counter() - start) / n * 1e6)
    return Spread.of(samples)


def host_us_per_call(ctx: BenchContext, fn: Callable[[], Any], iters: int | None = None) -> float:
    """The median of ``host_us_spread``."""
    return host_us_spread(ctx, fn, iters).median


def host_allocs() -> int:
    """Pinned host allocations so far (cudaHostAlloc calls by torch's caching host allocator)."""
    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.host_memory_stats().get("num_host_alloc", 0))
