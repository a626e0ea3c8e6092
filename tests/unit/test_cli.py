"""`pinpool bench` with tiny settings: exits 0, prints tables, writes valid JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pinpool.cli import main


def test_bench_runs_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Catches a main job that crashes on a CPU-only machine or writes malformed JSON."""
    out = tmp_path / "bench.json"
    code = main(
        [
            "bench",
            "--device",
            "cpu",
            "--batch-sizes",
            "1,3",
            "--iters",
            "3",
            "--repeats",
            "1",
            "--json",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "staging" in printed and "CPU run" in printed
    payload = json.loads(out.read_text())
    assert payload["device"] == "cpu"
    staging = next(t for t in payload["tables"] if t["title"].startswith("staging"))
    assert [row["bs"] for row in staging["rows"]] == [1, 3]
    assert all(row["pool µs"] > 0 for row in staging["rows"])


def test_bad_flags_are_rejected() -> None:
    """Catches a bench that silently ignores a malformed batch-size list."""
    with pytest.raises(SystemExit):
        main(["bench", "--batch-sizes", "0,x"])
    assert main(["bench", "--device", "cpu", "--workloads", "nope", "--quiet"]) == 2
