"""``pinpool``: the command line. ``pinpool bench`` runs every registered workload."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from pathlib import Path

import structlog
import torch

from pinpool.bench.kit import BenchContext, Table

Workload = Callable[[BenchContext], list[Table]]


def registered_workloads() -> dict[str, Workload]:
    found = {ep.name: ep for ep in entry_points(group="pinpool.bench")}
    if not found:  # running from a source tree that was never installed
        from pinpool.bench.staging import workload

        return {"staging": workload}
    return {name: ep.load() for name, ep in sorted(found.items())}


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers (got {text!r})") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1 (got {text!r})")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pinpool", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="run the benchmarks on the device found (or --device)")
    bench.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    bench.add_argument("--batch-sizes", type=_ints, default=(1, 64, 256, 1024, 4096), help="e.g. 1,64,256")
    bench.add_argument("--iters", type=int, default=100, help="timed calls per block")
    bench.add_argument(
        "--repeats", type=int, default=3, help="blocks (decode loop: rounds per mode); the median is reported"
    )
    bench.add_argument("--workloads", default=None, help="comma-separated subset of the registered workloads")
    bench.add_argument("--modes", default="sync,pinned,persistent,pool", help="staging modes to compare")
    bench.add_argument("--steps", type=int, default=None, help="decode loop: new tokens per request")
    bench.add_argument("--running", type=_ints, default=None, help="decode loop: running-batch sizes, e.g. 64,256")
    bench.add_argument("--json", type=Path, default=None, help="also write the tables as JSON to this file")
    bench.add_argument("--plot", type=Path, default=None, help="draw host µs against batch size per mode (PNG)")
    bench.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Tables own stdout; the library's events go to stderr, warnings and up.
    structlog.configure(
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
    )
    device = torch.empty(0, device=args.device or ("cuda" if torch.cuda.is_available() else "cpu")).device
    modes = tuple(m for m in args.modes.split(",") if m)
    bad = [m for m in modes if m not in ("sync", "pinned", "persistent", "pool")]
    if bad or "pool" not in modes:
        print(
            f"--modes must list modes of sync,pinned,persistent,pool and include pool (got {args.modes})",
            file=sys.stderr,
        )
        return 2
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
    workloads = registered_workloads()
    chosen = list(workloads) if args.workloads is None else args.workloads.split(",")
    unknown = [w for w in chosen if w not in workloads]
    if unknown:
        print(f"unknown workload(s) {unknown}; registered: {sorted(workloads)}", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"pinpool bench on {device} ({name}), torch {torch.__version__}")
    tables: list[Table] = []
    failed = []
    for workload in chosen:
        try:
            produced = workloads[workload](ctx)
        except Exception as exc:  # one broken workload must not hide the others' figures
            failed.append(workload)
            print(f"== {workload}: FAILED: {type(exc).__name__}: {exc}", flush=True)
            continue
        for table in produced:
            tables.append(table)
            print(table.render(), flush=True)
    if args.json is not None:
        payload = {
            "device": str(device),
            "device_name": name,
            "torch": torch.__version__,
            "tables": [t.as_json() for t in tables],
        }
        args.json.write_text(json.dumps(payload, indent=2))
    if args.plot is not None:
        from pinpool.bench.plot import plot_tables

        plot_tables(tables, args.plot, f"{name}, torch {torch.__version__}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
