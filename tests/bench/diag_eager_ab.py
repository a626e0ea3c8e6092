"""Same-run A/B of the eager pool exchange's put: the batch as Python lists or as one kept array (a diagnostic).

python3 tests/bench/diag_eager_ab.py

``list``: the decode step puts ``rows + positions`` (Python lists, packed by ``struct``);
``array``: the engine keeps them as one int64 array (``Engine._host_batch``) and the put
is a memcpy. Per running size, 5 interleaved rounds of the decode bench's pool and pinned
modes; staging µs per decode step (median over steps), then median over rounds.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from engine import loop
from engine.bench import measure
from pinpool.bench.kit import BenchContext

ROUNDS = 5


def _lists(self: loop.Engine, reqs: list[Any], bs: int) -> list[int]:
    return [r.row for r in reqs] + [r.seq_len for r in reqs]


def main() -> None:
    ctx = BenchContext(device=torch.device("cuda:0"), batch_sizes=(1,), iters=1, verbose=False)
    keep = loop.Engine._host_batch
    measure(ctx, "pool", 64, 6, 0.0, 0.0)  # compiles, outside the timings
    for running in (64, 256):
        got: dict[str, list[float]] = {"pinned": [], "pool list": [], "pool array": []}
        for _ in range(ROUNDS):
            for label in got:
                loop.Engine._host_batch = _lists if label == "pool list" else keep  # type: ignore[assignment,method-assign]
                got[label].append(measure(ctx, label.split()[0], running, 32, 0.0, 0.0)["staging_us"])
        loop.Engine._host_batch = keep  # type: ignore[method-assign]
        med = {k: statistics.median(v) for k, v in got.items()}
        print(
            f"running {running}: staging µs median of {ROUNDS} rounds: "
            + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
            + f"; pool/pinned: list {med['pool list'] / med['pinned']:.2f}"
            + f", array {med['pool array'] / med['pinned']:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
