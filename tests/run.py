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
# A CPU build that CPU machines install; the PyTorch CPU index serves it everywhere else.
CPU_TORCH = ["torch==2.13.0+cpu", "--extra-index-url", "https://download.pytorch.org/whl/cpu"]


def has_nvidia_driver() -> bool:
    return Path("/proc/driver/nvidia/version").exists() or any(
        (Path(p) / "nvidia-smi").exists() for p in os.environ.get("PATH", "").split(os.pathsep)
    )


def pip(*args: str) -> None:
    subprocess.run([str(BIN / "python"), "-m", "pip", "install", "-q", *args], check=True)


def ensure_venv() -> None:
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if STAMP.exists() and STAMP.read_text() == wanted:
        return
    if not (BIN / "python").exists():
        print("[venv] creating .venv", flush=True)
        venv.create(VENV, with_pip=True)
    probe = subprocess.run([str(BIN / "python"), "-c", "import torch"], capture_output=True)
    if probe.returncode != 0:
        print("[venv] installing torch (" + ("CUDA" if has_nvidia_driver() else "CPU") + " build)", flush=True)
        pip(*(["torch>=2.4"] if has_nvidia_driver() else CPU_TORCH))
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
