"""Expected nodes per token from loads alone: how a plan without tokens compares layouts on locality.

Where no token reaches the planner (SGLang's expert-distribution dump, the vLLM and SGLang plugins' load
statistics), nodes per token cannot be counted, and candidates.Contest took its first tied candidate, ours: on
bench/eplb_matrix.py's SGLang-dump cells of 128 GPUs / 16 nodes / 256 slots (P = E), s = 1.2, that was 6.24-6.49 nodes
per token against DeepSeek global's 4.77-4.85, whose sorted packing puts the hottest experts on the first nodes.

The model: a group-limited router draws a token's groups and experts independently. Group g (load W_g of the layer's
W) is taken with q_g = min(1, topk_group W_g / W); inside a taken group each expert e with p_e = min(1, (top_k /
topk_group) w_e / W_g). A node is missed where, in every group, the group is not taken or none of its experts on that
node is: P(miss n) = prod_g (1 - q_g + q_g prod_{e in g on n} (1 - p_e)); the expectation is the sum over nodes of
1 - P(miss n). With one group it is the independent model, sum_n 1 - prod_{e on n} (1 - top_k w_e / W).

Why the groups: the independent model alone ranks candidates by how few nodes hold the hot experts, and picked global's
layout where ours' group homes are better (grouped router, hidden tokens, s = 0.6: 64 GPUs / 8 nodes 4.83 against
ours' 4.06-4.16, 128 / 16 6.28 against 5.99). With V3's router (top_k 8, topk_group 4 of 8 groups) the model picked,
per layer among the candidates tied on the max load, layouts within 0.001 of the best the hidden tokens allowed on
16-128 GPUs (P = E) at s = 0.6 and 1.2 under slow drift (128 / 16, s = 1.2: 4.77 against ours' 6.53), and under fast
drift at s = 1.2; at s = 0.6 fast 5.99 against global's 6.01 and ours' 6.07, the best 5.88. topk_group 2 or 8 lost
up to 0.7 somewhere. One group (a router without groups, hidden tokens) on 64-128 GPUs: global's layouts, 4.27-6.30,
against ours' 5.34-7.17, the model picking global's (or global grouped: the same GPUs).

Logs and exps through portable.py, so a plan is the same on every CPU. Shape legend: L layers, E experts, P slots,
G groups, N nodes.
"""

from __future__ import annotations

import numpy as np

from r3trace.eplb import portable
from r3trace.eplb.placement import Cluster, PlacementError, replicas_per_node


def expected_nodes(phy2log: np.ndarray, w: np.ndarray, cluster: Cluster, top_k: int, topk_group: int) -> np.ndarray:
    """phy2log [L, P] with every expert once (P = E), loads w [L, E] -> [L] the module doc's expected distinct nodes
    of a token's experts. topk_group: groups a token's experts come from (0: half the cluster's groups, at least 1)."""
    n_layers, e = w.shape
    n_gr, n = cluster.num_groups, cluster.num_nodes
    ph = np.asarray(phy2log, dtype=np.int64)
    if ph.shape != (n_layers, e):
        raise PlacementError(f"phy2log {ph.shape} must be [{n_layers}, {e}]: one slot per expert")
    if top_k < 1:
        raise PlacementError(f"top_k={top_k} must be >= 1")
    if (topk_group if topk_group > 0 else max(1, n_gr // 2)) > n_gr:
        raise PlacementError(f"topk_group={topk_group} must be <= num_groups={n_gr}")
    gsize = e // n_gr
    q, p = router_odds(w, n_gr, top_k, topk_group)
    node_of = np.empty_like(ph)
    node_of[np.arange(n_layers)[:, None], ph] = cluster.slot_node()[None, :]  # [L, E]
    # log prod (1 - p_e) per (layer, group, node): a bincount sums in index order, the same on every CPU
    cell = (np.arange(n_layers)[:, None] * n_gr + np.arange(e)[None, :] // gsize) * n + node_of  # [L, E]
    kept = portable.log(np.maximum(1.0 - p, 1e-300))  # [L, E]; a sure expert (p = 1): log of ~0, exp -> 0
    none = portable.exp(np.bincount(cell.ravel(), weights=kept.ravel(), minlength=n_layers * n_gr * n)
                        ).reshape(n_layers, n_gr, n)  # [L, G, N] no expert of g on n chosen, g taken
    miss = 1.0 - q[:, :, None] + q[:, :, None] * none  # [L, G, N]
    out = np.ones((n_layers, n))
    for g in range(n_gr):  # the product over groups in a fixed order
        out *= miss[:, g]
    return (1.0 - out).sum(1)


def model_tokens(w: np.ndarray, num_groups: int, top_k: int, topk_group: int, n_tokens: int,
                 seed: int = 0) -> np.ndarray:
    """Loads w [L, E] -> tokens [T, L, K] drawn from a group-limited router with those loads: each token takes
    topk_group groups (0: half) drawn without replacement by group load, then top_k experts of those groups by expert
    load (a Plackett-Luce draw as exponential races: the smallest Exp(1) / load win; no log on the planner's side, the
    seed fixed). What a plan without tokens replays on more than two nodes, where this module has no closed form
    (two_node_dispatch is two nodes only). 1,024 tokens at [58, 256]: ~0.3 s."""
    n_layers, e = w.shape
    taken = topk_group if topk_group > 0 else max(1, num_groups // 2)
    gsize = e // num_groups
    rng = np.random.default_rng(seed)
    wg = w.reshape(n_layers, num_groups, gsize).sum(2)  # [L, G]
    gkey = rng.standard_exponential((n_tokens, n_layers, num_groups)) / np.maximum(wg, 1e-300)[None]  # [T, L, G]
    cut = np.partition(gkey, taken - 1, axis=2)[:, :, taken - 1:taken]  # [T, L, 1] the last group taken
    allowed = np.repeat(gkey <= cut, gsize, axis=2)  # [T, L, E]
    key = rng.standard_exponential((n_tokens, n_layers, e)) / np.maximum(w, 1e-300)[None]
    key[~allowed] = np.inf
    return np.argpartition(key, top_k - 1, axis=2)[:, :, :top_k]


def router_odds(w: np.ndarray, num_groups: int, top_k: int, topk_group: int,
                sure: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Loads w [L, E] -> the module doc's (q [L, G] a group taken, p [L, E] an expert picked in its taken group),
    each at most `sure`. topk_group: 0 is half the groups, at least 1."""
    n_layers, e = w.shape
    taken = topk_group if topk_group > 0 else max(1, num_groups // 2)
    gsize = e // num_groups
    total = np.maximum(w.sum(1, keepdims=True), 1e-300)  # [L, 1]
    w_gr = w.reshape(n_layers, num_groups, gsize).sum(2)  # [L, G]
    q = np.minimum(sure, taken * w_gr / total)
    p = np.minimum(sure, (top_k / taken) * w / np.repeat(np.maximum(w_gr, 1e-300), gsize, axis=1))
    return q, p


def two_node_dispatch(phy2log: np.ndarray, w: np.ndarray, cluster: Cluster, top_k: int,
                      topk_group: int) -> tuple[np.ndarray, np.ndarray]:
    """Two nodes, replicas anywhere: phy2log [M, P] (every expert at least once), loads w [M, E] -> (the expected GPU
    loads [M, G] under node-limited dispatch (score.node_limited: the fewest nodes covering a token's experts, the work
    split over the replicas there), the expected nodes per token [M]) under the module doc's router.

    A token fits node n where every expert it chose has a replica there (A: node 0, B: node 1). Given expert e chosen
    (its group taken), P(A | e) = prod over the other groups of (1 - q_g + q_g prod_{e' in g, not on 0} (1 - p_e')) x
    prod over e's group's experts not on node 0 of (1 - p_e'), and 0 where e has no replica on node 0; the same for B
    and for A and B (experts on both). e's load goes to node 0's replicas on A only, to node 1's on B only, to one
    node's, either, on both (the dispatcher's tie draw: half each), else over all its replicas; nodes per token is 2 -
    P(A) - P(B) + P(A and B). Why: without tokens (an SGLang dump, the server plugins) nothing can be replayed, and
    ours' group homes let tokens fit one node, whose replicas of a hot expert then take them all."""
    m, e = w.shape
    n_gr = cluster.num_groups
    q, p = router_odds(w, n_gr, top_k, topk_group)
    cnt = replicas_per_node(np.asarray(phy2log, dtype=np.int64), e, cluster).astype(float)  # [M, E, 2]
    on0, on1 = cnt[..., 0] > 0, cnt[..., 1] > 0
    fit_a, given_a = _fits(on0, q, p, n_gr)
    fit_b, given_b = _fits(on1, q, p, n_gr)
    fit_ab, given_ab = _fits(on0 & on1, q, p, n_gr)
    spread = (1.0 - given_a - given_b + given_ab) / cnt.sum(2)  # [M, E] a replica's share of e's two-node tokens
    per0 = w * ((given_a - 0.5 * given_ab) / np.maximum(cnt[..., 0], 1) + spread)  # [M, E] a node-0 replica's load
    per1 = w * ((given_b - 0.5 * given_ab) / np.maximum(cnt[..., 1], 1) + spread)
    rows = np.arange(m)[:, None]
    ph = np.asarray(phy2log, dtype=np.int64)
    slot = np.where(cluster.slot_node()[None, :] == 0, per0[rows, ph], per1[rows, ph])  # [M, P]
    return slot.reshape(m, cluster.num_gpus, -1).sum(-1), 2.0 - fit_a - fit_b + fit_ab


def _fits(inside: np.ndarray, q: np.ndarray, p: np.ndarray, num_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """inside [M, E] (the experts a node set holds), router_odds' q [M, G] and p [M, E] -> (P(every chosen expert
    inside) [M], P(every other chosen expert inside | e chosen) [M, E], 0 where e is outside)."""
    m, e = inside.shape
    gsize = e // num_groups
    kept = np.where(inside, 1.0, 1.0 - p).reshape(m, num_groups, gsize).prod(2)  # [M, G] none outside, g taken
    group = 1.0 - q + q * kept  # [M, G]
    others = np.ones_like(group)  # [M, G] the product over the other groups, in a fixed order
    for g in range(num_groups):
        for h in range(num_groups):
            if h != g:
                others[:, g] *= group[:, h]
    total = others[:, 0] * group[:, 0]
    return total, np.repeat(others * kept, gsize, axis=1) * inside
