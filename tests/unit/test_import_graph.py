"""The import graph of ``pinpool/``, read from its ``import`` statements (ast): one-way, no circle.

Every ``import`` counts, wherever it sits: at the top, inside a function, or under
``TYPE_CHECKING`` (a circle there still ties two modules into one, for a reader and for mypy).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pinpool"
#: Packages built on the pool: dependencies point from them to ``pinpool``, never back.
DOWNSTREAM = ("sampling", "memcache")
#: The lab beside the library: test tools and benchmarks, which the library never imports.
LAB = ("pinpool.testing", "pinpool.bench")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module ``name`` imports: a ``pinpool`` module where one matches, else the top-level name."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import sub`` imports the submodule ``pkg.sub`` when there is one.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            found.add(target if target in known else target.split(".")[0])
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected group of more than one module (Tarjan), as a path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_the_graph_reader_sees_the_pools_own_edges() -> None:
    """Catches a reader that finds no edges at all (a wrong root or module name), which would pass every check."""
    graph = _graph()
    assert "pinpool.ring" in graph and "pinpool.stage" in graph["pinpool.ring"]
    assert "pinpool.platform" in graph["pinpool.testing.simulated"]


def test_the_cycle_finder_finds_a_planted_circle() -> None:
    """Control: the finder must report a circle, with its members, or the next test proves nothing."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_inside_pinpool() -> None:
    """Catches two pinpool modules that import each other, directly or round a longer loop."""
    assert _cycles(_graph()) == []


def _is_lab(name: str) -> bool:
    return any(name == lab or name.startswith(lab + ".") for lab in LAB)


def test_pinpool_imports_no_package_built_on_it() -> None:
    """Catches a library module of pinpool importing sampling or memcache (dependencies point one way).

    The lab (``pinpool.bench``: workloads and the reference engine) drives them, so it may.
    """
    graph = _graph()
    wrong = {name: sorted(deps & set(DOWNSTREAM)) for name, deps in graph.items() if deps & set(DOWNSTREAM)}
    assert {name: deps for name, deps in wrong.items() if not _is_lab(name)} == {}


def test_sampling_and_memcache_import_no_lab_module() -> None:
    """Catches the downstream libraries importing a benchmark or test tool (the lab ships beside them)."""
    wrong = []
    for package in DOWNSTREAM:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(LAB):
                    wrong.append(f"{_module_name(path)} -> {node.module}")
    assert wrong == []


def test_the_library_imports_no_lab_module() -> None:
    """Catches a library module importing a test tool or a benchmark (``pinpool.testing``, ``pinpool.bench``)."""
    graph = _graph()
    library = [name for name in graph if not _is_lab(name)]
    wrong = {name: sorted(d for d in graph[name] if _is_lab(d)) for name in library}
    assert {name: deps for name, deps in wrong.items() if deps} == {}


def test_no_import_circle_inside_the_packages_built_on_the_pool() -> None:
    """Catches two sampling (or memcache) modules that import each other, even for types only
    (the draw took the sampler's ``SamplingTensors`` while the sampler imported the draw)."""
    for package in DOWNSTREAM:
        modules = {_module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}
        graph = {name: _imports(name, path, set(modules)) for name, path in modules.items()}
        assert f"{package}.__init__" not in graph and graph, package  # the reader found the package's modules
        assert _cycles(graph) == [], package


#: The small core's bound on a function's length (issue 26), in lines from ``def`` to its end.
MAX_FUNCTION_LINES = 60


def test_no_library_function_of_pinpool_passes_the_length_bound() -> None:
    """Catches a function of pinpool's library (not the lab) growing past ``MAX_FUNCTION_LINES``."""
    long = []
    for name, path in _modules().items():
        if _is_lab(name):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {size}")
    assert long == []
    assert any(not _is_lab(n) for n in _modules()), "the scan read no library module"
