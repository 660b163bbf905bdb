"""E[max] swaps: with two slots a GPU, a still re-plan spends its churn budget lowering a bound on the next window's
expected max GPU load, not the forecast's max.

Why: the next window's GPU loads are the forecast plus noise, and balancedness follows the expected max of them.
A seeded re-plan that only brings the forecast's max down to DeepSeek global's (pairing.py's budgeted ladder, then
hot swaps on the hottest GPUs) leaves a plateau just under it. On bench/eplb_matrix.py's 144 GPUs / 18 nodes / 288
slots, slow drift (grouped router, s = 0.6, windows 3-7) the seeded plans' forecast max sat within 0.01 of global's
but 20-24 GPUs within 5% of it against global's 17-19, and held out the max was 1.61 / 1.50 / 1.93 / 1.72 against
1.58 / 1.47 / 1.92 / 1.70: with per-GPU noise of ~0.13-0.21 x the mean load (the grouped router's domain mix) a
crowd of GPUs near the top raises the expected max more than the forecast's max says.

The bound: for GPU loads X_g ~ N(mu_g, V_g), E[max_g X_g] <= (1 / beta) log sum_g exp(beta mu_g + beta^2 V_g / 2)
for every beta > 0 (Jensen on exp); beta is the one minimising it for the layout the swaps start from. Each
replica's variance is a u + b u^2 (u its forecast load): a Poisson-like part and a multiplicative one (a window's
domain mix or drift scales an expert's load), fitted per layer by least squares to the windows' deviations from
their mean (scenarios.deviations); the replicas of a GPU are taken as independent. Then each GPU's term is
exp(A_g + P_g), A of its heavier replica (its anchor) and P of its lighter one, so swapping the lighter replicas
of GPUs g and h lowers the sum by (x_g - x_h)(y_g - y_h), x = exp(A), y = exp(P): the swaps sort the lighter
replicas against the anchors (heaviest anchor with the lightest, as DeepSeek's global policy pairs them) where
that lowers the bound most. Greedy: each step the valid swap of largest drop, over all pairs of GPUs, while the
layer's budget lasts and a swap lowers the bound; never a second replica of an expert on a GPU or a node.

Figures (ours - the better global policy, held out, even split, bench/eplb_matrix.py). The four 144 / 18 / 288
slow-drift cells (grouped s = 0.6 / 1.2, SGLang-dump s = 0.6 / 1.2): with reseating, leveling, pairing and hot swaps
-0.0082 / -0.0030 / -0.0144 / -0.0015 (all "no"); with these swaps -0.0046 / -0.0016 / -0.0044 / +0.0001 (three ties
and a yes), mean churn 8.0 / 6.8 / 8.1 / 6.6% -> 8.7 / 6.8 / 8.7 / 6.3% a re-plan (at most 9.0%). In sample the
bound over seeded - global's fell from 0.009-0.018 to 0.002-0.008 (grouped s = 0.6, windows 3-7). Over all 118 cells
yes / tie / no 71 / 43 / 4 -> 75 / 43 / 0, no cell lower: the 22 cells of 144 / 18 / 288 (2-slot layers with a spare
slot; no other shape changes) moved -0.0043 .. +0.0100, mean +0.0018, 18 up and 2 down by more than 0.0003 (both
still yes). Variants on the four cells: beta fixed at 10 (the fitted ones were 8-15) -0.0023 / -0.0013 / -0.0045 /
-0.0007, at 20 -0.0100 / -0.0016 / -0.0097 / -0.0009, at 40 -0.0151 / -0.0021 / -0.0200 / -0.0015; without the
multiplicative term (b = 0; where a = 0 too, beta 200: close to the max GPU load alone, swap by swap) -0.0043 /
-0.0015 / -0.0049 / -0.0001: paired standard errors are 0.001-0.008, so of the temperature only that beta in 20-40
lost is clear; the swaps over all pairs of GPUs with the whole budget, not the hard max's ladder, do most of the
work. Restricting the swaps to the 8 / 16 / 32 GPUs of largest term lost (grouped s = 0.6: -0.0090 / -0.0066 /
-0.0041; this and the next without the layer floor below). The exact assignment of lighter replicas to anchors with
a move penalty (linear_sum_assignment, the penalty bisected to the budget) scored -0.0046 / -0.0017 / -0.0009 /
-0.0003 but took 0.5 s at [58, 256] (this: 0.10 s, the re-plan before 0.22 s, DeepSeek's default call 1.5 s); one
assignment cut to the budget by its cycles lost (its cycles span 20-80 GPUs). The layer floor (min_drop =
PlannerConfig.min_gain, 0.002): without it 75 / 43 / 0 as well (grouped s = 0.9 yes, SGLang-dump s = 1.2 tie), and a
re-plan of unchanged loads moved 6.7% of slots instead of 1.5% (tests/analysis/test_eplb_seeded.py).

Without a spare slot (P = E, 128 GPUs / 16 nodes / 256 slots) the swaps come after the usual seeded re-plan
(reseating, leveling, pairing, hot swaps), with what that left of the budget: there the hottest expert alone sets the
max load and ours sat 0.0000-0.0013 under global held out, the light expert riding with the hot ones deciding. In place
of that re-plan, as with a spare slot, they lost (5 / 2 / 1 yes / tie / no on the 8 cells, against 4 / 4 / 0 after).
Across nodes they may move only lone replicas below PlannerConfig.level_cold x the mean slot load, and only in layers
with nodes per token to spare against global's (emax_node_slack): with any replica free to cross (and in place of
the re-plan) two one-group cells, whose layers take global's own layout in the P = E contest, rose over global's
nodes per token (no). A swap
must lower the bound by more than emax_step_drop: with no floor the swaps spent the whole budget (mean churn 8.5-8.9%
a re-plan against 1.2-6.8%) for 5 / 3 / 0; at 1e-3, 4 / 3 / 1. Paired standard errors there are ~0.0001, so which of
these cells reads yes or tie is noise; the gains (+0.0000 .. +0.0005, none lower) are not.

A drifting re-plan with a spare slot (replan.refreshed) takes them too: its seeded layers as a still re-plan's, and the
layers that take the fresh layout up to PlannerConfig.drift_emax_swaps of them before alignment (the fresh plan's
pairing, like the seeded plans above, sets GPUs at or under global's max load on the forecast with a crowd near it).
Over the 22 cells of 144 / 18 / 288, trace seeds 0-2 pooled (ours' rows alone, the matrix's loop): on the fresh layers
alone +0.00014 on average, with the seeded layers too +0.00027 (independent s = 0.6 fast drift no -> tie, SGLang-dump
s = 0.6 slow tie -> yes; one cell down by more than 0.0003), nodes per token +0.02 at most; the same swaps on the
finished re-plan, every layer unbudgeted, +0.00014 / +0.00021 / +0.00030 at 7 / 14 / 72 a layer, but a re-plan that
keeps its seeded layers then moved 49% of slots (tests/analysis/test_eplb_floor_swaps.py's, against < 10%). They
cost the drifting re-plan at [58, 288] on 144 GPUs 0.21 -> 0.38 s (DeepSeek's default call 3.7 s); 14 a layer gave
the same verdicts, -0.00008 held out (the fast-drift cells up to -0.0003). Each step takes every layer's best swap at
once: one layer at a time, emax_swaps at 58 layers x 144 GPUs x 72 swaps took 0.45 s instead of 0.15.

Shape legend: L layers, E experts, P slots, G GPUs, K windows.
"""

from __future__ import annotations

import numpy as np

from r3trace.eplb import portable
from r3trace.eplb.placement import Cluster, replica_counts
from r3trace.eplb.scenarios import deviations

BETAS = np.geomspace(1.0, 200.0, 48)  # the temperatures tried, in 1 / mean GPU load
NOISE_WINDOWS = 8  # the newest windows whose deviations fit the variance model (all of bench/eplb_matrix.py's 8)


def variance_model(dev: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """deviations [K, L, E] (scenarios.deviations, K >= 3), forecast w [L, E] -> (a [L], b [L]) >= 0: each
    expert's load varies about its forecast with variance ~ a w + b w^2, least squares over the layer's experts of
    the windows' squared deviations (over K - 1); where the best fit has a negative term, the other term alone."""
    var = (dev**2).sum(0) / (dev.shape[0] - 1)  # [L, E]
    w2 = w * w  # products, not np.power (its kernel is picked per CPU: portable.py)
    s11, s12, s22 = w2.sum(1), (w2 * w).sum(1), (w2 * w2).sum(1)
    r1, r2 = (w * var).sum(1), (w2 * var).sum(1)
    det = np.maximum(s11 * s22 - s12**2, 1e-300)
    a, b = (s22 * r1 - s12 * r2) / det, (s11 * r2 - s12 * r1) / det
    only_b, only_a = a < 0, b < 0
    a = np.where(only_b, 0.0, np.where(only_a, r1 / np.maximum(s11, 1e-300), a))
    b = np.where(only_a, 0.0, np.where(only_b, r2 / np.maximum(s22, 1e-300), b))
    return np.maximum(a, 0.0), np.maximum(b, 0.0)


def emax_bound(mu: np.ndarray, var: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GPU load means mu [L, G] and variances var [L, G], in mean GPU loads -> ([L] the least bound over BETAS on
    E[max_g load], [L] its beta)."""
    q = BETAS[:, None, None] * mu[None] + BETAS[:, None, None] ** 2 * var[None] / 2  # [B, L, G]
    top = q.max(2)
    bound = (top + portable.log(portable.exp(q - top[..., None]).sum(2))) / BETAS[:, None]  # [B, L]
    i = bound.argmin(0)
    return bound[i, np.arange(mu.shape[0])], BETAS[i]


def layout_bound(phy2log: np.ndarray, w: np.ndarray, cluster: Cluster, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """phy2log [L, P] (any slots per GPU), forecast w [L, E], variance model a, b [L] (variance_model) -> [L]
    emax_bound of each layer's next-window max GPU load, in mean GPU loads, under the even split: a replica carries
    1 / c of its expert's load, so its variance is the expert's (a w + b w^2) over c^2 (emax_swaps' a u + b u^2 treats
    a replica as an expert of load u = w / c: its Poisson part a w / c is then the same for every GPU of equal load,
    and no layout of other counts scores apart); a GPU's replicas taken as independent. The bound needs only each
    GPU's own distribution, so GPUs sharing an expert's replicas need no care."""
    n_layers, g = w.shape[0], cluster.num_gpus
    ph = np.asarray(phy2log, dtype=np.int64)
    cnt = replica_counts(ph, w.shape[1])
    mean = w.sum(1) / g  # [L]
    per = w / np.maximum(cnt, 1) / mean[:, None]  # [L, E] one replica's load, in mean GPU loads
    pv = a[:, None] * per / (np.maximum(cnt, 1) * mean[:, None]) + b[:, None] * per**2  # [L, E] its variance, in
    # squared mean loads
    mu = np.take_along_axis(per, ph, 1).reshape(n_layers, g, -1).sum(2)  # [L, G]
    var = np.take_along_axis(pv, ph, 1).reshape(n_layers, g, -1).sum(2)
    return emax_bound(mu, var)[0]


def layout_bounds(layouts: list[np.ndarray], w: np.ndarray, cluster: Cluster, a: np.ndarray,
                  b: np.ndarray) -> np.ndarray:
    """V layouts phy2log [L, P] on one forecast w [L, E] and variance model a, b [L] -> [V, L] layout_bound of each, in
    one call over V L rows (each row's values are the same elementwise steps and the same row sums: the same bits;
    four calls of [58, 16] GPUs were ~1.4 ms more of a two-node drifting re-plan)."""
    v = len(layouts)
    out = layout_bound(np.concatenate(layouts), np.tile(w, (v, 1)), cluster, np.tile(a, v), np.tile(b, v))
    return out.reshape(v, -1)


def drift_noise(loads: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """history loads [W, L, E], forecast w [L, E] -> variance_model's (a, b) on the newest NOISE_WINDOWS windows,
    any slots per GPU; None with fewer than scenarios.MIN_WINDOWS windows."""
    dev = deviations(loads, w, NOISE_WINDOWS)
    return None if dev is None else variance_model(dev, w)


def emax_swaps(phy2log: np.ndarray, w: np.ndarray, cluster: Cluster, swaps: np.ndarray, a: np.ndarray,
               b: np.ndarray, min_drop: float = 0.0, cross_below: np.ndarray | None = None,
               step_drop: float = 0.0) -> np.ndarray:
    """phy2log [L, P] (two slots per GPU), forecast w [L, E], swaps [L] the most swaps per layer (2 slots each),
    variance model a, b [L] (variance_model) -> phy2log [L, P] after greedy swaps of GPUs' lighter replicas, each the
    largest drop of sum_g exp(beta mu_g + beta^2 V_g / 2) (module doc) at the layer's beta (emax_bound's, on the
    input), while one lowers it; a layer keeps them only where they lower its bound by more than min_drop mean GPU
    loads (PlannerConfig.min_gain: smaller gains are noise next window). Counts do not change; every GPU keeps its
    heavier replica. cross_below [L] or None (any): a lighter replica changes node only where both swapped ones are
    their expert's only replica and below this load, in mean GPU loads (-inf: swaps stay inside nodes)."""
    out = np.asarray(phy2log, dtype=np.int64).copy()
    n_layers, p = out.shape
    g, e, n = cluster.num_gpus, w.shape[1], cluster.num_nodes
    if cluster.slots_per_gpu != 2 or not n_layers or int(np.max(swaps, initial=0)) <= 0:
        return out
    rows, gid = np.arange(n_layers)[:, None], np.arange(g)[None, :]
    cnt = replica_counts(out, e)
    mean = w.sum(1) / g  # [L]
    per = w / np.maximum(cnt, 1) / mean[:, None]  # [L, E] load of one replica, in mean GPU loads
    pv = (a[:, None] * per / mean[:, None] + b[:, None] * per**2)  # [L, E] its variance, in squared mean loads
    two = out.reshape(n_layers, g, 2)
    u = np.take_along_axis(per, out, 1).reshape(n_layers, g, 2)
    heavy = u.argmax(2)  # [L, G]
    ax, px = two[rows, gid, heavy], two[rows, gid, 1 - heavy]  # [L, G] anchor and lighter experts
    ua, up = np.take_along_axis(per, ax, 1), np.take_along_axis(per, px, 1)
    va, vp = np.take_along_axis(pv, ax, 1), np.take_along_axis(pv, px, 1)
    _, beta = emax_bound(ua + up, va + vp)
    big_a = beta[:, None] * ua + beta[:, None] ** 2 * va / 2
    big_p = beta[:, None] * up + beta[:, None] ** 2 * vp / 2
    x = portable.exp(big_a - big_a.max(1, keepdims=True))  # [L, G] each factor up to one per layer: the argmax is
    y = portable.exp(big_p - big_p.max(1, keepdims=True))  # alike
    scale = (x * y).sum(1)  # [L] the sum, as the swaps lower it
    start = scale.copy()
    node_of = np.arange(g) // cluster.gpus_per_node  # [G]
    held = np.zeros((n_layers, e, n), dtype=np.int64)  # replicas of each expert on each node
    np.add.at(held, (rows, out, np.repeat(node_of, 2)[None, :]), 1)
    # [L, E] experts whose replica may change node (an expert's load per replica is fixed while the swaps run)
    roams = np.ones((n_layers, e), dtype=bool) if cross_below is None else (cnt == 1) & (per < cross_below[:, None])
    # gain[l, g, h]: the drop of layer l's sum from swapping g's and h's lighter replicas, -inf where not allowed;
    # symmetric, kept up to date on the rows and columns a swap changes
    pairs = (np.repeat(np.arange(n_layers), g), np.tile(np.arange(g), n_layers))  # every (layer, GPU)
    gain = _gains(x, y, px, ax, held, roams, node_of, *pairs).reshape(n_layers, g, g)
    left = np.asarray(swaps, dtype=np.int64).copy()
    while True:
        act = np.flatnonzero(left > 0)
        if not len(act):
            break
        flat = gain.reshape(n_layers, -1) if len(act) == n_layers else gain[act].reshape(len(act), -1)  # no copy
        best = flat.argmax(1)
        top = flat[np.arange(len(act)), best]
        # above the sum's rounding, and a drop of the bound, (1 / beta) log(sum), by more than step_drop
        go = top > np.maximum(1e-12, -portable.expm1(-beta[act] * step_drop)) * scale[act]
        scale[act[go]] -= top[go]
        left[act[~go]] = 0
        ls = act[go]  # [A] the layers taking a swap this step, all at once (each its own rows of every array)
        i, j = np.divmod(best[go], g)
        xi, xj = px[ls, i], px[ls, j]
        for e_, n_, d in ((xi, node_of[i], -1), (xj, node_of[j], -1), (xi, node_of[j], 1), (xj, node_of[i], 1)):
            np.add.at(held, (ls, e_, n_), d)
        px[ls, i], px[ls, j] = xj, xi
        y[ls, i], y[ls, j] = y[ls, j], y[ls, i]
        # the rows (and columns) that changed: the two GPUs, and the GPUs whose lighter replica is of either expert
        # (its node set changed)
        rl, rg = np.nonzero((px[ls] == xi[:, None]) | (px[ls] == xj[:, None]))
        part = _gains(x, y, px, ax, held, roams, node_of, ls[rl], rg)  # [R, G]
        gain[ls[rl], rg, :] = part
        gain[ls[rl], :, rg] = part
        left[ls] -= 1
    res = two.copy()
    res[rows, gid, 1 - heavy] = px
    # the bound is (1 / beta) log(sum) + const: a layer whose swaps lower it by min_drop or less keeps its input
    low = portable.log(start / np.maximum(scale, 1e-300)) / beta <= min_drop
    res[low] = two[low]
    return res.reshape(n_layers, p)


def replan_noise(loads: np.ndarray, w: np.ndarray, cluster: Cluster) -> tuple[np.ndarray, np.ndarray] | None:
    """history loads [W, L, E], forecast w [L, E] -> variance_model's (a, b) on the newest NOISE_WINDOWS windows,
    where a re-plan takes E[max] swaps (two slots per GPU) and at least scenarios.MIN_WINDOWS windows to fit on;
    else None."""
    return drift_noise(loads, w) if cluster.slots_per_gpu == 2 else None


def _gains(x: np.ndarray, y: np.ndarray, px: np.ndarray, ax: np.ndarray, held: np.ndarray, roams: np.ndarray,
           node_of: np.ndarray, layers: np.ndarray, gpus: np.ndarray) -> np.ndarray:
    """Factors x, y [L, G], lighter and heavier experts px, ax [L, G], replicas per node held [L, E, N], experts that
    may change node roams [L, E], rows (layers [R], gpus [R]) -> [R, G] the drop (x_g - x_h)(y_g - y_h) of layer l
    from swapping the lighter replicas of g with each h, -inf where either would sit beside its own expert on a GPU,
    join a node that holds it or change node without roaming (or nothing changes)."""
    lc = layers[:, None]  # [R, 1]
    gain = (x[layers, gpus][:, None] - x[layers]) * (y[layers, gpus][:, None] - y[layers])
    pg, ph = px[layers, gpus][:, None], px[layers]  # [R, 1] g's lighter expert, [R, G] each h's
    ok = (pg != ax[layers]) & (ph != ax[layers, gpus][:, None]) & (pg != ph)
    ng = node_of[gpus][:, None]
    cross = ng != node_of[None, :]
    free = (held[lc, ph, ng] == 0) & (held[lc, pg, node_of[None, :]] == 0) & roams[lc, pg] & roams[lc, ph]
    ok &= ~cross | free
    return np.where(ok, gain, -np.inf)
