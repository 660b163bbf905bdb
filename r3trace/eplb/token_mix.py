"""Each window's loads at the long-run mix of the kinds of token behind them: what the planner forecasts from when
windows draw their own mix of prompts (domains, topics) and the router drifts under them.

Why: a window's loads are its router's loads at that window's mix. An EMA over windows averages the mix out only by
averaging the drift too; the newest window alone keeps the drift and its mix. bench/eplb_hindsight.py's clairvoyant
(the newest window's router at equal domain shares) led DeepSeek global on the better of all windows and the newest
by up to 0.025 balancedness where windows draw their mix (grouped / clustered routers, fast drift), room no EMA took.

Model, per layer l: a token of kind d in window w picks expert e with probability p[w, d, l, e] proportional to
A[w, l, e] B[d, l, e] (the window's router times the kind's lean, K picks a layer treated as independent draws), and
a token's kind is shared by all its layers, so its L K picks together say which kind it is. Fitted by EM: the E-step
gives each token's kind posterior from its picks and the window's kind shares; the M-step fits the expected counts
n[w, d, l, e] to the log-linear model with margins (w, l, e), (d, l, e) and (w, d, l) by iterative proportional
fitting (the kind's lean shared by every window, the window's router by every kind). A window's loads at shares s:
its raw loads times sum_d s[d] p[w, d, l, e] / sum_d shares[w, d] p[w, d, l, e]
(so the fit may see a sample of the window's tokens: the raw loads keep the rest).

Which loads plan: the number of kinds D by AIC (choose_components); then the raw windows, or these at equal kind
shares or at the windows' mean shares, whichever forecasts the next raw window best in a one-window-ahead backtest
over the history (forecast.py's EMA weights, the least squared rate error; the raw windows unless another errs less
by over MIN_GAIN). On windows from one router (no mix) the raw windows win: the demixed ones add estimation noise.
The mixture scored is the one fitted on all the windows, the scored ones too, so a kind of token first seen in the
scored window is already among those re-weighted to forecast it (on the sample model's trace, where each window brings
a new domain of prompt, the equal shares backtest 8-16% better than the raw windows, fitted on each window's past alone
5% worse to 3.5% better); choosing by refits on each window's past instead planned worse on average in every trace
family of bench/eplb_matrix.py (docs/perf-history/benchmarks-log.md, "the token mix's source chosen held out").
planner.plan(mixed=...) forecasts from them only where the raw history drifts (plan_forecast.forecasts_from_mix); a long
memory over the raw windows averages the mixes out by itself.

Shape legend: W windows, T tokens, L layers, E experts, K top-k, D kinds of token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from r3trace.eplb.early_drift import EARLY_WINDOWS
from r3trace.eplb.forecast import ema_errors, rates_of

COMPONENTS = (1, 2, 4, 8, 16)  # kinds of token tried, climbed while AIC falls (choose_components)
ITERS = 25  # EM rounds: on bench/eplb_traces.py's grouped windows (4 kinds) the posteriors stop moving by ~20
IPF_ROUNDS = 10
MIN_GAIN = 0.01  # a demixed source plans only when its backtest error is > 1% under the raw windows'
MIN_WINDOWS = 3  # the backtest needs two windows to forecast from and one to score
# layers the EM reads (evenly spaced; then one M-step fits every layer): a token's kind is shared by its layers, and 8
# layers of top-8 picks (64 a token) identify it as the 6-layer windows of bench/eplb_matrix.py (48) do. On 58-layer
# synthetic windows (bench/eplb_mix_time.py: 8 of 2,048 tokens, E = 256; grouped / clustered / independent routers,
# slow and fast drift) the fit took 0.16-0.22x the time of the EM on all 58 (0.8-4.4 s against 3.6-27 s), chose the
# same source and number of kinds on all five traces, and forecast the next raw window one window ahead within
# -6% .. +12% of its squared error (both ends the clustered router's 16 kinds; the others within 1.2%)
EM_LAYERS = 8


class Mix(NamedTuple):
    """A fitted mixture: p [W, D, L, E] pick probabilities of each window and kind; shares [W, D]."""

    p: np.ndarray
    shares: np.ndarray

    def at(self, shares: np.ndarray) -> np.ndarray:
        """shares [D] or [W, D] -> [W, L, E] each window's pick rates at those kind shares."""
        s = np.broadcast_to(shares, self.shares.shape)
        out = s[:, 0, None, None] * self.p[:, 0]
        for k in range(1, s.shape[1]):  # kind by kind, not np.tensordot: BLAS rounds by CPU (forecast.py)
            out = out + s[:, k, None, None] * self.p[:, k]
        return out

    def loads(self, raw: np.ndarray, shares: np.ndarray | None = None) -> np.ndarray:
        """raw [W, L, E] each window's loads (all its tokens; the fit may have seen a sample) -> the same at
        `shares` [D] or [W, D] (None: equal): raw x rates at those shares / rates at the window's own shares (not
        renormalised: a window's picks move by the fit's noise, 0.2% in tests/analysis/test_eplb_token_mix.py)."""
        d = self.p.shape[1]
        to = self.at(np.full(d, 1.0 / d) if shares is None else shares)
        return raw * to / np.maximum(self.at(self.shares), 1e-12)


def fit(windows: Sequence[np.ndarray], num_experts: int, components: int, iters: int = ITERS,
        seed: int = 0, layers: int = EM_LAYERS) -> Mix:
    """windows: W routes [T_w, L, K] (expert ids) -> the fitted Mix (module doc); deterministic in seed. With more
    than `layers` layers the EM reads `layers` of them, evenly spaced (EM_LAYERS says why), and a last M-step fits
    every layer to its posteriors."""
    if components < 1:
        raise ValueError(f"components={components}: must be >= 1")
    n_layers = windows[0].shape[1]
    sub = windows
    if n_layers > layers:
        keep = np.unique(np.linspace(0, n_layers - 1, layers).round().astype(np.int64))
        sub = [w[:, keep] for w in windows]
    n_sub = sub[0].shape[1]
    le = n_sub * num_experts
    rng = np.random.default_rng(seed)
    flat = _flat(sub, num_experts)
    post = [rng.dirichlet(np.ones(components), len(f)) for f in flat]  # W x [T_w, D]
    mix = _m_step(flat, post, components, le, n_sub)
    for _ in range(iters if components > 1 else 0):  # one kind: the M-step is the whole fit
        logp = np.log(mix.p.reshape(len(flat), components, le))
        post = [_posterior(f, lp, s) for f, lp, s in zip(flat, logp, mix.shares, strict=True)]
        mix = _m_step(flat, post, components, le, n_sub)
    if n_sub < n_layers:
        mix = _m_step(_flat(windows, num_experts), post, components, n_layers * num_experts, n_layers)
    return mix


def log_likelihood(windows: Sequence[np.ndarray], num_experts: int, mix: Mix) -> float:
    """The routes' log-likelihood under `mix` (each token's L K picks, its kind summed out)."""
    total = 0.0
    for f, lp, s in zip(_flat(windows, num_experts), np.log(mix.p.reshape(len(windows), mix.p.shape[1], -1)),
                        mix.shares, strict=True):
        ll = _kind_log_likelihood(f, lp, s)
        top = ll.max(1)
        total += float((top + np.log(np.exp(ll - top[:, None]).sum(1))).sum())
    return total


def aic(windows: Sequence[np.ndarray], num_experts: int, mix: Mix) -> float:
    """Akaike's information criterion of a fitted mixture (lower is better): 2 (free parameters - log-likelihood);
    the parameters: each window's router and each kind's lean, L (E - 1) each, and each window's D - 1 shares."""
    w, d, n_layers, e = mix.p.shape
    params = (w + d - 1) * n_layers * (e - 1) + w * (d - 1)
    return 2.0 * (params - log_likelihood(windows, num_experts, mix))


def choose_components(windows: Sequence[np.ndarray], num_experts: int, ladder: Sequence[int] = COMPONENTS,
                      em_layers: int = EM_LAYERS) -> tuple[Mix, dict[int, float]]:
    """-> (the mixture of least AIC climbing `ladder` until AIC rises, every AIC computed); em_layers: fit's layers.

    Why AIC, not BIC: the kinds are a means to a forecast, not a claim about the workload. BIC's log(tokens) penalty
    (~10 at 32,768 tokens) stopped at 4-8 kinds on the clustered router's 16 topics (bench/eplb_traces.py, skew 1.2,
    fast drift: 8 history windows, 4 at 3); planned on them ours trailed global on the newest window by 0.007 on
    one of two trace seeds, where AIC's choice led by 0.006-0.008 (it led on the grouped router's 4 domains too).
    AIC over-splits windows with no kinds at all (the independent router: every rung lowers it), which the
    backtest against the raw windows then rejects (planning_loads)."""
    best: tuple[int, Mix] | None = None
    scores: dict[int, float] = {}
    for d in ladder:
        mix = fit(windows, num_experts, d, layers=em_layers)
        scores[d] = aic(windows, num_experts, mix)
        if best is not None and scores[d] >= scores[best[0]]:
            break
        best = (d, mix)
    assert best is not None, "empty ladder"
    return best[1], scores


def _flat(windows: Sequence[np.ndarray], num_experts: int) -> list[np.ndarray]:
    """W routes [T_w, L, K] -> W x [T_w, L K] indices into the layer-major L E."""
    n_layers = windows[0].shape[1]
    return [(np.arange(n_layers)[None, :, None] * num_experts + w.astype(np.int64)).reshape(len(w), -1)
            for w in windows]


def _m_step(flat: list[np.ndarray], post: list[np.ndarray], d: int, le: int, n_layers: int) -> Mix:
    k = flat[0].shape[1]
    picks = np.stack([np.stack([np.bincount(f.ravel(), weights=np.repeat(r[:, j], k), minlength=le)
                                for j in range(d)]) for f, r in zip(flat, post, strict=True)])  # [W, D, L E]
    # + 1e-3: every expert possible (a log of 0 would pin a kind for good)
    n = picks.astype(np.float64).reshape(len(flat), d, n_layers, -1) + 1e-3
    mu = np.ones_like(n)
    by_window, by_kind, by_window_kind = n.sum(1, keepdims=True), n.sum(0, keepdims=True), n.sum(3, keepdims=True)
    for _ in range(IPF_ROUNDS):
        mu *= by_window / mu.sum(1, keepdims=True)
        mu *= by_kind / mu.sum(0, keepdims=True)
        mu *= by_window_kind / mu.sum(3, keepdims=True)
    shares = np.stack([r.mean(0) for r in post])  # [W, D]
    return Mix(mu / mu.sum(3, keepdims=True), shares)


def _posterior(flat: np.ndarray, logp: np.ndarray, shares: np.ndarray) -> np.ndarray:
    """flat [T, L K], logp [D, L E], shares [D] -> [T, D] each token's kind posterior."""
    ll = _kind_log_likelihood(flat, logp, shares)
    ll -= ll.max(1, keepdims=True)
    r = np.exp(ll)
    return r / r.sum(1, keepdims=True)


def _kind_log_likelihood(flat: np.ndarray, logp: np.ndarray, shares: np.ndarray) -> np.ndarray:
    """-> [T, D] log(share of kind d) + the log-probability of the token's picks under kind d."""
    lt = np.ascontiguousarray(logp.T)  # [L E, D]
    ll = np.log(np.maximum(shares, 1e-12)) + lt[flat[:, 0]]  # [T, D]
    for j in range(1, flat.shape[1]):  # pick by pick: 10x a fancy-indexed [D, T, L K] gather and its sum
        ll += lt[flat[:, j]]
    return ll


def backtest_error(history: Callable[[int], np.ndarray], targets: np.ndarray) -> float:
    """history(t) -> [t, L, E] the loads of windows 0 .. t - 1 as a source sees them before window t; targets
    [W, L, E] -> the least over forecast.ALPHAS of the squared rate error of the EMA of history(t) against
    targets[t], t = 2 .. W - 1 (forecast.backtest_errors, scored on the raw windows)."""
    g = rates_of(targets)
    return float(ema_errors([rates_of(history(t)) for t in range(2, len(g))], g).min())


class Source(NamedTuple):
    """The loads the planner plans on and why (module doc)."""

    loads: np.ndarray  # [W, L, E]
    name: str  # "raw", or "mix: D kinds, equal shares" / "mix: D kinds, mean shares"
    errors: dict[str, float]  # every source's backtest error
    aic: dict[int, float]  # kinds of token tried -> the mixture's AIC (choose_components)
    # [W, L, E] the windows at equal kind shares whichever source was picked (the raw ones where the fit found one
    # kind), where the windows are few enough for planner.plan's early drift test to read them (early_drift.py); None
    # without a fit (no routes, too few windows) or with more windows
    demixed: np.ndarray | None = None

    @property
    def mixed(self) -> np.ndarray | None:
        """What planner.plan takes as `mixed`: these loads where they are not the raw windows."""
        return None if self.name == "raw" else self.loads


def planning_loads(loads: np.ndarray, windows: Sequence[np.ndarray] | None,
                   components: Sequence[int] = COMPONENTS, em_layers: int = EM_LAYERS) -> Source:
    """loads [W, L, E] and the routes behind them (W x [T_w, L, K], or None) -> the loads to plan on (module doc).
    Mean shares are the mean over the windows seen; in the backtest, over the windows before the one scored (the
    scored window's own share would lean the forecast its way). em_layers: the layers fit's EM reads."""
    raw = np.asarray(loads, dtype=np.float64)
    if windows is None or raw.ndim != 3 or len(raw) < MIN_WINDOWS:
        return Source(raw, "raw", {}, {})
    if len(windows) != len(raw):
        raise ValueError(f"windows: {len(windows)} routes for {len(raw)} windows of loads")
    mix, scores = choose_components(windows, raw.shape[2], components, em_layers)
    d = mix.p.shape[1]
    cands: dict[str, Callable[[int], np.ndarray]] = {"raw": lambda t: raw[:t]}
    if d > 1:
        equal = mix.loads(raw)
        cands[f"mix: {d} kinds, equal shares"] = lambda t: equal[:t]
        cands[f"mix: {d} kinds, mean shares"] = lambda t: mix.loads(raw, mix.shares[:t].mean(0))[:t]
    errors = {k: backtest_error(f, raw) for k, f in cands.items()}
    best = min(errors, key=lambda k: errors[k])
    if errors[best] >= errors["raw"] * (1 - MIN_GAIN):
        best = "raw"
    # 1e-3 picks: the EM's exp / log round by the CPU's SIMD kernels; rounded, every machine plans on the same loads
    demixed = np.round(equal if d > 1 else raw, 3) if len(raw) <= EARLY_WINDOWS else None
    return Source(np.round(cands[best](len(raw)), 3), best, errors, scores, demixed)
