"""Swaps of two experts between nodes that lower node_model's expected nodes per token under a GPU-load cap: how a
plan without tokens and without a spare slot (P = E) gathers the experts a token picks together onto fewer nodes.

Why: without tokens candidates.Contest picks among whole layouts (ours, DeepSeek global grouped, global) by
node_model.expected_nodes, and the best of them, global's sorted packing (the hottest experts one a GPU on the first
nodes), left 4.77 nodes per token on bench/eplb_matrix.py's SGLang-dump cell of 128 GPUs / 16 nodes / 256 slots at
s = 1.2, slow drift. A token's 8 experts sit mostly among the hottest few and in the 4 groups it takes, and global's
layout spreads both: the hottest 16 experts on 8 nodes with the coldest 16, every group on every node. The swaps put
the hottest experts onto one node where the cap lets them share GPUs, and a group's experts onto the same nodes.
Used by candidates.Contest on its chosen layout (fresh plans, a drifting re-plan's fresh layers) and, one round of
larger gains only, by a still re-plan (planner.py; PlannerConfig.node_swap_cap and replan_swap_gain).

The cap: every GPU's load on the forecast stays at or under cap x the layer's max GPU load, whose GPU is not touched.
Held out the swapped GPUs must stay under the max GPU's load on the next window; a GPU filled to 0.6 of the max's
level in sample went over it there (SGLang-dump, s = 1.2, fast drift: balancedness 0.0823 -> 0.0808; at 0.3 the
same).

The search: every round scores every pair of experts on different nodes at once (the change in the expected nodes
of their two nodes, exact under node_model's router), takes per layer the best swap of each of a set of node-disjoint
node pairs (nodes add up independently in the expectation, so those swaps' gains add), then swaps again inside those
node pairs, best first, up to PAIR_SWAPS a pair (a pair's gains depend on its two nodes alone, so each is scored on
those S x S experts only, not the Q S^2 of a round); rounds end when no swap gains more than min_gain (MIN_GAIN), or
after max_rounds. Shape legend: L layers, E experts, P slots (= E), G groups, N nodes, S slots a node, Q node pairs,
M (layer, node pair) items.
"""

from __future__ import annotations

import numpy as np

from r3trace.eplb import portable
from r3trace.eplb.node_model import expected_nodes, router_odds
from r3trace.eplb.placement import Cluster

MIN_GAIN = 1e-4  # expected nodes per token a swap must save (4.77 -> 3.99 took ~160 swaps of 1e-4 .. 0.05 a layer)
# rounds, swaps a matched node pair makes in a round, and the slots a side of a pair scored: a round takes at most
# N / 2 swaps a layer, and a layer took 100-160 to settle from DeepSeek global's layout (s = 1.2, 8 and 16 nodes).
# At [58, 256], s = 1.2, from the contest's layout (4.56 expected nodes per token on 16 nodes, 3.66 on 8): these
# 3.92 / 3.64 in 0.19 / 0.03 s; every slot pair scored 3.92 / 3.57 in 0.30 / 0.11 s, 12 rounds of one swap 3.94 /
# 3.57 in 0.53 / 0.15 s; 4 candidates 3.94 / 3.66
MAX_ROUNDS = 6
PAIR_SWAPS = 4
CANDIDATES = 8
ITEM_FLOATS = 32768  # the [M, S, S] arrays are scored in chunks of this many (128 KB of float32: cache-sized, and
# under malloc's mmap threshold, so a chunk's temporaries are not page-faulted in afresh each time)
SURE = 1.0 - 1e-9  # p and q clipped below 1 so that every cell's miss probability divides


class _Layers:
    """The swap search's state: phy2log ph [L, P], slot loads ws [L, P], GPU loads [L, GPUs], and node_model's
    inputs (module doc of node_model.py) clipped by SURE."""

    def __init__(self, phy2log: np.ndarray, w: np.ndarray, cluster: Cluster, top_k: int, topk_group: int,
                 cap: float) -> None:
        n_layers, e = w.shape
        self.cluster, self.n_gr, self.gsize = cluster, cluster.num_groups, e // cluster.num_groups
        self.ph = np.array(phy2log, dtype=np.int64)
        self.q, self.p = router_odds(w, self.n_gr, top_k, topk_group, SURE)  # [L, G] a group taken, [L, E]
        self.ws = np.take_along_axis(w, self.ph, 1)  # [L, P] load of each slot's expert
        self.gpu_load = self.ws.reshape(n_layers, cluster.num_gpus, -1).sum(2)  # [L, GPUs]
        top = self.gpu_load.argmax(1)  # [L] the max GPU, never touched
        self.limit = cap * self.gpu_load[np.arange(n_layers), top]  # [L]
        self.frozen = cluster.slot_gpu()[None, :] == top[:, None]  # [L, P]

    def scores(self, live: np.ndarray) -> tuple[np.ndarray, ...]:
        """live [l] layers -> per slot (float32 [l, P] unless said): alpha (its node's miss without it), b, c (a
        same-group swap's terms), u (1 - p), the slot's load and room (the largest load it can take in), add [l, P,
        N] (a node's miss scaling with the slot's expert moved in), groups [l, P] and node misses nm [l, N] (float64).

        A node's miss is the product over groups of its cells 1 - q + q ea, ea the product of 1 - p over the
        group's experts on it. Moving slot s's expert (group g) onto node m makes cell (g, m) 1 - q + q ea u_s, off
        its own node 1 - q + q ea / u_s; a same-group swap of i (node n) and j changes one cell a node: n's becomes
        1 - q + q ea_n u_j / u_i, so the two nodes' misses are (b_i + b_j) + c_i u_j + c_j u_i with b_s = nm (1 -
        q) / cell, c_s = nm q ea / (u_s cell)."""
        cl, n_gr, n = self.cluster, self.n_gr, self.cluster.num_nodes
        nl, e = len(live), self.ph.shape[1]
        slot_node = cl.slot_node()
        pl = self.ph[live]
        gs = pl // self.gsize  # [l, P]
        u = 1.0 - np.take_along_axis(self.p[live], pl, 1)  # [l, P]
        cell = (np.arange(nl)[:, None] * n_gr + gs) * n + slot_node[None, :]  # [l, P]
        ea = portable.exp(np.bincount(cell.ravel(), weights=portable.log(u).ravel(),
                                      minlength=nl * n_gr * n)).reshape(nl, n_gr, n)  # [l, G, N]
        q = self.q[live]
        miss = 1.0 - q[:, :, None] + q[:, :, None] * ea  # [l, G, N]
        nm = np.ones((nl, n))
        for g in range(n_gr):  # a fixed order: the same bits on every CPU
            nm *= miss[:, g]
        lay = np.arange(nl)[:, None]
        qs = q[lay, gs]  # [l, P]
        ea_s, miss_s = ea[lay, gs], miss[lay, gs]  # [l, P, N] the slot's group's cells on every node
        add = ((1.0 - qs[:, :, None] + qs[:, :, None] * ea_s * u[:, :, None]) / miss_s).astype(np.float32)
        own_ea, own_miss = ea_s[:, np.arange(e), slot_node], miss_s[:, np.arange(e), slot_node]  # [l, P]
        nm_s = nm[:, slot_node]  # [l, P]
        alpha = nm_s * (1.0 - qs + qs * own_ea / u) / own_miss
        b = nm_s * (1.0 - qs) / own_miss
        c = nm_s * qs * own_ea / (u * own_miss)
        ws = self.ws[live]
        load = self.gpu_load[live][:, cl.slot_gpu()]  # [l, P] the slot's GPU's load
        room = np.where(self.frozen[live], -np.inf, self.limit[live][:, None] - load + ws)
        f32 = np.float32
        return (alpha.astype(f32), b.astype(f32), c.astype(f32), u.astype(f32), ws.astype(f32), room.astype(f32),
                add, gs, nm)

    def swap(self, lay: np.ndarray, si: np.ndarray, sj: np.ndarray) -> None:
        """Swap slots si and sj [K] of layers lay [K] (no slot twice in a layer)."""
        slot_gpu = self.cluster.slot_gpu()
        di = self.ws[lay, sj] - self.ws[lay, si]
        np.add.at(self.gpu_load, (lay, slot_gpu[si]), di)
        np.add.at(self.gpu_load, (lay, slot_gpu[sj]), -di)
        self.ph[lay, si], self.ph[lay, sj] = self.ph[lay, sj], self.ph[lay, si]
        self.ws[lay, si], self.ws[lay, sj] = self.ws[lay, sj], self.ws[lay, si]


def node_swaps(phy2log: np.ndarray, w: np.ndarray, cluster: Cluster, top_k: int, topk_group: int, cap: float,
               max_rounds: int = MAX_ROUNDS, pair_swaps: int = PAIR_SWAPS,
               candidates: int = CANDIDATES, min_gain: float = MIN_GAIN) -> np.ndarray:
    """phy2log [L, P] with every expert once, loads w [L, E] -> phy2log [L, P] after the module doc's swaps: no GPU
    over cap x the layer's max GPU load (the max GPU untouched), fewer expected nodes per token or the layer as it
    was. pair_swaps: swaps a matched node pair makes a round (1: the round's best swaps alone); candidates: the
    slots a side of a node pair scored (>= S: every pair of slots, each round's best swap exact); min_gain: expected
    nodes per token a swap must save."""
    n_layers, e = w.shape
    if cluster.num_slots != e or cluster.num_nodes == 1 or n_layers == 0 or cap <= 0:
        return phy2log
    w = np.asarray(w, dtype=np.float64)
    st = _Layers(phy2log, w, cluster, top_k, topk_group, cap)
    n, spn = cluster.num_nodes, cluster.slots_per_node
    pair_n, pair_m = np.nonzero(np.triu(np.ones((n, n), dtype=bool), 1))  # [Q] node pairs n < m
    live = np.arange(n_layers)  # layers whose last round found a swap
    for _ in range(max_rounds):
        sc = st.scores(live)
        nq = len(pair_n)
        li, qq = np.repeat(np.arange(len(live)), nq), np.tile(np.arange(nq), len(live))  # every item
        gain, best = _best(sc, li, qq, pair_n, pair_m, spn, candidates)
        picks = _disjoint(gain.reshape(len(live), nq), pair_n, pair_m, n, min_gain).ravel()  # [l Q]
        if not picks.any():
            break
        li, qq, best = li[picks], qq[picks], best[picks]
        moved = np.zeros(len(live), dtype=bool)
        moved[li] = True
        for k in range(pair_swaps):  # the matched pairs swap again, each on its own two nodes
            st.swap(live[li], pair_n[qq] * spn + best // spn, pair_m[qq] * spn + best % spn)
            if k == pair_swaps - 1:
                break
            rows = np.flatnonzero(np.bincount(li, minlength=len(live)))
            sc = st.scores(live[rows])
            sub = np.searchsorted(rows, li)  # the items' rows in sc
            gain, best = _best(sc, sub, qq, pair_n, pair_m, spn, candidates)
            more = gain > min_gain
            if not more.any():
                break
            li, qq, best = li[more], qq[more], best[more]
        live = live[moved]
    before = expected_nodes(phy2log, w, cluster, top_k, topk_group)
    after = expected_nodes(st.ph, w, cluster, top_k, topk_group)
    return np.where((after < before)[:, None], st.ph, phy2log)


def _best(sc: tuple[np.ndarray, ...], li: np.ndarray, qq: np.ndarray, pair_n: np.ndarray, pair_m: np.ndarray,
          spn: int, cands: int) -> tuple[np.ndarray, np.ndarray]:
    """_Layers.scores' arrays, items (layer row li [M] of them, node pair qq [M]) -> (gain [M] expected nodes the
    item's best swap saves, -inf where none is feasible; best [M] that swap as i * S + j, i of node n's slots, j of
    m's), among the cands slots of each side that gain the most moved alone (all S where cands >= S)."""
    alpha, b, c, u, ws, room, add, gs, nm = sc
    gain = np.empty(len(li))
    best = np.empty(len(li), dtype=np.int64)
    step = max(1, ITEM_FLOATS // min(spn, cands) ** 2)
    base = np.arange(spn)[None, :]
    for lo in range(0, len(li), step):
        lq, q = li[lo:lo + step, None], qq[lo:lo + step]
        nn, mm = pair_n[q], pair_m[q]
        sn, sm = nn[:, None] * spn + base, mm[:, None] * spn + base  # [m, S] the two nodes' slots
        nm_n, nm_m = nm[li[lo:lo + step], nn], nm[li[lo:lo + step], mm]  # [m]
        if spn > cands:  # each side's cands best movers: the gain of moving alone to the other node
            go_i = alpha[lq, sn] + nm_m[:, None] * add[lq, sn, mm[:, None]]  # [m, S] (the constants dropped)
            go_j = alpha[lq, sm] + nm_n[:, None] * add[lq, sm, nn[:, None]]
            ki = np.sort(np.argpartition(-go_i, cands - 1, axis=1)[:, :cands], axis=1)
            kj = np.sort(np.argpartition(-go_j, cands - 1, axis=1)[:, :cands], axis=1)
            sn, sm = np.take_along_axis(sn, ki, 1), np.take_along_axis(sm, kj, 1)
        else:
            ki = kj = np.broadcast_to(base, sn.shape)
        g, k = _item_best(
            alpha[lq, sn], alpha[lq, sm], add[lq, sm, nn[:, None]], add[lq, sn, mm[:, None]], b[lq, sn], b[lq, sm],
            c[lq, sn], c[lq, sm], u[lq, sn], u[lq, sm], gs[lq, sn], gs[lq, sm], ws[lq, sn], ws[lq, sm],
            room[lq, sn], room[lq, sm])
        t = sn.shape[1]
        rows = np.arange(len(k))
        best[lo:lo + step] = ki[rows, k // t] * spn + kj[rows, k % t]
        gain[lo:lo + step] = g - (nm_n + nm_m)
    return gain, best


def _item_best(a_i: np.ndarray, a_j: np.ndarray, add_jn: np.ndarray, add_im: np.ndarray, b_i: np.ndarray,
               b_j: np.ndarray, c_i: np.ndarray, c_j: np.ndarray, u_i: np.ndarray, u_j: np.ndarray, g_i: np.ndarray,
               g_j: np.ndarray, w_i: np.ndarray, w_j: np.ndarray, room_i: np.ndarray,
               room_j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per item [m, S] of slots i (node n) and j (node m) -> (the two nodes' summed miss after the item's best
    swap [m], -inf where none is feasible; that swap as i * S + j [m]): a pair of different groups alpha_i add_j(n) +
    alpha_j add_i(m), of one group (b_i + b_j) + c_i u_j + c_j u_i (_Layers.scores)."""
    col, row = (slice(None), slice(None), None), (slice(None), None, slice(None))
    new = np.multiply(a_i[col], add_jn[row])  # [m, S, S]
    tmp = np.multiply(a_j[row], add_im[col])
    new += tmp
    same = np.add(b_i[col], b_j[row])
    np.multiply(c_i[col], u_j[row], out=tmp)
    same += tmp
    np.multiply(c_j[row], u_i[col], out=tmp)
    same += tmp
    np.copyto(new, same, where=g_i[col] == g_j[row])
    ok = w_j[row] <= room_i[col]  # each GPU's new load within the limit (room -inf on the max GPU)
    ok &= w_i[col] <= room_j[row]
    np.copyto(new, -np.inf, where=~ok)
    flat = new.reshape(len(a_i), -1)
    best = flat.argmax(1)
    return flat[np.arange(len(a_i)), best].astype(np.float64), best


def _disjoint(score: np.ndarray, pair_n: np.ndarray, pair_m: np.ndarray, n: int, min_gain: float) -> np.ndarray:
    """score [L, Q] each node pair's best swap gain -> [L, Q] the pairs taken: greedily by gain, over min_gain,
    no node twice in a layer."""
    n_layers = score.shape[0]
    order = np.argsort(-score, axis=1, kind="stable")  # [L, Q]
    used = np.zeros((n_layers, n), dtype=bool)
    out = np.zeros(score.shape, dtype=bool)
    lay = np.arange(n_layers)
    for k in range(score.shape[1]):
        qk = order[:, k]
        s = score[lay, qk]
        if not (s > min_gain).any():
            break
        free = (s > min_gain) & ~used[lay, pair_n[qk]] & ~used[lay, pair_m[qk]]
        out[lay[free], qk[free]] = True
        used[lay[free], pair_n[qk[free]]] = True
        used[lay[free], pair_m[qk[free]]] = True
    return out
