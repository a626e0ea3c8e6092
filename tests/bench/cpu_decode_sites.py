"""CPU proxy of the eager decode loop's staging: this tree against an older one, per staging site.

    python3 tests/bench/cpu_decode_sites.py [--old .old] [--rounds 3] [--running 64]

Each tree runs the bench engine's ``pool`` mode on a CPU pool in a process of its own, the two
alternating. The tiny model's work between steps leaves the step's own code cold in the caches,
as the eager model's launches do on a GPU host, so the figures follow the GPU bench's staging
µs more closely than a tight loop does. Prints host µs per decode step at each site, the least
of three engine runs per process. A diagnostic, not a test: the host moves 10% between runs.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

SITES = (
    "decode.upload",
    "decode.readback",
    "read",
    "filter",
    "prefill.sampling_info",
    "prefill.write_cache",
    "prefill.merge",
    "prefill.upload",
    "prefill.readback",
)


def _child(tree: str, running: int) -> None:
    import logging

    logging.disable(logging.CRITICAL)
    sys.path.insert(0, tree)
    import torch

    if Path(tree, "engine").is_dir():  # 3e5dd9f kept the engine at the top level
        from engine.bench import _engine, _requests  # type: ignore[import-not-found]
    else:
        from pinpool.bench.engine.bench import _engine, _requests
    best: dict[str, float] = {}
    for _ in range(3):
        engine = _engine("pool", torch.device("cpu"), running, 0.0, 0.0)
        engine.run(_requests(running, 64, seed=1))
        steps = len(engine.times.decode_wall)
        for site, seconds in [*engine.staging.by_site.items(), ("total", engine.staging.total)]:
            best[site] = min(best.get(site, float("inf")), seconds / steps * 1e6)
    print(" ".join(f"{best.get(site, float('nan')):.1f}" for site in (*SITES, "total")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", default=".old")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--running", type=int, default=64)
    parser.add_argument("--child", nargs=2, metavar=("TREE", "RUNNING"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child[0], int(args.child[1]))
        return 0
    here, old = str(Path(__file__).resolve().parents[2]), str(Path(args.old).resolve())
    print("host µs per decode step, by staging site; columns: " + ", ".join((*SITES, "total")))
    for r in range(args.rounds):
        for name, tree in (("old", old), ("new", here)):
            cmd = [sys.executable, __file__, "--child", tree, str(args.running)]
            line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            print(f"{name:>4}  round {r}  " + "  ".join(f"{v:>6}" for v in line.split()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
