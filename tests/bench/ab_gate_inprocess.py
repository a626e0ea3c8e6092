"""The speed gate's cells as an in-process A/B: an older tree and this one timed in alternating blocks in one
process, so that a drift of the machine between runs cancels (a diagnostic, not a test).

    python3 tests/bench/ab_gate_inprocess.py [--old .old] [--cells stage,zero-copy,graph] [--rounds 32]
        [--graph-rounds 10] [--graph-steps 48] [--graph-running 1,16,64] [--device cuda] [--json out.json]

The older tree's ``pinpool``, ``sampling``, ``memcache`` and (top-level then) ``engine`` are copied to a
temporary folder as ``<name>_old``, every import between them renamed and nothing else touched, so that both
trees load in one interpreter. Cells, each built by that tree's own ``make_step`` of the gate's workload:
- ``stage`` (the 5-field stage): a copy stage of five sampling-shaped lists, bs 1, 256, 4096;
- ``zero-copy``: a zero-copy stage of the same lists and ``readers`` kernels (``torch.cat`` of the fields'
  bytes) launched before close, bs 1, 64, 256, 1 and 4 readers;
- ``graph``: host-bound graph decode, each tree's own ``graph_bench.measure`` (host µs, tokens/s).

Per round, each tree runs one block (the same number of steps for both, synchronised at both ends), in the
order old-new or new-old, alternating, after a warm-up. A round's ratio is new ÷ old of its two blocks
(old ÷ new for tokens/s); the figure is the median of the rounds' ratios. The control of a stage or
zero-copy cell times one peer (the pinned pattern, vLLM's UVA ring rebuilt) against itself: what the method
reads when both sides are one function. The graph cells' near-control is pinned+graph of each tree, whose
engines differ a little between the trees. Before any timing, one old step of each cell runs traced, and
the run stops if a frame of it runs a file of this tree's packages (a missed rename would time new code
against itself); at the end, no older module may hold a name from this tree.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pinpool.bench import staging  # noqa: E402
from pinpool.bench.staging import field_lists  # noqa: E402
from pinpool.bench.zero_copy import uva_stager  # noqa: E402

BLOCK_SECONDS = 0.02
STAGE_SIZES = (1, 256, 4096)
ZERO_COPY_SIZES = (1, 64, 256)
READERS = (1, 4)
GRAPH_CONFIG = "host-bound"  # the graph-decode figures


#: The older tree's top-level packages, each loaded as ``<name>_old`` (its reference engine was top-level then).
OLD_PACKAGES = ("pinpool", "sampling", "memcache", "engine")


def load_old(tree: Path, scratch: Path) -> None:
    """Copy the older tree's packages into ``scratch`` as ``<name>_old``, every import between them renamed."""
    names = [name for name in OLD_PACKAGES if (tree / name).is_dir()]
    pattern = re.compile(r"\b(from|import)(\s+)(" + "|".join(names) + r")\b")
    for name in names:
        target = scratch / f"{name}_old"
        shutil.copytree(tree / name, target, ignore=shutil.ignore_patterns("__pycache__"))
        for path in target.rglob("*.py"):
            path.write_text(pattern.sub(r"\1\2\3_old", path.read_text()))
    sys.path.insert(0, str(scratch))


#: This tree's package folders: no frame of an older step may run a file under them.
OURS = tuple(str(ROOT / name) + os.sep for name in ("pinpool", "sampling", "memcache"))


def traced_isolated(fn: Callable[[], Any], what: str) -> int:
    """Run ``fn`` once with every Python call traced; stop the run if one runs a file of this tree's packages
    (a missed rename, an import inside a function, an entry point): the count of calls traced."""
    files: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            files.append(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    leaks = sorted({f for f in files if f.startswith(OURS)})
    if leaks:
        raise SystemExit(f"{what}: the older tree ran this tree's {leaks[:3]}: it is not isolated")
    return len(files)


def check_isolated() -> int:
    """Refuse a run where an older module holds a name from this tree's packages (a missed import would time
    new code against itself); the count of older modules checked."""
    ours = set(OLD_PACKAGES)
    old = {name: m for name, m in sys.modules.items() if name.split(".")[0] in {f"{p}_old" for p in OLD_PACKAGES}}
    for name, module in old.items():
        for attr, value in vars(module).items():
            origin = getattr(value, "__module__", None) or getattr(value, "__name__", None)
            if isinstance(origin, str) and origin.split(".")[0] in ours and not isinstance(value, str):
                raise SystemExit(f"{name}.{attr} comes from this tree's {origin}: the older tree is not isolated")
    return len(old)


def pool_step(tree: str, device: torch.device, bs: int, zero_copy: bool, readers: int) -> Callable[[], Any]:
    """One step of tree ``tree`` (``pinpool`` or ``pinpool_old``): the gate workload's own ``make_step``."""
    module = importlib.import_module(tree)
    settings = module.PoolSettings(device=device, num_slots=16, slot_bytes=1 << 18, zero_copy=zero_copy)
    pool = module.PinnedRingBuffer(settings)
    if readers == 0:
        return importlib.import_module(f"{tree}.bench.staging").make_step("pool", bs, device, pool)  # type: ignore[no-any-return]
    mode = "zero-copy" if zero_copy else "copy"
    bench = importlib.import_module(f"{tree}.bench.zero_copy")
    return bench.make_step(mode, bs, readers, device, pool, field_lists(bs))  # type: ignore[no-any-return]


def peer_step(device: torch.device, bs: int, zero_copy: bool, readers: int) -> Callable[[], Any]:
    """The control's one function: the pinned pattern (stage cells) or vLLM's UVA ring rebuilt (zero-copy)."""
    if not zero_copy:
        return staging.make_step("pinned", bs, device, None)
    stage_uva, lists = uva_stager(bs, device), field_lists(bs)
    return lambda: [torch.cat([f.view(torch.uint8) for f in stage_uva(lists)]) for _ in range(readers)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # sync-ok: benchmark clock boundary


def block_us(fn: Callable[[], Any], n: int, device: torch.device) -> float:
    gc.collect()
    sync(device)
    start = time.perf_counter()
    for _ in range(n):
        fn()
    sync(device)
    return (time.perf_counter() - start) / n * 1e6


def ab(old: Callable[[], Any], new: Callable[[], Any], rounds: int, device: torch.device) -> dict[str, Any]:
    """Rounds of one block each, old-new then new-old alternating: per-round new ÷ old and each side's µs."""
    for fn in (old, new, old, new):
        block_us(fn, 200, device)
    n = max(20, int(BLOCK_SECONDS / (block_us(new, 200, device) * 1e-6)))
    ratios, olds, news = [], [], []
    for r in range(rounds):
        if r % 2:
            b, a = block_us(new, n, device), block_us(old, n, device)
        else:
            a, b = block_us(old, n, device), block_us(new, n, device)
        ratios.append(b / a)
        olds.append(a)
        news.append(b)
    q = statistics.quantiles(ratios, n=4)
    return {
        "rounds": ratios,
        "ratio": statistics.median(ratios),
        "q1": q[0],
        "q3": q[2],
        "old_us": statistics.median(olds),
        "new_us": statistics.median(news),
        "steps": n,
    }


class GraphContext:
    """What ``graph_bench.measure`` asks of a ``BenchContext`` (the same in both trees)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.is_cuda = device, device.type == "cuda"

    def synchronize(self) -> None:
        sync(self.device)


def graph_ab(
    old: Any, new: Any, mode: str, running: int, rounds: int, steps: int, device: torch.device
) -> dict[str, Any]:
    """Rounds of one ``graph_bench.measure`` per tree (the workload's own figures: host µs with the device idle
    at each step's start, and tokens/s of the overlapped run), old-new then new-old alternating."""
    ctx = GraphContext(device)
    traced_isolated(lambda: old.measure(ctx, mode, old.CONFIGS[GRAPH_CONFIG], running, 6), f"{mode} {running}")
    for module in (old, new, old, new):
        module.measure(ctx, mode, module.CONFIGS[GRAPH_CONFIG], running, 6)  # compiles and captures
    host, tokens = [], []
    for r in range(rounds):
        got = {}
        for side, module in (("old", old), ("new", new)) if r % 2 == 0 else (("new", new), ("old", old)):
            got[side] = module.measure(ctx, mode, module.CONFIGS[GRAPH_CONFIG], running, steps)
        host.append(got["new"]["host_us"] / got["old"]["host_us"])
        tokens.append(got["old"]["tokens_per_s"] / got["new"]["tokens_per_s"])
    return {
        "host_rounds": host,
        "tokens_rounds": tokens,
        "host": statistics.median(host),
        "host_range": (min(host), max(host)),
        "tokens": statistics.median(tokens),
        "tokens_range": (min(tokens), max(tokens)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", default=".old")
    parser.add_argument("--rounds", type=int, default=32)  # even: each order as often
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None)
    parser.add_argument("--cells", default="stage,zero-copy,graph")
    parser.add_argument("--graph-rounds", type=int, default=10)
    parser.add_argument("--graph-steps", type=int, default=48)
    parser.add_argument("--graph-running", default="1,16,64")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu":
        torch.set_num_threads(1)  # a copy past 32 KiB would wake a thread pool (pinpool.bench.kit)
    with tempfile.TemporaryDirectory() as scratch:
        load_old(Path(args.old).resolve(), Path(scratch))
        wanted = args.cells.split(",")
        cells = [("stage", bs, 0) for bs in STAGE_SIZES if "stage" in wanted]
        cells += [("zero-copy", bs, r) for r in READERS for bs in ZERO_COPY_SIZES if "zero-copy" in wanted]
        rows: list[dict[str, Any]] = []
        print(f"device {device}, torch {torch.__version__}, {args.rounds} rounds; new ÷ old per round, median")
        print(
            f"{'cell':<10} {'bs':>5} {'readers':>7} {'old µs':>8} {'new µs':>8} {'new÷old':>8} {'q1-q3':>11}  "
            f"{'peer÷peer':>9}"
        )
        for kind, bs, readers in cells:
            zero_copy = kind == "zero-copy"
            old_step = pool_step("pinpool_old", device, bs, zero_copy, readers)
            traced_isolated(old_step, f"{kind} bs {bs}")
            got = ab(old_step, pool_step("pinpool", device, bs, zero_copy, readers), args.rounds, device)
            peer = peer_step(device, bs, zero_copy, readers)
            control = ab(peer, peer, args.rounds, device)
            rows.append({"cell": kind, "bs": bs, "readers": readers, **got, "control": control["ratio"]})
            print(
                f"{kind:<10} {bs:>5} {readers:>7} {got['old_us']:>8.2f} {got['new_us']:>8.2f} {got['ratio']:>8.3f} "
                f"{got['q1']:>5.2f}-{got['q3']:<5.2f}  {control['ratio']:>9.3f}",
                flush=True,
            )
        if "graph" in wanted:
            old_graph = importlib.import_module("engine_old.graph_bench")
            new_graph = importlib.import_module("pinpool.bench.engine.graph_bench")
            print(
                f"graph decode, {GRAPH_CONFIG} model, {args.graph_rounds} rounds of {args.graph_steps} steps: "
                "new ÷ old host µs, old ÷ new tokens/s, per round, median (min-max); the pinned+graph control "
                "runs the new tree's pinned mode against the old tree's"
            )
            for running in map(int, args.graph_running.split(",")):
                for mode in ("pool+graph", "pinned+graph"):
                    g = graph_ab(old_graph, new_graph, mode, running, args.graph_rounds, args.graph_steps, device)
                    rows.append({"cell": "graph", "mode": mode, "running": running, **g})
                    print(
                        f"{mode:<13} running {running:>3}: host µs {g['host']:.3f} ({g['host_range'][0]:.2f}-"
                        f"{g['host_range'][1]:.2f}), tokens/s {g['tokens']:.3f} ({g['tokens_range'][0]:.2f}-"
                        f"{g['tokens_range'][1]:.2f})",
                        flush=True,
                    )
        print(
            f"isolation: every cell's traced old step ran no file of this tree; {check_isolated()} modules of the "
            "older tree, none holding a name from this one"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(device), "rounds": args.rounds, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
