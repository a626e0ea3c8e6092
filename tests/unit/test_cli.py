"""`pinpool bench` with tiny settings: exits 0, prints every workload's tables, writes valid JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pinpool.bench.cli import main, registered_workloads


def test_bench_runs_every_workload_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Catches a main job that crashes on a CPU-only machine or writes malformed JSON."""
    out = tmp_path / "bench.json"
    args = ["bench", "--device", "cpu", "--batch-sizes", "1,3", "--iters", "3", "--repeats", "1"]
    code = main([*args, "--steps", "4", "--running", "3", "--json", str(out), "--quiet"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "CPU run" in printed
    payload = json.loads(out.read_text())
    assert payload["device"] == "cpu"
    titles = [t["title"] for t in payload["tables"]]
    for prefix in ("staging", "sampling", "memcache", "decode loop"):
        assert any(t.startswith(prefix) for t in titles), (prefix, titles)
    staging = next(t for t in payload["tables"] if t["title"].startswith("staging"))
    assert [row["bs"] for row in staging["rows"]] == [1, 3]
    assert all(row["pool µs"] > 0 for row in staging["rows"])
    decode = next(t for t in payload["tables"] if t["title"].startswith("decode loop"))
    assert [row["mode"] for row in decode["rows"]] == ["sync", "pinned", "persistent", "pool"]
    assert "identical across modes: True" in decode["notes"][0]


def test_workloads_are_registered_through_entry_points() -> None:
    """Catches a package whose benchmark silently dropped out of `pinpool bench`."""
    assert {"staging", "sampling", "memcache", "decode"} <= set(registered_workloads())


def test_bad_flags_are_rejected() -> None:
    """Catches a bench that silently ignores a malformed batch-size list or mode name."""
    with pytest.raises(SystemExit):
        main(["bench", "--batch-sizes", "0,x"])
    assert main(["bench", "--device", "cpu", "--workloads", "nope", "--quiet"]) == 2
    assert main(["bench", "--device", "cpu", "--modes", "sync,turbo", "--quiet"]) == 2
