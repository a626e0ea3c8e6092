"""The speed gate's compare (tests/bench/speed_gate.py): the figures it prints decide issue 26's gate."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "speed_gate.py"


def _gate() -> Any:
    spec = importlib.util.spec_from_file_location("speed_gate_under_test", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _run(path: Path, pool_us: float, pinned_us: float, graph_host_us: float, graph_tok: float) -> str:
    tables = [
        {
            "title": "staging: host µs per stage",
            "rows": [{"bs": 1, "pinned µs": {"median": pinned_us}, "pool µs": {"median": pool_us}}],
        },
        {
            "title": "graph decode: host-bound, 16 running",
            "rows": [
                {"mode": "pinned+graph", "host µs": {"median": 100.0}, "tokens/s": {"median": 1000.0}},
                {"mode": "pool+graph", "host µs": {"median": graph_host_us}, "tokens/s": {"median": graph_tok}},
            ],
        },
    ]
    path.write_text(json.dumps({"tables": tables}))
    return str(path)


def _gate_line(out: str) -> tuple[float, float]:
    line = next(x for x in out.splitlines() if x.startswith("GATE"))
    worst, named = line.split("new/old ")[1].split(" ")[0], line.rsplit(" ", 1)[1]
    return float(worst), float(named)


def test_best_takes_each_trees_best_run_and_mean_takes_their_average(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One disturbed run of the new tree (twice the µs) fails the mean and passes the best."""
    gate = _gate()
    old = ",".join(_run(tmp_path / f"old{i}.json", 10.0, 20.0, 50.0, 2000.0) for i in (1, 2))
    new = ",".join(
        [
            _run(tmp_path / "new1.json", 10.0, 20.0, 50.0, 2000.0),
            _run(tmp_path / "new2.json", 20.0, 40.0, 100.0, 1000.0),
        ]
    )
    gate.compare(old, new)
    worst_mean, named_mean = _gate_line(capsys.readouterr().out)
    assert named_mean == pytest.approx(1.5)  # (10 + 20) / 2 over 10; (50 + 100) / 2 over 50; tokens 2000 / 1500 = 1.33
    gate.compare(old, new, best=True)
    assert _gate_line(capsys.readouterr().out)[1] == pytest.approx(1.0)
    assert worst_mean >= named_mean


def test_only_the_issues_figures_are_marked_and_a_regression_there_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """pool µs at bs 1 and pool+graph host µs are named; a slower pinned mode is printed but not gated."""
    gate = _gate()
    old = _run(tmp_path / "old.json", 10.0, 20.0, 50.0, 2000.0)
    gate.compare(old, _run(tmp_path / "slower_peer.json", 10.0, 60.0, 50.0, 2000.0))
    out = capsys.readouterr().out
    assert "pinned µs 3.00 >1.10;" in out and "pool µs 1.00 [gate]" in out
    assert _gate_line(out) == (pytest.approx(3.0), pytest.approx(1.0))
    gate.compare(old, _run(tmp_path / "slower_pool.json", 10.0, 20.0, 60.0, 2000.0))
    assert _gate_line(capsys.readouterr().out)[1] == pytest.approx(1.2)


def test_paired_takes_the_median_of_each_pairs_ratio(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Pairs on a fast and a ten-times slower machine weigh the same: 1.2 and 1.0 give 1.1, where the
    ratio of the trees' means (112 / 110) would hide the fast pair's 20%."""
    gate = _gate()
    old = ",".join(
        [_run(tmp_path / "o1.json", 10.0, 20.0, 50.0, 2000.0), _run(tmp_path / "o2.json", 100.0, 200.0, 50.0, 2000.0)]
    )
    new = ",".join(
        [_run(tmp_path / "n1.json", 12.0, 20.0, 50.0, 2000.0), _run(tmp_path / "n2.json", 100.0, 200.0, 50.0, 2000.0)]
    )
    gate.compare_paired(old, new)
    assert capsys.readouterr().out.splitlines()[-1].endswith("figure 1.10 (gate 1.10)")
    gate.compare(old, new)
    assert _gate_line(capsys.readouterr().out)[1] == pytest.approx(112 / 110, abs=0.005)  # printed to 2 places
    with pytest.raises(SystemExit, match="as many old runs"):
        gate.compare_paired(old, str(tmp_path / "n1.json"))


def test_cpu_list_takes_the_first_cpus_of_a_sysfs_list() -> None:
    """Catches the gate's runs pinned to CPUs outside the GPU's local list, or a range read as its ends."""
    cpu_list = _gate().cpu_list
    assert cpu_list("0-7,16-23\n", 4) == "0,1,2,3"
    assert cpu_list("6,9-11", 3) == "6,9,10"
    assert cpu_list("", 4) == "0"
    assert cpu_list("0-15", 2, allowed={3, 4, 9}) == "3,4"  # a container's CPUs only
