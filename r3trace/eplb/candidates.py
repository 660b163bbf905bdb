"""Per layer, the best of three layouts on the forecast: ours, DeepSeek's global policy with its GPUs grouped onto
nodes, and global's plan as it is. Used where ours' layout would otherwise be kept whatever it costs: fresh plans
without a spare slot (P = E) and the fresh plan a drifting workload re-plans to (planner.plan).

The lowest forecast max GPU load wins; within MAX_LOAD_TIE of it, the fewest nodes per token; and where global's own
layer is among the tied, it stays unless that pick has fewer nodes per token by more than GLOBAL_Z paired standard
errors on tokens it was not fitted on (P = E with tokens: bench/eplb_matrix.py's one-group 128 GPUs / 16 nodes cell,
independent router, went from 4.62 against global's 4.62 to 4.61, the matrix from 41 / 62 / 15 to 42 / 62 / 14).
With one replica per expert (P = E) a token's nodes are exactly the distinct nodes of its K experts, so they are
counted on the newest tokens (predicting the next window's to 0.01 on bench/eplb_matrix.py's 128x16x256 cells); with
replicas the cover is the dispatcher's choice, so ties go to ours, then global grouped, then global. Why global is a
candidate: on bench/eplb_matrix.py's cells it balances some layers better than ours on the same forecast, in sample
and held out (independent router, s = 1.2, fast drift, 32x4x288: 0.997 vs 0.989 in sample, 0.801 vs 0.778 on the
next window), and at high skew without spare slots its packing puts the hottest experts, one per GPU, on the first
nodes (5.61 nodes per token against ours' 6.24 at s = 0.9 on 16 nodes). Reordering whole GPUs (by_group) keeps every
GPU's load, so it changes nodes per token only.

With P = E and tokens, ours' and global's GPUs are first moved between nodes by co-activation (regroup.py) in the
layers where they tie on the max load, kept where the order fitted on the older half of the tokens has fewer nodes
per token on the newer half (by REGROUP_Z standard errors), and the candidates compare on that newer half's nodes
per token, a figure no candidate was fitted on. On bench/eplb_matrix.py's slow-drift P = E cells of the grouped
router on 4-16 nodes, nodes per token held out fell 0.002-0.27 (128 GPUs / 16 nodes at s = 0.9: 5.62 -> 5.35,
global 5.62). A plan keeps every GPU's load; held out, balancedness moved -0.007 .. +0.001 (64 GPUs / 8 nodes,
s = 0.3: 0.688 -> 0.681, global 0.668), the re-plans' leveling swaps starting from another layout.
Shape legend: T tokens, L layers, K top-k, E experts, P slots, G GPUs.
"""

from __future__ import annotations

import numpy as np

from r3trace.eplb.deepseek import global_phy2log
from r3trace.eplb.node_model import expected_nodes
from r3trace.eplb.node_swaps import node_swaps
from r3trace.eplb.placement import Cluster
from r3trace.eplb.regroup import gpu_coactivation, node_order, reordered
from r3trace.eplb.score import phy2log_gpu_load

# a candidate whose forecast max GPU load is within this share of the lowest counts as balanced as it (the
# forecast's own sampling noise is larger); then nodes per token decide
MAX_LOAD_TIE = 0.002
REGROUP_Z = 2.0  # standard errors by which a regrouped layer must have fewer nodes per token on held-out tokens
GLOBAL_Z = 2.0  # ... and by which a candidate must beat DeepSeek global's own layer to replace it
# global's layer is regrouped only where its nodes per token is below this x the best other tied candidate's: over
# bench/eplb_matrix.py's 20 P = E cells (120 layers) the regroup lowered global's layers by 3.4% at most (0.18 of
# 5.24, 64 GPUs / 8 nodes, s = 0.6), while ours' group homes (PlannerConfig.contest_swaps) now tie on the max load and
# sit 0.3-1.3 below global there on 4-8 nodes, so both regroups would double a fresh plan's regroup time
REGROUP_REACH = 1.1


def by_group(phy2log: np.ndarray, num_experts: int, cluster: Cluster) -> np.ndarray:
    """phy2log [L, P] -> the same GPUs' slot sets with GPUs ordered by the group most of their slots hold (the
    purest first), so consecutive GPUs, and so nodes, hold one group's experts."""
    n_layers = phy2log.shape[0]
    gpus = phy2log.reshape(n_layers, cluster.num_gpus, cluster.slots_per_gpu)  # [L, G, P/G]
    grp = gpus // (num_experts // cluster.num_groups)
    share = np.zeros((n_layers, cluster.num_gpus, cluster.num_groups))
    np.add.at(share, (np.arange(n_layers)[:, None, None], np.arange(cluster.num_gpus)[None, :, None], grp), 1.0)
    key = share.argmax(2) * (cluster.slots_per_gpu + 1) - share.max(2)  # [L, G] dominant group, purest first
    order = np.argsort(key, axis=1, kind="stable")
    return np.take_along_axis(gpus, order[:, :, None], 1).reshape(n_layers, -1)


def nodes_per_token(phy2log: np.ndarray, tokens: np.ndarray, cluster: Cluster) -> np.ndarray:
    """phy2log [L, P] with every expert once, tokens [T, L, K] -> [L] mean distinct nodes of a token's experts."""
    return token_nodes(phy2log, tokens, cluster).mean(0)


def token_nodes(phy2log: np.ndarray, tokens: np.ndarray, cluster: Cluster) -> np.ndarray:
    """phy2log [L, P] with every expert once, tokens [T, L, K] -> [T, L] distinct nodes of each token's experts.

    A token's nodes are the set bits of the OR of its experts' node bits (N <= 64; more nodes: a sort over K): at
    [58, 256] on 8 nodes ~3 ms a candidate against 13 ms for sorting the [T, L, K] node ids."""
    n_layers, e = phy2log.shape[0], phy2log.shape[1]
    flat = tokens.astype(np.intp)  # [T, L, K] into [L, E] raveled; offset in place: a second [T, L, K] array of
    flat += (np.arange(tokens.shape[1]) * e)[None, :, None]  # int64 was 2 of a 5 ms count at [58 x 2, 256]
    node_of = np.empty_like(phy2log)
    node_of[np.arange(n_layers)[:, None], phy2log] = cluster.slot_node()[None, :]  # [L, E]
    if cluster.num_nodes > 64:
        nodes = np.sort(np.take(node_of, flat), axis=2)  # [T, L, K]
        return 1 + (np.diff(nodes, axis=2) != 0).sum(2)
    mask_t = next(t for t in (np.uint8, np.uint16, np.uint32, np.uint64) if np.iinfo(t).bits >= cluster.num_nodes)
    picked = np.take(np.left_shift(1, node_of.astype(np.uint64)).astype(mask_t), flat)  # [T, L, K] node bits
    cover = picked[:, :, 0].copy()  # [T, L] OR over K, one position at a time (a reduce over the short axis: 4x slower)
    for k in range(1, picked.shape[2]):
        cover |= picked[:, :, k]
    return np.bitwise_count(cover).astype(np.int64)


def regrouped(phy2log: np.ndarray, tokens: np.ndarray, cluster: Cluster, layers: np.ndarray | None = None,
              plain: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """phy2log [L, P] with every expert once, tokens [T, L, K] -> (phy2log [L, P], nodes [T / 2, L]): per layer
    regroup.py's GPU order fitted on all the tokens where the order fitted on their older half has fewer nodes per
    token on the newer half, else the layer as it was; nodes: each newer-half token's nodes under the half-fitted
    order or the layer as it was (figures not fitted on the tokens they count, so candidates compare fairly).
    layers [L] bool: only these are regrouped (None: all).

    Why held out: the regroup counts pairs of a token's experts, and with an independent router those pairs are
    noise; fitted and judged on one window it lowered that window's nodes per token 2-3% and raised the next
    window's 0.3% (bench/eplb_matrix.py, 128 GPUs / 16 nodes / 256 slots), where on grouped and clustered routers
    it lowered the next window's 0.1-2.5%. Fitted on the older half, it lost on the newer half in 11 of the 12
    layers of the independent cells and won in 72 of 72 grouped layers (9 of 12 clustered)."""
    n_layers, half = phy2log.shape[0], len(tokens) // 2
    newer = tokens[half:]
    plain = token_nodes(phy2log, newer, cluster) if plain is None else plain  # [T / 2, L]
    if half < 2:
        return phy2log, plain
    todo = np.ones(n_layers, dtype=bool) if layers is None else layers
    if not todo.any():  # the layers not tried keep their order and the newer half's count
        return phy2log, plain
    trial = phy2log.copy()
    sub = phy2log[todo]
    older = gpu_coactivation(sub, tokens[:half, todo], cluster)  # [l, G, G], kept for the refit below
    first = node_order(older, cluster)  # [l, G]
    trial[todo] = reordered(sub, first, cluster)
    diff = np.zeros(plain.shape, dtype=plain.dtype)  # [T / 2, L] paired per token; 0 in the layers not tried
    diff[:, todo] = token_nodes(trial[todo], newer[:, todo], cluster) - plain[:, todo]
    # fewer by more than REGROUP_Z standard errors of the paired mean (independent router: 1-3 layers of 12 were
    # a little lower by chance, and the next window's nodes per token rose 0.002-0.008 with them)
    helps = diff.mean(0) < -REGROUP_Z * paired_se(diff)
    out = phy2log.copy()
    if helps.any():  # refit on all the tokens, from the half's order (fewer swaps), in that order's GPU ids
        pick = helps[todo]
        a = older[pick] + gpu_coactivation(sub[pick], tokens[half:][:, helps], cluster)
        o = first[pick]
        a = np.take_along_axis(np.take_along_axis(a, o[:, :, None], 1), o[:, None, :], 2)
        out[helps] = reordered(trial[helps], node_order(a, cluster), cluster)
    return out, plain + np.where(helps, diff, 0)


def paired_se(diff: np.ndarray) -> np.ndarray:
    """diff [T, L] integer per-token differences -> [L] the standard error of each column's mean (NaN under 2
    rows), from exact integer sums (T sum x^2 - (sum x)^2): a layer gets the same bits alone as in a stack, where
    numpy's std sums a lone contiguous column pairwise and a stack's columns row by row (Contest chooses any subset
    of layers as the whole stack does; the means of integer counts are exact either way)."""
    n = len(diff)
    if n < 2:
        return np.full(diff.shape[1:], np.nan)
    d = diff.astype(np.int64)
    s1, s2 = d.sum(0), (d * d).sum(0)
    return np.sqrt((n * s2 - s1 * s1) / (n * (n - 1) * n))


def best_layout(phy2log: np.ndarray, w: np.ndarray, cluster: Cluster, tokens: np.ndarray | None,
                router: tuple[int, int] = (8, 0), swap_cap: float = 0.0) -> np.ndarray:
    """Ours' phy2log [L, P], forecast w [L, E], newest tokens [T, L, K] or None -> phy2log [L, P], per layer the
    candidate of the module doc with the lowest max GPU load up to MAX_LOAD_TIE, then the fewest nodes per token.
    router, swap_cap: Contest's, without tokens."""
    return Contest(phy2log, w, cluster, tokens, router=router, swap_cap=swap_cap).layouts(np.arange(len(phy2log)))


def losing_load(glob: np.ndarray, w: np.ndarray, cluster: Cluster) -> np.ndarray:
    """DeepSeek global's phy2log [L, P] on w [L, E] -> [L] the max GPU load above which ours' layer ties no
    candidate (global grouped has global's GPU loads), so Contest never chooses it nor reads its max load."""
    return phy2log_gpu_load(glob, w, cluster).max(1) * (1 + MAX_LOAD_TIE)


class Contest:
    """best_layout's choice made per layer on demand. A drifting re-plan (replan.refreshed) needs every layer's
    winning max GPU load but the winning layout only of the layers that take the fresh plan. The regroups change no
    GPU's load, so a layer's winning max load is known without them wherever the tied candidates' max loads are
    equal. The drifting re-plan at [58, 256] on 64 GPUs / 8 nodes (P = E; bench/eplb_matrix.plan_times) chose 4 of
    its 58 layers so (none took the fresh plan) and took 0.027 s instead of 0.049 s with every layer chosen.
    compete=False: ours alone.

    Each layer's choice is its own (every step below is per layer), so a subset of layers gets the layouts and
    loads that the whole stack gets (tests/analysis/test_eplb_contest.py)."""

    def __init__(self, phy2log: np.ndarray, w: np.ndarray, cluster: Cluster, tokens: np.ndarray | None,
                 compete: bool = True, glob: np.ndarray | None = None, router: tuple[int, int] = (8, 0),
                 swap_cap: float = 0.0) -> None:
        """glob: DeepSeek global's phy2log [L, P] on w where the caller has it. router: (top_k, topk_group) of
        node_model.expected_nodes, which ranks the tied candidates where P = E and tokens is None; there the chosen
        layout's experts then swap between nodes under swap_cap (node_swaps.py; 0: not), which keeps every layer's
        max GPU load (its GPU untouched, every other one under swap_cap of it), so peak() holds."""
        self.w, self.cluster, self.tokens, self.router, self.swap_cap = w, cluster, tokens, router, swap_cap
        if compete:
            glob = global_phy2log(w, cluster) if glob is None else glob
            self.cands = np.stack([phy2log, by_group(glob, w.shape[1], cluster), glob])  # [3, L, P]
        else:
            self.cands = phy2log[None]
        self.peaks = np.stack([phy2log_gpu_load(c, w, cluster).max(1) for c in self.cands])  # [C, L]
        self.tied = self.peaks <= self.peaks.min(0) * (1 + MAX_LOAD_TIE)
        self.won = np.empty_like(phy2log)  # [L, P] the chosen layouts, where done
        self.done = np.zeros(len(phy2log), dtype=bool)

    def peak(self) -> np.ndarray:
        """-> [L] the max GPU load of each layer's chosen layout: the tied candidates' where they share it,
        else that of the layout chosen."""
        low = self.peaks.min(0)
        out = low.copy()
        spread = np.flatnonzero(np.where(self.tied, self.peaks, -np.inf).max(0) > low)
        if len(spread):
            out[spread] = phy2log_gpu_load(self.layouts(spread), self.w[spread], self.cluster).max(1)
        return out

    def layouts(self, rows: np.ndarray) -> np.ndarray:
        """rows [R] layer indices -> phy2log [R, P]: each layer's chosen candidate (best_layout's rows)."""
        todo = np.flatnonzero(~self.done[rows])
        if len(todo):
            need = np.unique(rows[todo])
            self.won[need] = self._choose(need)
            self.done[need] = True
        return self.won[rows]

    def _choose(self, rows: np.ndarray) -> np.ndarray:
        tied, e, cluster = self.tied[:, rows], self.w.shape[1], self.cluster
        if len(self.cands) > 1 and self.tokens is None and cluster.num_slots == e:  # the fewest expected nodes per
            # token from loads (node_model.py), the first of equals
            est = np.stack([expected_nodes(c[rows], self.w[rows], cluster, *self.router) for c in self.cands])
            won = self.cands[np.argmin(np.where(tied, est, np.inf), axis=0), rows]
            return node_swaps(won, self.w[rows], cluster, *self.router, self.swap_cap)
        if len(self.cands) == 1 or self.tokens is None or cluster.num_slots != e:  # the first tied candidate
            return self.cands[np.argmax(tied, axis=0), rows]
        # np.take: C-contiguous copies (x[:, rows] is not, and the token counts below ran 1.4x as long on it)
        cands, tokens = np.take(self.cands, rows, axis=1), np.take(self.tokens, rows, axis=1)
        # ours' and global's GPUs regrouped onto nodes by co-activation, in the layers where they tie on the max
        # load (loads unchanged: regroup.py); global grouped is global's GPUs ordered by another rule, so its regroup
        # would mostly repeat global's (regroup.py: the regroups are most of a fresh plan's time here). Global's only
        # where it can still win: its plain count under REGROUP_REACH x the best other tied candidate's
        glob = cands[2]
        n_layers, newer = len(rows), tokens[len(tokens) // 2:]
        own_nodes = token_nodes(glob, newer, cluster)  # [T / 2, L] global's layer as it is
        ours, ours_nodes = regrouped(cands[0], tokens, cluster, tied[0])
        kept = token_nodes(cands[1], newer, cluster)  # [T / 2, L] regrouped's count of a layer it skips
        rival = np.minimum(np.where(tied[0], ours_nodes.mean(0), np.inf), np.where(tied[1], kept.mean(0), np.inf))
        reach = tied[2] & (own_nodes.mean(0) < REGROUP_REACH * rival)
        glob_ph, glob_nodes = regrouped(glob, tokens, cluster, reach, own_nodes)
        cands = np.stack([ours, cands[1], glob_ph])
        per_token = np.stack([ours_nodes, kept, glob_nodes])  # [3, T / 2, L]
        pick = np.argmin(np.where(tied, per_token.mean(1), np.inf), axis=0)  # [L]
        # DeepSeek global's own layer where it ties on the max load and the pick's fewer nodes per token are within
        # GLOBAL_Z paired standard errors of its own (a pick that wins by noise lost to it on the next window)
        diff = per_token[pick, :, np.arange(n_layers)].T - own_nodes  # [T / 2, L]
        noise = GLOBAL_Z * paired_se(diff)
        own = tied[2] & (diff.mean(0) >= -noise)
        return np.where(own[:, None], glob, cands[pick, np.arange(n_layers)])
