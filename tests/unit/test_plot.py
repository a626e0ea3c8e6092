"""pinpool bench --plot: a panel per table with a batch-size axis, one for the decode loop, honest legends."""

from __future__ import annotations

from pathlib import Path

import pytest

from pinpool.bench.kit import Spread, Table
from pinpool.bench.plot import _line, _panels, plot_workloads

S = Spread(1.0, 2.0, 3.0)
PRODUCED = {
    "staging": [Table.build("staging: host µs per stage", ("bs", "sync µs", "pool µs"), [(1, S, S), (64, S, S)])],
    "decode": [
        Table.build(f"decode loop: {n} running", ("mode", "step µs", "staging µs"), [("pinned", S, S), ("pool", S, S)])
        for n in (64, 256)
    ]
    + [Table.build("decode loop: 64 running, 1000 µs GPU work per step", ("mode", "staging µs"), [("pool", S)])],
}


def test_every_workload_gets_a_panel_including_the_decode_loop() -> None:
    """Catches a plot that leaves out the decode loop (it has no batch-size column)."""
    panels = _panels(PRODUCED)
    assert [p[0].split(":")[0] for p in panels] == ["staging", "decode"]
    _, xlabel, xs, lines = panels[1]
    assert xlabel == "running requests" and xs == [64.0, 256.0] and set(lines) == {"pinned", "pool"}


def test_legend_lists_only_the_lines_drawn(tmp_path: Path) -> None:
    """Catches a legend entry for a mode that has no figure on this device (nothing drawn)."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    assert not _line(ax, [1.0, 64.0], [None, None], "pinned")
    assert _line(ax, [1.0, 64.0], [S, 4.0], "pool")
    assert ax.get_legend_handles_labels()[1] == ["pool"]
    plt.close(fig)
    plot_workloads(PRODUCED, tmp_path / "bench.png", "test")
    assert (tmp_path / "bench.png").stat().st_size > 0
