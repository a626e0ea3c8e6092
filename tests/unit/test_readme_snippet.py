"""The README's first example, run on the CPU in a fresh interpreter: stdout holds only what it prints; and
the CUDA-graph inputs example (``DeviceBlock``), run as written."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Runs the snippet with a print that also records what the user printed, then writes
# that record to the file named in argv[1], so the test compares stdout with it exactly.
RUNNER = """
import builtins, io, sys
record = io.StringIO()
def user_print(*args, **kw):
    builtins.print(*args, **kw)
    kw.pop("file", None)
    builtins.print(*args, file=record, **kw)
exec(compile(sys.stdin.read(), "README snippet", "exec"), {"print": user_print, "__name__": "__main__"})
open(sys.argv[1], "w").write(record.getvalue())
"""


def readme_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"```python\n(.*?)```", text, re.S)
    assert match, "README.md has no ```python example"
    return re.sub(r"""device=["']cuda[^"']*["']""", 'device="cpu"', match.group(1))


def test_readme_snippet_prints_only_what_the_user_prints(tmp_path: Path) -> None:
    """Catches library log lines (pool.created, stage.aborted, ...) landing in a program's stdout."""
    snippet = readme_snippet()
    # On the CPU here: a literal device is replaced, and one chosen by torch.cuda.is_available()
    # finds no CUDA device (CUDA_VISIBLE_DEVICES is emptied below).
    assert '"cpu"' in snippet and "PinnedRingBuffer" in snippet
    printed = tmp_path / "printed.txt"
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, str(printed)],
        input=snippet,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={
            **os.environ,
            "CUDA_VISIBLE_DEVICES": "",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        },
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert printed.read_text(), "the snippet printed nothing: nothing was checked"
    assert done.stdout == printed.read_text()
    # Nor in stderr: with logging unconfigured a library user sees nothing below warning.
    assert "pool.created" not in done.stderr


#: The CUDA-graph inputs example on the new core (``StaticInputs`` / ``StaticField`` are gone: a
#: ``Layout`` of ``Field``s in a ``DeviceBlock``), run while neither README.md nor
#: docs/layouts.md carries a ``DeviceBlock`` example; from then on the documented one is run.
DEVICE_BLOCK_SNIPPET = """
import torch
from pinpool import DeviceBlock, Field, Layout, PinnedRingBuffer, PoolSettings

pool = PinnedRingBuffer(PoolSettings(device="cpu", num_slots=4, slot_bytes=1 << 16))
layout = Layout([Field("positions", torch.int64, pad=0), Field("temperature", torch.float32, pad=1.0)], max_rows=8)
block = DeviceBlock(pool, layout)
views = block.views(4)  # what a graph for 4 padded rows captures (fixed addresses)
with block.stage(rows=4, live=3) as st:  # this step: 3 live rows of a graph sized 4
    st.put("positions", [17, 5, 9])
    st.host("temperature")[:] = 0.7  # or fill the pinned slot in place
# exit: padding written, one copy of the 4-row layout into the block
print(views["positions"].tolist(), views["temperature"].tolist())  # [17, 5, 9, 0] [0.7, 0.7, 0.7, 1.0]
"""


def documented_device_block_snippet() -> str:
    """The first ```python block building a ``DeviceBlock`` in README.md or docs/layouts.md, else the port's own."""
    for doc in (ROOT / "README.md", ROOT / "docs" / "layouts.md"):
        if doc.exists():
            for block in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S):
                if "DeviceBlock(" in block:
                    return str(block)
    return DEVICE_BLOCK_SNIPPET


def test_the_device_block_snippet_lands_live_rows_and_padding() -> None:
    """Catches a documented DeviceBlock example (the CUDA-graph inputs) that no longer runs, or prints other
    values than its closing ``print(...)  # [..] [..]`` comment says (live rows, then padding)."""
    snippet = documented_device_block_snippet()
    claimed = re.search(r"^print\(.*\)\s*#\s*(\[.*\])\s*$", snippet, re.M)
    assert claimed, "the example's print line does not say what it prints"
    want = ast.literal_eval("(" + re.sub(r"\]\s+\[", "], [", claimed.group(1)) + ",)")
    printed: list[tuple[object, ...]] = []
    exec(compile(snippet, "documented DeviceBlock snippet", "exec"), {"print": lambda *a: printed.append(a)})
    assert len(printed) == 1 and len(printed[0]) == len(want), printed
    for got, expected in zip(printed[0], want, strict=True):
        assert got == pytest.approx(expected, rel=1e-6), (printed, want)
