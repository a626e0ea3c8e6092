"""``pinpool bench --plot``: one panel per result table with a batch-size axis, plus the decode loop.

Each line is a mode's median, with its min-max band shaded. The decode loop's panel plots
staging µs per decode step against the running-batch size. matplotlib is optional
(``pip install 'pinpool[plot]'``); the command line checks for it before any work.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pinpool.bench.kit import Cell, Spread, Table

DECODE_TITLE = re.compile(r"decode loop: (\d+) running$")  # the no-GPU-work tables only


def _median_band(cell: Cell) -> tuple[float, float, float] | None:
    if isinstance(cell, Spread):
        return cell.median, cell.min, cell.max
    if isinstance(cell, (int, float)) and not isinstance(cell, bool):
        return float(cell), float(cell), float(cell)
    return None


def _line(ax: Any, xs: list[float], cells: list[Cell], label: str) -> bool:
    """Draw one mode's line; False (and nothing drawn, nothing in the legend) if it has no figure."""
    points = [(x, b) for x, c in zip(xs, cells, strict=True) if (b := _median_band(c)) is not None]
    if not points:
        return False
    x = [p[0] for p in points]
    (line,) = ax.plot(x, [p[1][0] for p in points], marker="o", label=label)
    ax.fill_between(x, [p[1][1] for p in points], [p[1][2] for p in points], color=line.get_color(), alpha=0.2)
    return True


def _panels(produced: dict[str, list[Table]]) -> list[tuple[str, str, list[float], dict[str, list[Cell]]]]:
    """(title, x label, x values, {label: cells}) for each panel to draw."""
    panels = []
    for workload, tables in produced.items():
        decode_rows: dict[int, dict[str, Cell]] = {}
        for table in tables:
            if table.columns[:1] == ("bs",):
                xs = [float(v) for v in table.column("bs") if isinstance(v, (int, float))]
                lines = {c.removesuffix(" µs"): table.column(c) for c in table.columns[1:] if c.endswith(" µs")}
                panels.append((f"{workload}: {table.title}", "batch size", xs, lines))
            elif (match := DECODE_TITLE.match(table.title)) and "staging µs" in table.columns:
                names = [str(m) for m in table.column("mode")]
                decode_rows[int(match.group(1))] = dict(zip(names, table.column("staging µs"), strict=True))
        if decode_rows:
            running = sorted(decode_rows)
            modes = list(dict.fromkeys(m for r in running for m in decode_rows[r]))
            lines = {m: [decode_rows[r].get(m) for r in running] for m in modes}
            title = f"{workload}: staging µs per decode step (no GPU work)"
            panels.append((title, "running requests", [float(r) for r in running], lines))
    return panels


def plot_workloads(produced: dict[str, list[Table]], path: Path, subtitle: str) -> None:
    """Write a PNG of every workload's figures to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(produced)
    if not panels:
        raise SystemExit("--plot: no workload produced a table to plot")
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (title, xlabel, xs, lines) in zip(axes[0], panels, strict=True):
        drawn = [label for label, cells in lines.items() if _line(ax, xs, cells, label)]
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("µs per call, median (band: min-max)")
        ax.set_title(title, fontsize=9)
        if drawn:
            ax.legend(fontsize=8)
    fig.suptitle(subtitle, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
