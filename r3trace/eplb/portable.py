"""Elementary functions that give the same bits on every x86-64 CPU, for the planner's E[max] swaps (emax.py).

Why: numpy picks its exp / log / power kernels per CPU at run time, and they round differently: float64 exp on an
AVX-512 Xeon differed from an AVX2 EPYC's in 4,551 of 100,000 values (1 ulp), x ** 3 in 2,682. The E[max] swaps
compare sums of such values, so one ulp picked another swap and every later plan followed: 24 of 60 plan sequences
on 16-18 nodes differed between those two machines with the same numpy build, first in emax.variance_model and the
swaps' factors. Here each function is a fixed sequence of IEEE-754 adds, multiplies, divides and exact scalings
(np.ldexp, np.frexp, np.rint), which every CPU rounds alike (numpy applies them elementwise, never fused).

Accuracy: exp and log within 2 ulp of numpy's, expm1 within 4 (tests/analysis/test_eplb_portable.py).

Still on per-CPU kernels (docs/analysis.md, "A plan is the same on every machine"): on slots > 2 a GPU
scenarios.spread's eigh (LAPACK) and the leveling's product with it (BLAS), which move values by ~1e-16 of their
size; re-plans under OpenBLAS's Haswell, Sandybridge and Nehalem kernels, and with numpy's own SIMD kernels switched
off, come out the same (tests/analysis/test_eplb_blas.py). A portable cyclic Jacobi eigh took 7 ms at [58, 8, 8]
against LAPACK's 0.6.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

# ln 2 split so that k * LN2_HI is exact for |k| < 2^20 (its low 32 bits are zero) and LN2_LO carries the rest
LN2_HI = 6.93147180369123816490e-01
LN2_LO = 1.90821492927058770002e-10
INV_LN2 = 1.44269504088896338700e00
EXP_MAX, EXP_MIN = 709.78, -745.2  # beyond: inf and 0
# 1 / n! for n = 2 .. 13: after range reduction |r| <= ln(2) / 2, r^14 / 14! < 5e-18 of the result
_INV_FACT = [1.0 / float(np.prod(np.arange(1, n + 1, dtype=np.float64))) for n in range(2, 14)]
# 2 / (2n + 1) for n = 1 .. 11: log(m) = 2 atanh(s), s^2 <= 0.0295 after reduction, so z^12 terms are < 1e-18
_ATANH = [2.0 / (2 * n + 1) for n in range(1, 12)]


def _exp_reduced(r: np.ndarray) -> np.ndarray:
    """exp(r) - 1 for |r| <= ln(2) / 2 + a little, by Horner on the Taylor series (no constant term)."""
    p = np.full_like(r, _INV_FACT[-1])
    for c in reversed(_INV_FACT[:-1]):
        p *= r
        p += c
    p *= r
    p += 1.0
    p *= r
    return p


def exp(x: np.ndarray) -> np.ndarray:
    """e^x elementwise (float64), the same bits on every CPU."""
    x = np.asarray(x, dtype=np.float64)
    xc = np.clip(np.where(np.isnan(x), 0.0, x), EXP_MIN, EXP_MAX)
    k = np.rint(xc * INV_LN2)
    r = (xc - k * LN2_HI) - k * LN2_LO
    out = np.ldexp(_exp_reduced(r) + 1.0, k.astype(np.int32))
    out[x > EXP_MAX] = np.inf
    out[x < EXP_MIN] = 0.0
    out[np.isnan(x)] = np.nan
    return out


def expm1(x: np.ndarray) -> np.ndarray:
    """e^x - 1 elementwise (float64), accurate near 0, the same bits on every CPU."""
    x = np.asarray(x, dtype=np.float64)
    small = np.abs(x) <= LN2_HI / 2
    return np.where(small, _exp_reduced(np.where(small, x, 0.0)), exp(x) - 1.0)


def log(x: np.ndarray) -> np.ndarray:
    """natural log elementwise (float64; 0 -> -inf, < 0 -> nan), the same bits on every CPU."""
    x = np.asarray(x, dtype=np.float64)
    m, e = np.frexp(np.where((x > 0) & (x < np.inf), x, 1.0))  # m in [0.5, 1)
    low = m < 0.7071067811865476
    m = np.where(low, 2.0 * m, m)  # [sqrt(1/2), sqrt(2))
    ef = (e - low).astype(np.float64)
    f = m - 1.0
    s = f / (2.0 + f)
    z = s * s
    p = np.full_like(z, _ATANH[-1])
    for c in reversed(_ATANH[:-1]):
        p *= z
        p += c
    p *= z
    lm = 2.0 * s + s * p  # log(m) = 2 atanh(s)
    out = ef * LN2_HI + (lm + ef * LN2_LO)
    out = np.where(x > 0, out, np.where(x == 0, -np.inf, np.nan))
    return np.where(np.isinf(x) & (x > 0), np.inf, out)


def left_sum(xs: Iterable[float]) -> float:
    """Python floats added left to right from 0.0: what sum() did before CPython 3.12, whose sum() compensates the
    rounding (Neumaier) and so gives another last bit for the same list; the forecast's window weights and the static
    ladder's node budget walk read those bits (3.11 and 3.12 planned ours-static differently from the same inputs)."""
    total = 0.0
    for x in xs:
        total += x
    return total
