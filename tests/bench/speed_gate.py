"""The small core's speed gate: the same bench workloads on an earlier tree (``.old``) and on this one.

Run on the device, in one call, in the order old, new, new, old (a machine's first runs can be
slower: the order cancels a drift)::

    python3 tests/bench/speed_gate.py run --tree .old --json old1.json   # then new1, new2, old2
    python3 tests/bench/speed_gate.py compare old1.json,old2.json new1.json,new2.json

``run`` imports the tree's own ``pinpool.bench.cli`` (its workload modules by their names in
that tree: the reference engine was top-level ``engine`` before it moved under
``pinpool.bench``) in a fresh process, so the two trees never share a module. ``compare``
prints new ÷ old for every µs median of every row that both runs have (lower is better),
and old ÷ new for tokens/s; ``>1.10`` marks a figure past the gate and ``[gate]`` the figures
the issue names. Each tree's runs are averaged; ``--best`` takes each tree's best run instead,
``--normalise`` divides each figure by a peer of the same run first, and ``--paired`` takes
run i of each tree as a pair (run back to back) and the median of the pairs' ratios: on a
machine whose speed drifts between runs, the normalised paired figure is the steadiest.
Steadier still: ``tests/bench/ab_gate_inprocess.py`` times the stage, zero-copy and graph-decode
cells of both trees in one process, in alternating blocks (``PINPOOL_DIAG=ab_gate_inprocess``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

#: workload -> its module in the new tree, then in the old one.
WORKLOADS = {
    "staging": ("pinpool.bench.staging", "pinpool.bench.staging"),
    "zero_copy": ("pinpool.bench.zero_copy", "pinpool.bench.zero_copy"),
    "decode": ("pinpool.bench.engine.bench", "engine.bench"),
    "decode_graph": ("pinpool.bench.engine.graph_bench", "engine.graph_bench"),
    "sampling_sglang": ("pinpool.bench.sampling_vs_sglang", "sampling.bench_sglang"),
    "memcache_sglang": ("pinpool.bench.memcache_vs_sglang", "memcache.bench_sglang"),
}


def run(tree: Path, workloads: list[str], out: Path, repeats: int) -> int:
    sys.path.insert(0, str(tree.resolve()))
    cli = importlib.import_module("pinpool.bench.cli")
    found: dict[str, Any] = {}
    for name in workloads:
        for module in WORKLOADS[name]:
            try:
                found[name] = importlib.import_module(module).workload
                break
            except ModuleNotFoundError:
                continue
    cli.registered_workloads = lambda: found
    cli._workload_names = lambda: sorted(found)
    args = ["bench", "--workloads", ",".join(found), "--repeats", str(repeats), "--json", str(out)]
    return int(cli.main(args) or 0)


def _median(cell: Any) -> float | None:
    return cell.get("median") if isinstance(cell, dict) else None


#: The columns that name a row (the rest are figures).
KEYS = ("bs", "readers", "mode", "running", "config")


def _key(row: dict[str, Any]) -> tuple[Any, ...]:
    return tuple((c, row[c]) for c in KEYS if c in row)


def _load(paths: str, best: bool = False) -> dict[str, dict[str, Any]]:
    """Tables by title from one run, or several (comma-separated): each figure the mean of the
    runs' medians, or with ``best`` the best of them (least µs, most tokens/s): a disturbed
    run is only ever slower, so the best run is the one the machine left alone."""
    runs = [{t["title"]: t for t in json.loads(Path(p).read_text())["tables"]} for p in paths.split(",")]
    merged = runs[0]
    for title, table in merged.items():
        for row in table["rows"]:
            others = [r for run in runs[1:] for r in run.get(title, {}).get("rows", []) if _key(r) == _key(row)]
            for column, cell in row.items():
                values = (
                    [cell.get("median")] + [_median(o.get(column)) for o in others] if isinstance(cell, dict) else []
                )
                if values and all(v for v in values):
                    nums = [float(v) for v in values if v]
                    pick = (max if "tokens/s" in column else min) if best else None
                    cell["median"] = pick(nums) if pick else sum(nums) / len(nums)
    return merged


#: Per table kind, the same-run reference each figure is divided by in the normalised gate: a
#: peer measured in the same process moves with the machine, so the ratio does not.
REFERENCE_COLUMNS = ("pinned µs", "uva-ring µs")


def _normalised(table: dict[str, Any]) -> dict[str, Any]:
    """Each µs / tokens/s median divided by the same run's reference (the pinned row or column)."""
    rows = table["rows"]
    ref_row = next((r for r in rows if str(r.get("mode", "")).startswith("pinned")), None)
    ref_col = next((c for c in REFERENCE_COLUMNS if rows and c in rows[0]), None)
    out = []
    for row in rows:
        cells: dict[str, Any] = {}
        for column, cell in row.items():
            value = _median(cell)
            ref = (
                _median(ref_row.get(column)) if ref_row is not None else _median(row.get(ref_col)) if ref_col else None
            )
            if value and ref and column != ref_col and row is not ref_row:
                cells[column] = {"median": value / ref}
            elif not isinstance(cell, dict):
                cells[column] = cell
        out.append(cells)
    return {**table, "rows": out}


def named(title: str, row: dict[str, Any], column: str) -> bool:
    """The figures issue 26's gate names (the other figures print, for reading, outside it)."""
    if title.startswith("staging:"):
        return column == "pool µs" and row.get("bs") in (1, 256, 4096)
    if title.startswith("zero-copy"):
        return column == "zero-copy µs" and row.get("bs") in (1, 64, 256)
    running = title.split(", ")[-1]
    if title.startswith("graph decode: host-bound") and running in ("1 running", "16 running", "64 running"):
        return row.get("mode") == "pool+graph" and column in ("host µs", "tokens/s")
    return False


def _eager_staging(tables: dict[str, Any]) -> str:
    """Eager decode staging, pool ÷ pinned in the same run, at 64 and 256 running (issue: <= 0.5)."""
    out = []
    for running in (64, 256):
        rows = {r.get("mode"): r for r in tables.get(f"decode loop: {running} running", {}).get("rows", [])}
        pool, pinned = (_median(rows.get(m, {}).get("staging µs")) for m in ("pool", "pinned"))
        if pool and pinned:
            out.append(f"{running} running {pool / pinned:.2f}")
    return "; ".join(out)


def _ratios(old: dict[str, Any], new: dict[str, Any]) -> dict[tuple[Any, ...], float]:
    """new ÷ old (old ÷ new for tokens/s) of every µs and tokens/s figure both runs have, by (title, row, column)."""
    out = {}
    for title, table in new.items():
        earlier = {_key(r): r for r in old.get(title, {}).get("rows", [])}
        for row in table["rows"]:
            match = earlier.get(_key(row))
            for column, value in row.items() if match is not None else ():
                a, b = _median(match.get(column)), _median(value)  # type: ignore[union-attr]
                if a and b and ("µs" in column or "tokens/s" in column):
                    out[(title, _key(row), column)] = b / a if "µs" in column else a / b
    return out


def compare_paired(old_paths: str, new_paths: str, normalise: bool = False) -> None:
    """Run i of the new tree against run i of the old (run back to back, so a drift of the machine
    between pairs cancels): each named figure's median over the pairs."""
    olds, news = old_paths.split(","), new_paths.split(",")
    if len(olds) != len(news):
        raise SystemExit(f"--paired needs as many old runs as new ones (got {len(olds)} and {len(news)})")
    pairs = []
    for a, b in zip(olds, news, strict=True):
        old, new = _load(a), _load(b)
        if normalise:
            old, new = ({t: _normalised(v) for t, v in x.items()} for x in (old, new))
        pairs.append(_ratios(old, new))
    gated = 0.0
    how = ", normalised" if normalise else ""
    print(f"(paired: {len(pairs)} pairs{how}; each named figure's ratio in each pair, then their median)")
    for key in pairs[0]:
        title, row_key, column = key
        if named(title, dict(row_key), column) and all(key in p for p in pairs):
            ratios = sorted(p[key] for p in pairs)
            median = statistics.median(ratios)
            gated = max(gated, median)
            where = " ".join(f"{k}={v}" for k, v in row_key)
            print(f"  {title} | {where} | {column}: {' '.join(f'{r:.2f}' for r in ratios)} -> {median:.2f}")
    print(f"GATE paired median, worst named figure {gated:.2f} (gate 1.10)")


def compare(old_paths: str, new_paths: str, normalise: bool = False, best: bool = False) -> None:
    old, new = _load(old_paths, best), _load(new_paths, best)
    if best:
        print("(best: each figure the best of a tree's runs, least µs and most tokens/s)")
    print(f"eager decode staging pool / pinned, new: {_eager_staging(new)}; old: {_eager_staging(old)} (<= 0.5)")
    if normalise:
        print("(normalised: each figure over the same run's pinned row or column, or vLLM's ring)")
        old = {t: _normalised(v) for t, v in old.items()}
        new = {t: _normalised(v) for t, v in new.items()}
    ratios = _ratios(old, new)
    worst = gated = 0.0
    for title, table in new.items():
        if title not in old:
            continue
        print(f"== {title}")
        for row in table["rows"]:
            cells = []
            for column in row:
                ratio = ratios.get((title, _key(row), column))
                if ratio is None:
                    continue
                worst = max(worst, ratio)
                mark = ""
                if named(title, row, column):
                    gated, mark = max(gated, ratio), " [gate]"
                cells.append(f"{column} {ratio:.2f}{' >1.10' if ratio > 1.10 else ''}{mark}")
            if cells:
                print("  " + " ".join(f"{k}={v}" for k, v in _key(row)) + ": " + "; ".join(cells))
    print(f"GATE worst new/old {worst:.2f} (gate 1.10); of the issue's named figures [gate] {gated:.2f}")


def cpu_list(text: str, count: int, allowed: set[int] | None = None) -> str:
    """The first ``count`` CPUs of a sysfs cpulist ("0-7,16-23") that are in ``allowed`` (this
    process's affinity, when given), as a ``taskset -c`` list ("0,1,2,3"); "0" when none is."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        if first.isdigit():
            cpus.extend(c for c in range(int(first), int(last or first) + 1) if allowed is None or c in allowed)
    return ",".join(map(str, cpus[:count])) or "0"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--tree", type=Path, required=True)
    r.add_argument("--json", type=Path, required=True)
    r.add_argument("--workloads", default="staging,zero_copy,decode,sampling_sglang,memcache_sglang")
    r.add_argument("--repeats", type=int, default=3)
    c = sub.add_parser("compare")
    c.add_argument("old", help="the earlier tree's JSON, or several comma-separated (their medians averaged)")
    c.add_argument("new", help="this tree's JSON, or several comma-separated")
    c.add_argument("--normalise", action="store_true", help="divide by a same-run peer first (see REFERENCE_COLUMNS)")
    c.add_argument("--best", action="store_true", help="each tree's best run per figure, not the mean")
    c.add_argument("--paired", action="store_true", help="old run i against new run i, the median over the pairs")
    cp = sub.add_parser(
        "cpus", help="the first COUNT CPUs of a cpulist file this process may use (its own if unreadable)"
    )
    cp.add_argument("path", type=Path)
    cp.add_argument("count", type=int)
    args = parser.parse_args()
    if args.cmd == "cpus":
        allowed = os.sched_getaffinity(0)
        try:
            text, source = args.path.read_text(), str(args.path)
        except OSError:
            text, source = ",".join(map(str, sorted(allowed))), f"this process's CPUs ({args.path} unreadable)"
        print(f"gate CPUs from {source}: {text.strip()}", file=sys.stderr)
        print(cpu_list(text, args.count, allowed))
        return 0
    if args.cmd == "run":
        return run(args.tree, args.workloads.split(","), args.json, args.repeats)
    if args.paired:
        compare_paired(args.old, args.new, args.normalise)
    else:
        compare(args.old, args.new, args.normalise, args.best)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
