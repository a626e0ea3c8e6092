"""pinpool: the command line. pinpool bench runs every registered workload and prints its tables.

Each figure is host µs per call (device µs where a column says so), shown as
median (min-max) over the repeats. Progress lines and log events go to stderr; tables to stdout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from pathlib import Path

import torch

from pinpool import __version__
from pinpool.bench.kit import MODES, BenchContext, Cell, Table
from pinpool.bench.stderr_log import LOG_LEVEL_ENV, level_from_env, log_to_stderr

Workload = Callable[[BenchContext], list[Table]]

#: What each built-in workload measures (--help); a workload registered elsewhere shows its name alone.
WORKLOAD_HELP = {
    "staging": "five sampling-shaped fields per stage, every mode, per batch size",
    "sampling": "SamplingBatchInfo builds per batch size; on CUDA also the sampler's eager draw vs one Triton kernel",
    "memcache": "write_cache_indices per batch size; on CUDA also its Triton kernel vs sglang's (device µs)",
    "decode": "the reference decode loop, every mode, per running-batch size; token streams compared across modes",
    "decode_graph": "decode replayed as CUDA graphs (host-bound and GPU-bound models), per staging mode, with the "
    "eager loop",
}
CPU_LINE = (
    "CPU run: no pinned memory, async copies or GPU exist here, so every mode copies plain memory and these "
    "figures show only Python-side host cost (the pool can come out slower); the comparison pinpool is for "
    "needs a CUDA device."
)


def registered_workloads() -> dict[str, Workload]:
    found = {ep.name: ep for ep in entry_points(group="pinpool.bench")}
    if not found:  # running from a source tree that was never installed
        from pinpool.bench.staging import workload

        return {"staging": workload}
    return {name: ep.load() for name, ep in sorted(found.items())}


def _workload_names() -> list[str]:
    return sorted({ep.name for ep in entry_points(group="pinpool.bench")} or {"staging"})


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers (got {text!r})") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1 (got {text!r})")
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 (got {text!r})") from exc
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 (got {text!r})")
    return value


def _device(text: str) -> torch.device:
    """A device this run can use, resolved ('cuda' becomes 'cuda:<current>'), or argparse's one-line error."""
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N (got {text!r})") from exc
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N: no {device.type} path here (got {text!r})")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"this torch ({torch.__version__}) sees no CUDA device; use --device cpu (got {text!r})"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"expected an index below the {torch.cuda.device_count()} visible CUDA devices (got {text!r})"
            )
    return device


_Formatter = argparse.RawDescriptionHelpFormatter  # keeps the epilog's lists; each help states its default
DEFAULT_BATCH_SIZES = (1, 64, 256, 1024, 4096)


def _epilog() -> str:
    width = max(map(len, [*MODES, *WORKLOAD_HELP]))
    workloads = "\n".join(f"  {w:{width}}  {WORKLOAD_HELP.get(w, '')}".rstrip() for w in _workload_names())
    modes = "\n".join(f"  {m:{width}}  {what}" for m, what in MODES.items())
    return (
        f"workloads (registered through the pinpool.bench entry-point group):\n{workloads}\n\n"
        f"modes (each workload runs the ones it has):\n{modes}\n\n"
        f"environment:\n  {LOG_LEVEL_ENV}  level of pinpool's log events on stderr (debug, info, warning, error; "
        "default warning)\n\n"
        "examples:\n"
        "  pinpool bench\n"
        "  pinpool bench --workloads staging,sampling --batch-sizes 1,256 --repeats 5\n"
        "  pinpool bench --json bench.json --plot bench.png   # --plot needs pip install 'pinpool[plot]'"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pinpool", description=__doc__, formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"pinpool {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser(
        "bench",
        help="run the benchmarks on the device found (or --device)",
        description=__doc__,
        epilog=_epilog(),
        formatter_class=_Formatter,
    )
    bench.add_argument(
        "--device", type=_device, default=None, help="cpu, cuda or cuda:N (default: cuda if available, else cpu)"
    )
    bench.add_argument(
        "--batch-sizes",
        type=_ints,
        default=DEFAULT_BATCH_SIZES,
        help=f"comma-separated batch sizes (default: {','.join(map(str, DEFAULT_BATCH_SIZES))})",
    )
    bench.add_argument(
        "--iters",
        type=_positive,
        default=100,
        help="timed calls per block, fewer when one block would pass 0.25 s (default: 100)",
    )
    bench.add_argument(
        "--repeats",
        type=_positive,
        default=3,
        help="blocks per figure; decode loops: rounds per mode, at most 5 for graph decode (default: 3)",
    )
    bench.add_argument(
        "--workloads",
        default=",".join(_workload_names()),
        help="comma-separated subset of the workloads below (default: all)",
    )
    bench.add_argument(
        "--modes",
        default=",".join(MODES),
        help="comma-separated subset of the modes below, including pool (default: all)",
    )
    bench.add_argument(
        "--steps",
        type=_positive,
        default=None,
        help="decode loop: new tokens per request (default: 32 on CUDA, 12 on CPU)",
    )
    bench.add_argument(
        "--running",
        type=_ints,
        default=None,
        help="decode loop: running-batch sizes (default: 64,256 on CUDA, 8 on CPU)",
    )
    bench.add_argument(
        "--json",
        type=Path,
        default=None,
        help="also write the tables to this file as strict JSON (null where no figure)",
    )
    bench.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="also draw the figures into this PNG: a panel per batch-size table, one for the decode loop",
    )
    bench.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser


def _error(message: str) -> int:
    print(f"pinpool bench: {message}", file=sys.stderr)
    return 2


def _plot_unavailable() -> str | None:
    """Why --plot cannot work here, checked before any benchmark runs; None if it can."""
    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return None
    return (
        f"--plot needs matplotlib, which {sys.executable} cannot import. Install it into this environment: "
        f"{sys.executable} -m pip install 'pinpool[plot]' (in a source checkout: "
        f"{sys.executable} -m pip install -e '.[plot]'), or leave out --plot"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        level = level_from_env(default=logging.WARNING)
    except ValueError as exc:
        return _error(str(exc))
    # The command line is an application: it picks the level of pinpool's stderr events,
    # and puts the previous one back for a caller that runs it in-process.
    previous = log_to_stderr(level)
    try:
        return _bench(args)
    except Exception as exc:
        # A command line answers in one line; the traceback is for whoever asks for debug.
        if level <= logging.DEBUG:
            raise
        return _error(f"{type(exc).__name__}: {exc} ({LOG_LEVEL_ENV}=debug shows the traceback)")
    finally:
        log_to_stderr(previous)


def _bench(args: argparse.Namespace) -> int:
    modes = tuple(m for m in args.modes.split(",") if m)
    bad = [m for m in modes if m not in MODES]
    if bad or "pool" not in modes:
        return _error(f"--modes must list modes of {','.join(MODES)} and include pool (got {args.modes})")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None and not path.resolve().parent.is_dir():
            return _error(f"{flag} {path}: the folder {path.resolve().parent} does not exist")
    if args.plot is not None and (why := _plot_unavailable()):
        return _error(why)
    workloads = registered_workloads()
    chosen = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in chosen if w not in workloads]
    if unknown:
        return _error(f"unknown workload(s) {unknown}; registered: {sorted(workloads)}")
    device = args.device or _device("cuda" if torch.cuda.is_available() else "cpu")
    ctx = BenchContext(
        device,
        args.batch_sizes,
        args.iters,
        args.repeats,
        verbose=not args.quiet,
        modes=modes,
        steps=args.steps,
        running=args.running,
    )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"pinpool {__version__} bench on {device} ({name}), torch {torch.__version__}")
    if device.type != "cuda":
        print(CPU_LINE)
    produced: dict[str, list[Table]] = {}
    failed, skipped = [], []
    for workload in chosen:
        try:
            tables = workloads[workload](ctx)
        except Exception as exc:  # one broken workload must not hide the others' figures
            failed.append(workload)
            print(f"== {workload}: FAILED: {type(exc).__name__}: {exc}", flush=True)
            continue
        if not tables:  # a workload returns nothing where its subject does not exist (GPU kernels on CPU)
            skipped.append(workload)
            need = "needs a CUDA device" if device.type != "cuda" else "produced no table"
            print(f"== {workload}: not run on {device}: it {need}", flush=True)
            continue
        produced[workload] = tables
        for table in tables:
            print(table.render(), flush=True)
    print(summary(produced, failed, skipped), flush=True)
    if args.json is not None:
        payload = {
            "pinpool": __version__,
            "device": str(device),
            "device_name": name,
            "torch": torch.__version__,
            "failed": failed,
            "skipped": skipped,
            "tables": [t.as_json() | {"workload": w} for w, tables in produced.items() for t in tables],
        }
        args.json.write_text(json.dumps(payload, indent=2, allow_nan=False))
    if args.plot is not None:
        from pinpool.bench.plot import plot_workloads

        plot_workloads(produced, args.plot, f"{name}, torch {torch.__version__}")
    # Nothing measured (every workload chosen needs another device) is not a success either.
    return 1 if failed or not produced else 0


def headline_ratio(table: Table) -> str | None:
    """The table's first ratio column ("sync/pool", "x", "x host"), or None when it has none (a rate: "tokens/s")."""
    return next((c for c in table.columns if ("/" in c and not c.endswith("/s")) or c.split(" ")[0] == "x"), None)


def _ratio_text(cell: Cell) -> str:
    if isinstance(cell, (int, float)) and not isinstance(cell, bool) and math.isfinite(cell):
        return f"{cell:.2f}"
    return "-"


def summary(produced: dict[str, list[Table]], failed: Sequence[str], skipped: Sequence[str]) -> str:
    """The closing block: each table's headline ratio per row, then what failed or did not run."""
    lines = ["== summary: each table's first ratio column (ratio of medians, as its table defines it)"]
    for tables in produced.values():
        for table in tables:
            column = headline_ratio(table)
            if column is None:
                continue
            # Rows are named by their first column, and the second too where the first repeats (bs, readers).
            width = 1 if len(set(table.column(table.columns[0]))) == len(table.rows) else 2
            key = ",".join(table.columns[:width])
            at = table.columns.index(column)
            cells = "  ".join(f"{','.join(map(str, row[:width]))}: {_ratio_text(row[at])}" for row in table.rows)
            lines.append(f"{table.title} [{key} -> {column}]  {cells}")
    if len(lines) == 1:
        lines.append("no table has a ratio column")
    if skipped:
        lines.append(f"not run on this device: {', '.join(skipped)}")
    if failed:
        lines.append(f"FAILED: {', '.join(failed)}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
