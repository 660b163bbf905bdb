"""Load another bench script as a module by its path: `kernels` alone would import the repository's kernels/
package (r3trace.kernels is installed from it), so bench scripts that reuse each other's timers and inputs
go through here."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def load_path(path: str | Path, name: str) -> ModuleType:
    """The Python file at `path` as a module called `name` (executed on every call: keep the result)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_sibling(filename: str, name: str) -> ModuleType:
    """bench/<filename> as a module called `name`."""
    return load_path(Path(__file__).with_name(filename), name)
