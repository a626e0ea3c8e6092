"""CPU A/B of a decode step's staging: this tree's layout stage against an older tree's one-call exchange.

    python3 tests/bench/ab_layout_step.py [--old .old] [--rounds 3]

Each side runs in a process of its own (both trees are the package ``pinpool``), alternating,
on a CPU pool with zero-copy on (so landings work without a GPU): two puts of ``bs`` int64
(rows and positions), the copy, the views, with and without a landing field, then close.
Prints the min over blocks of steps, µs per step, per round (``--calls``: the Python calls one warm
step makes, counted with ``sys.setprofile``). A diagnostic, not a test.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

STEPS, BLOCKS, WARM = 20_000, 7, 2_000


def _step_fn(bs: int, land: bool) -> object:
    import torch

    from pinpool import PinnedRingBuffer, PoolSettings

    pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=8, slot_bytes=1 << 20, zero_copy=True))
    rows, positions = list(range(bs)), [100 + i for i in range(bs)]
    if hasattr(pool, "exchange"):  # the older tree: one call opens, packs, lands and copies

        def old_step() -> None:
            ex = pool.exchange(((rows, torch.int64), (positions, torch.int64)), land=bs if land else None)
            _ = ex.views, ex.land_to, ex.landing
            ex.close()

        return old_step
    from pinpool import Field, Layout

    fields = [Field("rows", torch.int64), Field("positions", torch.int64)]
    layout = Layout([*fields, *([Field.landing("tokens")] if land else [])], 1024)

    def new_step() -> None:
        st = pool.stage(layout, rows=bs)
        st.put("rows", rows)
        st.put("positions", positions)
        st.flush()
        views = st.views
        _ = views["rows"], views["positions"]
        if land:
            _ = views["tokens"], st.landing("tokens")
        st.close()

    return new_step


def _child(tree: str, bs: int, land: bool, calls: bool = False) -> None:
    sys.path.insert(0, tree)
    step = _step_fn(bs, land)
    assert callable(step)
    for _ in range(WARM):
        step()
    if calls:  # the Python calls one warm step makes, the step function itself not counted
        seen = [0]

        def count(frame: object, event: str, arg: object) -> None:
            seen[0] += event == "call"

        sys.setprofile(count)
        step()
        sys.setprofile(None)
        print(seen[0] - 1)
        return
    best = float("inf")
    for _ in range(BLOCKS):
        start = time.perf_counter()
        for _ in range(STEPS):
            step()
        best = min(best, (time.perf_counter() - start) / STEPS * 1e6)
    print(f"{best:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", default=".old")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", action="store_true", help="count the Python calls of one step instead")
    parser.add_argument("--child", nargs=3, metavar=("TREE", "BS", "LAND"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child[0], int(args.child[1]), args.child[2] == "1", args.calls)
        return 0
    here, old = str(Path(__file__).resolve().parents[2]), str(Path(args.old).resolve())

    def run(tree: str, bs: int, land: bool) -> str:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            tree,
            str(bs),
            "1" if land else "0",
            *(["--calls"] if args.calls else []),
        ]
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]

    what = "Python calls" if args.calls else "µs"
    print(f"bs  landing  round  old exchange {what}  new layout stage {what}")
    for bs in (64, 256):
        for land in (True, False):
            for r in range(args.rounds):
                print(f"{bs:>3}  {land!s:>7}  {r:>5}  {run(old, bs, land):>15}  {run(here, bs, land):>19}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
