"""The most even-split balancedness any placement reaches on a window's loads when every slot holds one expert (P = E),
known in hindsight: `r3trace eplb` prints it beside the plan's held-out score, bench/eplb_hindsight.py sets the
held-out matrix's ties against it.

With P = E each GPU holds exactly S = E / G experts, one replica each, so the even split puts on a GPU the sum of its
S experts' loads. For a layer's loads x_1 >= x_2 >= ... >= x_E, every placement's max GPU load is at least
- the mean, sum(x) / G;
- for m = 0 .. S - 1: among the G m + 1 hottest experts some GPU holds m + 1 (pigeonhole), so its load is at least
  the m + 1 lightest of them, x_{Gm-m+1} + ... + x_{Gm+1}, plus the S - m - 1 lightest of all (m = 0: the hottest
  expert and the S - 1 coldest beside it);
- for i = 1 .. E: the i hottest experts sit on some k GPUs, ceil(i / S) <= k <= min(i, G), which hold them and
  k S - i others, so the hottest of those k carries at least (x_1 + ... + x_i + the k S - i coldest) / k; the
  least of that over k bounds every placement;
- with S = 2, for i = 1 .. G: x_i + x_{E+1-i} (the i hottest have i partners, at most i - 1 of them among the i - 1
  coldest, so one of them sits beside an expert at least as hot as x_{E+1-i}). The largest of these is the
  pairing of the i-th hottest with the i-th coldest, which reaches it: the bound is exact for pairs.
Balancedness (mean / max, averaged over loaded layers) is then at most `bound`.

Shape legend: L layers, E experts, G GPUs, S slots a GPU (E / G here).
"""

from __future__ import annotations

import numpy as np


def max_load_floor(heat: np.ndarray, gpus: int) -> np.ndarray:
    """heat [L, E] with E = G S -> [L] a lower bound on every P = E placement's max GPU load under the even split
    (module doc: the mean, the pigeonhole and averaging bounds, and for S = 2 the sorted pairing, which is exact)."""
    n_layers, e = heat.shape
    if e % gpus:
        raise ValueError(f"num_experts={e} is not a multiple of gpus={gpus}: the bound is for one expert a slot")
    s = e // gpus
    x = -np.sort(-np.asarray(heat, dtype=np.float64), axis=1)  # [L, E] hottest first
    if s == 2:
        return (x[:, :gpus] + x[:, ::-1][:, :gpus]).max(1)
    zero = np.zeros((n_layers, 1))
    hot = np.concatenate([zero, np.cumsum(x, axis=1)], axis=1)  # [L, E + 1] sum of the j hottest
    cold = np.concatenate([zero, np.cumsum(x[:, ::-1], axis=1)], axis=1)  # [L, E + 1] sum of the j coldest
    floor = x.sum(1) / gpus
    for m in range(s):
        top = hot[:, gpus * m + 1] - hot[:, gpus * m - m]  # the m + 1 lightest of the G m + 1 hottest
        floor = np.maximum(floor, top + cold[:, s - m - 1])
    i = np.arange(1, e + 1)[:, None]  # [E, 1] the i hottest
    k = np.arange(1, gpus + 1)[None, :]  # [1, G] on k GPUs
    ok = (k >= -(-i // s)) & (k <= i)  # [E, G]
    rest = np.clip(k * s - i, 0, e)  # [E, G] the others on those k GPUs
    avg = (hot[:, i[:, 0]][:, :, None] + cold[:, rest]) / k  # [L, E, G]
    avg = np.where(ok[None], avg, np.inf).min(2).max(1)  # the adversary's k, the strongest i
    return np.maximum(floor, avg)


def bound(heat: np.ndarray, gpus: int) -> float:
    """heat [L, E] -> the most balancedness any P = E placement reaches on these loads (mean over loaded layers)."""
    ok = heat.sum(1) > 0
    return float((heat.sum(1)[ok] / gpus / max_load_floor(heat, gpus)[ok]).mean())
