"""tests/run.py: the set-up says which torch it installs, and why, before installing anything."""

from __future__ import annotations

import venv
from pathlib import Path

import pytest

from tests import run as setup


def _machine(
    monkeypatch: pytest.MonkeyPatch,
    *,
    venv: str | None = None,
    interpreter: str | None = None,
    nvidia: bool = False,
    local_wheel: str | None = None,
    cpu_index: bool = False,
) -> None:
    """Replace every probe, so a test describes the machine it needs and touches nothing real."""
    monkeypatch.setattr(setup, "venv_torch", lambda: venv)
    monkeypatch.setattr(setup, "interpreter_torch", lambda: interpreter)
    monkeypatch.setattr(setup, "has_nvidia_driver", lambda: nvidia)
    monkeypatch.setattr(setup, "local_cpu_wheel", lambda: local_wheel)
    monkeypatch.setattr(setup, "cpu_index_reachable", lambda: cpu_index)


def _dry_run(capsys: pytest.CaptureFixture[str]) -> str:
    assert setup.main(["--dry-run"]) == 0
    return capsys.readouterr().out


def test_dry_run_reuses_an_importable_torch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches a set-up that installs a second torch next to one the interpreter already has."""
    _machine(monkeypatch, interpreter="2.11.0+cu130 at /usr/lib/python3/site-packages", cpu_index=True)
    plan = setup.plan_torch()
    assert (plan.case, plan.pip_args, plan.reuse_from) == ("reuse", (), "/usr/lib/python3/site-packages")
    out = _dry_run(capsys)
    assert "reusing torch 2.11.0+cu130" in out and "would run: pip install torch" not in out


def test_dry_run_uses_the_cpu_index_when_reachable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches a CPU-only machine sent to PyPI's multi-GB CUDA build while the CPU index answers."""
    _machine(monkeypatch, cpu_index=True)
    plan = setup.plan_torch()
    assert plan.case == "cpu-index"
    assert plan.pip_args == (setup.TORCH, "--index-url", setup.CPU_INDEX)
    out = _dry_run(capsys)
    assert "CPU build" in out and f"would run: pip install {setup.TORCH} --index-url {setup.CPU_INDEX}" in out


def test_dry_run_says_pypi_torch_is_the_cuda_build(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches the old message that called PyPI's torch the "CPU build" when the CPU index was unreachable."""
    _machine(monkeypatch)
    plan = setup.plan_torch()
    assert (plan.case, plan.pip_args) == ("pypi-cuda-build-on-cpu", (setup.TORCH,))
    out = _dry_run(capsys)
    assert "PyPI's torch is the CUDA build" in out and "540 MB" in out and "runs on the CPU" in out
    assert "CPU build" not in out.replace("a CPU build of torch", "")


def test_a_local_cpu_wheel_is_pinned_by_what_pip_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches a hard-coded `+cpu` pin (PyPI never serves one) instead of the version found on disk."""
    _machine(monkeypatch, local_wheel="2.13.0+cpu", cpu_index=True)
    plan = setup.plan_torch()
    assert (plan.case, plan.pip_args) == ("local-cpu-wheel", ("torch==2.13.0+cpu",))


def test_the_env_variable_also_selects_dry_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches PINPOOL_SETUP_DRY_RUN being ignored and the set-up installing for real."""
    _machine(monkeypatch, venv="2.13.0+cpu at /x")
    monkeypatch.setenv(setup.DRY_RUN_ENV, "1")
    monkeypatch.setattr(setup, "ensure_venv", lambda: pytest.fail("dry run must install nothing"))
    assert setup.main(["pytest"]) == 0
    assert "dry run (in-venv)" in capsys.readouterr().out


def test_set_up_says_what_it_installs_before_installing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Catches a set-up that starts a multi-GB download before telling the user what it is."""
    _machine(monkeypatch)
    venv_dir = tmp_path / ".venv"
    monkeypatch.setattr(setup, "VENV", venv_dir)
    monkeypatch.setattr(setup, "BIN", venv_dir / "bin")
    monkeypatch.setattr(setup, "STAMP", venv_dir / "stamp")
    monkeypatch.setattr(venv, "create", lambda path, **kw: Path(path).mkdir())
    calls: list[tuple[str, ...]] = []
    printed: list[str] = []

    def fake_pip(*args: str) -> None:
        printed.append(capsys.readouterr().out)
        assert "PyPI's torch is the CUDA build" in "".join(printed), "installed before saying what"
        calls.append(args)

    monkeypatch.setattr(setup, "pip", fake_pip)
    setup.ensure_venv()
    assert calls[0] == (setup.TORCH,) and calls[1][0] == "-e"
    assert (venv_dir / "stamp").exists()
    calls.clear()
    setup.ensure_venv()  # the stamp matches pyproject.toml: a re-run installs nothing
    assert calls == []
