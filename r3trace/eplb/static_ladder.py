"""Static ladder: per layer, how many of its mixed experts to make static-even, within a nodes-per-token budget.

static_spread.py fixes every mixed expert (a node holding 2 .. c - 1 of its c replicas), so that SGLang's static
dispatch splits each expert's load evenly; gathering an expert's replicas on one node or spreading them one a node
changes which nodes hold it, and on 2-4 nodes that cost up to +0.27 nodes per token over DeepSeek global's layout.
The plan before it (ours' default) sits under global's nodes per token but, mixed, loses up to 0.054 of static
balancedness. Between them: fix only the experts of load >= tau x the mean GPU load (the hottest ones set the max
GPU load; the lightest ones' moves buy little balance for the nodes they cost). Each layer gets the ladder TAUS of
such layouts plus the default plan's, each scored on the forecast (static_expected_load's max GPU load) and on the
newest tokens (nodes per token, the node-limited cover as score.node_limited counts it); then the layers' choices
maximise the mean static balancedness while the mean nodes per token stays within the budget: DeepSeek global's
layout of the same loads on the same tokens, less NODE_MARGIN (the goal of issue 25: balance at least global's at
no more nodes per token). Greedy over the layers' upper hull, best balancedness gained per node per token first.

When: plan()'s last step on 2-8 nodes under `--dispatch static` (PlannerConfig.static_even) where the plan has the
newest tokens; on two nodes without them, nodes per token expected under the router model (model_static_ladder); on
more nodes without tokens, or beyond 8 nodes, where the exact cover would enumerate 2^N node subsets, every mixed
expert is fixed (static_even; on 16-18 nodes that plan has fewer nodes per token than global in every one of
bench/eplb_matrix.py's cells, and static balancedness at most 0.009 under it).
Under node-limited dispatch (the default plan) on two nodes with spare slots the same ladder is climbed with each layout
scored by node-limited replay of the newest tokens (token_ladder, in the layers whose replay is skewed), or without
tokens by the router model's expected node-limited loads and nodes per token (replay_ladder,
node_model.two_node_dispatch).
Shape legend: V layouts a layer, L layers, P slots, E experts, T tokens, K top-k, G GPUs.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from r3trace.eplb import portable
from r3trace.eplb.cover import cover_sizes, node_masks
from r3trace.eplb.deepseek import global_phy2log
from r3trace.eplb.node_cover import EXACT_COVER_NODES
from r3trace.eplb.node_model import two_node_dispatch
from r3trace.eplb.placement import Cluster, within_churn
from r3trace.eplb.replay_max import node_limited_replay
from r3trace.eplb.score import heat_of, phy2log_gpu_load
from r3trace.eplb.static import SGLangDispatch, static_expected_load
from r3trace.eplb.static_spread import static_even, static_even_ladder

TAUS = (4.0, 2.0, 1.0, 0.5, 0.25, 0.0)  # expert load over the mean GPU load from which mixed experts are fixed
NODE_MARGIN = 0.01  # of global's nodes per token the choice leaves unspent, for the held-out window's noise
CHOICE_TOKENS = 2048  # newest tokens nodes per token is counted on
SKEW = 0.01  # token_ladder: replayed max GPU load over the even split's above which a layer climbs


def static_ladder(phy2log: np.ndarray, weight: np.ndarray, cluster: Cluster, tokens: np.ndarray,
                  mean_loads: np.ndarray, dispatch: SGLangDispatch = "static") -> np.ndarray:
    """phy2log [L, P] (the default plan), weight [L, E] (the forecast), tokens [T, L, K] (the newest window),
    mean_loads [L, E] (what DeepSeek global plans on: the windows' summed loads), dispatch: the SGLang dispatch whose
    expected loads score the layouts -> phy2log [L, P] (module doc)."""
    if not applies(cluster):
        return static_even(phy2log, weight, cluster)
    tok = np.asarray(tokens[-CHOICE_TOKENS:])  # as given (int16 from a trace): cover_sizes indexes by it
    e = weight.shape[1]

    def score(rows: np.ndarray, li: np.ndarray, glob: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        load = static_expected_load(rows, weight[li], cluster, dispatch=dispatch)  # [M, G]
        # global's layout counted in the same call: [M + L] rows
        counted = _nodes(np.concatenate([rows, glob]), tok, cluster, e, np.concatenate([li, np.arange(len(glob))]))
        return load.mean(1) / np.maximum(load.max(1), 1e-12), counted[:len(li)], counted[len(li):]

    return _climb(phy2log, _ladder(phy2log, weight, cluster), global_phy2log(mean_loads, cluster), score)[0]


def model_static_ladder(phy2log: np.ndarray, weight: np.ndarray, cluster: Cluster, mean_loads: np.ndarray,
                        router: tuple[int, int], dispatch: SGLangDispatch = "static", prev: np.ndarray | None = None,
                        churn: float = 1.0) -> np.ndarray:
    """Two nodes without tokens, SGLang's dispatch: static_ladder's climb, each layout's nodes per token (and global's,
    the budget) expected under the router model (node_model.two_node_dispatch, router = (top_k, topk_group)) in
    place of counted on tokens -> phy2log [L, P]; prev and churn as replay_ladder's (a still re-plan's rungs change
    between re-plans where fixing every mixed expert did not: unbudgeted, an unchanged workload's first re-plan moved
    10.4% of slots, tests/analysis/test_eplb_static_spread.py). Fixing every mixed expert instead (static_even, what
    plans without tokens on more nodes get) put bench/eplb_matrix.py's SGLang-dump two-node cells 0.017-0.018 nodes
    per token over global's."""

    def score(rows: np.ndarray, li: np.ndarray, glob: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        load = static_expected_load(rows, weight[li], cluster, dispatch=dispatch)  # [M, G]
        _, nodes, theirs = _modelled(rows, li, glob, weight, cluster, router)
        return load.mean(1) / np.maximum(load.max(1), 1e-12), nodes, theirs

    out, gain = _climb(phy2log, _ladder(phy2log, weight, cluster), global_phy2log(mean_loads, cluster), score)
    return _within(phy2log, out, gain, prev, churn)


def replay_ladder(phy2log: np.ndarray, weight: np.ndarray, cluster: Cluster, mean_loads: np.ndarray,
                  router: tuple[int, int], prev: np.ndarray | None = None, churn: float = 1.0) -> np.ndarray:
    """Two nodes, no tokens, node-limited dispatch: the same ladder, each layout scored by node_model.two_node_dispatch
    (its expected node-limited balancedness and nodes per token under the router model, router = (top_k, topk_group))
    and global's layout's expected nodes per token the budget -> phy2log [L, P]. prev [L, P]: a re-plan's previous
    placement; the laddered layers are then taken biggest expected gain first while the slots moved from prev stay
    within `churn` of all slots (an unchanged workload's re-plans keep their budget).

    Why: without tokens nothing replays (dispatch_contest.py), and ours' group homes let tokens fit one node, whose
    few replicas of a hot expert then take all of them; an expert whose replicas are all on one node, or one a node,
    cannot be skewed so. bench/eplb_matrix.py's SGLang-dump cells of 16 GPUs / 2 nodes / 288 slots (trace seed 0, on
    still re-plans and fresh plans): s = 1.2, slow drift, node-limited replay 0.801 -> 0.900 (global 0.890) at the
    even split 0.927 -> 0.924 and 1.81 -> 1.96 nodes per token (global 1.98). The same ladder scored by SGLang's static
    dispatch reached 0.882 and cost the fast-drift cells 0.002-0.003 of the even split."""

    def score(rows: np.ndarray, li: np.ndarray, glob: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        load, nodes, theirs = _modelled(rows, li, glob, weight, cluster, router)
        return load.mean(1) / np.maximum(load.max(1), 1e-12), nodes, theirs

    out, gain = _climb(phy2log, _ladder(phy2log, weight, cluster), global_phy2log(mean_loads, cluster), score)
    return _within(phy2log, out, gain, prev, churn)


def _modelled(rows: np.ndarray, li: np.ndarray, glob: np.ndarray, weight: np.ndarray, cluster: Cluster,
              router: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Layouts rows [M, P] of layers li [M], global's layout [L, P] -> node_model.two_node_dispatch's expected
    node-limited GPU loads [M, G] and nodes per token [M] of the rows, and global's nodes per token [L], in one call."""
    load, nodes = two_node_dispatch(np.concatenate([rows, glob]), np.concatenate([weight[li], weight]), cluster,
                                    *router)
    m = len(li)
    return load[:m], nodes[:m], nodes[m:]


def _within(phy2log: np.ndarray, out: np.ndarray, gain: np.ndarray, prev: np.ndarray | None, churn: float
            ) -> np.ndarray:
    """The default plan [L, P], its laddered layout [L, P] and each layer's gain [L] (_climb's) -> out, or with prev
    [L, P] (a re-plan's previous placement) the laddered layers biggest gain first while the slots moved from prev
    stay within `churn` of all slots."""
    if prev is None:
        return out
    rows = np.flatnonzero((out != phy2log).any(1))  # the laddered layers
    budget = int(churn * phy2log.size) - int((phy2log != prev).sum())
    return within_churn(phy2log, out, prev, rows[np.argsort(-gain[rows], kind="stable")], budget)


def token_ladder(phy2log: np.ndarray, weight: np.ndarray, cluster: Cluster, tokens: np.ndarray,
                 mean_loads: np.ndarray, prev: np.ndarray | None = None, churn: float = 1.0) -> np.ndarray:
    """Two nodes with tokens, node-limited dispatch: the same ladder on the layers whose node-limited replay of the
    newest CHOICE_TOKENS tokens puts their max GPU load more than SKEW over the even split's on the same tokens, each
    layout scored by that replay (node_limited_replay: balancedness and nodes per token from the same covers),
    within global's replayed nodes per token over all layers less NODE_MARGIN -> phy2log [L, P]; prev and churn as
    replay_ladder's.

    Why: the replay contest (dispatch_contest.py) takes global's whole layout or keeps ours', and a still re-plan only
    guards its layers against the previous ones, so ours' co-location can keep a node's few replicas of a hot expert
    under the tokens that fit that node. Why only skewed layers: over 30 fresh and still two-node plans
    (bench/eplb_traces.py's families, 16 / 2 / 288, 180 layer plans) the ladder changed 55 of the 137 layers under
    SKEW by 0.6% of replayed balancedness on average, in-sample noise, and 26 of the 43 above by 2-6%; laddering every
    layer took a fresh plan at [58, 256] from 0.03 to 0.08 s, over the plan-time goal."""
    tok = np.asarray(tokens[-CHOICE_TOKENS:])
    e = weight.shape[1]
    glob = global_phy2log(mean_loads, cluster)
    (top, _), (mine, theirs) = node_limited_replay([phy2log, glob], e, tok, cluster)  # [L] each
    even = phy2log_gpu_load(phy2log, heat_of(tok, e), cluster).max(1)  # [L]
    skewed = top > even * (1 + SKEW)
    if not skewed.any():
        return phy2log
    rows = np.flatnonzero(skewed)
    sub, tok = phy2log[rows], tok[:, rows]
    mean = tok.shape[0] * tok.shape[2] / cluster.num_gpus  # every layer's mean GPU load: T K units over G
    # the budget is the whole plan's, as the other ladders': global's nodes per token over every layer less the
    # margin, less what the layers left as they are spend
    budget = float(theirs.sum()) * (1 - NODE_MARGIN) - float(mine[~skewed].sum())

    def score(layouts: np.ndarray, li: np.ndarray, _: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # layouts of one layer go to distinct whole layouts (the k-th of a layer to layout k), each filled out with
        # the default plan's other layers, replayed in one call
        rank = np.zeros(len(li), dtype=np.int64)
        for layer in np.unique(li):
            at = np.flatnonzero(li == layer)
            rank[at] = np.arange(len(at))
        whole = np.repeat(sub[None], int(rank.max()) + 1, axis=0)  # [V', R, P]
        whole[rank, li] = layouts
        peak, nodes = node_limited_replay(list(whole), e, tok, cluster)  # [V', R]
        return mean / np.maximum(peak[rank, li], 1e-12), nodes[rank, li], theirs[rows]

    got, gain = _climb(sub, _ladder(sub, weight[rows], cluster), glob[rows], score, budget)
    out, full = phy2log.copy(), np.ones(len(phy2log))
    out[rows], full[rows] = got, gain
    return _within(phy2log, out, full, prev, churn)


Score = Callable[[np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


def _climb(phy2log: np.ndarray, ladder: np.ndarray, glob: np.ndarray, score: Score,
           budget: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The default plan [L, P], its ladder [V, L, P], global's layout [L, P], score(rows [M, P], their layers [M],
    glob) -> (balancedness [M], nodes per token [M], global's nodes per token [L]) -> (each layer's rung [L, P]: the
    most balancedness within global's nodes per token less NODE_MARGIN (choose), its balancedness over the default
    plan's [L]). budget: the summed nodes per token the layers may spend, where not global's less NODE_MARGIN."""
    # a layer's layout is often the same for several taus: score each distinct one once (pairs v, l whose layout
    # differs from v - 1's), then copy the scores down the ladder
    fresh = np.ones(ladder.shape[:2], dtype=bool)  # [V, L]
    fresh[1:] = (ladder[1:] != ladder[:-1]).any(2)
    if not fresh[1:].any():  # no mixed expert anywhere: the default plan is every layer's only rung
        return phy2log, np.ones(len(phy2log))
    vi, li = np.nonzero(fresh)
    bal, nodes = np.zeros(fresh.shape), np.zeros(fresh.shape)  # [V, L]
    bal[vi, li], nodes[vi, li], theirs = score(ladder[vi, li], li, glob)  # the distinct layouts, each as a layer
    src = np.maximum.accumulate(np.where(fresh, np.arange(len(ladder))[:, None], 0), axis=0)  # [V, L]
    bal, nodes = np.take_along_axis(bal, src, 0), np.take_along_axis(nodes, src, 0)
    pick = choose(bal, nodes, float(theirs.sum()) * (1 - NODE_MARGIN) if budget is None else budget)  # [L]
    layers = np.arange(ladder.shape[1])
    return ladder[pick, layers], bal[pick, layers] / np.maximum(bal[0], 1e-12)


def _ladder(phy2log: np.ndarray, weight: np.ndarray, cluster: Cluster) -> np.ndarray:
    """-> [V, L, P]: the default plan, then static_even at each of TAUS."""
    return np.concatenate([phy2log[None], static_even_ladder(phy2log, weight, cluster, TAUS)])


def applies(cluster: Cluster) -> bool:
    """Several nodes, at most EXACT_COVER_NODES of them (cover_sizes enumerates node subsets)."""
    return 1 < cluster.num_nodes <= EXACT_COVER_NODES


def _nodes(phy2log: np.ndarray, tok: np.ndarray, cluster: Cluster, e: int, layer: np.ndarray | None = None
           ) -> np.ndarray:
    """phy2log [M, P], tok [T, L, K], layer [M] each row's layer (None: row l is layer l) -> [M] mean nodes per
    token of the node-limited cover (score.node_limited's)."""
    return cover_sizes(node_masks(phy2log, e, cluster), tok, cluster.num_nodes, layer).mean(1)


def choose(bal: np.ndarray, nodes: np.ndarray, budget: float) -> np.ndarray:
    """bal, nodes [V, L] per layout and layer (layout 0 the default) -> [L] the layout each layer takes: the most
    summed balancedness with summed nodes <= budget, greedy along each layer's upper hull, then single-layer
    changes that still fit (module doc); where the layers' fewest nodes already exceed the budget, each layer's
    fewest-nodes layout."""
    n_layers = bal.shape[1]
    bl, nl = bal.T.tolist(), nodes.T.tolist()  # [L][V] Python floats: the walk's scalar steps 4x faster, same values
    hulls = [_hull(bl[i], nl[i]) for i in range(n_layers)]
    at = [0] * n_layers  # position along each hull
    spent = portable.left_sum(nl[i][h[0]] for i, h in enumerate(hulls))  # as sum() before CPython 3.12
    while True:
        best, step = 0.0, -1
        for i, h in enumerate(hulls):
            if at[i] + 1 >= len(h):
                continue
            a, b = h[at[i]], h[at[i] + 1]
            dn, db = nl[i][b] - nl[i][a], bl[i][b] - bl[i][a]
            if spent + dn > budget + 1e-12:
                continue
            rate = db / max(dn, 1e-12)
            if rate > best:
                best, step = rate, i
        if step < 0:
            return _fill(bal, nodes, np.array([h[at[i]] for i, h in enumerate(hulls)]), budget - spent)
        a, b = hulls[step][at[step]], hulls[step][at[step] + 1]
        spent += nl[step][b] - nl[step][a]
        at[step] += 1


def _fill(bal: np.ndarray, nodes: np.ndarray, pick: np.ndarray, left: float) -> np.ndarray:
    """The hull walk stops where its next step does not fit; a layout under the chord (skipped by the hull) may
    still: take the single-layer change of most balancedness that fits what is left, while one does."""
    pick = pick.copy()
    cols = np.arange(bal.shape[1])
    while True:
        dn = nodes - nodes[pick, cols]  # [V, L]
        db = np.where(dn <= left + 1e-12, bal - bal[pick, cols], 0.0)
        v, i = np.unravel_index(int(np.argmax(db)), db.shape)
        if db[v, i] <= 1e-12:
            return pick
        left -= float(dn[v, i])
        pick[i] = v


def _hull(bal: list[float], nodes: list[float]) -> list[int]:
    """bal, nodes [V] -> the layouts on the upper concave hull of (nodes, balancedness), fewest nodes first: each
    further one gains balancedness at a falling rate per node per token. Ties go to the lower layout index."""
    order = sorted(range(len(bal)), key=lambda v: (nodes[v], -bal[v], v))
    front: list[int] = []
    for v in order:  # Pareto front: more nodes only for more balancedness
        if not front or bal[v] > bal[front[-1]] + 1e-12:
            front.append(v)
    hull: list[int] = []
    for v in front:
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # drop b where the chord a -> v lies above it
            if (bal[b] - bal[a]) * (nodes[v] - nodes[a]) <= (bal[v] - bal[a]) * (nodes[b] - nodes[a]):
                hull.pop()
            else:
                break
        hull.append(v)
    return hull
