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
tokens, no expert leaving a node it was on. Ties go to fewer nodes per token. Where that descent stops, seeded
random kicks and a descent again (_kicked) go on while they find a better layout. In sample on bench/eplb_milp.py's
instances, against HiGHS' proven optima 20.0 / 48.0 / 48.0 / 36.0: synth-e16 20.5 -> 20.0, synth-e32 48.75 ->
48.25, sample-e32 49.0 -> 48.17, synth-e64 37.0 -> 36.0, with nodes per token 1.15 / 1.68 / 1.40 / 2.58 -> 1.15 /
1.43 / 1.28 / 2.33 (the descent alone: 20.0 / 48.25 / 48.83 / 36.5), measured when the polish was built; the
plans' current figures: BENCHMARKS.md#eplb-placement-milp.
Last, with tokens under the "cover" rule, cover.py searches for fewer nodes per token at the max load reached
(synth-e16 1.15 -> 1.00, sample-e32 1.28 -> 1.135: cover.py has the figures), then exchange.py trades one-replica
experts between nodes where both nodes repack under that max load (synth-e32 1.323 -> 1.3125).
Where: layers of at most POLISH_SLOTS slots, POLISH_SLOTS_PER_GPU of them a GPU, on at most 8 nodes, in fresh plans
only (a re-plan's churn budget stays the leveling's). A step scores every move around the hottest GPU
(polish_moves.py): 33K at 8 GPUs x 12 slots, 2.8M at 8 x 36 ([58, 288] on one node), and there the leveling swaps
already leave the hottest GPU within noise of the next window.

Shape legend: E experts, P slots, G GPUs, S slots per GPU, T tokens, K top-k, N nodes, C candidates.
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import numpy as np

from r3trace.eplb.affinity import COACT_TOKENS
from r3trace.eplb.cover import cover, cover_rounds, lower_cover, node_masks
from r3trace.eplb.exchange import exchanges
from r3trace.eplb.placement import Cluster
from r3trace.eplb.polish_moves import apply, layout_keys, move_keys, neighbours

POLISH_SLOTS = 128  # slots of a layer the polish runs on (the MILP's instances: 20-80; the sample model's: 32-64)
# slots per GPU the polish runs on: a step scores C(S, 2)^2 (G - 1) two-for-two exchanges, 5.5K at 8 GPUs x 8 slots
# and 100K at 8 x 16, where [48, 128] on 8 GPUs (a Qwen3-30B-A3B-sized layout) took 2.3 s a plan for +0.0002
# balancedness in sample and 0.0000 held out (0.007 s without); the MILP's instances and the sample's cells have 3-5
POLISH_SLOTS_PER_GPU = 8
POLISH_NODES = 8  # exact node cover over 2^N subsets
BATCH = 64  # improving candidates scored for nodes per token at a time, best first
KICKS = 64  # perturbation rounds of a plan, shared by its layers (_kicked); bench/eplb_milp.py's sample-e32 layer
# at 0 / 8 / 16 / 32 / 64 rounds: 48.0 / 48.5 / 48.17 / 48.0 / 48.0 over its proven 48.0 (not monotone: the cover
# search after the kicks lowers the max load too, from wherever they left it); synth-e64 36.5 at 0-8 rounds, 36.33
# (proven 36.0) at the 12 KICK_COVERS allows on 4 nodes
KICK_COVERS = 64 * 96 * 3  # token x node-subset covers the rounds of one plan may score, over all its layers:
# 64 rounds of one layer of 96 tokens on 2 nodes, 12 on 4 nodes, none for 1024 tokens on 8 nodes (the dashboard's
# sample-trace EPLB page, 4 GPUs / 2 nodes / 36 slots, takes 1.9 s, where it gets none; 8.0 s with 64 rounds in
# every layer)
PATIENCE = 32  # rounds in a row without a better layout that end them
KICK_SWAPS = 2  # random slot swaps per kick
KICK_MIN_ROUNDS = 4  # a layer's share below this gets none: one round a layer adds 0.4 s to the dashboard's
# sample-trace EPLB page (1.9 -> 2.3 s: 8 plans of 4 layers of 1024 tokens)


def applies(cluster: Cluster) -> bool:
    """True where polish runs (module doc)."""
    return (cluster.num_slots <= POLISH_SLOTS and cluster.slots_per_gpu <= POLISH_SLOTS_PER_GPU
            and cluster.num_nodes <= POLISH_NODES and cluster.num_gpus > 1)


NodeRule = Literal["cover", "keep", "fixed"]


def polish(phy2log: np.ndarray, weight: np.ndarray, cluster: Cluster, tokens: np.ndarray | None,
           max_steps: int, rule: NodeRule = "cover") -> np.ndarray:
    """phy2log [L, P], forecast loads weight [L, E], tokens [T, L, K] or None -> phy2log [L, P] after at most
    max_steps moves per descent (the first, and one after each kick: _kicked). rule: "cover" = the tokens' mean
    cover may not grow (module doc); "keep" = no expert leaves a node (keep_groups' guarantee: no token's cover
    grows); "fixed" = every expert keeps exactly its nodes (one node per expert stays one node)."""
    out = np.asarray(phy2log, dtype=np.int64).copy()
    if not applies(cluster):
        return out
    covers = 0 if tokens is None or rule != "cover" else min(len(tokens), COACT_TOKENS) * ((1 << cluster.num_nodes) - 1)
    rounds = KICKS // out.shape[0] if not covers else min(KICKS, KICK_COVERS // covers) // out.shape[0]
    rounds = rounds if rounds >= KICK_MIN_ROUNDS else 0
    lowered = 0 if tokens is None or not covers else cover_rounds(cluster, out.shape[0], min(len(tokens), COACT_TOKENS))
    spread = max(cluster.num_nodes, cluster.gpus_per_node)  # the planner's replica cap (fresh.spread_cap)
    for layer in range(out.shape[0]):
        tok = None if tokens is None or not len(tokens) else np.asarray(tokens[-COACT_TOKENS:, layer], dtype=np.int64)
        w = np.asarray(weight[layer], dtype=np.float64)
        out[layer] = _kicked(out[layer], w, tok, cluster, max_steps, rule, rounds)
        if lowered and tok is not None and max_steps > 0:  # then fewer nodes per token at that max load (cover.py)
            cap = max(spread, int(np.bincount(out[layer]).max()))
            out[layer] = lower_cover(out[layer], w, tok, cluster, lowered, partial(
                _layer, w=w, tok=tok, cl=cluster, steps=max_steps, rule=rule), cap)
            out[layer] = exchanges(out[layer], w, tok, cluster)  # trades whose nodes only fit repacked
    return out


def _layer(ph: np.ndarray, w: np.ndarray, tok: np.ndarray | None, cl: Cluster, steps: int,
           rule: NodeRule) -> np.ndarray:
    e, n_gpu = len(w), cl.num_gpus
    tol = 1e-9 * max(float(w.sum()) / n_gpu, 1e-12)
    key = layout_keys(ph[None], w, cl, tol)[0]
    mask = node_masks(ph[None], e, cl)[0]
    nodes = cover(mask[None], tok, cl)[0]
    for _ in range(steps):
        mv = neighbours(ph, w, cl)  # C moves
        k = move_keys(ph, w, cl, tol, mv)  # [C, 2]: max GPU load, GPUs within tol of it
        better = (k[:, 0] < key[0] - tol) | ((k[:, 0] <= key[0] + tol) & (k[:, 1] < key[1]))
        idx = np.flatnonzero(better)
        if not len(idx):
            break
        idx = idx[np.lexsort((k[idx, 1], k[idx, 0]))]
        pick = None
        for start in range(0, len(idx), BATCH):
            part = idx[start:start + BATCH]
            cand = apply(ph, mv, part)  # [B, P]
            m = node_masks(cand, e, cl)  # [B, E]
            if rule == "fixed":
                ok = (m == mask).all(1)
                nd = np.full(len(part), nodes)
            elif rule == "keep" or tok is None:  # no expert leaves a node: no token's cover can grow
                ok = ((m & mask) == mask).all(1)
                nd = np.full(len(part), nodes)
            else:  # covers change only where some expert's nodes do: most swaps stay inside a node
                moved = (m != mask).any(1)
                nd = np.full(len(part), nodes)
                nd[moved] = cover(m[moved], tok, cl)
                ok = nd <= nodes + 1e-12
            if ok.any():
                j = np.flatnonzero(ok)
                best = j[np.lexsort((nd[j], k[part[j], 1], k[part[j], 0]))[0]]
                pick = (cand[best], k[part[best]], m[best], nd[best])
                break
        if pick is None:
            break
        ph, key, mask, nodes = pick
    return ph


def _kicked(ph: np.ndarray, w: np.ndarray, tok: np.ndarray | None, cl: Cluster, steps: int, rule: NodeRule,
            rounds: int) -> np.ndarray:
    """The descent (_layer), then up to `rounds` rounds of iterated local search: KICK_SWAPS random slot swaps of
    the best layout so far (each kept only where the node rule holds against the input layout ph), the descent
    again, kept where it lowers (max GPU load, GPUs at it), or ties them with fewer nodes per token. Stops
    at the mean GPU load (nothing lower than the mean exists) or after PATIENCE rounds without a
    better layout; polish() shares KICKS rounds and KICK_COVERS token x node-subset covers among a plan's layers.

    Why: the descent stops where no single move around the hottest GPU helps while a node carries more than its
    share (sample-e32 of bench/eplb_milp.py: 48.5 over a proven optimum of 48.0, which the kicks reach); a few swaps
    elsewhere reopen moves. Seeded, so a plan is reproducible."""
    if steps <= 0:
        return ph
    e = len(w)
    tol = 1e-9 * max(float(w.sum()) / cl.num_gpus, 1e-12)
    mask0 = node_masks(ph[None], e, cl)[0]
    by_cover = rule == "cover" and tok is not None
    n0 = cover(mask0[None], tok, cl)[0]

    def allowed(x: np.ndarray) -> tuple[bool, float]:
        m = node_masks(x[None], e, cl)[0]
        if rule == "fixed":
            return bool((m == mask0).all()), n0
        if not by_cover:
            return bool(((m & mask0) == mask0).all()), n0
        nd = float(cover(m[None], tok, cl)[0])
        return nd <= n0 + 1e-12, nd

    best = _layer(ph, w, tok, cl, steps, rule)
    key, nodes = layout_keys(best[None], w, cl, tol)[0], allowed(best)[1]
    # kicks stop at the mean GPU load, the max's lower bound: stopping 0.5% above it left sample-e32 at 48.17, +0.35%
    # over its proven optimum 48.0 (the mean), which the kicks then reach in 0.8 s
    floor = float(w.sum()) / cl.num_gpus + tol
    rng = np.random.default_rng(0)
    stale = 0
    for _ in range(rounds):
        if key[0] <= floor or stale >= PATIENCE:
            break
        x = best.copy()
        for _ in range(KICK_SWAPS):
            a, b = rng.choice(len(x), 2, replace=False)
            y = x.copy()
            y[a], y[b] = x[b], x[a]
            if allowed(y)[0]:
                x = y
        x = _layer(x, w, tok, cl, steps, rule)
        k, nd = layout_keys(x[None], w, cl, tol)[0], allowed(x)[1]
        lower = k[0] < key[0] - tol or (k[0] <= key[0] + tol and k[1] < key[1])
        if lower or (k[0] <= key[0] + tol and k[1] == key[1] and nd < nodes - 1e-12):
            best, key, nodes, stale = x, k, nd, 0
        else:
            stale += 1
    return best
