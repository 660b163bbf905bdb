"""Ours plans the same on every machine: no figure a plan depends on may come from a BLAS kernel, which OpenBLAS
picks per CPU at run time and which rounds a sum in its own order. r3trace/eplb/forecast.py's EMA summed windows
with np.tensordot, and the same code and numpy build planned 74 of bench/eplb_matrix.py's 124 cells differently on
an AVX-512 machine than on an AVX2 one. Here the same history is forecast and planned (fresh, then re-planned from
the first plan) on 4, 2 and 16 nodes (the first two re-plans level with the variance term, scenarios.spread, whose
products are BLAS calls; 16 nodes take the E[max] swaps) in processes that force different OpenBLAS kernels, and
the bytes must match.

Any x86-64 CPU with AVX2 runs the Haswell, Sandybridge (AVX, no FMA) and Nehalem (SSE) kernels, so this runs in CI:
with the EMA back on np.tensordot the three digests all differ. SkylakeX joins where the CPU has AVX-512. The same
plans with numpy's own SIMD kernels switched off (NPY_DISABLE_CPU_FEATURES=X86_V3) must match too: with
leveling.py's GPU ranking back on numpy's default argsort (tie order per SIMD kernel) they differ.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import numpy as np
from r3trace.eplb import Cluster, plan
from r3trace.eplb.forecast import choose_alpha, forecast
rng = np.random.default_rng(0)
rank = rng.permutation(256)
rate = (1.0 + rank) ** -0.9 * rng.lognormal(0.0, 0.3, (8, 6, 256))  # [W, L, E] a drifting skewed router
hist = np.stack([rng.multinomial(32768, r / r.sum()) for r in rate.reshape(-1, 256)]).reshape(8, 6, 256) * 1.0
out = [forecast(hist, a) for a in (0.1, 0.35, 0.7)] + [np.array([choose_alpha(hist)])]
for cl in (Cluster(32, 4, 288, num_groups=8), Cluster(16, 2, 288, num_groups=8), Cluster(128, 16, 256, num_groups=8)):
    first = plan(hist[:6], cl)
    again = plan(hist, cl, prev=first)
    out += [first.phy2log, again.phy2log]
print(''.join(a.tobytes().hex() for a in out))
"""


# token_mix.planning_loads on windows of three kinds of token (tests/analysis/test_eplb_token_mix.py's draw): its EM
# takes numpy's exp / log, whose SIMD kernels round by CPU (its mixture's bytes differ with X86_V3 off), so the loads
# a plan reads are rounded to 1e-3; those and the source picked must match
MIX_SCRIPT = """
import sys
import numpy as np
sys.path.insert(0, "tests/analysis")
from test_eplb_token_mix import draw, heat
from r3trace.eplb import token_mix
routes = draw(3, 1.5, seed=5)[0]
src = token_mix.planning_loads(heat(routes), routes)
print(src.name, sorted(src.aic), src.loads.tobytes().hex())
"""


def digest(coretype: str, script: str = SCRIPT, **extra: str) -> str:
    env = {**os.environ, "OPENBLAS_CORETYPE": coretype, **extra}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          check=True, cwd=Path(__file__).resolve().parents[2])
    return hashlib.sha256(done.stdout.encode()).hexdigest()


def cpu_flags() -> set[str]:
    info = Path("/proc/cpuinfo")
    if not info.exists():
        return set()
    return {f for line in info.read_text().splitlines() if line.startswith("flags") for f in line.split(":")[1].split()}


@pytest.mark.skipif("avx2" not in cpu_flags() or platform.machine() != "x86_64",
                    reason="OpenBLAS's x86-64 kernels (Haswell needs AVX2)")
def test_forecast_and_plans_match_across_blas_kernels() -> None:
    kernels = ["Haswell", "Sandybridge", "Nehalem"] + (["SkylakeX"] if "avx512f" in cpu_flags() else [])
    digests = {k: digest(k) for k in kernels}
    assert len(set(digests.values())) == 1, digests


@pytest.mark.skipif("avx2" not in cpu_flags() or platform.machine() != "x86_64",
                    reason="numpy's X86_V3 (AVX2) dispatch to switch off")
def test_plans_match_with_numpys_simd_kernels_switched_off() -> None:
    """numpy's own per-CPU kernels (sort, argsort, ufuncs) with AVX2 and up switched off, as on a CPU without them or
    another architecture's fallback: the same forecast and plan bytes."""
    assert digest("Haswell") == digest("Haswell", NPY_DISABLE_CPU_FEATURES="X86_V3")


@pytest.mark.skipif("avx2" not in cpu_flags() or platform.machine() != "x86_64",
                    reason="numpy's X86_V3 (AVX2) dispatch to switch off")
def test_token_mix_loads_match_with_numpys_simd_kernels_switched_off() -> None:
    """The token mix's loads and source (what plan(mixed=...) reads) across OpenBLAS kernels and with numpy's AVX2
    kernels off; the mixture itself differs in its last bits there."""
    base = digest("Haswell", MIX_SCRIPT)
    assert base == digest("Nehalem", MIX_SCRIPT) == digest("Haswell", MIX_SCRIPT, NPY_DISABLE_CPU_FEATURES="X86_V3")
