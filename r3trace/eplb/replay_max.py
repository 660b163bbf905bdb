"""Node-limited replay's max GPU load (and nodes per token) of several layouts at once, from the same covers: the
contests' and ladders' scorer (dispatch_contest.py, static_ladder.py). Each (layer, expert) unit is counted per cover
node set and split once per set, rather than [T, L, K, N] shares per token as score.node_limited does.
Shape legend: T tokens, L layers, K top-k, E experts, P slots, N nodes, V layouts.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice
from typing import NamedTuple

import numpy as np

from r3trace.eplb.node_cover import cover_codes, expert_bits, flat_keys, or_over_k, tie_scores, two_node_code
from r3trace.eplb.placement import Cluster, from_phy2log, replicas_per_node
from r3trace.eplb.score import node_limited


def node_limited_max(layouts: Sequence[np.ndarray], num_experts: int, topk_ids: np.ndarray, cluster: Cluster,
                     seed: int = 0, chunk: int = 2048) -> np.ndarray:
    """V layouts phy2log [L, P], each holding every one of num_experts, topk_ids [T, L, K] -> [V, L] node_limited's
    max GPU load of each (token_node None), for N <= MAX_LOAD_NODES: the same covers (the same draws, made once for
    all V), each (layer, expert) unit counted per cover node set and split once per set, instead of [T, L, K, N]
    shares summed per token (2,048 tokens at [58, 288] on 2 nodes: ~0.008 s a layout against 0.07). The same sums in
    another order: equal up to float rounding (tests/analysis/test_eplb_replay_max.py)."""
    return _replay(layouts, num_experts, topk_ids, cluster, seed, chunk, False).gpu_load.max(2)


def node_limited_replay(layouts: Sequence[np.ndarray], num_experts: int, topk_ids: np.ndarray, cluster: Cluster,
                        seed: int = 0, chunk: int = 2048) -> tuple[np.ndarray, np.ndarray]:
    """node_limited_max's [V, L] max GPU loads, and [V, L] each layer's mean nodes per token (the covers' sizes, as
    node_limited's nodes count them) from the same covers."""
    got = _replay(layouts, num_experts, topk_ids, cluster, seed, chunk, True)
    return got.gpu_load.max(2), got.nodes


def node_limited_loads(phy2log: np.ndarray, num_experts: int, topk_ids: np.ndarray, cluster: Cluster,
                       seed: int = 0, chunk: int = 2048) -> tuple[np.ndarray, np.ndarray]:
    """One layout's [L, G] GPU loads and [T, L] nodes each token reaches under node_limited's dispatch (its covers,
    its draws), by node_limited_max's counting: what the report's and the backtest's scores read (evaluate.
    score_placement). 8,192 tokens at [58, 288] on a busy 2-core machine: 4 nodes 0.12-0.15 s against node_limited's
    0.48-0.51 s, 2 nodes 0.03 against 0.27; above MAX_LOAD_NODES node_limited itself. Equal to node_limited's to
    float rounding (GPU loads within 4e-15 of the max), its node counts exactly."""
    got = _replay([phy2log], num_experts, topk_ids, cluster, seed, chunk, True, per_token=True)
    assert got.token_nodes is not None
    return got.gpu_load[0], got.token_nodes[0]


class Replayed(NamedTuple):
    gpu_load: np.ndarray  # [V, L, G]
    nodes: np.ndarray  # [V, L] mean nodes per token (zeros unless counted)
    token_nodes: np.ndarray | None  # [V, T, L] nodes each token reaches (per_token), else None


def _replay(layouts: Sequence[np.ndarray], num_experts: int, topk_ids: np.ndarray, cluster: Cluster, seed: int,
            chunk: int, count_nodes: bool, per_token: bool = False) -> Replayed:
    """The layouts' GPU loads, with the covers' sizes per layer where count_nodes (else [V, L] zeros) and per token
    where per_token."""
    e, n = num_experts, cluster.num_nodes
    t, n_layers, k = topk_ids.shape
    if n > MAX_LOAD_NODES:
        ds = [node_limited(from_phy2log(ph, e), topk_ids, cluster, seed=seed, chunk=chunk) for ph in layouts]
        return Replayed(np.stack([d.gpu_load for d in ds]), np.stack([d.nodes.mean(0) for d in ds]),
                        np.stack([d.nodes for d in ds]) if per_token else None)
    sets, n_lay = 1 << n, len(layouts)
    cnts = [replicas_per_node(ph, e, cluster) for ph in layouts]  # [L, E, N] each
    ebits = [expert_bits(c) for c in cnts]  # [L E] node bitmask of each (layer, expert)
    kinds = [_two_node_kinds(ebits[v:v + 2]) for v in range(0, n_lay, 2)] if n == 2 else []
    units = np.zeros((n_lay, n_layers * e * sets))
    sizes = np.zeros((n_lay, n_layers), dtype=np.int64)  # [V, L] summed cover sizes (count_nodes)
    token_nodes = np.zeros((n_lay, t, n_layers), dtype=np.int64) if per_token else None  # [V, T, L]
    size_of = ((np.arange(sets)[:, None] >> np.arange(n)) & 1).sum(1)  # [2^N] a cover code's node count
    sub = max(1, LOAD_BLOCK // (n_layers * k))  # tokens a block: [T', L, K] int64 keys, 1 MB
    for i in range(0, t, chunk):  # a chunk's ties are one draw, shared by the layouts
        tc = min(chunk, t - i)
        # <= 15 subsets of [T', L] scores; two nodes read only the single nodes' (_two_node_codes: the pair's are not
        # drawn, the last draw of a fresh generator)
        ties = list(islice(tie_scores(np.random.default_rng(seed + i), n, tc, n_layers), 2 if n == 2 else None))
        codes = np.empty((n_lay, tc, n_layers), dtype=np.uint8)  # [V, T', L] the cover's node set
        total = np.zeros(n_layers * e, dtype=np.int64)  # [L E] the chunk's units of each expert
        for a in range(0, tc, sub):
            key = flat_keys(topk_ids[i + a:i + min(a + sub, tc)], e)  # [T'', L, K] (layer, expert)
            total += np.bincount(key.ravel(), minlength=len(total))
            if n == 2:  # two layouts' kinds of expert per token from one gather (_two_node_kinds)
                for v in range(0, n_lay, 2):
                    seen = or_over_k(np.take(kinds[v // 2], key))  # [T'', L] layout v's kinds, then v + 1's
                    for u in range(v, min(v + 2, n_lay)):
                        codes[u, a:a + sub] = two_node_code((seen >> 4 * (u - v)) & 15, ties[0][1][a:a + sub],
                                                             ties[1][1][a:a + sub])
                continue
            for v in range(n_lay):
                codes[v, a:a + sub] = cover_codes(np.take(ebits[v], key), n, ((s, tie[a:a + sub]) for s, tie in ties))
        for v in range(n_lay):
            if count_nodes:
                sizes[v] += size_of[codes[v]].sum(0)
            if token_nodes is not None:
                token_nodes[v, i:i + tc] = size_of[codes[v]]
            # where one cover set holds most tokens (on two nodes 90-98% of a layer's reach both), its units are the
            # rest of each expert's: only the others are counted (below COMMON_SHARE, as on four nodes at 50-60%,
            # gathering the others cost more than it saved)
            hist = np.bincount(codes[v].ravel(), minlength=sets)
            common = int(np.argmax(hist))
            part = np.zeros(len(units[v]), dtype=np.int64)
            if hist[common] < COMMON_SHARE * codes[v].size:
                common = -1
                rest = np.ones((tc, n_layers), dtype=bool)
            else:
                rest = codes[v] != common
            for a in range(0, tc, sub):
                tt, ll = np.nonzero(rest[a:a + sub])
                ids = topk_ids[i + a + tt, ll].astype(np.int64)  # [Q, K] the choices of the other tokens
                ids += (ll * e)[:, None]
                ids *= sets
                ids += codes[v, a + tt, ll][:, None]
                part += np.bincount(ids.ravel(), minlength=len(part))
            if common >= 0:
                part[common::sets] = total - part.reshape(-1, sets).sum(1)  # integer counts: exact
            units[v] += part
    out = []
    member = ((np.arange(sets)[:, None] >> np.arange(n)) & 1).astype(float)  # [2^N, N]
    node = cluster.slot_node()
    for v, phy2log in enumerate(layouts):
        by_set = units[v].reshape(n_layers, e, sets)  # [L, E, 2^N] units of each expert served by each node set
        share = by_set / np.maximum(cnts[v] @ member.T, 1)  # [L, E, 2^N] a replica's units from each set
        if n == 2:  # the einsum's sums, two nonzero terms each (+0.0 elsewhere): the same bits, 1 ms less (58 layers)
            per = np.stack([share[..., 1] + share[..., 3], share[..., 2] + share[..., 3]], -1)
        else:
            per = np.einsum("les,sn->len", share, member)  # [L, E, N] per replica
        slot_load = per[np.arange(n_layers)[:, None], phy2log, node[None, :]]  # [L, P]
        out.append(slot_load.reshape(n_layers, cluster.num_gpus, -1).sum(-1))
    return Replayed(np.stack(out), sizes / max(t, 1), token_nodes)


MAX_LOAD_NODES = 4  # node_limited_max counts per node set: 2^N sets per (layer, expert)
LOAD_BLOCK = 1 << 17  # choices node_limited_max reads at once: [T', L, K] int64 keys, 1 MB (all 2,048 tokens' at once,
# 7.6 MB at [58, 256], and the arrays around them peaked at 14 MB: fresh pages on every re-plan)
COMMON_SHARE = 0.75  # share of tokens one cover set needs for node_limited_max to count only the others


def _two_node_kinds(ebits: Sequence[np.ndarray]) -> np.ndarray:
    """One or two layouts' node bitmasks [L E] (two nodes: 0-3) -> [L E] uint8 one-hot kinds, the first layout's in
    bits 0-3 and the second's in bits 4-7, so one gather per token serves both (node_limited_max)."""
    out = np.left_shift(np.uint8(1), ebits[0], dtype=np.uint8)
    if len(ebits) > 1:
        out |= np.left_shift(np.uint8(16), ebits[1], dtype=np.uint8)
    return out
