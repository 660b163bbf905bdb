"""pyproject.toml lists the wheel's packages by hand (find_packages cannot see through the package-dir renames):
every folder with an __init__.py under r3trace/, engine/, kernels/ and dashboards/ must be listed, or the wheel
installs without it (r3trace.engine.spec went missing that way). Reads the files only; no wheel is built.

Run: .venv/bin/pytest -q tests/packaging/test_package_list.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parents[2]


def test_every_subpackage_is_listed() -> None:
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {name: Path(folder) for name, folder in tool["package-dir"].items()}  # r3trace.kernels -> kernels
    on_disk = set()
    for name, folder in folders.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            on_disk.add(".".join([name, *rel.parts]))
    assert on_disk - set(tool["packages"]) == set()
