"""Swaps of two experts between nodes that lower node_model's expected nodes per token under a GPU-load cap: how a
plan without tokens and without a spare slot (P = E) gathers the experts a token picks together onto fewer nodes.

Why: without tokens candidates.Contest picks among whole layouts (ours, DeepSeek global grouped, global) by
node_model.expected_nodes, and the best of them, global's sorted packing (the hottest experts one a GPU on the first
nodes), left 4.77 nodes per token on bench/eplb_matrix.py's SGLang-dump cell of 128 GPUs / 16 nodes / 256 slots at
s = 1.2, slow drift. A token's 8 experts sit mostly among the hottest few and in the 4 groups it takes, and global's
layout spreads both: the hottest 16 experts on 8 nodes with the coldest 16, every group on every node. The swaps put
the hottest experts onto one node where the cap lets them share GPUs, and a group's experts onto the same nodes.

The cap: every GPU's load on the forecast stays at or under swap_cap x the layer's max GPU load, whose GPU is not
touched. Held out the swapped GPUs must stay under the max GPU's load on the next window; a GPU filled to the max's
level in sample was over it there (SGLang-dump, s = 1.2, fast drift: balancedness 0.0823 -> 0.0808).

The search: every round scores every pair of experts on different nodes at once (the change in the expected nodes
of their two nodes, exact under node_model's router) and applies, per layer, the best swap of each of a set of
node-disjoint node pairs (nodes add up independently in the expectation, so those swaps' gains add), until no swap
gains more than MIN_GAIN or max_rounds. Shape legend: L layers, E experts, P slots (= E), G groups, N nodes,
S slots a node.
"""

from __future__ import annotations

import numpy as np

from r3trace.eplb import portable
from r3trace.eplb.node_model import expected_nodes
from r3trace.eplb.placement import Cluster

MIN_GAIN = 1e-4  # expected nodes per token a swap must save (4.77 -> 3.99 took ~160 swaps of 1e-4 .. 0.05 a layer)
# rounds of node-disjoint swaps (up to N / 2 a layer a round): at [58, 256] on 16 nodes, s = 1.2, expected nodes per
# token 4.55 (global's) -> 4.04 / 3.87 / 3.83 after 8 / 16 / 64 rounds at ~25 ms a round
MAX_ROUNDS = 12
SURE = 1.0 - 1e-9  # p and q clipped below 1 so that every cell's miss probability divides


def node_swaps(phy2log: np.ndarray, w: np.ndarray, cluster: Cluster, top_k: int, topk_group: int, cap: float,
               max_rounds: int = MAX_ROUNDS) -> np.ndarray:
    """phy2log [L, P] with every expert once, loads w [L, E] -> phy2log [L, P] after the module doc's swaps: no GPU
    over cap x the layer's max GPU load (the max GPU untouched), fewer expected nodes per token or the layer as it
    was."""
    n_layers, e = w.shape
    if cluster.num_slots != e or cluster.num_nodes == 1 or n_layers == 0 or cap <= 0:
        return phy2log
    n_gr, n = cluster.num_groups, cluster.num_nodes
    spn, gsize = cluster.slots_per_node, e // n_gr
    taken = topk_group if topk_group > 0 else max(1, n_gr // 2)
    ph = np.array(phy2log, dtype=np.int64)
    w = np.asarray(w, dtype=np.float64)
    total = np.maximum(w.sum(1, keepdims=True), 1e-300)
    w_gr = w.reshape(n_layers, n_gr, gsize).sum(2)  # [L, G]
    q = np.minimum(SURE, taken * w_gr / total)  # [L, G]
    p = np.minimum(SURE, (top_k / taken) * w / np.repeat(np.maximum(w_gr, 1e-300), gsize, axis=1))  # [L, E]
    slot_gpu, slot_node = cluster.slot_gpu(), cluster.slot_node()
    rows = np.arange(n_layers)[:, None]
    ws = w[rows, ph]  # [L, P] load of each slot's expert
    gpu_load = ws.reshape(n_layers, cluster.num_gpus, -1).sum(2)  # [L, GPUs]
    top = gpu_load.argmax(1)  # [L] the max GPU, never touched
    limit = cap * gpu_load[np.arange(n_layers), top]  # [L]
    frozen = slot_gpu[None, :] == top[:, None]  # [L, P]
    upper = np.triu(np.ones((n, n), dtype=bool), 1)  # node pairs n < m
    pair_n, pair_m = np.nonzero(upper)  # [Q] Q = N (N - 1) / 2
    sn = pair_n[:, None] * spn + np.arange(spn)[None, :]  # [Q, S] slots of n
    sm = pair_m[:, None] * spn + np.arange(spn)[None, :]  # [Q, S] slots of m
    live = np.arange(n_layers)  # layers whose last round found a swap
    for _ in range(max_rounds):
        nl = len(live)
        lr = live[:, None]
        pl = ph[live]
        gs = pl // gsize  # [l, P] group of each slot's expert
        u = 1.0 - p[lr, pl]  # [l, P] P(expert not picked | its group taken)
        cell = (np.arange(nl)[:, None] * n_gr + gs) * n + slot_node[None, :]  # [l, P]
        ea = portable.exp(np.bincount(cell.ravel(), weights=portable.log(u).ravel(),
                                      minlength=nl * n_gr * n)).reshape(nl, n_gr, n)  # [l, G, N]
        qg = q[live][:, :, None]
        miss = 1.0 - qg + qg * ea  # [l, G, N] node n missed through group g
        nm = np.ones((nl, n))
        for g in range(n_gr):
            nm *= miss[:, g]  # [l, N] node n missed
        lay = np.arange(nl)[:, None]
        qs = q[live][lay, gs]  # [l, P]
        ea_s = ea[lay, gs]  # [l, P, N] s's group's cell on every node
        # moving slot s's expert onto node m: cell (g(s), m) becomes 1 - q + q ea u_s, and m's miss scales by
        # new / old cell; off its own node the cell becomes 1 - q + q ea / u_s
        add = ((1.0 - qs[:, :, None] + qs[:, :, None] * ea_s * u[:, :, None]) / miss[lay, gs]).astype(np.float32)
        own_ea = ea_s[:, np.arange(e), slot_node]  # [l, P]
        own_miss = miss[lay, gs, slot_node[None, :]]  # [l, P]
        nm_s = nm[:, slot_node]  # [l, P]
        alpha = nm_s * (1.0 - qs + qs * own_ea / u) / own_miss  # [l, P] s's node's miss without s
        # a same-group pair changes one cell on each node: n's becomes 1 - q + q ea_n u_j / u_i, so the pair's
        # two misses are (b_i + b_j) + c_i u_j + c_j u_i (b_s = nm (1 - q) / cell, c_s = nm q ea / (u_s cell))
        b = nm_s * (1.0 - qs) / own_miss  # [l, P]
        c = nm_s * qs * own_ea / (u * own_miss)  # [l, P]
        f32 = np.float32
        a_i, a_j = alpha[:, sn].astype(f32)[..., None], alpha[:, sm].astype(f32)[:, :, None, :]
        new = a_i * add[:, sm, pair_n[:, None]][:, :, None, :]  # [l, Q, S, S] the two nodes' misses after
        new += a_j * add[:, sn, pair_m[:, None]][..., None]  # the swap, a pair of different groups
        u_i, u_j = u[:, sn].astype(f32)[..., None], u[:, sm].astype(f32)[:, :, None, :]
        same_new = b[:, sn].astype(f32)[..., None] + b[:, sm].astype(f32)[:, :, None, :]
        same_new += c[:, sn].astype(f32)[..., None] * u_j
        same_new += c[:, sm].astype(f32)[:, :, None, :] * u_i
        np.copyto(new, same_new, where=gs[:, sn][..., None] == gs[:, sm][:, :, None, :])
        # feasible: each GPU's new load within the limit (room -inf on the max GPU: never moved)
        ws_l, load = ws[live], gpu_load[live][:, slot_gpu]  # [l, P]
        room = np.where(frozen[live], -np.inf, limit[live][:, None] - load + ws_l)  # [l, P] largest load s can take
        ok = ws_l[:, sm].astype(f32)[:, :, None, :] <= room[:, sn].astype(f32)[..., None]
        ok &= ws_l[:, sn].astype(f32)[..., None] <= room[:, sm].astype(f32)[:, :, None, :]
        np.copyto(new, -np.inf, where=~ok)
        flat = new.reshape(nl, len(pair_n), spn * spn)
        best = flat.argmax(2)  # [l, Q] the same argmax as the gain's: nm_n + nm_m is the pair's constant
        score = np.take_along_axis(flat, best[:, :, None], 2)[:, :, 0] - (nm[:, pair_n] + nm[:, pair_m])  # [l, Q]
        picks = _disjoint(score, pair_n, pair_m, n)  # [l, Q] bool
        moved = picks.any(1)
        if not moved.any():
            break
        li, qq = np.nonzero(picks)
        lay_g = live[li]
        si = pair_n[qq] * spn + best[li, qq] // spn
        sj = pair_m[qq] * spn + best[li, qq] % spn
        di = ws[lay_g, sj] - ws[lay_g, si]
        np.add.at(gpu_load, (lay_g, slot_gpu[si]), di)
        np.add.at(gpu_load, (lay_g, slot_gpu[sj]), -di)
        ph[lay_g, si], ph[lay_g, sj] = ph[lay_g, sj], ph[lay_g, si]
        ws[lay_g, si], ws[lay_g, sj] = ws[lay_g, sj], ws[lay_g, si]
        live = live[moved]
    before = expected_nodes(phy2log, w, cluster, top_k, topk_group)
    after = expected_nodes(ph, w, cluster, top_k, topk_group)
    return np.where((after < before)[:, None], ph, phy2log)


def _disjoint(score: np.ndarray, pair_n: np.ndarray, pair_m: np.ndarray, n: int) -> np.ndarray:
    """score [L, Q] each node pair's best swap gain -> [L, Q] the pairs taken: greedily by gain, over MIN_GAIN,
    no node twice in a layer."""
    n_layers = score.shape[0]
    order = np.argsort(-score, axis=1, kind="stable")  # [L, Q]
    used = np.zeros((n_layers, n), dtype=bool)
    out = np.zeros(score.shape, dtype=bool)
    lay = np.arange(n_layers)
    for k in range(score.shape[1]):
        qk = order[:, k]
        s = score[lay, qk]
        if not (s > MIN_GAIN).any():
            break
        free = (s > MIN_GAIN) & ~used[lay, pair_n[qk]] & ~used[lay, pair_m[qk]]
        out[lay[free], qk[free]] = True
        used[lay[free], pair_n[qk[free]]] = True
        used[lay[free], pair_m[qk[free]]] = True
    return out
