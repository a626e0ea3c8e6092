"""``pinpool bench --plot``: host µs against batch size, one line per mode and table.

matplotlib is optional (not a dependency of the library): the flag says how to get it.
"""

from __future__ import annotations

from pathlib import Path

from pinpool.bench.kit import Table


def plot_tables(tables: list[Table], path: Path, subtitle: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from exc
    plottable = [t for t in tables if t.columns and t.columns[0] == "bs" and any(c.endswith(" µs") for c in t.columns)]
    if not plottable:
        raise SystemExit("--plot: no table with a batch-size axis was produced")
    fig, axes = plt.subplots(1, len(plottable), figsize=(5.5 * len(plottable), 4.2), squeeze=False)
    for ax, table in zip(axes[0], plottable, strict=True):
        sizes = [row[0] for row in table.rows]
        for i, column in enumerate(table.columns):
            if column.endswith(" µs") and i:
                ax.plot(sizes, [row[i] for row in table.rows], marker="o", label=column.removesuffix(" µs"))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel("µs per call (title says host or device)")
        ax.set_title(table.title, fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle(subtitle, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
