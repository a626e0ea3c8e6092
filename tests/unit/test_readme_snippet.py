"""The README's first example, run on device="cpu" in a fresh interpreter: stdout holds only what it prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

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
    assert 'device="cpu"' in snippet and "PinnedRingBuffer" in snippet
    printed = tmp_path / "printed.txt"
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, str(printed)],
        input=snippet,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert printed.read_text(), "the snippet printed nothing: nothing was checked"
    assert done.stdout == printed.read_text()
    # Nor in stderr: with logging unconfigured a library user sees nothing below warning.
    assert "pool.created" not in done.stderr


def test_the_static_inputs_snippet_lands_live_rows_and_padding() -> None:
    """Catches a README StaticInputs example that no longer runs or lands other values."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "StaticInputs(" in b]
    assert blocks, "README.md has no StaticInputs example"
    printed: list[tuple[object, ...]] = []
    exec(compile(blocks[0], "README StaticInputs snippet", "exec"), {"print": lambda *a: printed.append(a)})
    assert printed == [([17, 5, 9, 0], [0.699999988079071, 0.699999988079071, 0.699999988079071, 1.0])]
