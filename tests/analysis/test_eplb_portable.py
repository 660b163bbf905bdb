"""The E[max] swaps' elementary functions give the same bits on every CPU (r3trace/eplb/portable.py).

numpy picks its exp / log / power kernels per CPU at run time; the planner's swaps break near-ties by the last bits,
so a kernel that rounds differently gives another plan (24 of 60 plan sequences on 16-18 nodes differed between an
AVX-512 and an AVX2 machine). Here: portable's functions against numpy's (ulps), against a scalar twin in plain
Python floats (bit for bit: every step is an IEEE add, multiply, divide or exact scaling), and emax.py run with
numpy's per-CPU functions made to raise.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from r3trace.eplb import emax, portable


def ulps(a: np.ndarray, b: np.ndarray) -> float:
    ok = np.isfinite(b) & (b != 0)
    return float(np.max(np.abs(a[ok] - b[ok]) / np.spacing(np.abs(b[ok]))))


def test_exp_log_expm1_within_ulps_of_numpy() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=200_000) * 40
    assert ulps(portable.exp(x), np.exp(x)) <= 2
    pos = np.abs(x) * np.exp(rng.normal(size=x.size) * 30)  # 1e-300 .. 1e300
    assert ulps(portable.log(pos), np.log(pos)) <= 2
    small = x / 400
    assert ulps(portable.expm1(small), np.expm1(small)) <= 4
    tiny = small * 1e-12  # e^x - 1 ~ x: no cancellation
    assert ulps(portable.expm1(tiny), np.expm1(tiny)) <= 1


def test_special_values() -> None:
    with np.errstate(all="ignore"):
        assert np.array_equal(portable.exp(np.array([-800.0, 800.0, 0.0, -np.inf, np.inf])),
                              [0.0, np.inf, 1.0, 0.0, np.inf])
        assert np.isnan(portable.exp(np.array([np.nan]))[0])
        got = portable.log(np.array([0.0, -1.0, np.inf, 1.0, 2.0, 5e-324]))
    assert got[0] == -np.inf and np.isnan(got[1]) and got[2] == np.inf and got[3] == 0.0
    assert got[4] == math.log(2.0) and abs(got[5] - math.log(5e-324)) < 1e-12


def _exp_twin(x: float) -> float:
    """portable.exp in Python floats (IEEE doubles, one operation at a time)."""
    xc = min(max(x, portable.EXP_MIN), portable.EXP_MAX)
    k = float(round(xc * portable.INV_LN2))  # round half to even, as np.rint
    r = (xc - k * portable.LN2_HI) - k * portable.LN2_LO
    p = portable._INV_FACT[-1]
    for c in reversed(portable._INV_FACT[:-1]):
        p = p * r + c
    return math.ldexp((((p * r) + 1.0) * r) + 1.0, int(k))


def _log_twin(x: float) -> float:
    m, e = math.frexp(x)
    if m < 0.7071067811865476:
        m, e = 2.0 * m, e - 1
    f = m - 1.0
    s = f / (2.0 + f)
    z = s * s
    p = portable._ATANH[-1]
    for c in reversed(portable._ATANH[:-1]):
        p = p * z + c
    return float(e) * portable.LN2_HI + ((2.0 * s + s * (p * z)) + float(e) * portable.LN2_LO)


def test_bit_for_bit_with_a_scalar_twin() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=4_000) * 50
    assert portable.exp(x).tolist() == [_exp_twin(v) for v in x.tolist()]
    pos = np.abs(x) * np.exp(rng.normal(size=x.size) * 20)
    assert portable.log(pos).tolist() == [_log_twin(v) for v in pos.tolist()]


def test_emax_calls_no_per_cpu_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """E[max] swaps (two slots a GPU, 16-18 nodes) summed exps whose last bits came from numpy's AVX-512 or AVX2
    exp: their plans differed between an AVX-512 Xeon and an AVX2 EPYC. None of numpy's exp / log / expm1 may run."""
    def banned(*a: object, **k: object) -> None:
        raise AssertionError("a per-CPU numpy kernel ran")

    for name in ("exp", "log", "expm1", "log1p", "power", "matmul"):
        monkeypatch.setattr(np, name, banned)
    from r3trace.eplb import Cluster
    cl = Cluster(16, 2, 32, num_groups=4)
    rng = np.random.default_rng(2)
    w = rng.gamma(0.5, 100.0, (3, 16)) + 1.0  # [L, E], E = 16: every expert twice
    dev = rng.normal(0.0, 5.0, (4, 3, 16))
    a, b = emax.variance_model(dev - dev.mean(0), w)
    ph = np.tile(np.arange(32) % 16, (3, 1))
    out = emax.emax_swaps(ph, w, cl, np.full(3, 4), a, b)
    assert out.shape == (3, 32) and (np.sort(out, 1) == np.sort(ph, 1)).all()  # counts kept


def test_left_sum_adds_left_to_right() -> None:
    """CPython 3.12's sum() compensates the rounding: [1e16, 1.0, -1e16] sums to 1.0 there, 0.0 on 3.11."""
    assert portable.left_sum([1e16, 1.0, -1e16]) == 0.0
    xs = np.random.default_rng(3).normal(size=1000).tolist()
    total = 0.0
    for x in xs:
        total += x
    assert portable.left_sum(iter(xs)) == total


def test_forecast_and_the_ladder_use_no_builtin_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    """The forecast's weights and the static ladder's budget walk summed floats with sum(): on CPython 3.12 (the
    device's) ours-static planned 12 of the matrix's 1-8 node sequences otherwise than on 3.11 from the same inputs."""
    from r3trace.eplb import forecast, static_ladder

    def banned(*a: object, **k: object) -> None:
        raise AssertionError("builtin sum() ran")

    monkeypatch.setattr(forecast, "sum", banned, raising=False)
    monkeypatch.setattr(static_ladder, "sum", banned, raising=False)
    rng = np.random.default_rng(4)
    hist = rng.gamma(1.0, 50.0, (5, 3, 16))
    assert forecast.forecast(hist, 0.35).shape == (3, 16)
    bal, nodes = rng.uniform(0.5, 1.0, (4, 3)), rng.uniform(1.0, 3.0, (4, 3))
    got = static_ladder.choose(bal, nodes, float(nodes[0].sum()) + 0.5)
    assert got.shape == (3,) and ((got >= 0) & (got < 4)).all()
