"""The engine's configuration sits below the model: engine_config never imports the model or its CUDA graphs, so
model -> engine_config and cuda_graph -> model are one-way. The token dispatchers likewise: low_latency_dispatcher
imports dispatcher (for Dispatched), never the reverse, and dispatcher_choice sits above both. Read from the
sources, function-level imports and `if TYPE_CHECKING:` blocks included, since those are where a cycle hides.

Run: .venv/bin/pytest -q tests/engine/test_import_direction.py
"""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "engine"
PACKAGE = "r3trace.engine"


def _module(path: Path) -> str:
    parts = path.relative_to(ENGINE).with_suffix("").parts
    return ".".join((PACKAGE, *parts[:-1])) if parts[-1] == "__init__" else ".".join((PACKAGE, *parts))


def import_graph() -> dict[str, set[str]]:
    """Module -> the engine modules it imports anywhere in its source (by name, relative imports resolved)."""
    paths = {_module(p): p for p in ENGINE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in paths.items():
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                names = [f"{base}.{a.name}" for a in node.names] + [base]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            deps |= {n for n in names if n in paths and n != mod}
        graph[mod] = deps
    return graph


def reaches(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """An import path start -> ... -> goal, or None."""
    seen, stack = {start}, [[start]]
    while stack:
        path = stack.pop()
        for nxt in sorted(graph[path[-1]]):
            if nxt == goal:
                return [*path, nxt]
            if nxt not in seen:
                seen.add(nxt)
                stack.append([*path, nxt])
    return None


def test_engine_config_model_and_cuda_graph_import_one_way() -> None:
    g = import_graph()
    cfg, model, graphs = f"{PACKAGE}.engine_config", f"{PACKAGE}.model", f"{PACKAGE}.cuda_graph"
    assert reaches(g, model, cfg) and reaches(g, graphs, model)  # the direction that must exist
    for low, high in ((cfg, model), (cfg, graphs), (model, graphs)):
        assert reaches(g, low, high) is None, f"{low} imports {high}: {' -> '.join(reaches(g, low, high) or [])}"


def test_dispatcher_modules_import_one_way() -> None:
    g = import_graph()
    base, low, choice = (f"{PACKAGE}.layers.{m}" for m in ("dispatcher", "low_latency_dispatcher", "dispatcher_choice"))
    assert reaches(g, low, base) and reaches(g, choice, low) and reaches(g, choice, base)
    for lower, higher in ((base, low), (base, choice), (low, choice)):
        path = reaches(g, lower, higher)
        assert path is None, f"{lower} imports {higher}: {' -> '.join(path)}"
