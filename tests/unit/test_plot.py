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


def _zero_copy_table() -> Table:
    rows = [(bs, readers, S, S, 1.5, S) for bs in (1, 64) for readers in (1, 4)]
    columns = ("bs", "readers", "copy µs", "zero-copy µs", "copy/zero-copy", "copy dev µs")
    return Table.build("zero-copy vs copy: µs per step", columns, rows)


def test_one_panel_per_question_readers_and_device_time_apart() -> None:
    """Catches two reader counts drawn as one zigzag line, and device µs on the host µs axis."""
    panels = _panels({"zero_copy": [_zero_copy_table()]})
    titles = [p[0] for p in panels]
    assert titles == [
        "zero_copy: zero-copy vs copy: µs per step (readers=1)",
        "zero_copy: zero-copy vs copy: µs per step (readers=1) (device µs)",
        "zero_copy: zero-copy vs copy: µs per step (readers=4)",
        "zero_copy: zero-copy vs copy: µs per step (readers=4) (device µs)",
    ]
    _, _, xs, lines = panels[0]
    assert xs == [1.0, 64.0] and set(lines) == {"copy", "zero-copy"}
    assert set(panels[1][3]) == {"copy dev"}
    # A workload's name already at the head of its table's title is not repeated.
    assert _panels(PRODUCED)[0][0] == "staging: host µs per stage"


def test_many_panels_make_a_grid_whose_titles_do_not_overlap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches the wide one-row strip whose long panel titles ran into each other."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kept = []
    monkeypatch.setattr(plt, "close", kept.append)  # keep the figure to look at it
    long_title = "sampling: SamplingBatchInfo build vs sglang's from_schedule_batch, no logit bias"
    produced = {
        **PRODUCED,
        "zero_copy": [_zero_copy_table()],
        "sampling_sglang": [Table.build(long_title, ("bs", "sglang µs", "pool µs"), [(1, S, S), (64, S, S)])],
    }
    plot_workloads(produced, tmp_path / "bench.png", "test")
    (fig,) = kept
    shown = [ax for ax in fig.axes if ax.get_visible()]
    assert len(shown) == len(_panels(produced)) == 7
    assert len({round(ax.get_position().y0, 3) for ax in shown}) == 3  # three rows of at most three
    fig.canvas.draw()
    boxes = [ax.title.get_window_extent() for ax in shown]
    for ax, box in zip(shown, boxes, strict=True):
        assert box.width <= ax.get_window_extent().width * 1.05, ax.get_title()  # a title fits its panel
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b)
    plt.close(fig)
