"""Every bench script's `--smoke` run (CPU, tiny shapes, Triton in its interpreter): a broken bench fails CI.

Run: .venv/bin/pytest tests/bench/test_smoke.py -q   (CPU; ~1 min on 2 cores, two scripts at a time)

A script is any bench/*.py with a `__main__` block, found here, so a new one joins without an edit; each runs as
`python -m bench.<name> --smoke` would, in its own process with a timeout, but with the repository's root last on
sys.path (_RUN). The selected scripts start together on a pool of two workers when the first of them is checked
(each is one process on one core; 2 is this machine's count).
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if 'if __name__ == "__main__":' in p.read_text())
TIMEOUT_S = 300  # one script on a loaded 2-core machine; alone they take 2-10 s of CPU each


# `python -m` puts the working directory first on sys.path, where `import kernels` finds this repository's kernels/
# folder (r3trace.kernels once installed) before the Hugging Face `kernels` package that transformers >= 5.25 imports:
# bench/engine_gpu.py's smoke builds its checkpoint with transformers. Last, the root still serves `bench`.
_RUN = ("import runpy, sys; root = sys.argv[1]; sys.path[:] = [p for p in sys.path if p not in ('', root)] + [root]; "
        "sys.argv = sys.argv[2:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")


def _smoke(name: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-c", _RUN, str(ROOT), f"bench.{name}", "--smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)  # fmt: skip


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> dict[str, Future[subprocess.CompletedProcess[str]]]:
    """The smoke run of every script selected in this session, started together on two workers."""
    selected = [item.callspec.params["name"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec") and "name" in item.callspec.params]
    pool = ThreadPoolExecutor(max_workers=2)
    request.addfinalizer(pool.shutdown)
    return {name: pool.submit(_smoke, name) for name in selected}


def test_scripts_are_found() -> None:
    for name in ("mla_decode", "moe", "capture", "tables", "analysis"):
        assert name in SCRIPTS


# The costliest smokes of GPU benches (5-40 s each on two loaded cores, 170 s of the CI suite's 20 minutes) are in the
# slow set (`make test-all`): their scripts run whole on the GPU, where their numbers come from.
SLOW = {"invariant_cost", "eplb_corner", "short_extend", "exact_cost", "node_floor", "engine_gpu", "spec_decode",
        "mla_decode_sglang", "moe_verify_tiles", "step_kernels", "moe_in_step"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in SCRIPTS])
def test_smoke(name: str, runs: dict[str, Future[subprocess.CompletedProcess[str]]]) -> None:
    done = runs[name].result()
    assert done.returncode == 0, f"python -m bench.{name} --smoke exited {done.returncode}:\n{done.stderr[-4000:]}"
