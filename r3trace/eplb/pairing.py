"""Pairing: with two slots per GPU, re-pick each GPU's lighter replica over all nodes, heaviest with lightest.

Why: on 18 nodes of 16 slots (144 GPUs, 288 slots) the leveling swaps pair replicas within a node's 16 slots
and across nodes only under their group rules, and the hottest replicas do not find the coldest ones there (group
homes fix which experts a node holds): fresh plans sat 5-7% above the max-load floor for their counts (grouped
router, s = 0.6, bench/eplb_matrix.py's 18-node windows), where DeepSeek's global policy, pairing the heaviest
replica with the lightest over all GPUs, reaches it and scored 0.017-0.046 higher on the next window in 5 of 6.
How: each GPU's heavier replica (its anchor) stays; the lighter ones form a pool. With the anchors b_1 >= b_2 >=
... and the pool sorted s_1 <= s_2 <= ..., anchor i, heaviest first, takes a pool replica s <= min(s_i + tol,
F - b_i), F = max_i (b_i + s_i) + slack the bound on the max. These sets grow down the order and anchor i's holds
s_1 .. s_i, so whatever an anchor takes, every later one still has a replica to take. Among those it takes the
cheapest in nodes per token: one of its node (its own first in a re-plan), else the one whose move to its node
adds the fewest token-nodes on the newest tokens (first order: that expert's tokens with another expert on its old
node minus those with one on the new), or without tokens the coldest; never a second replica of an expert on a
node. tol = 0 is global's pairs, ties broken by nodes per token.
Held out, fresh plans on that cell's windows 2-7: tol 0 came within 0.004 of global in 5 of 6 windows (0.526-0.682;
before 0.509-0.648) at 5.61-5.66 nodes per token (before 5.30-5.37, global 6.57-6.66); tol 0.02 / 0.05 / 0.1 of the
mean GPU load lost 0.002-0.013 / 0.002-0.018 / 0-0.047 to tol 0 for 0.07-0.13 / 0.12-0.16 / 0.16-0.18 fewer nodes
per token, and the bound alone (tol infinite) moved the plans before by -0.026 .. +0.017 (mean -0.003): the next
window's max needs the sorted pairs, not only a lower max on the forecast.
A re-plan may move few slots (the sorted pairs of a new forecast differ from the previous plan's on ~140 of 144
GPUs), so there each layer takes the first of LADDER that fits its budget and lowers its max GPU load.
sorted_pairs goes further where moves are cheap (a drifting re-plan, replan.resorted): it first makes every GPU's
heavier replica one of the G heaviest (reanchored), so pair() at tol 0 reaches the sorted pairs of all 2G replicas.

Shape legend: L layers, E experts, P slots, G GPUs, N nodes, T tokens, K top-k.
"""

from __future__ import annotations

import numpy as np

from r3trace.eplb.affinity import COACT_TOKENS
from r3trace.eplb.placement import Cluster, replica_counts, replicas_per_node
from r3trace.eplb.score import phy2log_gpu_load

MOVE_COST = 1e-3  # per moved replica, in token-nodes per token: among equally cheap choices, no move
# a re-plan's (tol, slack) per layer, most sorted first, as shares of the mean GPU load: the first whose moves fit
# the layer's budget and lower its max GPU load is taken
LADDER = ((0.05, 0.0), (0.1, 0.0), (np.inf, 0.0), (np.inf, 0.01), (np.inf, 0.02), (np.inf, 0.04), (np.inf, 0.08))


def node_hits(phy2log: np.ndarray, tokens: np.ndarray, e: int, cluster: Cluster) -> np.ndarray:
    """phy2log [L, P], tokens [T, L, K] -> [L, E, N] per expert and node, the newest COACT_TOKENS tokens that choose
    it with another expert held on that node, per token."""
    n_layers, n = phy2log.shape[0], cluster.num_nodes
    tok = np.asarray(tokens[-COACT_TOKENS:])  # [T, L, K] as given (int16 from a trace)
    t, _, k = tok.shape
    held = np.zeros((n_layers, e, n), dtype=bool)
    held[np.arange(n_layers)[:, None], phy2log, cluster.slot_node()[None, :]] = True
    bits = (held * (np.int64(1) << np.arange(n))).sum(2).ravel()  # [L E] node bitmask of each (layer, expert)
    off = (np.arange(n_layers) * e)[None, :, None]
    out = np.zeros((n, n_layers * e))
    step = max(1, HITS_BLOCK // (n_layers * k))
    for lo in range(0, t, step):  # token blocks; the counts are integers, so exact in any order
        key = tok[lo:lo + step] + off  # [T', L, K] (layer, expert) of each choice
        m = np.take(bits, key)  # [T', L, K] node bitmask of each choice
        before = np.zeros_like(m)  # OR of the token's other K - 1 experts' nodes: those before, then those after
        for i in range(1, k):
            np.bitwise_or(before[:, :, i - 1], m[:, :, i - 1], out=before[:, :, i])
        after = m[:, :, k - 1].copy()
        for i in range(k - 2, -1, -1):
            before[:, :, i] |= after
            after |= m[:, :, i]
        flat = key.ravel()
        for node in range(n):
            out[node] += np.bincount(flat, weights=((before.ravel() >> node) & 1).astype(np.float64),
                                     minlength=n_layers * e)
    return out.T.reshape(n_layers, e, n) / t


HITS_BLOCK = 1 << 17  # choices node_hits reads at once: [T', L, K] int64 arrays of 1 MB (all 1,024 tokens' at once
# peaked at 21 MB on 18 nodes, fresh pages on every plan)


def pair(phy2log: np.ndarray, weight: np.ndarray, cluster: Cluster, hits: np.ndarray | None, tol: float = 0.0,
         slack: float = 0.0, keep_own: bool = False, budget: np.ndarray | None = None) -> np.ndarray:
    """phy2log [L, P] (2 slots per GPU), forecast weight [L, E], hits [L, E, N] (node_hits of this layout) or None
    (no tokens) -> phy2log [L, P] with every GPU's lighter replica re-picked under tol and slack (module doc); every
    GPU keeps its heavier one. keep_own: an anchor keeps its own lighter replica wherever it may (fewest moves).
    budget [L]: a layer stops once more than that many of its slots changed, its later anchors keeping their own
    (its result changes more than budget slots either way, and layers are independent: a re-plan at [58, 256] on
    18 nodes changed ~140 of 144 GPUs' pairs where budgets allow a few, so most layers stop within ~10 anchors)."""
    out = np.asarray(phy2log, dtype=np.int64)
    n_layers, p = out.shape
    e, g, n, gpn = weight.shape[1], cluster.num_gpus, cluster.num_nodes, cluster.gpus_per_node
    cnt = replica_counts(out, e)
    u = np.take_along_axis(weight / cnt, out, 1).reshape(n_layers, g, 2)
    two = out.reshape(n_layers, g, 2)
    heavy = u.argmax(2)  # [L, G]
    rows, gid, lr = np.arange(n_layers)[:, None], np.arange(g)[None, :], np.arange(n_layers)
    b, s = u[rows, gid, heavy], u[rows, gid, 1 - heavy]  # [L, G] anchor and pool loads
    bx, sx = two[rows, gid, heavy], two[rows, gid, 1 - heavy]  # their experts
    sx0 = sx
    order = np.argsort(-b, 1, kind="stable")  # [L, G] anchors heaviest first
    ranked = np.sort(s, 1)
    mean = weight.sum(1) / g  # [L]
    bound = (np.take_along_axis(b, order, 1) + ranked).max(1) + slack * mean  # [L] F
    node_of = np.arange(g) // gpn  # [G]
    at = (rows * e + sx) * n  # [L, G] each pool replica's expert's row in the raveled [L, E, N] arrays
    if hits is None:  # a cross-node move costs its expert's share of the load
        cross = np.take_along_axis(weight / np.maximum(weight.sum(1, keepdims=True), 1e-12), sx, 1)  # [L, G]
    else:
        hits_flat = hits.reshape(-1)
        src = np.take(hits_flat, at + node_of[None, :])  # [L, G] its expert's tokens with others on its node
    held = np.zeros(n_layers * e * n, dtype=np.int64)  # replicas of each expert per node [L E N], as the pool moves
    np.add.at(held, ((rows * e + out) * n + np.repeat(node_of, 2)[None, :]).ravel(), 1)
    taken = np.zeros((n_layers, g), dtype=bool)
    pick = np.tile(np.arange(g), (n_layers, 1))  # [L, G] the pool entry each GPU takes (its own until it picks)
    live = np.arange(n_layers)  # the layers still stepping, their rows in pick (lr: their rows in the shrunk arrays)
    changed = np.zeros(n_layers, dtype=np.int64)  # slots changed so far
    for i in range(g):
        a = order[:, i]  # [L] this step's anchor's GPU
        k = node_of[a]  # [L]
        lim = np.minimum(bound - b[lr, a], ranked[:, i] + tol * mean)
        here = node_of[None, :] == k[:, None]  # [L, G] already on the anchor's node
        # no second replica of an expert on a node, nor on a GPU
        to_k = at + k[:, None]  # [L, G] into [L E N]: each pool replica's expert on the anchor's node
        rule = (here | (np.take(held, to_k) == 0)) & (sx != bx[lr, a][:, None])
        ok = ~taken & rule & (s <= lim[:, None] + 1e-12)  # [L, G] pool replicas it may take
        if hits is not None:
            cross = src - np.take(hits_flat, to_k)
        cost = np.where(here, 0.0, cross) + MOVE_COST
        cost[lr, a] = -1.0 if keep_own else 0.0
        # where the rule empties the set (the bound alone never does: module doc), the lightest replica left that
        # keeps the rule, else the lightest left
        cost = np.where(ok, cost, np.where(taken, np.inf, np.where(rule, 1e9, 2e9) + s))
        j = np.argmin(cost, 1)
        taken[lr, j] = True
        pick[live, a] = j
        moved = node_of[j] != k
        if moved.any():
            row = at[moved, j[moved]]
            held[row + node_of[j[moved]]] -= 1
            held[row + k[moved]] += 1
        if budget is None:
            continue
        changed += sx[lr, j] != sx[lr, a]
        over = changed > budget
        if over.any():  # those layers stop; the rest step on as rows of smaller arrays
            keep = ~over
            live, order, b, s, sx, bx, bound, ranked, mean, at, taken, changed, budget = (
                x[keep] for x in (live, order, b, s, sx, bx, bound, ranked, mean, at, taken, changed, budget))
            if hits is None:
                cross = cross[keep]
            else:
                src = src[keep]
            lr = np.arange(len(live))
            if not len(live):
                break
    res = two.copy()
    res[rows, gid, 1 - heavy] = np.take_along_axis(sx0, pick, 1)
    return res.reshape(n_layers, p)


def peak_load(phy2log: np.ndarray, weight: np.ndarray, cluster: Cluster) -> np.ndarray:
    """phy2log [L, P], weight [L, E] -> [L] the max GPU load under the even split."""
    return phy2log_gpu_load(phy2log, weight, cluster).max(1)


def paired(phy2log: np.ndarray, weight: np.ndarray, cluster: Cluster, tokens: np.ndarray | None,
           budget: np.ndarray | None = None) -> np.ndarray:
    """phy2log [L, P], forecast weight [L, E], tokens [T, L, K] or None -> phy2log [L, P]: with two slots per GPU,
    per layer pair()'s layout where it lowers the max GPU load on weight, else the input. budget None (fresh
    plans): tol 0; budget [L] (re-plans: slots each layer may change): the first (tol, slack) of LADDER whose
    layout changes at most that many slots and lowers the max. Other shapes: the input."""
    out = np.asarray(phy2log, dtype=np.int64).copy()
    if cluster.slots_per_gpu != 2 or not len(out):
        return out
    best = peak_load(out, weight, cluster)
    # no re-picking brings a layer under its anchors' bound F (module doc), and none changes no slot: such layers
    # are skipped (a re-plan at [58, 256] on 16 nodes: most layers)
    n_layers, g = out.shape[0], cluster.num_gpus
    cnt = np.bincount((out + (np.arange(n_layers) * weight.shape[1])[:, None]).ravel(), minlength=weight.size)
    u = np.take_along_axis(weight / cnt.reshape(weight.shape), out, 1).reshape(n_layers, g, 2)
    floor = (-np.sort(-u.max(2), 1) + np.sort(u.min(2), 1)).max(1)  # [L] F with slack 0
    todo = best > floor * (1 + 1e-9)
    if budget is not None:
        todo &= budget > 0
    hits = None  # [L, E, N] node_hits of the layers to do; None without tokens
    # node_hits packs a token's nodes into one int64 bitmask: past 64 nodes the moves go by coldness (no tokens)
    if tokens is not None and len(tokens) and todo.any() and cluster.num_nodes <= 64:
        hits = np.zeros((n_layers, weight.shape[1], cluster.num_nodes))
        hits[todo] = node_hits(out[todo], tokens[:, todo], weight.shape[1], cluster)
    for tol, slack in ((0.0, 0.0),) if budget is None else LADDER:
        rows = np.flatnonzero(todo)
        if not len(rows):
            break
        cand = pair(out[rows], weight[rows], cluster, None if hits is None else hits[rows], tol, slack,
                    keep_own=budget is not None, budget=None if budget is None else budget[rows])
        fits = np.ones(len(rows), dtype=bool) if budget is None else (cand != out[rows]).sum(1) <= budget[rows]
        take = fits.copy()  # a layer that stopped over its budget may miss an expert: no peak_load of it
        if fits.any():
            take[fits] = peak_load(cand[fits], weight[rows[fits]], cluster) < best[rows[fits]] * (1 - 1e-9)
        out[rows[take]] = cand[take]
        todo[rows[take]] = False
    return out


def reanchored(phy2log: np.ndarray, weight: np.ndarray, cluster: Cluster) -> np.ndarray:
    """phy2log [L, P] (2 slots per GPU), weight [L, E] -> phy2log [L, P] whose GPUs' heavier replicas are the G
    heaviest: a GPU holding two of them gives its lighter one to a GPU holding none, in exchange for one of that
    GPU's, on its own node where one has none, else the first node that holds no other replica of either expert.
    pair() keeps every GPU's heavier replica, so only from here can it reach the sorted pairs of all 2G replicas."""
    out = np.asarray(phy2log, dtype=np.int64).copy()
    g, gpn, e = cluster.num_gpus, cluster.gpus_per_node, weight.shape[1]
    node_of = np.arange(g) // gpn
    per_node = replicas_per_node(out, e, cluster)  # [L, E, N], each layer's row kept up to date by its swaps
    for layer in range(len(out)):
        two = out[layer].reshape(g, 2)  # a view: swaps write out
        cnt = np.bincount(two.ravel(), minlength=e)
        held = per_node[layer]
        u = (weight[layer] / np.maximum(cnt, 1))[two]  # [G, 2]
        flag = np.zeros(2 * g, dtype=bool)
        flag[np.argsort(-u.ravel(), kind="stable")[:g]] = True
        top = flag.reshape(g, 2)  # [G, 2] the G heaviest replicas
        both, none = np.flatnonzero(top.all(1)), list(np.flatnonzero(~top.any(1)))  # as many of each
        lighter = np.argsort(u, axis=1, kind="stable").tolist()  # [G, 2] each GPU's lighter replica first
        for a in both[np.argsort(u[both].min(1), kind="stable")]:
            ia = int(u[a].argmin())
            x, na = two[a, ia], node_of[a]
            own = [c for c in none if node_of[c] == na]  # own node first, then the rest in order
            for b, ib in ((c, i) for c in own + [c for c in none if node_of[c] != na] for i in lighter[c]):
                y, nb = two[b, ib], node_of[b]
                if nb != na and (held[y, na] or held[x, nb]):
                    continue  # never a second replica of an expert on a node (pair()'s rule)
                if y == two[a, 1 - ia] or x == two[b, 1 - ib]:
                    continue
                two[a, ia], two[b, ib] = y, x
                held[x, na] -= 1
                held[y, na] += 1
                held[y, nb] -= 1
                held[x, nb] += 1
                none.remove(b)
                break
    return out


def sorted_pairs(phy2log: np.ndarray, weight: np.ndarray, cluster: Cluster, tokens: np.ndarray | None) -> np.ndarray:
    """phy2log [L, P], forecast weight [L, E], tokens [T, L, K] or None -> phy2log [L, P]: with two slots per GPU,
    per layer the sorted pairs of all its replicas (reanchored, then pair() at tol 0: the i-th heaviest with the
    i-th lightest, ties by nodes per token) where they do not raise the max GPU load on weight, else the input.
    Other shapes: the input."""
    out = np.asarray(phy2log, dtype=np.int64).copy()
    if cluster.slots_per_gpu != 2 or not len(out):
        return out
    ph = reanchored(out, weight, cluster)
    hits = None
    if tokens is not None and len(tokens) and cluster.num_nodes <= 64:
        hits = node_hits(ph, tokens, weight.shape[1], cluster)
    cand = pair(ph, weight, cluster, hits)
    keep = peak_load(cand, weight, cluster) <= peak_load(out, weight, cluster) * (1 + 1e-9)
    out[keep] = cand[keep]
    return out
