"""The torchrun entry point, rehearsed on CPU with two gloo workers (the GPU run is in the record)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_two_workers_match_single_worker_replays() -> None:
    """Catches a worker whose token streams depend on the process layout, or a broken launch path."""
    # CUDA hidden: a rehearsal on CPU everywhere, also on a one-GPU machine, where two
    # ranks would otherwise look for a second GPU.
    # PYTHONPATH extended, not replaced: packages installed there (the GPU image's
    # structlog) must stay importable in the workers.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            "29517",
            "-m",
            "pinpool.bench.engine.distributed",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "TWO-WORKER CHECK (CPU) PASSED" in done.stdout
    assert done.stdout.count("equal to a single-device run: True") == 2
