"""What every ``pinpool bench`` workload shares: the context, result tables, host timing.

Workloads register under the ``pinpool.bench`` entry-point group (see pyproject.toml),
so sampling and memcache add theirs without pinpool importing them.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import attrs
import torch

from pinpool.bench.stderr_log import log_to_stderr, stderr_level

#: When this process imported the kit (the zero of the progress lines' clock).
_STARTED = time.perf_counter()

#: The staging modes ``pinpool bench`` compares, and what each one is.
MODES: dict[str, str] = {
    "sync": "torch.tensor(values, device=...) per field: a pageable copy that blocks the host",  # sync-ok: text
    "pinned": "torch.tensor(values, pin_memory=True).to(device, non_blocking=True) per field (sglang PR #28076)",
    "persistent": "one pinned buffer per field, kept across steps; one event wait per step",
    "pool": "a PinnedRingBuffer stage: every field into one slot, one copy",
    "owned": "a pool stage copied into memory the batch owns (sampling only)",
}

#: A timed block stops early once it passes this many seconds (slow modes on slow hosts).
BLOCK_SECONDS = 0.25


@attrs.frozen
class BenchContext:
    """What a workload is asked to measure: device, sizes, repeats, modes.

    Example, a workload's skeleton::

        def workload(ctx: BenchContext) -> list[Table]:
            rows = [(bs, host_us_spread(ctx, make_step(bs))) for bs in ctx.batch_sizes]
            return [Table.build("mine: host µs per call", ("bs", "pool µs"), rows)]
    """

    device: torch.device
    batch_sizes: tuple[int, ...]
    iters: int
    repeats: int = 3
    #: Print progress lines to stderr (long runs); tables go to stdout.
    verbose: bool = True
    #: Staging modes to run (each workload runs the ones it has).
    modes: tuple[str, ...] = tuple(MODES)
    #: Decode-loop settings: new tokens per request and running-batch sizes (None: defaults).
    steps: int | None = None
    running: tuple[int, ...] | None = None

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def progress(self, message: str) -> None:
        if self.verbose:
            # The process's clock in each line: a boxed run killed mid-way still says where its time went.
            print(f"  .. [{time.perf_counter() - _STARTED:7.1f} s] {message}", file=sys.stderr, flush=True)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)  # sync-ok: benchmark clock boundary, outside any hot path


@attrs.frozen
class Spread:
    """One figure over the repeats: min, median and max, shown together as ``median (min-max)``.

    >>> Spread.of([12.0, 10.0, 15.5]).render()
    '12.0 (10.0-15.5)'
    """

    min: float
    median: float
    max: float

    @classmethod
    def of(cls, samples: Iterable[float]) -> Spread:
        values = list(samples)
        return cls(min(values), statistics.median(values), max(values))

    def render(self) -> str:
        if self.min == self.max:
            return _num(self.median)
        return f"{_num(self.median)} ({_num(self.min)}-{_num(self.max)})"

    def as_json(self) -> dict[str, float | None]:
        return {"median": _finite(self.median), "min": _finite(self.min), "max": _finite(self.max)}


Cell = Spread | float | int | str | bool | None


@attrs.frozen
class Table:
    """One result table: a title, columns, rows of cells, notes.

    Cells are ``Spread`` (rendered ``median (min-max)``, JSON ``{"median", "min", "max"}``),
    numbers, strings, or ``None`` where a figure does not exist on this device (``-`` in
    text, ``null`` in JSON). ``Table.build`` leaves out columns with no figure at all.

    >>> print(Table.build("demo", ("bs", "pool µs", "GPU µs"), [(1, Spread(2.0, 2.5, 3.0), None)]).render())
    == demo
    bs           pool µs
    --------------------
     1  2.50 (2.00-3.00)
    """

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Cell, ...], ...]
    notes: tuple[str, ...] = ()

    @classmethod
    def build(
        cls, title: str, columns: Sequence[str], rows: Sequence[Sequence[Cell]], notes: Sequence[str] = ()
    ) -> Table:
        """A table without the columns where every row is ``None`` (GPU-only figures on CPU)."""
        keep = [i for i in range(len(columns)) if any(_present(row[i]) for row in rows)] if rows else []
        return cls(
            title,
            tuple(columns[i] for i in keep),
            tuple(tuple(row[i] for i in keep) for row in rows),
            tuple(notes),
        )

    def render(self) -> str:
        cells = [[_fmt(v) for v in row] for row in self.rows]
        widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(self.columns)]
        line = "  ".join(c.rjust(w) for c, w in zip(self.columns, widths, strict=True))
        out = [f"== {self.title}", line, "-" * len(line)]
        out += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)

    def as_json(self) -> dict[str, Any]:
        """Plain JSON values only: no NaN or infinity (``null`` instead), spreads as objects."""
        return {
            "title": self.title,
            "notes": list(self.notes),
            "rows": [{c: _json(v) for c, v in zip(self.columns, r, strict=True)} for r in self.rows],
        }

    def column(self, name: str) -> list[Cell]:
        i = self.columns.index(name)
        return [row[i] for row in self.rows]


def _present(value: Cell) -> bool:
    return value is not None and not (isinstance(value, float) and not math.isfinite(value))


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _json(value: Cell) -> Any:
    if isinstance(value, Spread):
        return value.as_json()
    if isinstance(value, float):
        return _finite(value)
    return value


def _num(value: float) -> str:
    if not math.isfinite(value):
        return "-"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"


def _fmt(value: Cell) -> str:
    if isinstance(value, Spread):
        return value.render()
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value)
    if isinstance(value, float):
        return _num(value)
    return str(value)


def ratio(num: Cell, den: Cell) -> float | None:
    """``num / den`` of two figures' medians, or None where either is missing."""
    a = num.median if isinstance(num, Spread) else num
    b = den.median if isinstance(den, Spread) else den
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or not b:
        return None
    return float(a) / float(b)


def host_us_spread(ctx: BenchContext, fn: Callable[[], Any], iters: int | None = None) -> Spread:
    """Host µs per call of ``fn`` in each of ``ctx.repeats`` blocks: min, median, max.

    Each block synchronises before reading the clock at both ends, so queued device work
    from one block cannot hide in the next (one sync per block, amortised over iters). A
    block holds ``iters`` calls, fewer (at least 3) when the warm-up says it would take
    longer than ``BLOCK_SECONDS``.
    """
    n = iters or ctx.iters
    warm, start = 0, time.perf_counter()
    while warm < max(3, n // 10) and (warm < 2 or time.perf_counter() - start < BLOCK_SECONDS):
        fn()
        warm += 1
    ctx.synchronize()
    per_call = (time.perf_counter() - start) / warm
    n = max(3, min(n, int(BLOCK_SECONDS / per_call) if per_call > 0 else n))
    samples = []
    for _ in range(ctx.repeats):
        ctx.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        ctx.synchronize()
        samples.append((time.perf_counter() - start) / n * 1e6)
    return Spread.of(samples)


@contextmanager
def one_thread_on_cpu(ctx: BenchContext) -> Iterator[None]:
    """On a CPU run, torch on one thread for the block: a copy above 32 KiB wakes its thread pool,
    which costs milliseconds per call and would swamp the host figures of every mode alike."""
    threads = torch.get_num_threads()
    if not ctx.is_cuda:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def host_allocs() -> int:
    """Pinned host allocations so far (cudaHostAlloc calls by torch's caching host allocator)."""
    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.host_memory_stats().get("num_host_alloc", 0))


def run_isolated(fn: Callable[..., Any], jobs: Sequence[tuple[Any, ...]]) -> list[Any]:
    """``[fn(*job) for job in jobs]``, run in one fresh child process (spawned), in order.

    For passes that profile: once ``torch.profiler`` has traced CUDA activity, CUPTI stays
    attached to the process (Kineto does not tear it down; pytorch/pytorch#144455) and
    every later CUDA runtime call carries its overhead (``tests/bench/diag_replay.py`` shows
    a decode graph's ``replay()`` several times slower on the host after a profiled pass in
    the same process). A workload times first, then counts here, so no timing in the
    bench's process ever runs under CUPTI.
    ``fn`` must be importable at module level and its results picklable.
    """
    if not jobs:
        return []
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(
        max_workers=1,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=log_to_stderr,
        initargs=(stderr_level(),),  # the caller's stderr logging (the CLI sets one), in the child too
    ) as child:
        return list(child.map(_call, [(fn, job) for job in jobs]))


def _call(packed: tuple[Callable[..., Any], tuple[Any, ...]]) -> Any:
    fn, args = packed
    return fn(*args)


def counted_or_none(fn: Callable[..., Any], jobs: Sequence[tuple[Any, ...]]) -> list[Any] | None:
    """``run_isolated(fn, jobs)``, or None (said on stderr) when the child fails: the timings stand."""
    try:
        return run_isolated(fn, jobs)
    except Exception as err:  # a counting pass is a side figure: its failure leaves its columns empty
        print(f"  !! counting passes failed, their columns stay empty: {err!r}", file=sys.stderr, flush=True)
        return None
