"""SGLang's static and dynamic dispatch replayed on a placement: the replica each rank sends an expert's tokens to,
and the GPU loads that follow. What `r3trace eplb` reports beside the even split and the node-limited replay.

SGLang dispatches "static" whenever EPLB is on or an --init-expert-location is given and no --ep-dispatch-algorithm
is (python/sglang/srt/server_args.py, _handle_eplb_and_dispatch, sgl-project/sglang@469c63e). Which replica a rank
sends expert e's pairs to (compute_logical_to_rank_dispatch_physical_map and _find_nearest_expert in
python/sglang/srt/eplb/expert_location.py; the rule as of character-tech/sglang@aa27354, a fork tracking upstream,
from sgl-project/sglang PRs #9849 and #10874), replicas listed by ascending slot:
  1. e has one replica: that one;
  2. the rank holds a replica of e: its first one;
  3. the rank's node holds some but not all of e's replicas: the node's first one (on by default; SGLang turns it
     off under elastic EP's scale-up join, and SGLang before PR #9849 never had it: prefer_same_node=False);
  4. else the m ranks left are spread over all c replicas by _fair_choices (each replica m // c of them, m mod c
     replicas drawn by random.Random(42) one more, then shuffled). Here (as in the engine's ExpertMap,
     engine/layers/expert_map.py) the i-th rank left, in rank order, takes replica (i + e) mod c: each replica serves
     as many of them as under SGLang's draw; which replicas take the extra rank differs.
Rule 3 makes a second replica on a node nearly idle: the node's other ranks all go to its first one (2 nodes x 8
GPUs, e on GPUs 0, 1 and 8: GPU 0 serves 7 ranks, GPU 1 its own, GPU 8 all 8 of node 1's). On one node it never
applies (every replica is on the rank's node), so a one-node cluster dispatches as before PR #9849.
Dynamic dispatch (--ep-dispatch-algorithm dynamic) collapses a rank's candidates to rules 1-3's replica where there is
one (_compute_logical_to_all_physical_map, PR #10874) and otherwise draws one of all c replicas per pair
(_topk_ids_logical_to_physical_dynamic in expert_location_dispatch.py); dispatched_load takes its expectation.

A GPU's load then depends on where each token comes from, not on which other experts it picked: each rank sends
its own share of the tokens, and a replica's load is its own rank's pairs plus those of the ranks mapped to it. Where
the trace says which DP rank served a token (token_sources), a DP group of D on G GPUs owns G / D consecutive
ranks and its tokens go out from them in turn (D = G, DP attention on every rank: the token's own rank); else token
t from rank t mod G.
Shape legend: T tokens, L layers, K top-k, E experts, P slots, G GPUs (ranks), N nodes, R max replicas.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import numpy as np

from r3trace.eplb.placement import Cluster, Placement, from_phy2log, slot_order

SGLangDispatch = Literal["static", "dynamic"]


def static_slots(pl: Placement, cluster: Cluster, prefer_same_node: bool = True) -> np.ndarray:
    """-> [L, G, E] the slot rank g sends expert e's pairs to (module doc's rules 1-4): its first own replica, else
    (prefer_same_node, several nodes) its node's first where the node holds some but not all of e's replicas, else
    the i-th rank left (rank order) takes replica (i + e) mod count[e]."""
    l2p, pick = _nearest(pl, cluster, prefer_same_node)
    e, r = l2p.shape[1], l2p.shape[2]
    left = pick == r  # [L, G, E] ranks for the fair spread (rule 4)
    nth = np.cumsum(left, axis=1) - 1  # [L, G, E] this rank's place among them
    spread = (nth + np.arange(e)[None, None, :]) % pl.logcnt[:, None, :]
    pick = np.where(left, spread, pick)
    return np.take_along_axis(l2p, pick.transpose(0, 2, 1), 2).transpose(0, 2, 1)  # [L, E, G] -> [L, G, E]


def _nearest(pl: Placement, cluster: Cluster, prefer_same_node: bool) -> tuple[np.ndarray, np.ndarray]:
    """-> (log2phy [L, E, R] by ascending slot, -1 padded; [L, G, E] the replica index rules 1-3 give rank g for
    expert e, R where they give none)."""
    l2p = from_phy2log(pl.phy2log, pl.num_experts).log2phy  # replicas by ascending slot, as SGLang lists them
    # (_compute_logical_to_all_physical_map), whatever order pl.log2phy has
    n_layers, e, r = l2p.shape
    g, gpn = cluster.num_gpus, cluster.gpus_per_node
    valid = l2p >= 0
    owner = np.where(valid, l2p // cluster.slots_per_gpu, 0)  # [L, E, R] rank holding each replica
    li, ei, ri = np.nonzero(valid)
    pick = np.full((n_layers, g, e), r, dtype=np.int64)  # [L, G, E] replica index of rank g's own copy, r: none
    np.minimum.at(pick, (li, owner[li, ei, ri], ei), ri)
    pick[np.broadcast_to(pl.logcnt[:, None, :] == 1, pick.shape)] = 0  # rule 1: the one replica
    if prefer_same_node and cluster.num_nodes > 1:
        n = cluster.num_nodes
        node = owner[li, ei, ri] // gpn
        on_node = np.zeros((n_layers, n, e), dtype=np.int64)  # [L, N, E] replicas of e on node n
        np.add.at(on_node, (li, node, ei), 1)
        node_first = np.full((n_layers, n, e), r, dtype=np.int64)  # [L, N, E] the node's first replica index
        np.minimum.at(node_first, (li, node, ei), ri)
        narrows = (on_node > 0) & (on_node < pl.logcnt[:, None, :])  # [L, N, E] rule 3 applies
        rank_node = np.arange(g) // gpn
        pick = np.where((pick == r) & narrows[:, rank_node], node_first[:, rank_node], pick)
    return l2p, pick


def demand(topk_ids: np.ndarray, num_experts: int, num_gpus: int, token_rank: np.ndarray | None = None) -> np.ndarray:
    """topk_ids [T, L, K], token_rank [T] (None: token t from rank t mod G) -> [L, G, E] the pairs each rank sends."""
    t, n_layers, k = topk_ids.shape
    g, e = num_gpus, num_experts
    rank = np.arange(t) % g if token_rank is None else np.asarray(token_rank, dtype=np.int64) % g
    cell = ((np.arange(n_layers)[None, :, None] * g + rank[:, None, None]) * e + topk_ids).ravel()
    return np.bincount(cell, minlength=n_layers * g * e).reshape(n_layers, g, e).astype(np.float64)


def dispatched_load(pl: Placement, sent: np.ndarray, cluster: Cluster, dispatch: SGLangDispatch = "static",
                    prefer_same_node: bool = True) -> np.ndarray:
    """sent [L, G, E] (demand, or an expectation) -> per-GPU load [L, G] under SGLang's static dispatch (rules 1-4)
    or its dynamic dispatch in expectation (rules 1-3, then one of all c replicas drawn uniformly per pair: the
    pairs of the ranks left split evenly over them)."""
    n_layers, g = sent.shape[0], cluster.num_gpus
    # per-GPU sums by one bincount over (layer, GPU) cells, pairs in C order as np.add.at would add them (10x faster)
    rows = (np.arange(n_layers) * g)[:, None, None]
    if dispatch == "static":
        cell = rows + static_slots(pl, cluster, prefer_same_node) // cluster.slots_per_gpu  # [L, G, E]
        return np.bincount(cell.ravel(), weights=np.ravel(sent), minlength=n_layers * g).reshape(n_layers, g)
    l2p, pick = _nearest(pl, cluster, prefer_same_node)
    r = l2p.shape[2]
    near = pick < r  # [L, G, E]
    slot = np.take_along_axis(l2p, np.minimum(pick, r - 1).transpose(0, 2, 1), 2).transpose(0, 2, 1)
    far = np.where(near, 0.0, sent).sum(1) / pl.logcnt  # [L, E] each replica's share of the ranks left
    li, ei, ri = np.nonzero(l2p >= 0)
    cells = np.concatenate([(rows + np.where(near, slot, 0) // cluster.slots_per_gpu).ravel(),  # far: 0 added
                            li * g + l2p[li, ei, ri] // cluster.slots_per_gpu])
    weights = np.concatenate([np.where(near, sent, 0.0).ravel(), far[li, ei]])
    return np.bincount(cells, weights=weights, minlength=n_layers * g).reshape(n_layers, g)


def static_gpu_load(pl: Placement, topk_ids: np.ndarray, cluster: Cluster, token_rank: np.ndarray | None = None,
                    prefer_same_node: bool = True, dispatch: SGLangDispatch = "static") -> np.ndarray:
    """topk_ids [T, L, K], token_rank [T] (None: token t from rank t mod G) -> per-GPU load [L, G] in pairs under
    SGLang's static (or dynamic) dispatch; prefer_same_node: rule 3."""
    sent = demand(topk_ids, pl.logcnt.shape[1], cluster.num_gpus, token_rank)
    return dispatched_load(pl, sent, cluster, dispatch, prefer_same_node)


def static_expected_load(phy2log: np.ndarray, weight: np.ndarray, cluster: Cluster,
                         prefer_same_node: bool = True, dispatch: SGLangDispatch = "static") -> np.ndarray:
    """phy2log [L, P], weight [L, E] -> per-GPU load [L, G] under static (or dynamic) dispatch when every rank sends
    1 / G of each expert's load (static_gpu_load's expectation over tokens spread evenly over the ranks).

    Counted per replica instead of per (rank, expert) pair: with every rank sending the same share, a replica's load
    is the number of ranks rules 1-4 map to it times w / G, and those counts follow from each expert's replicas in
    slot order (rank and node runs): [L, P] arrays where dispatched_load builds [L, G, E] ones (406 layouts of 320
    slots on 64 GPUs: 0.004 s against 0.08 s). Equal to dispatched_load of the uniform demand up to float rounding
    (tests/analysis/test_eplb_static_twins.py). Rows go EXPECTED_BLOCK slots at a time (each row's sums are its own)."""
    phy2log = np.asarray(phy2log, dtype=np.int64)
    if not len(phy2log):
        return np.zeros((0, cluster.num_gpus))
    step = max(1, EXPECTED_BLOCK // phy2log.shape[1])
    return np.concatenate([_expected_load(phy2log[a:a + step], weight[a:a + step], cluster, prefer_same_node, dispatch)
                           for a in range(0, len(phy2log), step)])


# slots static_expected_load handles at once: ~20 [rows, P] temporaries of 256 KB (the static ladder's ~290 layouts of
# 288 slots at once peaked at 9.9 MB: fresh pages on every plan)
EXPECTED_BLOCK = 1 << 15


def _expected_load(phy2log: np.ndarray, weight: np.ndarray, cluster: Cluster, prefer_same_node: bool,
                   dispatch: SGLangDispatch) -> np.ndarray:
    """static_expected_load of rows phy2log [L, P] (int64), weight [L, E] -> [L, G]."""
    n_layers, p = phy2log.shape
    e, g, gpn = weight.shape[1], cluster.num_gpus, cluster.gpus_per_node
    order = slot_order(phy2log)  # [L, P] slots grouped by expert, ascending slot
    x = np.take_along_axis(phy2log, order, 1).ravel() + np.repeat(np.arange(n_layers) * e, p)  # [L P] layer-expert
    rank = (order // cluster.slots_per_gpu).ravel()  # [L P] the rank holding each replica
    node = rank // gpn
    new_x = np.ones(x.shape, dtype=bool)
    new_x[1:] = x[1:] != x[:-1]  # first replica of its expert
    first_rank, first_node = new_x.copy(), new_x.copy()
    first_rank[1:] |= rank[1:] != rank[:-1]  # its expert's first replica on its rank (rule 2 serves that rank)
    first_node[1:] |= node[1:] != node[:-1]  # its expert's first replica on its node (rule 3's target)
    cnt = np.bincount(x, minlength=n_layers * e)  # [L E] replicas c
    start = np.cumsum(cnt) - cnt  # [L E] each expert's first position
    run = np.cumsum(first_node) - 1  # [L P] the (expert, node) run of each replica
    run_len = np.bincount(run)  # replicas of the expert on that node
    run_ranks = np.bincount(run, weights=first_rank).astype(np.int64)  # ranks of that node holding one
    narrows = run_len < cnt[x[first_node]] if prefer_same_node and cluster.num_nodes > 1 else run_len < 0
    node_extra = np.where(narrows, gpn - run_ranks, 0)  # rule 3: the node's other ranks, to its first replica
    left = g - np.bincount(x, weights=first_rank, minlength=n_layers * e)  # [L E] ranks without their own
    left -= np.bincount(x[first_node], weights=node_extra, minlength=n_layers * e)  # ... nor rule 3's
    c, m = cnt[x], left[x]  # per replica: its expert's c and m
    if dispatch == "static":  # rule 4: the i-th rank left takes replica (i + e) mod c
        j = np.arange(len(x)) - start[x]  # replica index by ascending slot
        far = m // c + ((j - x % e) % c < m % c)
    else:  # a uniform draw per pair: m / c ranks' worth each
        far = m / c
    ranks = first_rank + np.where(first_node, node_extra[run], 0) + far  # [L P] ranks sending to each replica
    share = weight.ravel()[x] / g
    cell = np.repeat(np.arange(n_layers) * g, p) + rank
    return np.bincount(cell, weights=ranks * share, minlength=n_layers * g).reshape(n_layers, g)


class TokenSources(NamedTuple):
    rank: np.ndarray | None  # [T] the rank each token is sent from; None: token t from rank t mod G
    how: str  # the rule taken, for reports


def token_sources(dp_rank: np.ndarray | None, dp_size: int | None, num_gpus: int) -> TokenSources:
    """dp_rank [T] of sampled tokens in file order (None: no routes), the capture's DP size D (None: the highest
    rank + 1) -> the ranks static dispatch sends them from on G GPUs: DP group d owns ranks d G / D .. (d + 1) G / D
    - 1 and its tokens go out from them in turn. A D that does not divide G, or a rank >= D, gives token t from
    rank t mod G, with the reason in `how`."""
    default = f"token t from rank t mod {num_gpus}"
    if dp_rank is None or not len(dp_rank):
        return TokenSources(None, default)
    r = np.asarray(dp_rank, dtype=np.int64)
    d = int(r.max()) + 1 if dp_size is None else dp_size
    if d <= 1:
        return TokenSources(None, f"{default} (one DP rank in the trace)")
    if num_gpus % d or r.min() < 0 or r.max() >= d:
        return TokenSources(None, f"{default} (the trace's {d} DP ranks do not divide {num_gpus} GPUs)")
    order = np.argsort(r, kind="stable")
    turn = np.empty_like(r)
    starts = np.searchsorted(r[order], r[order])  # each token's group start in the sorted order
    turn[order] = np.arange(len(r)) - starts  # [T] the token's place among its group's tokens
    per = num_gpus // d
    src = "DP rank" if per == 1 else f"DP group's {per} ranks in turn"
    return TokenSources(r * per + turn % per, f"each token from its {src} ({d} DP ranks on {num_gpus} GPUs)")
