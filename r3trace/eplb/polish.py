"""Polish: a last local search on small layers, on the max GPU load itself, that never costs nodes per token.

The layouts before it fix replica counts first (each extra slot to the expert with the highest load per replica)
and then swap single slots, lowering the sum of squared GPU loads; on the small shapes of bench/eplb_milp.py that
left the hottest GPU 1.6-2.8% above the exact optimum, which picks counts and slots together. Each step here
tries every move of three kinds around the hottest GPU h:
  swap      a slot of h with a slot of another GPU;
  recount   a slot of an expert with >= 2 replicas becomes one more replica of an expert of h;
  exchange  two slots of h with two slots of one other GPU (single swaps get stuck where loads are coarse:
            on synth-e16 h sits at 20.5 over a 20.0 optimum that only a 2-for-2 exchange reaches),
and takes the one with the lowest (max GPU load, GPUs at that load) among those that lower that pair and do not
raise nodes per token: the mean fewest covering nodes of the layer's newest COACT_TOKENS tokens (exact cover,
<= 8 nodes; scored only for candidates that move an expert off or onto a node: 78K tokens of the sample model
made a plan take 100 s), or without
tokens, no expert leaving a node it was on. Ties go to fewer nodes per token. In sample on bench/eplb_milp.py's
instances: synth-e16 20.5 -> 20.0 (the proven optimum), synth-e32 48.75 -> 48.25 (optimum 48.0), sample-e32
49.0 -> 48.83 (best known 48.5), synth-e64 37.0 -> 36.5 (bound 36.0), with nodes per token 1.15 / 1.68 / 1.40
/ 2.58 -> 1.15 / 1.50 / 1.29 / 2.43.
Where: layers of at most POLISH_SLOTS slots on at most 8 nodes, in fresh plans only (a re-plan's churn budget
stays the leveling's). A step scores a few thousand candidate layouts; at [58, 288] that would be 30-60x the
plan-time budget, and there the leveling swaps already leave the hottest GPU within noise of the next window.

Shape legend: E experts, P slots, G GPUs, S slots per GPU, T tokens, K top-k, N nodes, C candidates.
"""

from __future__ import annotations

from itertools import combinations
from typing import Literal

import numpy as np

from r3trace.eplb.affinity import COACT_TOKENS
from r3trace.eplb.placement import Cluster

POLISH_SLOTS = 128  # slots of a layer the polish runs on (the MILP's instances: 20-80; the sample model's: 32-64)
POLISH_NODES = 8  # exact node cover over 2^N subsets
BATCH = 64  # improving candidates scored for nodes per token at a time, best first


def applies(cluster: Cluster) -> bool:
    """True where polish runs (module doc)."""
    return cluster.num_slots <= POLISH_SLOTS and cluster.num_nodes <= POLISH_NODES and cluster.num_gpus > 1


NodeRule = Literal["cover", "keep", "fixed"]


def polish(phy2log: np.ndarray, weight: np.ndarray, cluster: Cluster, tokens: np.ndarray | None,
           max_steps: int, rule: NodeRule = "cover") -> np.ndarray:
    """phy2log [L, P], forecast loads weight [L, E], tokens [T, L, K] or None -> phy2log [L, P] after at most
    max_steps moves per layer. rule: "cover" = the tokens' mean cover may not grow (module doc); "keep" = no
    expert leaves a node (keep_groups' guarantee: no token's cover grows); "fixed" = every expert keeps exactly
    its nodes (one node per expert stays one node)."""
    out = np.asarray(phy2log, dtype=np.int64).copy()
    if not applies(cluster):
        return out
    for layer in range(out.shape[0]):
        tok = None if tokens is None or not len(tokens) else np.asarray(tokens[-COACT_TOKENS:, layer], dtype=np.int64)
        out[layer] = _layer(out[layer], np.asarray(weight[layer], dtype=np.float64), tok, cluster, max_steps, rule)
    return out


def _layer(ph: np.ndarray, w: np.ndarray, tok: np.ndarray | None, cl: Cluster, steps: int,
           rule: NodeRule) -> np.ndarray:
    e, n_gpu = len(w), cl.num_gpus
    tol = 1e-9 * max(float(w.sum()) / n_gpu, 1e-12)
    key = _keys(ph[None], w, cl, tol)[0]
    mask = _node_masks(ph[None], e, cl)[0]
    nodes = _nodes(mask[None], tok, cl)[0]
    for _ in range(steps):
        cand = _neighbours(ph, w, cl)  # [C, P]
        k = _keys(cand, w, cl, tol)  # [C, 2]: max GPU load, GPUs within tol of it
        better = (k[:, 0] < key[0] - tol) | ((k[:, 0] <= key[0] + tol) & (k[:, 1] < key[1]))
        idx = np.flatnonzero(better)
        if not len(idx):
            break
        idx = idx[np.lexsort((k[idx, 1], k[idx, 0]))]
        pick = None
        for start in range(0, len(idx), BATCH):
            part = idx[start:start + BATCH]
            m = _node_masks(cand[part], e, cl)  # [B, E]
            if rule == "fixed":
                ok = (m == mask).all(1)
                nd = np.full(len(part), nodes)
            elif rule == "keep" or tok is None:  # no expert leaves a node: no token's cover can grow
                ok = ((m & mask) == mask).all(1)
                nd = np.full(len(part), nodes)
            else:  # covers change only where some expert's nodes do: most swaps stay inside a node
                moved = (m != mask).any(1)
                nd = np.full(len(part), nodes)
                nd[moved] = _nodes(m[moved], tok, cl)
                ok = nd <= nodes + 1e-12
            if ok.any():
                j = np.flatnonzero(ok)
                best = j[np.lexsort((nd[j], k[part[j], 1], k[part[j], 0]))[0]]
                pick = (part[best], m[best], nd[best])
                break
        if pick is None:
            break
        c, mask, nodes = pick
        ph, key = cand[c], k[c]
    return ph


def _neighbours(ph: np.ndarray, w: np.ndarray, cl: Cluster) -> np.ndarray:
    """[C, P] every swap, recount and 2-for-2 exchange around the hottest GPU (module doc)."""
    spg, p = cl.slots_per_gpu, len(ph)
    cnt = np.bincount(ph, minlength=len(w))
    gpu = (w[ph] / cnt[ph]).reshape(-1, spg).sum(1)
    h = int(gpu.argmax())
    mine = np.arange(h * spg, (h + 1) * spg)
    other = np.setdiff1d(np.arange(p), mine)
    a, b = np.repeat(mine, len(other)), np.tile(other, len(mine))
    a, b = a[ph[a] != ph[b]], b[ph[a] != ph[b]]
    swaps = np.tile(ph, (len(a), 1))
    swaps[np.arange(len(a)), a], swaps[np.arange(len(a)), b] = ph[b], ph[a]
    s_all = np.arange(p)
    a, s = np.repeat(mine, p), np.tile(s_all, len(mine))
    keep = (cnt[ph[s]] > 1) & (ph[s] != ph[a])
    a, s = a[keep], s[keep]
    recounts = np.tile(ph, (len(a), 1))
    recounts[np.arange(len(a)), s] = ph[a]
    pairs = np.array(list(combinations(range(spg), 2)), dtype=np.int64).reshape(-1, 2)  # [S(S-1)/2, 2]
    rows = []
    for g in range(cl.num_gpus):
        if g == h or not len(pairs):
            continue
        a2 = h * spg + pairs  # [Q, 2]
        b2 = g * spg + pairs
        i, j = np.repeat(np.arange(len(pairs)), len(pairs)), np.tile(np.arange(len(pairs)), len(pairs))
        q = np.tile(ph, (len(i), 1))
        r = np.arange(len(i))
        q[r, a2[i, 0]], q[r, a2[i, 1]] = ph[b2[j, 0]], ph[b2[j, 1]]
        q[r, b2[j, 0]], q[r, b2[j, 1]] = ph[a2[i, 0]], ph[a2[i, 1]]
        rows.append(q)
    return np.concatenate([swaps, recounts, *rows]) if rows else np.concatenate([swaps, recounts])


def _keys(cand: np.ndarray, w: np.ndarray, cl: Cluster, tol: float) -> np.ndarray:
    """[C, P] -> [C, 2] (max GPU load under the even split, GPUs within tol of it)."""
    c, e = len(cand), len(w)
    cnt = np.bincount((cand + e * np.arange(c)[:, None]).ravel(), minlength=c * e).reshape(c, e)
    u = w[cand] / np.maximum(np.take_along_axis(cnt, cand, 1), 1)
    gpu = u.reshape(c, cl.num_gpus, cl.slots_per_gpu).sum(-1)
    mx = gpu.max(1)
    return np.stack([mx, (gpu > (mx - tol)[:, None]).sum(1)], 1)


def _node_masks(cand: np.ndarray, e: int, cl: Cluster) -> np.ndarray:
    """[C, P] -> [C, E] bitmask of the nodes holding each expert (node k = bit k)."""
    c = len(cand)
    bits = (np.int64(1) << cl.slot_node()).astype(np.int64)
    out = np.zeros((c, e), dtype=np.int64)
    np.bitwise_or.at(out, (np.repeat(np.arange(c), cand.shape[1]), cand.ravel()), np.tile(bits, c))
    return out


def _nodes(masks: np.ndarray, tok: np.ndarray | None, cl: Cluster) -> np.ndarray:
    """[B, E] node masks, tokens [T, K] -> [B] mean over tokens of the fewest nodes holding all K experts."""
    if tok is None or cl.num_nodes == 1:
        return np.ones(len(masks))
    subsets = np.arange(1, 1 << cl.num_nodes, dtype=np.int64)
    size = np.array([bin(int(s)).count("1") for s in subsets])
    tm = masks[:, tok]  # [B, T, K]
    covers = ((tm[..., None] & subsets) != 0).all(2)  # [B, T, 2^N - 1]
    return np.where(covers, size, cl.num_nodes + 1).min(2).mean(1)
