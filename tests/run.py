"""Make ./.venv with what pinpool needs, then run a command inside it.

    python3 tests/run.py pytest              # the tests (README, .ci/run)
    python3 tests/run.py pinpool bench       # the main job
    python3 tests/run.py --dry-run           # say which torch it would install, install nothing
                                             # (or PINPOOL_SETUP_DRY_RUN=1)

Needs only Python 3.10+. Before installing anything it says what and why. Torch, in order:
1. a torch ./.venv already has: kept;
2. a torch the Python running this script already imports: reused (a .pth line in the
   venv names its folder), never a second copy;
3. a machine with an NVIDIA driver: PyPI's torch, the CUDA build;
4. a CPU-only machine: a CPU-build wheel already on this machine (pip's configured
   find-links, no download), else the PyTorch CPU index (about 190 MB), else PyPI's torch,
   which is the CUDA build (about 540 MB plus several GB of CUDA libraries) and runs on
   the CPU all the same: this says so before it starts.
Then pinpool itself with its test tools (``pip install -e '.[test]'``; triton is one of
pinpool's dependencies on Linux, about 290 MB to download). With the CPU build the venv
measured 2.0 GB on 2026-11-30 (torch 0.75 GB, triton 1.0 GB). Re-runs skip all of this
until pyproject.toml changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import urllib.request
import venv
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
STAMP = VENV / ".pinpool-installed"
TORCH = "torch>=2.11"  # pyproject.toml's floor
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
DRY_RUN_ENV = "PINPOOL_SETUP_DRY_RUN"


@dataclass(frozen=True)
class TorchPlan:
    """Which torch the venv gets, how, and the sentence that says so before it happens."""

    case: str  # "in-venv", "reuse", "cuda", "local-cpu-wheel", "cpu-index", "pypi-cuda-build-on-cpu"
    pip_args: tuple[str, ...]  # arguments to `pip install`; empty when nothing is installed
    say: str
    reuse_from: str | None = None  # the site-packages folder of a torch to reuse


# Probes: each answers one question about this machine. Tests replace them.


def venv_torch() -> str | None:
    """The torch version ./.venv imports, or None."""
    if not (BIN / "python").exists():
        return None
    return _torch_of(str(BIN / "python"))


def interpreter_torch() -> str | None:
    """'version at /its/site-packages' of the torch the Python running this script imports, or None."""
    return _torch_of(sys.executable)


def _torch_of(python: str) -> str | None:
    code = "import os, torch; print(torch.__version__, 'at', os.path.dirname(torch.__path__[0]))"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def has_nvidia_driver() -> bool:
    return Path("/proc/driver/nvidia/version").exists() or any(
        (Path(p) / "nvidia-smi").exists() for p in os.environ.get("PATH", "").split(os.pathsep)
    )


def local_cpu_wheel() -> str | None:
    """The version of a CPU-build torch wheel pip can install without the network, or None.

    Asks pip, with ``--no-index``, what it would install from the find-links this machine's
    pip configuration names; only a ``+cpu`` build counts.
    """
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-deps", "--ignore-installed"]
    done = subprocess.run([*cmd, "--quiet", "--report", "-", TORCH], capture_output=True, text=True)
    if done.returncode != 0:
        return None
    try:
        version = str(json.loads(done.stdout)["install"][0]["metadata"]["version"])
    except (ValueError, KeyError, IndexError):
        return None
    return version if version.endswith("+cpu") else None


def cpu_index_reachable(timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(f"{CPU_INDEX}/torch/", timeout=timeout) as reply:
            return int(reply.status) == 200
    except OSError:
        return False


def plan_torch() -> TorchPlan:
    """Decide which torch to install (nothing is installed here)."""
    found = venv_torch()
    if found:
        return TorchPlan("in-venv", (), f"torch {found} is already in .venv: keeping it")
    found = interpreter_torch()
    if found:
        return TorchPlan(
            "reuse",
            (),
            f"reusing torch {found}, which {sys.executable} already imports: .venv gets a .pth line "
            "naming that folder, so no second copy is installed",
            reuse_from=found.split(" at ", 1)[1],
        )
    if has_nvidia_driver():
        return TorchPlan(
            "cuda",
            (TORCH,),
            "installing torch from PyPI, the CUDA build (an NVIDIA driver is present): about 540 MB "
            "plus several GB of CUDA libraries",
        )
    version = local_cpu_wheel()
    if version:
        return TorchPlan(
            "local-cpu-wheel",
            (f"torch=={version}",),
            f"installing torch {version}, the CPU build (no NVIDIA driver here), from a wheel already on "
            "this machine (pip's configured find-links): no torch download; about 750 MB installed",
        )
    if cpu_index_reachable():
        return TorchPlan(
            "cpu-index",
            (TORCH, "--index-url", CPU_INDEX),
            f"installing torch, the CPU build (no NVIDIA driver here), from {CPU_INDEX}: about 190 MB to "
            "download, 750 MB installed",
        )
    return TorchPlan(
        "pypi-cuda-build-on-cpu",
        (TORCH,),
        f"installing torch from PyPI. This machine has no NVIDIA driver, but {CPU_INDEX} cannot be reached "
        "and PyPI's torch is the CUDA build: about 540 MB plus several GB of CUDA libraries that stay "
        "unused. It runs on the CPU all the same. To avoid the download, install a CPU build of torch "
        "into the Python that runs this script first; it will be reused",
    )


def say(message: str) -> None:
    print(f"[venv] {message}", flush=True)


def pip(*args: str) -> None:
    subprocess.run([str(BIN / "python"), "-m", "pip", "install", "-q", *args], check=True)


def ensure_venv() -> None:
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if STAMP.exists() and STAMP.read_text() == wanted:
        return
    plan = plan_torch()
    say(plan.say)
    say("then pinpool and its test tools: pip install -e '.[test]' (triton on Linux: about 290 MB, if not present)")
    if not (BIN / "python").exists():
        say(f"creating {VENV}")
        venv.create(VENV, with_pip=True)
    if plan.reuse_from:
        # A .pth line rather than system_site_packages: that would name the base
        # interpreter's folder, not the torch of a venv this script may run from.
        code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        site = subprocess.run([str(BIN / "python"), "-c", code], capture_output=True, text=True, check=True)
        (Path(site.stdout.strip()) / "pinpool-reused-torch.pth").write_text(plan.reuse_from + "\n")
    if plan.pip_args:
        pip(*plan.pip_args)
    pip("-e", f"{ROOT}[test]")
    STAMP.write_text(wanted)
    say("done; re-runs skip these steps until pyproject.toml changes")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--dry-run"] or os.environ.get(DRY_RUN_ENV):
        plan = plan_torch()
        say(f"dry run ({plan.case}): {plan.say}")
        if plan.pip_args:
            say(f"would run: pip install {' '.join(plan.pip_args)}")
        say("would then run: pip install -e '.[test]'")
        return 0
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args else 2
    ensure_venv()
    command, rest = args[0], args[1:]
    exe = BIN / command
    cmd = [str(exe), *rest] if exe.exists() else [command, *rest]
    if command == "pytest":  # run through the venv's interpreter so the repo is importable
        cmd = [str(BIN / "python"), "-m", "pytest", *rest]
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    os.chdir(ROOT)
    return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
