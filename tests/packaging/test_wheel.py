"""A plain wheel install, used outside the checkout: no network, no source tree.

    TRITON_INTERPRET=1 .venv/bin/pytest -q tests/packaging

Builds the wheel from a copy of the sources (pip, no build isolation, no index), installs it with --no-deps into
a fresh venv whose dependencies come from this venv's site-packages through a .pth file (a path line only adds
the folder: this venv's editable-install hook is not run, so `r3trace` can only come from the wheel), then from
a temp folder runs the README's Python snippet and serves `r3trace dashboard` until its health URL answers.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.health import stop, wait_healthy

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "r3trace", "engine", "kernels", "dashboards")


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{cmd[:4]} exited {p.returncode}: {p.stderr[-3000:]}"
    return p.stdout


def _readme_snippet() -> str:
    """The README's first ```python block, with the sample model's path made absolute."""
    block = re.search(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    assert block is not None, "README.md has no python snippet"
    return block.group(1).replace('"samples/model"', repr(str(REPO / "samples" / "model")))


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """(the fresh venv's python, the environment to run it in); the wheel is built and installed."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, src / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PIP_NO_INDEX"] = "1"  # never download: everything needed is already here
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"),
          str(src)], tmp, env)
    [wheel] = (tmp / "dist").glob("r3trace-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert {"r3trace/dashboards/app.py", "r3trace/dashboards/views/heat.py", "r3trace/engine/engine.py",
            "r3trace/kernels/moe/fused_moe.py", "r3trace/kernels/mla_decode/wide.py",
            "r3trace/trace/layout.py"} <= names
    triton = [ln for ln in meta.splitlines() if ln.startswith("Requires-Dist: triton")]
    assert triton and "platform_machine == \"x86_64\"" in triton[0] and "sys_platform == \"linux\"" in triton[0]
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp, env)
    py = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", str(wheel)], tmp, env)
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp, env).strip())
    (site / "_r3trace_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")  # this venv's packages, last
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return py, env


def test_readme_snippet_runs_from_the_wheel(fresh: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    py, env = fresh
    where = _run([str(py), "-c", "import r3trace, r3trace.engine; print(r3trace.__file__)"], tmp_path, env)
    assert Path(where.strip()).is_relative_to(py.parent.parent), where  # the wheel's copy, not the checkout
    traced = "engine.generate(prompt='x = 1', sampling_params={'max_new_tokens': 4})\n"  # into the trace
    out = _run([str(py), "-c", f"{_readme_snippet()}\n{traced}print('rows', len(routes))\n"], tmp_path, env)
    assert int(out.split("rows")[-1]) >= 16  # prompt + 16 new tokens - 1
    # the script ends without stop_trace: the exit hook commits and closes the run (docs/durability.md)
    from r3trace.trace import open_dataset

    [run] = open_dataset(tmp_path / "traces")
    assert run.state == "closed" and run.manifest.rows > 0
    assert [p.parent.parent.name for p in run.route_files] == ["routes"] * len(run.route_files)


def test_dashboard_serves_from_the_wheel(fresh: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    py, env = fresh
    store = tmp_path / "store"
    shutil.copytree(REPO / "samples" / "traces", store)
    # the app itself, from the installed package: it imports and draws the sample store without an exception
    check = ("from streamlit.testing.v1 import AppTest; from r3trace.commands.dashboard import app_path; "
             "at = AppTest.from_file(str(app_path()), default_timeout=60).run(); "
             "assert not at.exception and not at.error, (at.exception, at.error); print(app_path())")
    app = _run([str(py), "-c", check], tmp_path, {**env, "R3TRACE_STORE": str(store)})
    assert Path(app.strip().splitlines()[-1]).is_relative_to(py.parent.parent), app
    with socket.socket() as s:  # a free port: bind to 0, read it back, release it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "dashboard.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([str(py.parent / "r3trace"), "dashboard", str(store), "--port", str(port)],
                                cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/_stcore/health", proc, 90, lambda: log.read_text()[-2000:])
    finally:
        stop(proc, signal.SIGTERM, 15)
