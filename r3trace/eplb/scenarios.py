"""Load scenarios about the forecast, and their spread: the variance a seeded re-plan's leveling lowers besides the
forecast's squared GPU loads (leveling.level_refine's spread).

Why: a plan leveled against one forecast [L, E] lowers the max of E[GPU load], while the next window's balancedness
follows E[max GPU load]: held out, its hottest GPU is often not the forecast's. The grouped router draws each window's
domain mix afresh (bench/eplb_traces.py), so whole groups' loads rise and fall together from window to window; a
GPU holding several of them swings with them. The scenarios are the forecast plus each training window's deviation
from the windows' mean (in rates, scaled to the forecast's tokens): the empirical spread of a window about its
expectation, centred where the planner expects the next one. Sampling noise alone (the independent router) adds the
same variance to every placement with the same counts, so only the axes of the deviations above it are kept.

Scenarios tried and left (the robust objective, sample-average E[max], commit "EPLB experiment"): each hot swap
(descent.py) taken only where it lowered the mean over the scenarios of the max GPU load: bench/eplb_matrix.py's 52
shape cells of 1-18 nodes went from 24 / 22 / 6 yes / tie / no to 24 / 20 / 8 (three new no's; without a spare slot
the swaps, and churn, halved); of the forecast's swaps, the one with the lowest mean max: 23 / 23 / 6, each cell
within -0.001 .. +0.002. On 20 re-plans of four missed cells the next window put global ahead of ours 18 times, the
forecast's max 20, the scenarios' mean max 11: K <= 8 scenarios rank two layouts by noise.

Shape legend: K windows (scenarios), W windows seen, L layers, E experts, R spread axes.
"""

from __future__ import annotations

import numpy as np

MIN_WINDOWS = 3  # fewer windows give fewer than 3 deviations (two are mirror images): no spread
# spread keeps a principal axis of the windows' deviations (each expert's over the square root of its load, so that
# Poisson sampling noise is white, ~E / K along every axis) only where its variance exceeds NOISE_BULK x E / K. Over
# bench/eplb_traces.py's windows (3-7 of them, s = 0.3 / 0.6 / 1.2, 6 layers) the independent router, whose windows
# differ by noise alone, never passed 3.0; the grouped router's domain mix reached 27, the clustered router's 21, few
# axes of either falling in 3.5-4
NOISE_BULK = 4.0


def deviations(history: np.ndarray, w: np.ndarray, windows: int) -> np.ndarray | None:
    """history [W, L, E] loads (oldest first), forecast w [L, E] -> [K, L, E] each of the newest K = min(W, windows)
    windows' deviation from their mean, in rates scaled to w's tokens per layer (they sum to 0 over K; w plus one is
    a scenario); None with fewer than MIN_WINDOWS of them or windows <= 0."""
    h = np.asarray(history, dtype=np.float64)
    if windows <= 0 or h.ndim != 3 or min(len(h), windows) < MIN_WINDOWS:
        return None
    rates = h[-windows:] / np.maximum(h[-windows:].sum(-1, keepdims=True), 1e-12)  # [K, L, E]
    return (rates - rates.mean(0)) * w.sum(-1, keepdims=True)[None]


def spread(history: np.ndarray, w: np.ndarray, windows: int) -> np.ndarray | None:
    """history [W, L, E], forecast w [L, E] -> [R, L, E] deviations whose squares, summed over R, give the part of the
    scenarios' mean squared deviation from w of any sum of loads (a GPU's) that stands above sampling noise: per layer
    the principal axes of the K deviations over sqrt(K), each expert's divided by sqrt(w) (Poisson noise is then
    white), those whose variance exceeds NOISE_BULK x E / K, scaled back; layers with fewer than R such axes get zero
    rows. None where deviations are None or no layer has such an axis. Noise alone adds the same variance to every
    placement with the same counts (a replica's is its expert's over its count squared, on whatever GPU), so leaving
    it out changes no choice."""
    dev = deviations(history, w, windows)
    if dev is None:
        return None
    k, e = dev.shape[0], dev.shape[2]
    root = np.sqrt(np.maximum(w, 1e-12))[:, None, :]  # [L, 1, E]
    z = np.moveaxis(dev, 0, 1) / np.sqrt(k) / root  # [L, K, E] whitened
    # principal axes from the [L, K, K] Gram matrix (an SVD of z took 0.66 ms at [58, 3, 256], this 0.1): eigenvector
    # v_j of z z^T gives the axis' deviations v_j^T z, of squared norm its eigenvalue, the axis' variance
    var, vec = np.linalg.eigh(z @ np.swapaxes(z, 1, 2))  # [L, K] ascending, [L, K, K]
    var, vec = var[:, ::-1], vec[:, :, ::-1]
    keep = var > NOISE_BULK * e / k
    r = int(keep.sum(1).max())
    if r == 0:
        return None
    comp = np.where(keep[:, :r, None], np.swapaxes(vec[:, :, :r], 1, 2) @ z * root, 0.0)  # [L, R, E] back in loads
    return np.moveaxis(comp, 1, 0)
