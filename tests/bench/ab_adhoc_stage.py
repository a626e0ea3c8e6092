"""CPU A/B of an ad-hoc stage's host cost: this tree against an older one (a diagnostic, not a test).

    python3 tests/bench/ab_adhoc_stage.py [--old .old] [--rounds 3]

Each tree runs in a process of its own (both are the package ``pinpool``), alternating: a CPU
pool with zero-copy on, one stage of the speed gate's five sampling-shaped lists (``pinpool
bench``'s staging workload), copied or read in place. Prints the best of seven blocks of
20,000 warm stages, µs per stage, per round.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

_CHILD = """
import random, sys, time
sys.path.insert(0, {tree!r})
import torch
from pinpool import PinnedRingBuffer, PoolSettings
pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=8, slot_bytes=1 << 20, zero_copy=True))
dtypes = (torch.float32, torch.float32, torch.int32, torch.float32, torch.int64)
rng = random.Random(0)
lists = [[rng.uniform(0.1, 1.5) for _ in range({bs})], [rng.uniform(0.5, 1.0) for _ in range({bs})],
         [rng.randint(1, 100) for _ in range({bs})], [rng.uniform(0.0, 0.2) for _ in range({bs})],
         [rng.randint(0, 2**40) for _ in range({bs})]]
def step():
    with pool.stage(zero_copy={zero_copy}) as st:
        return [st.put(v, d) for v, d in zip(lists, dtypes)]
for _ in range(3000):
    step()
best = float("inf")
for _ in range(7):
    t = time.perf_counter()
    for _ in range(20000):
        step()
    best = min(best, (time.perf_counter() - t) / 20000 * 1e6)
print(f"{{best:.2f}}")
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", default=".old")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    trees = {"old": str(Path(args.old).resolve()), "new": str(Path(__file__).resolve().parents[2])}
    print("bs  zero_copy  round  old µs  new µs")
    for bs in (1, 256):
        for zero_copy in (False, True):
            for r in range(args.rounds):
                got = {}
                for name, tree in trees.items():
                    code = _CHILD.format(tree=tree, bs=bs, zero_copy=zero_copy)
                    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
                    got[name] = run.stdout.strip()
                print(f"{bs:>3}  {zero_copy!s:>9}  {r:>5}  {got['old']:>6}  {got['new']:>6}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
