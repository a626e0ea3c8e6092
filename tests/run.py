"""Make ./.venv with what pinpool needs, then run a command inside it.

    python3 tests/run.py pytest          # the test command (README, .ci/run)
    python3 tests/run.py pinpool bench   # the main job

Needs only Python. On a machine without an NVIDIA driver it installs the CPU build of
torch (about 200 MB) rather than the multi-GB CUDA build a plain ``pip install torch``
takes on Linux. Re-runs skip the install unless pyproject.toml changed.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
STAMP = VENV / ".pinpool-installed"
# CPU builds of torch, tried in order: a wheel the machine's configured index or
# find-links already carries (quick, no network), then the PyTorch CPU index.
CPU_TORCH_ATTEMPTS = [
    ["torch==2.13.0+cpu", "--retries", "0"],
    [
        "torch>=2.4",
        "--index-url",
        "https://download.pytorch.org/whl/cpu",
        "--extra-index-url",
        "https://pypi.org/simple",
    ],
]


def has_nvidia_driver() -> bool:
    return Path("/proc/driver/nvidia/version").exists() or any(
        (Path(p) / "nvidia-smi").exists() for p in os.environ.get("PATH", "").split(os.pathsep)
    )


def pip(*args: str, check: bool = True) -> bool:
    done = subprocess.run([str(BIN / "python"), "-m", "pip", "install", "-q", *args], check=check)
    return done.returncode == 0


def install_torch() -> None:
    if has_nvidia_driver():
        print("[venv] installing torch (CUDA build)", flush=True)
        pip("torch>=2.4")
        return
    for attempt in CPU_TORCH_ATTEMPTS:
        print(f"[venv] installing torch (CPU build): pip install {' '.join(attempt)}", flush=True)
        if pip(*attempt, check=False):
            return
    raise SystemExit("[venv] could not install a CPU build of torch")


def ensure_venv() -> None:
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if STAMP.exists() and STAMP.read_text() == wanted:
        return
    if not (BIN / "python").exists():
        print("[venv] creating .venv", flush=True)
        venv.create(VENV, with_pip=True)
    probe = subprocess.run([str(BIN / "python"), "-c", "import torch"], capture_output=True)
    if probe.returncode != 0:
        install_torch()
    print("[venv] installing pinpool and its test tools", flush=True)
    pip("-e", f"{ROOT}[test]")
    STAMP.write_text(wanted)


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    ensure_venv()
    command, args = sys.argv[1], sys.argv[2:]
    exe = BIN / command
    argv = [str(exe), *args] if exe.exists() else [command, *args]
    if command == "pytest":  # run through the venv's interpreter so the repo is importable
        argv = [str(BIN / "python"), "-m", "pytest", *args]
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    os.chdir(ROOT)
    return subprocess.run(argv, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
