"""``pinpool bench --plot``: a grid with one panel per question, each titled in a few short lines.

A question is a result table with a batch-size axis, split where one table answers several:
host µs apart from device µs, and one panel per value of a second key column (``readers``).
The decode loop gets one panel: staging µs per decode step against the running-batch size.
Each line is a mode's median, with its min-max band shaded. matplotlib is optional
(``pip install 'pinpool[plot]'``); the command line checks for it before any work.
"""

from __future__ import annotations

import math
import re
import textwrap
from pathlib import Path
from typing import Any

from pinpool.bench.kit import Cell, Spread, Table

DECODE_TITLE = re.compile(r"decode loop: (\d+) running$")  # the no-GPU-work tables only
#: Panels per row, and characters per title line at that panel width.
COLUMNS = 3
TITLE_WIDTH = 48


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
                panels += _batch_panels(workload, table)
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


def _is_device(column: str) -> bool:
    return "dev µs" in column or "device µs" in column


def _batch_panels(workload: str, table: Table) -> list[tuple[str, str, list[float], dict[str, list[Cell]]]]:
    """A batch-size table's panels: host and device µs apart, and one per value of a second key column."""
    timed = [c for c in table.columns[1:] if c.endswith(" µs")]
    # Batch sizes that repeat come with a second key column (zero-copy's "readers"): one panel per value.
    sizes = table.column("bs")
    key = table.columns[1] if len(set(sizes)) < len(sizes) and len(table.columns) > 1 else None
    values: list[Cell] = list(dict.fromkeys(table.column(key))) if key else [None]
    panels = []
    for value in values:
        rows = [i for i in range(len(table.rows)) if value is None or table.rows[i][1] == value]
        xs = [float(v) for i in rows if isinstance(v := table.rows[i][0], (int, float))]
        for device in (False, True):
            columns = [c for c in timed if _is_device(c) == device]
            if not columns:
                continue
            lines = {c.removesuffix(" µs"): [table.rows[i][table.columns.index(c)] for i in rows] for c in columns}
            # "sampling: sampling: ..." says the workload twice: the title alone then.
            title = table.title if table.title.startswith(f"{workload}:") else f"{workload}: {table.title}"
            if value is not None:
                title += f" ({key}={value})"
            if device and len(columns) < len(timed):
                title += " (device µs)"
            panels.append((title, "batch size", xs, lines))
    return panels


def plot_workloads(produced: dict[str, list[Table]], path: Path, subtitle: str) -> None:
    """Write a PNG of every workload's figures to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(produced)
    if not panels:
        raise ValueError("--plot: no workload produced a table with a batch-size or running-batch axis")
    ncols = min(COLUMNS, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4.6 * nrows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)  # the last row's empty cells
    for ax, (title, xlabel, xs, lines) in zip(axes.flat, panels, strict=False):
        drawn = [label for label, cells in lines.items() if _line(ax, xs, cells, label)]
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("µs per call, median (band: min-max)")
        ax.set_title(textwrap.fill(title, TITLE_WIDTH), fontsize=9)
        if drawn:
            ax.legend(fontsize=8)
    fig.suptitle(subtitle, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (4.6 * nrows)))  # room for the suptitle above the top row
    fig.savefig(path, dpi=110)
    plt.close(fig)
