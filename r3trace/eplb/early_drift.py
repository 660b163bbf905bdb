"""Drift at a re-plan the backtest cannot judge yet: three windows seen, one of them scored.

forecast.drifts needs MIN_DRIFT_FOLDS scored windows, so a re-plan three windows after a cold start kept its churn
budget whatever the workload did, and under fast drift the held-out matrix's first two re-plans trailed the better
global policy (48 fast-drift cells of trace seed 0: -0.010 on the first two, +0.009 later; 4 nodes -0.023, 18 nodes
-0.027). Calling drift there on every trace lost 0.034 on the slow ones (docs/perf-history/benchmarks-log.md), and
the backtest's own ratio was 1.000 on fast and slow traces alike at three windows, so this test scores the one window
against noise instead: the plain mean of the windows before the newest one forecasts it with squared rate error
(1 + 1 / t) v on an unchanged router (t windows averaged, v a window's squared rate noise summed over layer and
expert), and v is read off the newest window's own tokens, cut into NOISE_BLOCKS contiguous blocks dealt to two
halves (halves differ by 4 v at half the tokens). Blocks, not alternate tokens: a serving stream's tokens of one
request lean the same way, and alternate tokens put each request in both halves, which hid that noise (the sample
model's serving stream, bench/eplb_traces.py's sample-mix: ratio 9.5-14 by alternate tokens, 0.2-0.7 by blocks).

Read on the windows at their long-run mix of kinds of token (token_mix.Source.demixed; the raw windows where its
fit found one kind), and only where that fit was made: the grouped and clustered routers draw each window's domain
or topic mix afresh, which the raw windows' ratio counts as change (slow drift 4-37). bench/eplb_early_drift.py over
the matrix's traces with tokens, trace seeds 0-2, three windows: slow drift 1.4-4.4 (grouped <= 3.2, clustered <=
4.4, the independent router <= 2.3), fast drift 15.3-46 (four windows: <= 7.1 against >= 22.8); the sample model's
traces (windows of different prompt sets) 53; the sample-mix stream 0.2-0.7. PlannerConfig.early_drift is the
threshold; what it moved in the held-out matrix: docs/perf-history/benchmarks-log.md, "fast drift at three windows".
Shape legend: W windows, T tokens, L layers, K top-k, E experts.
"""

from __future__ import annotations

import numpy as np

from r3trace.eplb.forecast import MIN_DRIFT_FOLDS, rates_of
from r3trace.eplb.score import heat_of

NOISE_BLOCKS = 16  # contiguous blocks of the newest tokens, alternate ones to each half (128 tokens of 2,048)
EARLY_WINDOWS = MIN_DRIFT_FOLDS + 1  # the windows a history has when the backtest scores one and cannot call drift


def half_noise(tokens: np.ndarray, num_experts: int, blocks: int | None = NOISE_BLOCKS) -> float:
    """tokens [T, L, K] -> v of a window of these T tokens: the squared difference of two halves' rates, summed over
    (layer, expert), over 4 (each half's noise is 2 v). Halves by alternate contiguous blocks of `blocks`, or by
    alternate tokens (None)."""
    if blocks is None:
        a, b = tokens[0::2], tokens[1::2]
    else:
        cut = np.array_split(np.arange(len(tokens)), blocks)
        a, b = tokens[np.concatenate(cut[0::2])], tokens[np.concatenate(cut[1::2])]
    return float(((rates_of(heat_of(a, num_experts)) - rates_of(heat_of(b, num_experts))) ** 2).sum()) / 4


def change_ratio(history: np.ndarray, v: float) -> float:
    """history [W, L, E], v the newest window's noise -> the plain mean of windows 0 .. W - 2's squared rate error on
    window W - 1 over (1 + 1 / (W - 1)) v: ~1 where the router does not move (module doc)."""
    r = rates_of(np.asarray(history, dtype=np.float64))
    t = len(r) - 1
    return float(((r[t] - r[:t].mean(0)) ** 2).sum()) / ((1 + 1 / t) * max(v, 1e-300))


def early_ratio(history: np.ndarray, tokens: np.ndarray | None, demixed: np.ndarray | None) -> float | None:
    """history [W, L, E] raw loads (counts: a layer's sum is the window's tokens x K), the newest window's tokens
    [T, L, K] (or a sample of them), demixed [W, L, E] the same windows at their long-run mix of kinds of token
    (token_mix.Source.demixed: the raw ones where its fit found one kind) -> change_ratio on demixed, with the noise of
    the whole newest window from the T tokens; None where the backtest has no single scored window (W !=
    EARLY_WINDOWS), without a fit (demixed None: a window's drawn mix would count as change, module doc) or with the
    tokens missing or too few to halve by blocks."""
    h = np.asarray(history, dtype=np.float64)
    if (demixed is None or tokens is None or h.ndim != 3 or len(h) != EARLY_WINDOWS
            or len(tokens) < 2 * NOISE_BLOCKS):
        return None
    window = float(h[-1].sum(-1).mean()) / tokens.shape[2]  # the newest window's tokens
    if window <= 0:
        return None
    v = half_noise(tokens, h.shape[2]) * len(tokens) / window  # v of the whole window, from the T tokens given
    return change_ratio(demixed, v)

