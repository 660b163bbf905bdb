"""Load scenarios: several plausible next windows about the forecast, for a robust (sample-average) objective.

Why: a plan leveled against one forecast [L, E] lowers the max of E[GPU load], while the next window's balancedness
follows E[max GPU load]: held out, its hottest GPU is often not the forecast's. The grouped router draws each window's
domain mix afresh (bench/eplb_traces.py), so whole groups' loads rise and fall together from window to window, a
spread that the newest window's tokens alone (a bootstrap) do not show. The scenarios are the forecast plus each
training window's deviation from the windows' mean (in rates, scaled to the forecast's tokens): the empirical spread
of a window about its expectation, centred where the planner expects the next one.

Shape legend: K scenarios, W windows, L layers, E experts.
"""

from __future__ import annotations

import numpy as np

MIN_WINDOWS = 3  # fewer windows give fewer than 3 deviations (two are mirror images): no scenarios


def scenarios(history: np.ndarray, w: np.ndarray, windows: int) -> np.ndarray | None:
    """history [W, L, E] loads (oldest first), forecast w [L, E] -> [K, L, E] scenarios (module doc), K = the newest
    min(W, windows) windows; None with fewer than MIN_WINDOWS of them or windows <= 0. Loads are clipped at 0."""
    h = np.asarray(history, dtype=np.float64)
    if windows <= 0 or h.ndim != 3 or min(len(h), windows) < MIN_WINDOWS:
        return None
    rates = h[-windows:] / np.maximum(h[-windows:].sum(-1, keepdims=True), 1e-12)  # [K, L, E]
    dev = (rates - rates.mean(0)) * w.sum(-1, keepdims=True)[None]
    return np.maximum(w[None] + dev, 0.0)
