"""`pinpool bench` with tiny settings: every workload runs on CPU, JSON is strict, --plot fails early."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from pinpool.bench import cli
from pinpool.bench.cli import main, registered_workloads
from pinpool.bench.kit import Table

TINY = ["bench", "--device", "cpu", "--batch-sizes", "1,3", "--iters", "3", "--repeats", "2", "--quiet"]
DECODE = ["--steps", "4", "--running", "3"]


def _strict(text: str) -> Any:
    def refuse(name: str) -> None:
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, Any]:
    """One tiny CPU run of every workload, shared by the tests that read its output."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    printed = io.StringIO()  # capsys is function-scoped: capture this module-wide run by hand
    with contextlib.redirect_stdout(printed):
        code = main([*TINY, *DECODE, "--json", str(out)])
    return code, printed.getvalue(), _strict(out.read_text())


def test_bench_runs_every_workload_on_cpu(bench_run: tuple[int, str, Any]) -> None:
    """Catches a main job that crashes on a CPU-only machine or drops a workload's table."""
    code, _, payload = bench_run
    assert code == 0 and payload["failed"] == []
    assert payload["device"] == "cpu"
    titles = [t["title"] for t in payload["tables"]]
    for prefix in ("staging", "sampling", "memcache", "decode loop"):
        assert any(t.startswith(prefix) for t in titles), (prefix, titles)
    decode = next(t for t in payload["tables"] if t["title"].startswith("decode loop"))
    assert [row["mode"] for row in decode["rows"]] == ["sync", "pinned", "persistent", "pool", "pool-rb"]
    assert "identical across modes: True" in decode["notes"][0]


def test_cpu_run_says_what_is_meaningful_once_at_the_top(bench_run: tuple[int, str, Any]) -> None:
    """Catches a CPU run that reads as "the pool is slower" with no word on what CPU figures mean."""
    _, printed, _ = bench_run
    lines = printed.splitlines()
    assert lines[1] == cli.CPU_LINE
    assert printed.count("CPU run") == 1


def test_json_is_strict_with_spreads_and_no_gpu_only_columns(bench_run: tuple[int, str, Any]) -> None:
    """Catches bare NaN in the JSON, figures without their spread, and GPU-only columns printed on CPU."""
    _, printed, payload = bench_run
    assert "nan" not in printed.lower()
    staging = next(t for t in payload["tables"] if t["title"].startswith("staging"))
    assert [row["bs"] for row in staging["rows"]] == [1, 3]
    for row in staging["rows"]:
        spread = row["pool µs"]
        assert 0 < spread["min"] <= spread["median"] <= spread["max"]
        assert "pool allocs" not in row  # pinned allocations exist only on CUDA
    decode = next(t for t in payload["tables"] if t["title"].startswith("decode loop"))
    assert not {"GPU µs", "GPU idle", "syncs/step"} & set(decode["rows"][0])


def test_every_table_runs_the_same_modes(bench_run: tuple[int, str, Any]) -> None:
    """Catches a mode ("pinned") shown in one CPU table and missing or NaN in the others."""
    _, _, payload = bench_run
    for title in ("staging", "sampling", "memcache"):
        table = next(t for t in payload["tables"] if t["title"].startswith(title))
        for row in table["rows"]:
            for mode in ("sync", "pinned", "pool"):
                assert isinstance(row[f"{mode} µs"], dict), (title, mode)


def test_memcache_summary_counts_the_calls_it_timed(bench_run: tuple[int, str, Any]) -> None:
    """Catches the summary "pool made 0 copies for 0 calls" printed after timing those calls."""
    _, _, payload = bench_run
    table = next(t for t in payload["tables"] if t["title"].startswith("memcache"))
    assert "0 pool calls" not in table["notes"][0] and " pool calls timed" in table["notes"][0]


def test_workloads_are_registered_through_entry_points() -> None:
    """Catches a package whose benchmark silently dropped out of `pinpool bench`."""
    assert {"staging", "sampling", "memcache", "decode"} <= set(registered_workloads())


def test_help_lists_workloads_modes_and_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    """Catches a --help that names no workloads, modes or defaults, or shows RST markup."""
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    for word in (
        "staging",
        "sampling",
        "memcache",
        "decode",
        "persistent",
        "owned",
        "default: 100",
        "PINPOOL_LOG_LEVEL",
    ):
        assert word in text, word
    assert "``" not in text


def test_bad_flags_are_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches a bench that silently ignores a malformed batch-size list, mode name or log level."""
    with pytest.raises(SystemExit):
        main(["bench", "--batch-sizes", "0,x"])
    assert main(["bench", "--device", "cpu", "--workloads", "nope", "--quiet"]) == 2
    assert main(["bench", "--device", "cpu", "--modes", "sync,turbo", "--quiet"]) == 2
    monkeypatch.setenv("PINPOOL_LOG_LEVEL", "loud")
    assert main(["bench", "--device", "cpu", "--workloads", "staging", "--quiet"]) == 2


def test_plot_without_matplotlib_fails_before_any_work(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Catches --plot failing only after the whole bench ran, or suggesting a pip outside the environment."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a)
    )
    monkeypatch.setattr(cli, "registered_workloads", lambda: pytest.fail("a workload was loaded before the check"))
    assert main([*TINY, "--plot", str(tmp_path / "bench.png")]) == 2
    err = capsys.readouterr().err
    assert "pinpool[plot]" in err and f"{sys.executable} -m pip install" in err
    assert not (tmp_path / "bench.png").exists()


def _pid_times(x: int) -> tuple[int, int]:
    return os.getpid(), x * 3


def _refuse(x: int) -> int:
    raise ValueError(f"refused {x}")


def test_run_isolated_runs_every_job_in_order_in_one_other_process() -> None:
    from pinpool.bench.kit import run_isolated

    out = run_isolated(_pid_times, [(1,), (2,), (5,)])
    assert [v for _, v in out] == [3, 6, 15]
    pids = {pid for pid, _ in out}
    assert len(pids) == 1 and os.getpid() not in pids  # one child, not this process
    assert run_isolated(_pid_times, []) == []


def test_run_isolated_raises_the_childs_error_here() -> None:
    from pinpool.bench.kit import run_isolated

    with pytest.raises(ValueError, match="refused 4"):
        run_isolated(_refuse, [(4,)])


def test_a_failed_counting_child_leaves_the_counts_empty_not_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    from pinpool.bench.kit import counted_or_none

    assert counted_or_none(_refuse, [(5,)]) is None
    assert "refused 5" in capsys.readouterr().err
    assert counted_or_none(_pid_times, [(2,)]) is not None


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    """Catches a command line with no --version (or one that disagrees with pinpool.__version__)."""
    import pinpool

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"pinpool {pinpool.__version__}\n"


def _no_cuda_here() -> str:
    """A CUDA device this machine does not have: any index on a CPU-only machine, one past the last otherwise."""
    import torch

    return f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--repeats", "0"], "--repeats"),
        (["--iters", "-1"], "--iters"),
        (["--steps", "zero"], "--steps"),
        (["--device", "tpu"], "--device"),
        (["--device", "meta"], "--device"),
        (["--device", _no_cuda_here()], "--device"),
    ],
)
def test_bad_flag_values_are_refused_by_argparse_in_one_line(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches `--repeats 0` failing every workload with min() of an empty sequence, and a device
    the machine lacks ending in a traceback."""
    with pytest.raises(SystemExit) as info:
        main(["bench", *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    (error,) = [line for line in err.splitlines() if "error:" in line]
    assert f"argument {named}:" in error and repr(flags[1]) in error and "Traceback" not in err


def test_an_unexpected_error_is_one_line_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches an error outside the workloads (loading them, writing the JSON) shown as a traceback."""
    monkeypatch.delenv("PINPOOL_LOG_LEVEL", raising=False)

    def broken() -> dict[str, Any]:
        raise RuntimeError("entry point exploded")

    monkeypatch.setattr(cli, "registered_workloads", broken)
    assert main([*TINY]) == 2
    err = capsys.readouterr().err
    assert err == "pinpool bench: RuntimeError: entry point exploded (PINPOOL_LOG_LEVEL=debug shows the traceback)\n"


def test_a_workload_that_cannot_run_here_says_so_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches a CUDA-only workload that prints only the header on CPU and exits 0 as if it had run."""
    monkeypatch.setattr(cli, "registered_workloads", lambda: {"gpu_only": lambda ctx: []})
    assert main([*TINY, "--workloads", "gpu_only"]) == 1
    out = capsys.readouterr().out
    assert "== gpu_only: not run on cpu: it needs a CUDA device\n" in out
    assert "not run on this device: gpu_only" in out


def test_the_output_ends_with_a_summary_of_ratio_columns(bench_run: tuple[int, str, Any]) -> None:
    """Catches a run whose headline ratios are scattered over a page of tables with nothing at the end."""
    _, printed, _ = bench_run
    summary = printed[printed.index("== summary") :]
    assert "staging: host µs per stage [bs -> " in summary and "/pool]  1: " in summary
    assert "tokens/s" not in summary  # a rate, not a ratio
    assert cli.headline_ratio(Table.build("t", ("bs", "sync µs", "x host"), [(1, 2.0, 3.0)])) == "x host"
