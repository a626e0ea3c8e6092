"""Installing pinpool as a user does: a fresh venv, the torch already there, no build isolation.

The venv sees the packages of the interpreter running the tests (torch, numpy, attrs,
structlog, triton) through a ``.pth`` line, as ``tests/run.py`` reuses a torch: a venv made
with ``--system-site-packages`` from inside ``.venv`` would see the base interpreter's
folder, not ``.venv``'s, and find no torch. The source tree is not importable from there,
so every check below runs against the installed copy.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

import pinpool

ROOT = Path(__file__).resolve().parents[2]
#: The oldest setuptools the build floor in pyproject.toml promises, runnable on this Python
#: (setuptools before 66.1 cannot import on 3.12, which removed pkgutil.ImpImporter).
FLOOR_SETUPTOOLS = "64.0.3" if sys.version_info < (3, 12) else "68.1.2"

#: What pip says when no index answers (offline machine), as opposed to a failed build.
NO_INDEX = ("No matching distribution found", "Could not find a version that satisfies")

CREATE_AND_CLOSE = """
import torch
from pinpool import PinnedRingBuffer, PoolSettings
pool = PinnedRingBuffer(PoolSettings(device="cpu", slot_bytes=1024))
with pool.stage() as st:
    st.put([1, 2, 3], torch.int64)
pool.close()
"""

THROUGH_STDLIB = (
    """
import json, logging
import pinpool
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append([record.name, record.levelname, getattr(record, "event", None), record.getMessage()])
logging.basicConfig(level=logging.INFO)
logging.getLogger().addHandler(Keep())
"""
    + CREATE_AND_CLOSE
    + """
print(json.dumps({"version": pinpool.__version__, "file": pinpool.__file__, "records": records}))
"""
)


def _pyproject_packages() -> list[str]:
    """``[tool.setuptools] packages`` (read with a pattern: tomllib is 3.11+, and 3.10 is supported)."""
    match = re.search(r"^packages = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    assert match, "pyproject.toml has no [tool.setuptools] packages list"
    return re.findall(r'"([^"]+)"', match.group(1))


def _source_copy(dest: Path) -> Path:
    """What an sdist holds (pyproject, README, LICENSE, the packages): the build writes nothing into the checkout."""
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, dest / name)
    for top in {p.split(".")[0] for p in _pyproject_packages()}:
        shutil.copytree(ROOT / top, dest / top, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    # No PYTHONPATH: the checkout must not shadow the installed copy.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


def _venv_with_our_packages(where: Path) -> tuple[Path, Path]:
    """A fresh venv whose ``.pth`` names this interpreter's site folders; returns its python and purelib."""
    venv.create(where, with_pip=True)
    python = where / ("Scripts" if sys.platform == "win32" else "bin") / "python"
    purelib = Path(
        _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], where).stdout.strip()
    )
    ours = [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and Path(p).is_dir()]
    ours.append(sysconfig.get_paths()["purelib"])
    (purelib / "pinpool-test-reuse.pth").write_text("\n".join(dict.fromkeys(ours)) + "\n")
    return python, purelib


def _installed_top_level(purelib: Path) -> set[str]:
    (dist_info,) = purelib.glob("pinpool-*.dist-info")
    record = (dist_info / "RECORD").read_text().splitlines()
    tops = {line.split(",")[0].split("/")[0] for line in record}
    return {t for t in tops if not t.endswith(".dist-info") and t != ".." and not t.startswith("__")}


#: The setuptools each build uses, in this order in one venv (pip specs; ``wheel`` beside it:
#: before 70.1 setuptools builds wheels only with that package).
SETUPTOOLS = [
    # What a fresh venv of this Python brings (65.5 on 3.11: the string license form failed
    # there), or the newest where it brings none (3.12+).
    ("venv-default", ["setuptools>=64", "wheel"]),
    # The floor pyproject.toml declares (the string form failed here too).
    ("floor", [f"setuptools=={FLOOR_SETUPTOOLS}", "wheel"]),
    # The newest, which accepts the table form with a deprecation warning.
    ("newest", ["--upgrade", "setuptools", "wheel"]),
]


def test_install_without_build_isolation_into_a_fresh_venv(tmp_path: Path) -> None:
    """Catches metadata a setuptools from the declared floor on cannot build (`license = "..."` needs
    77 while 64 is declared), a missing LICENSE or __version__, a changed set of installed
    top-level packages, and library log lines printed where nothing configured logging."""
    python, purelib = _venv_with_our_packages(tmp_path / "venv")
    source = tmp_path / "src"
    source.mkdir()
    _source_copy(source)
    for name, spec in SETUPTOOLS:
        done = _run([str(python), "-m", "pip", "install", "-q", "--retries", "1", *spec], tmp_path)
        if done.returncode and any(m in done.stderr for m in NO_INDEX):
            # The GPU machine has no network; CI and a workstation reach PyPI and run this.
            pytest.skip(f"no package index reachable for {name} ({' '.join(spec)}): {done.stderr.strip()[-200:]}")
        assert done.returncode == 0, done.stderr
        version = _run([str(python), "-c", "import setuptools; print(setuptools.__version__)"], tmp_path).stdout
        install = ["install", "-q", "--force-reinstall", "--no-build-isolation", "--no-deps", str(source)]
        done = _run([str(python), "-m", "pip", *install], tmp_path)
        assert done.returncode == 0, f"{name}: setuptools {version.strip()}: {done.stderr}"
        tops = _installed_top_level(purelib)
        print(f"{name} (setuptools {version.strip()}): installed top-level names {sorted(tops)}")
        assert tops == {p.split(".")[0] for p in _pyproject_packages()} == {"pinpool", "sampling", "memcache"}, name
        (dist_info,) = purelib.glob("pinpool-*.dist-info")
        assert "Apache License" in next(dist_info.rglob("LICENSE*")).read_text(), name

    quiet = _run([str(python), "-c", CREATE_AND_CLOSE], tmp_path)
    assert quiet.returncode == 0, quiet.stderr
    assert (quiet.stdout, quiet.stderr) == ("", "")

    configured = _run([str(python), "-c", THROUGH_STDLIB], tmp_path)
    assert configured.returncode == 0, configured.stderr
    report = json.loads(configured.stdout)
    assert Path(report["file"]).is_relative_to(purelib)
    assert report["version"] == pinpool.__version__ == dist_info.name.removesuffix(".dist-info").split("-")[1]
    events = [(name, level, event) for name, level, event, _ in report["records"]]
    assert ("pinpool", "INFO", "pool.created") in events and ("pinpool", "INFO", "pool.closed") in events
    assert "pool.created" in configured.stderr  # basicConfig's own handler printed it


def test_the_pool_imports_and_runs_without_triton(tmp_path: Path) -> None:
    """Catches a module-level `import triton` reachable from the pool (a 1 GB dependency CPU users need not load)."""
    script = """
import sys
sys.modules["triton"] = None  # any `import triton` now raises ImportError
import torch
import pinpool
from pinpool import PinnedRingBuffer, PoolSettings
from pinpool.landing import land, land_reference
pool = PinnedRingBuffer(PoolSettings(device="cpu", slot_bytes=1024))
with pool.stage() as st:
    staged = st.put([5, 6, 7], torch.int64)
assert staged.tolist() == [5, 6, 7]
out = torch.zeros(2, dtype=torch.int64)
land(torch.tensor([8, 9]), torch.tensor([out.data_ptr(), out.data_ptr() + 8]))
assert out.tolist() == [8, 9], out
pool.close()
print("ok", [m for m in sys.modules if m.startswith("triton") and sys.modules[m] is not None])
"""
    env_free = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env_free["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env_free, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok []"
