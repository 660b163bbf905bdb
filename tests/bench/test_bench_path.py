"""`python -m bench.<name>` and `python -m pytest` from the repository root: Hugging Face's top-level `kernels` (which
transformers >= 5.25 imports with its models) must not resolve to this repository's kernels/ folder (bench/__init__.py,
which tests/conftest.py imports)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = ("import importlib.util, sys{}; s = importlib.util.find_spec('kernels'); "
         "print(s.origin if s else '-'); print(sys.path[0])")


def probe(cwd: Path, import_bench: bool) -> list[str]:
    code = PROBE.format(", bench" if import_bench else "")
    env = {"PYTHONPATH": str(ROOT)} if not import_bench else None  # from elsewhere: bench found through PYTHONPATH
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120,
                          check=True, env=env)
    return done.stdout.split("\n")[:2]


def test_the_root_goes_last_and_kernels_is_hugging_faces(tmp_path: Path) -> None:
    ours = str(ROOT / "kernels" / "__init__.py")
    assert probe(ROOT, import_bench=False)[0] == ours  # what python -c / -m from the root did before
    origin, first = probe(ROOT, import_bench=True)
    assert first not in ("", str(ROOT))
    elsewhere = subprocess.run([sys.executable, "-c", PROBE.format("")], cwd=tmp_path, capture_output=True,
                               text=True, timeout=120, check=True).stdout.split("\n")[0]
    # with Hugging Face's kernels installed it is the one found; without, ours is found last on the path
    assert origin == (elsewhere if elsewhere != "-" else ours)


def test_kernels_in_this_process_is_not_the_roots() -> None:
    if not _hugging_faces_installed():
        pytest.skip("Hugging Face's kernels is not installed")
    spec = importlib.util.find_spec("kernels")
    assert spec is not None and spec.origin != str(ROOT / "kernels" / "__init__.py")


def _hugging_faces_installed() -> bool:
    return any((Path(p) / "kernels" / "__init__.py").exists() for p in sys.path if p and Path(p).resolve() != ROOT)


def test_python_m_pytest_from_the_root_finds_hugging_faces_kernels() -> None:
    # `python -m pytest` puts the root first on sys.path (pytest's own script does not); tests/conftest.py moves it last
    if not _hugging_faces_installed():  # the inner test would skip, and this one could not fail
        pytest.skip("Hugging Face's kernels is not installed")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           f"{Path(__file__).relative_to(ROOT)}::test_kernels_in_this_process_is_not_the_roots"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:]
