"""Loading files of sglang's own source for side-by-side benchmarks (lab code, not library code).

sglang 0.5.23's wheel is extracted into ``.sglang/`` (ignored by git; nothing of it is
copied into this repository). Its modules import much of sglang for functions the
benchmarks never call; ``stub`` puts inert modules in their place so that one file can be
executed on its own with ``exec_file``.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any


def sglang_dir(*relative: Path) -> Path | None:
    """``.sglang/`` beside the checkout or in the working directory, if it holds every ``relative`` file."""
    for root in (Path(__file__).resolve().parents[2], Path.cwd()):
        base = root / ".sglang"
        if all((base / r).is_file() for r in relative):
            return base
    return None


class _AnyModule(types.ModuleType):
    """A stub module: every name not set explicitly is an inert class."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        stub = type(name, (), {"__init__": lambda self, *a, **k: None})
        setattr(self, name, stub)
        return stub


def stub(name: str, **attrs: Any) -> None:
    """Register ``name`` (and its parents) as stub modules unless loaded, then set ``attrs`` on it."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        sub = ".".join(parts[:i])
        if sub not in sys.modules:
            mod = _AnyModule(sub)
            mod.__path__ = []
            sys.modules[sub] = mod
            if i > 1:  # `import a.b.c as x` walks the attributes
                setattr(sys.modules[".".join(parts[: i - 1])], parts[i - 1], mod)
    for key, value in attrs.items():
        setattr(sys.modules[name], key, value)


def exec_file(name: str, path: Path) -> Any:
    """Execute ``path`` as module ``name`` and return it."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
