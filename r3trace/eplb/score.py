"""Scoring a placement on routed tokens: per-GPU load and nodes per token under node-limited dispatch.

Two load models:
  even           each replica of e gets count_e / logcnt_e (EPLB's own assumption; needs only heat)
  node_limited   per token and layer the dispatcher first picks the fewest nodes that hold all its K experts
                 (exact minimum cover for N <= 8 nodes, 2^N subsets; greedy set cover above; ties broken at
                 random so no node is favoured), then splits each expert's unit of work evenly
                 over that expert's replicas on the chosen nodes. Nodes per token = the cover's size.
Shape legend: T tokens, L layers, K top-k, E experts, P slots, G GPUs, N nodes, R max replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from typing import NamedTuple

import numpy as np

from r3trace.eplb.placement import Cluster, Placement, from_phy2log, replica_counts, replicas_per_node


def node_counts(pl: Placement, cluster: Cluster) -> np.ndarray:
    """Replicas per (layer, expert, node): [L, E, N]."""
    return replicas_per_node(pl.phy2log, pl.logcnt.shape[1], cluster)


def even_gpu_load(pl: Placement, heat: np.ndarray, cluster: Cluster) -> np.ndarray:
    """heat [L, E] -> per-GPU load [L, G] when every replica gets an equal share."""
    n_layers = heat.shape[0]
    per_slot = np.take_along_axis(heat / pl.logcnt, pl.phy2log, 1)  # [L, P]
    return per_slot.reshape(n_layers, cluster.num_gpus, cluster.slots_per_gpu).sum(-1)


def phy2log_gpu_load(phy2log: np.ndarray, heat: np.ndarray, cluster: Cluster) -> np.ndarray:
    """phy2log [L, P], heat [L, E] -> per-GPU load [L, G] under the even split: even_gpu_load of
    from_phy2log(phy2log), the same numbers, without building log2phy (1 ms a call at [58, 256])."""
    n_layers, e = heat.shape
    per_slot = np.take_along_axis(heat / replica_counts(phy2log, e), phy2log, 1)  # [L, P]
    return per_slot.reshape(n_layers, cluster.num_gpus, cluster.slots_per_gpu).sum(-1)


class Dispatch(NamedTuple):
    slot_load: np.ndarray  # [L, P] token-expert units handled per slot
    gpu_load: np.ndarray  # [L, G] the same per GPU
    nodes: np.ndarray  # [T, L] distinct nodes each token reaches
    remote: np.ndarray  # [T, L] of those, nodes other than the token's own


def node_limited(
    pl: Placement, topk_ids: np.ndarray, cluster: Cluster, token_node: np.ndarray | None = None, seed: int = 0,
    chunk: int = 2048,
) -> Dispatch:
    """topk_ids [T, L, K] -> Dispatch under greedy node cover (see module doc); token_node [T] or None.

    Works on `chunk` tokens at a time: the [T, L, K, N] masks of 8K V3 tokens on 18 nodes are 68 MB each.
    """
    parts = [
        _node_limited(pl, topk_ids[i:i + chunk], cluster,
                      None if token_node is None else token_node[i:i + chunk], seed + i)
        for i in range(0, len(topk_ids), chunk)
    ]
    slot = np.sum([p.slot_load for p in parts], axis=0)
    return Dispatch(slot, slot.reshape(len(slot), cluster.num_gpus, -1).sum(-1),
                    np.concatenate([p.nodes for p in parts]), np.concatenate([p.remote for p in parts]))


def node_limited_max(layouts: Sequence[np.ndarray], num_experts: int, topk_ids: np.ndarray, cluster: Cluster,
                     seed: int = 0, chunk: int = 2048) -> np.ndarray:
    """V layouts phy2log [L, P], each holding every one of num_experts, topk_ids [T, L, K] -> [V, L] node_limited's
    max GPU load of each (token_node None), for N <= MAX_LOAD_NODES: the same covers (the same draws, made once for
    all V), each (layer, expert) unit counted per cover node set and split once per set, instead of [T, L, K, N]
    shares summed per token (2,048 tokens at [58, 288] on 2 nodes: ~0.008 s a layout against 0.07). The same sums in
    another order: equal up to float rounding (tests/analysis/test_eplb_replay_max.py)."""
    return _replay(layouts, num_experts, topk_ids, cluster, seed, chunk, False)[0]


def node_limited_replay(layouts: Sequence[np.ndarray], num_experts: int, topk_ids: np.ndarray, cluster: Cluster,
                        seed: int = 0, chunk: int = 2048) -> tuple[np.ndarray, np.ndarray]:
    """node_limited_max's [V, L] max GPU loads, and [V, L] each layer's mean nodes per token (the covers' sizes, as
    node_limited's nodes count them) from the same covers."""
    return _replay(layouts, num_experts, topk_ids, cluster, seed, chunk, True)


def _replay(layouts: Sequence[np.ndarray], num_experts: int, topk_ids: np.ndarray, cluster: Cluster, seed: int,
            chunk: int, count_nodes: bool) -> tuple[np.ndarray, np.ndarray]:
    """node_limited_max, with the covers' sizes summed per layer where count_nodes (else [V, L] zeros)."""
    e, n = num_experts, cluster.num_nodes
    t, n_layers, k = topk_ids.shape
    if n > MAX_LOAD_NODES:
        ds = [node_limited(from_phy2log(ph, e), topk_ids, cluster, seed=seed, chunk=chunk) for ph in layouts]
        return np.stack([d.gpu_load.max(1) for d in ds]), np.stack([d.nodes.mean(0) for d in ds])
    sets, n_lay = 1 << n, len(layouts)
    cnts = [replicas_per_node(ph, e, cluster) for ph in layouts]  # [L, E, N] each
    ebits = [_expert_bits(c) for c in cnts]  # [L E] node bitmask of each (layer, expert)
    kinds = [_two_node_kinds(ebits[v:v + 2]) for v in range(0, n_lay, 2)] if n == 2 else []
    units = np.zeros((n_lay, n_layers * e * sets))
    sizes = np.zeros((n_lay, n_layers), dtype=np.int64)  # [V, L] summed cover sizes (count_nodes)
    size_of = ((np.arange(sets)[:, None] >> np.arange(n)) & 1).sum(1)  # [2^N] a cover code's node count
    sub = max(1, LOAD_BLOCK // (n_layers * k))  # tokens a block: [T', L, K] int64 keys, 1 MB
    for i in range(0, t, chunk):  # a chunk's ties are one draw, shared by the layouts
        tc = min(chunk, t - i)
        # <= 15 subsets of [T', L] scores; two nodes read only the single nodes' (_two_node_codes: the pair's are not
        # drawn, the last draw of a fresh generator)
        ties = list(islice(_tie_scores(np.random.default_rng(seed + i), n, tc, n_layers), 2 if n == 2 else None))
        codes = np.empty((n_lay, tc, n_layers), dtype=np.uint8)  # [V, T', L] the cover's node set
        total = np.zeros(n_layers * e, dtype=np.int64)  # [L E] the chunk's units of each expert
        for a in range(0, tc, sub):
            key = _flat(topk_ids[i + a:i + min(a + sub, tc)], e)  # [T'', L, K] (layer, expert)
            total += np.bincount(key.ravel(), minlength=len(total))
            if n == 2:  # two layouts' kinds of expert per token from one gather (_two_node_kinds)
                for v in range(0, n_lay, 2):
                    seen = _or_over_k(np.take(kinds[v // 2], key))  # [T'', L] layout v's kinds, then v + 1's
                    for u in range(v, min(v + 2, n_lay)):
                        codes[u, a:a + sub] = _two_node_code((seen >> 4 * (u - v)) & 15, ties[0][1][a:a + sub],
                                                             ties[1][1][a:a + sub])
                continue
            for v in range(n_lay):
                codes[v, a:a + sub] = _cover_codes(np.take(ebits[v], key), n, ((s, tie[a:a + sub]) for s, tie in ties))
        for v in range(n_lay):
            if count_nodes:
                sizes[v] += size_of[codes[v]].sum(0)
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
        out.append(slot_load.reshape(n_layers, cluster.num_gpus, -1).sum(-1).max(1))
    return np.stack(out), sizes / max(t, 1)


MAX_LOAD_NODES = 4  # node_limited_max counts per node set: 2^N sets per (layer, expert)
LOAD_BLOCK = 1 << 17  # choices node_limited_max reads at once: [T', L, K] int64 keys, 1 MB (all 2,048 tokens' at once,
# 7.6 MB at [58, 256], and the arrays around them peaked at 14 MB: fresh pages on every re-plan)
COMMON_SHARE = 0.75  # share of tokens one cover set needs for node_limited_max to count only the others


def _flat(topk_ids: np.ndarray, e: int) -> np.ndarray:
    """[T, L, K] expert ids -> [T, L, K] int64 (layer, expert) rows of an [L, E] table, raveled."""
    flat = topk_ids.astype(np.int64)
    flat += (np.arange(topk_ids.shape[1]) * e)[None, :, None]
    return flat


def _expert_bits(cnt: np.ndarray) -> np.ndarray:
    """cnt [L, E, N] (N <= 8) -> [L E] uint8 node bitmask of each (layer, expert)."""
    n = cnt.shape[2]
    return ((cnt > 0).astype(np.uint16) << np.arange(n, dtype=np.uint16)).sum(-1, dtype=np.uint16).astype(
        np.uint8).ravel()


def _chosen(cnt: np.ndarray, flat: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """cnt [L, E, N] replicas per node, flat [T, L, K] tokens' (layer, expert) rows -> chosen [T, L, N]: the cover
    node_limited dispatches each token over (exact below EXACT_COVER_NODES, greedy above, ties by rng)."""
    if n <= EXACT_COVER_NODES:  # node bitmask per (layer, expert), gathered per token: 1 byte, not N bools
        t, n_layers = flat.shape[:2]
        code = _cover_codes(np.take(_expert_bits(cnt), flat), n, _tie_scores(rng, n, t, n_layers))
        return ((code[..., None] >> np.arange(n)) & 1).astype(bool)
    return _greedy_cover(np.take(cnt.reshape(-1, n), flat, axis=0) > 0, rng)  # has [T, L, K, N]


def _node_limited(
    pl: Placement, topk_ids: np.ndarray, cluster: Cluster, token_node: np.ndarray | None, seed: int
) -> Dispatch:
    t, n_layers, k = topk_ids.shape
    n = cluster.num_nodes
    cnt = node_counts(pl, cluster)  # [L, E, N]
    lrow = np.arange(n_layers)[None, :, None]
    chosen = _chosen(cnt, _flat(topk_ids, cnt.shape[1]), n, np.random.default_rng(seed))
    # split each (token, layer, k) unit evenly over its expert's replicas on the chosen nodes: each replica on a
    # chosen node gets 1/m of it, m = the expert's replicas there. Summed per (layer, expert, node) and read back
    # per slot: [T, L, K, N] arrays instead of [T, L, K, R] ones (R = 8 on V3 at 288 slots: 2-4x less work)
    e = cnt.shape[1]
    pick = chosen[:, :, None, :]  # [T, L, 1, N]
    m = (cnt[lrow, topk_ids] * pick).sum(3, keepdims=True)  # [T, L, K, 1]
    share = pick / np.maximum(m, 1)  # [T, L, K, N] per replica on each chosen node
    cell = ((lrow * e + topk_ids) * n)[..., None] + np.arange(n)  # [T, L, K, N] flat (layer, expert, node)
    per = np.bincount(cell.ravel(), weights=share.ravel(), minlength=n_layers * e * n).reshape(n_layers, e, n)
    slot_load = per[np.arange(n_layers)[:, None], pl.phy2log, cluster.slot_node()[None, :]]  # [L, P]
    nodes = chosen.sum(2)
    if token_node is None:
        remote = nodes.copy()
    else:
        remote = nodes - np.take_along_axis(chosen, token_node[:, None, None].repeat(n_layers, 1), 2)[..., 0]
    return Dispatch(slot_load, slot_load.reshape(n_layers, cluster.num_gpus, -1).sum(-1), nodes, remote)


EXACT_COVER_NODES = 8  # 255 subsets: exact; 18 nodes would be 262K subsets, so greedy there


def _tie_scores(rng: np.random.Generator, n: int, t: int, n_layers: int) -> Iterator[tuple[int, np.ndarray]]:
    """The cover search's order over node subsets (size, then subset; subset s is the bitmask s + 1) with each one's
    score where it covers, [T, L]: its size plus one random draw x 0.5 per (token, layer), drawn in that order as
    the search reads them (255 subsets of [2,048, 58] scores on 8 nodes would be 243 MB at once)."""
    size = np.bitwise_count(np.arange(1, 2**n))  # [S]
    for s in np.argsort(size, kind="stable"):
        yield int(s), size[s] + rng.random((t, n_layers)) * 0.5


def _cover_codes(bits: np.ndarray, n: int, ties: Iterable[tuple[int, np.ndarray]]) -> np.ndarray:
    """bits [T, L, K] uint8 node bitmask of each expert (N <= 8 nodes), ties (_tie_scores) -> [T, L] int64 the
    bitmask of a smallest node set covering all K experts, ties broken by the draws."""
    if n == 2:
        return _two_node_codes(bits, ties)
    t, n_layers, k = bits.shape
    best = np.full((t, n_layers), -1)
    best_score = np.full((t, n_layers), np.inf)
    meets_all = _cover_test(bits, n)
    for s, tie in ties:
        score = np.where(meets_all(s + 1), tie, np.inf)  # [T, L]
        better = score < best_score
        np.copyto(best, s, where=better)
        np.copyto(best_score, score, where=better)
    return best + 1  # 0 where nothing covers (an expert on no node)


def _two_node_codes(bits: np.ndarray, ties: Iterable[tuple[int, np.ndarray]]) -> np.ndarray:
    """_cover_codes on two nodes, the same codes from the kinds of expert a token has (bit m of `seen` set where one
    has mask m): one node-1-only and one node-2-only expert need both nodes (3); else the node holding them all; where
    both nodes do (every expert on both), the lower of the two size-1 scores, as the general search's strict < keeps
    node 1 on equal scores. Reads only the first two ties (subsets {1} and {2}): 3x-4x faster at [2,048, 58, 8]."""
    (_, one), (_, two) = islice(ties, 2)  # [T, L] scores of node 1 alone, node 2 alone
    return _two_node_code(_or_over_k(np.left_shift(np.uint8(1), bits, dtype=np.uint8)), one, two)


def _two_node_kinds(ebits: Sequence[np.ndarray]) -> np.ndarray:
    """One or two layouts' node bitmasks [L E] (two nodes: 0-3) -> [L E] uint8 one-hot kinds, the first layout's in
    bits 0-3 and the second's in bits 4-7, so one gather per token serves both (node_limited_max)."""
    out = np.left_shift(np.uint8(1), ebits[0], dtype=np.uint8)
    if len(ebits) > 1:
        out |= np.left_shift(np.uint8(16), ebits[1], dtype=np.uint8)
    return out


def _or_over_k(x: np.ndarray) -> np.ndarray:
    """[T, L, K] uint8 -> [T, L] their bitwise OR over K: with K = 8 each token's bytes as one uint64, folded in
    three shifts (a loop over K was 0.6 ms at [2,048, 58, 8], the fold 0.2; np.bitwise_or.reduce 1.7)."""
    if x.shape[2] == 8:
        y = np.ascontiguousarray(x).view(np.uint64)[..., 0]  # a view: the shifts below make new arrays
        y = y | (y >> np.uint64(32))
        y |= y >> np.uint64(16)
        y |= y >> np.uint64(8)
        return y.astype(np.uint8)  # the low byte: every byte ORed
    out = x[:, :, 0].copy()
    for j in range(1, x.shape[2]):
        out |= x[:, :, j]
    return out


def _two_node_code(seen: np.ndarray, one: np.ndarray, two: np.ndarray) -> np.ndarray:
    """seen [T, L] (bit m: a token has an expert of node mask m), scores of node 1 alone and node 2 alone [T, L] ->
    [T, L] the cover's code (_two_node_codes)."""
    code = _TWO_NODE_CODE[seen]  # [T, L]
    tie = code == _TIE
    code[tie] = np.where(two[tie] < one[tie], 2, 1)
    return code


_TIE = 255
# seen (bits 0-3: a token has an expert on no node / on node 1 only / on node 2 only / on both) -> its cover's code:
# 0 where an expert is on no node (nothing covers), _TIE where either node covers alone
_TWO_NODE_CODE = np.array([0 if v & 1 else 3 if v & 6 == 6 else 1 if v & 2 else 2 if v & 4 else _TIE
                           for v in range(16)], dtype=np.int64)


def _cover_test(bits: np.ndarray, n: int) -> Callable[[int], np.ndarray]:
    """bits [T, L, K] node bitmasks -> subset -> [T, L] whether it meets every one of a token's K masks. On <= 4
    nodes the masks a token's experts have are kept as a 16-bit set, so a subset's test is one AND with the masks it
    misses; above, one AND a top-k position ([T, L] passes: a reduce over the short K axis was 3x slower)."""
    t, n_layers, k = bits.shape
    if n <= 4:
        seen = np.zeros((t, n_layers), dtype=np.uint16)
        for j in range(k):
            seen |= np.left_shift(np.uint16(1), bits[:, :, j], dtype=np.uint16)
        missed_by = [sum(1 << v for v in range(1 << n) if not v & sub) for sub in range(1 << n)]
        return lambda sub: (seen & np.uint16(missed_by[sub])) == 0
    by_k = [bits[:, :, j] for j in range(k)]

    def meets_all(sub: int) -> np.ndarray:
        out = (by_k[0] & np.uint8(sub)) != 0
        for b in by_k[1:]:
            out &= (b & np.uint8(sub)) != 0
        return out
    return meets_all


def _greedy_cover(has: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """has [T, L, K, N] -> chosen [T, L, N]: greedy set cover, most uncovered experts first."""
    t, n_layers, k, n = has.shape
    uncovered = np.ones((t, n_layers, k), dtype=bool)
    chosen = np.zeros((t, n_layers, n), dtype=bool)
    jitter = rng.random((t, n_layers, n)) * 0.5  # breaks ties between equal gains only
    for _ in range(k):
        gain = (has & uncovered[..., None]).sum(2)  # [T, L, N]
        if not gain.any():
            break
        best = np.argmax(gain + jitter, axis=2)  # [T, L]
        active = np.take_along_axis(gain, best[..., None], 2)[..., 0] > 0
        chosen[np.arange(t)[:, None], np.arange(n_layers)[None, :], best] |= active
        took = np.take_along_axis(has, best[..., None, None].repeat(k, 2), 3)[..., 0]  # [T, L, K]
        uncovered &= ~(took & active[..., None])
    return chosen


def balancedness(gpu_load: np.ndarray) -> float:
    """mean over layers of mean/max GPU load ([L, G] -> scalar in (0, 1]; 1 = perfectly balanced).

    SGLang's "[Expert Balancedness]" (eplb/expert_distribution.py, compute_utilization_rate), without its 1e-5
    in both terms; a layer with no load is left out here, where SGLang counts it as 1."""
    mx = gpu_load.max(1)
    ok = mx > 0
    return float((gpu_load.mean(1)[ok] / mx[ok]).mean()) if ok.any() else 1.0


def heat_of(topk_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """topk_ids [T, L, K] -> selections per (layer, expert) [L, E]."""
    t, n_layers, _ = topk_ids.shape
    flat = topk_ids + (np.arange(n_layers) * num_experts)[None, :, None]
    counts = np.bincount(flat.ravel(), minlength=n_layers * num_experts)
    return counts.reshape(n_layers, num_experts).astype(float)
