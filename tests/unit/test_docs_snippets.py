"""Every ```python block of README.md and docs/*.md, run on the CPU, each in a fresh interpreter.

The snippets pick their device themselves (``"cuda:0" if torch.cuda.is_available() else
"cpu"``); here CUDA is hidden from them and any ``device="cuda..."`` left in one is
rewritten to ``device="cpu"``, so every block runs on a CPU-only machine as CI has.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.S | re.M)
DEVICE = re.compile(r"""device\s*=\s*["']cuda[^"']*["']""")
#: Languages a fence may name: Python runs here; the others are shell lines and output.
LANGUAGES = {"python", "bash", "text"}
#: Names 0.2.0 removed (CHANGELOG's porting table): the docs must not teach them.
REMOVED = re.compile(
    r"\b(pool\.exchange|Exchange|StaticInputs|StaticField|StaticStage|ZeroCopyStage|owned_bytes|reuse_owned)\b"
)
#: pinpool's own log events: with logging unconfigured none may reach a program's output.
EVENTS = ("pool.created", "pool.closed", "stage.aborted", "consumer.registered")


def snippets() -> list[tuple[str, str]]:
    """(id, code) of every ```python block, as ``page.md#n`` counting from 1 per page."""
    found = []
    for page in PAGES:
        blocks = [code for lang, code in FENCE.findall(page.read_text()) if lang.strip() == "python"]
        found += [(f"{page.relative_to(ROOT)}#{i}", code) for i, code in enumerate(blocks, 1)]
    return found


SNIPPETS = dict(snippets())


def run_snippet(code: str, workdir: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "CUDA_VISIBLE_DEVICES": "",  # the snippets' own device choice then picks the CPU
    }
    for name in [n for n in env if n.startswith("PINPOOL_")]:
        del env[name]  # a developer's PINPOOL_* setting must not change what a snippet does
    return subprocess.run(
        [sys.executable, "-c", DEVICE.sub('device="cpu"', code)],
        capture_output=True,
        text=True,
        cwd=workdir,  # anything a snippet writes lands outside the checkout
        env=env,
        timeout=300,
    )


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every snippet run once, concurrently: each is mostly an interpreter importing torch."""
    workdir = tmp_path_factory.mktemp("snippets")
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        done = pool.map(lambda code: run_snippet(code, workdir), SNIPPETS.values())
        return dict(zip(SNIPPETS, done, strict=True))


@pytest.mark.parametrize("snippet_id", list(SNIPPETS))
def test_snippet_runs_on_cpu(snippet_id: str, ran: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """Catches a documented example that no longer runs: a renamed API, an undefined name, a wrong value."""
    done = ran[snippet_id]
    assert done.returncode == 0, f"{snippet_id} failed:\n{done.stderr[-3000:]}"


def test_readme_example_prints_and_logs_nothing_unasked(ran: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """Catches a README example that shows nothing, or library log lines in a program's output."""
    done = ran["README.md#1"]
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), "the README example printed nothing"
    for event in EVENTS:
        assert event not in done.stdout and event not in done.stderr, f"{event!r} reached the program's output"


def test_readme_has_exactly_one_python_example() -> None:
    """Catches a README growing a second example (the rest belongs in docs/) or losing its only one."""
    assert [s for s in SNIPPETS if s.startswith("README.md#")] == ["README.md#1"]


def test_every_fence_names_a_known_language() -> None:
    """Catches a Python block fenced as ``py`` or left bare, which this test would silently skip."""
    for page in PAGES:
        for lang, _ in FENCE.findall(page.read_text()):
            assert lang.strip() in LANGUAGES, f"{page.name}: fence language {lang!r} (use one of {sorted(LANGUAGES)})"


def test_docs_teach_no_removed_name() -> None:
    """Catches the pre-0.2.0 names (CHANGELOG's porting table) surviving in the user docs."""
    for page in PAGES:
        hits = REMOVED.findall(page.read_text())
        assert not hits, f"{page.name} names removed API: {sorted(set(hits))}"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    """Catches a docs page no reader can find from the README."""
    readme = (ROOT / "README.md").read_text()
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in readme, f"README.md does not link docs/{page.name}"


def test_the_snippets_were_found() -> None:
    """Catches a fence pattern that no longer matches, which would leave every snippet untested."""
    assert len(SNIPPETS) >= 10
    assert all("import" in code for code in SNIPPETS.values()), "each snippet must run on its own"
