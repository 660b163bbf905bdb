"""Exchange: two one-replica experts of one node traded for two of another, both nodes' GPUs then repacked exactly.

Why: at the max GPU load the polish reaches, most GPUs sit at it, so a node-level change that lowers nodes per
token (which experts share a node) only fits under that load with the node's GPUs packed anew, and the cover
search's slot swaps and descent never get there. On bench/eplb_milp.py's synth-e32 (8 GPUs / 2 nodes / 40 slots,
96 tokens, max load 48.17) HiGHS with ours' replica counts proves 1.3125 nodes per token against ours' 1.3229:
that placement's node sets differ from ours by trading experts 22 and 25 for 23 and 27, which after the swap sits
at 49.17 and repacked inside each node at 48.17.

exchanges: each pass scores every 2-for-2 trade of one-replica experts between two nodes by nodes per token on the
layer's tokens (node masks only, no loads), and tries the ones that lower it, best first, up to EXCHANGE_TRIES a
pass: the four slots swap, then pack_node looks for a packing of each of the two nodes' replicas onto their GPUs
(the slot count of each) at or under the starting max load; the first that fits is kept and the next pass starts.

pack_node is a depth-first search, items largest first, a GPU tried once per distinct (load, count), pruned where
the items left exceed the room left or a GPU's load plus its slots left filled with the smallest items exceeds the
cap (that bound took the synth-e32 repack from ~3M search nodes to a few hundred); it gives up after PACK_NODES.
Shape legend: E experts, P slots, T tokens, K top-k, N nodes, C candidate trades.
"""

from __future__ import annotations

import numpy as np

from r3trace.eplb.cover import cover, max_load, node_masks
from r3trace.eplb.placement import Cluster

EXCHANGE_TRIES = 16  # trades a pass packs at most (the best by nodes per token first)
EXCHANGE_PASSES = 8  # passes a layer makes at most (each kept trade starts one)
EXCHANGE_CANDIDATES = 1 << 15  # trades a pass scores at most (per node pair, the first in expert order)
PACK_NODES = 20_000  # search nodes pack_node visits before it gives up


def pack_node(share: np.ndarray, gpus: int, slots: int, cap: float) -> np.ndarray | None:
    """share [gpus * slots] loads of one node's replicas -> each replica's GPU (0 .. gpus - 1), `slots` a GPU, every
    GPU's load <= cap; None where none is found within PACK_NODES."""
    order = np.argsort(-share, kind="stable")
    s = share[order].tolist()
    n = len(s)
    left = np.r_[np.cumsum(s[::-1])[::-1], 0.0].tolist()  # left[i]: the items from i on
    smallest = np.r_[0.0, np.cumsum(s[::-1])].tolist()  # smallest[r]: the r smallest items
    load, count, gpu = [0.0] * gpus, [0] * gpus, [0] * n
    visits = 0

    def place(i: int) -> bool:
        nonlocal visits
        visits += 1
        if i == n:
            return True
        if visits > PACK_NODES or left[i] > sum(cap - load[g] for g in range(gpus) if count[g] < slots) + 1e-9:
            return False
        tried = set()
        for g in range(gpus):
            if count[g] == slots or load[g] + s[i] + smallest[slots - count[g] - 1] > cap + 1e-9:
                continue
            if (load[g], count[g]) in tried:
                continue
            tried.add((load[g], count[g]))
            load[g] += s[i]
            count[g] += 1
            gpu[i] = g
            if place(i + 1):
                return True
            load[g] -= s[i]
            count[g] -= 1
        return False

    if not place(0):
        return None
    out = np.empty(n, dtype=np.int64)
    out[order] = gpu
    return out


def exchanges(ph: np.ndarray, w: np.ndarray, tok: np.ndarray, cl: Cluster) -> np.ndarray:
    """One layer ph [P], loads w [E], tokens [T, K] -> ph [P] with nodes per token <= ph's and max GPU load <= ph's
    (module doc)."""
    e, spn = len(w), cl.gpus_per_node * cl.slots_per_gpu
    node = cl.slot_node()
    cnt = np.bincount(ph, minlength=e)
    cap = max_load(ph, w, cl) + 1e-9 * max(float(w.sum()), 1e-12)
    base = node_masks(ph[None], e, cl)[0]  # [E]; a repack inside nodes leaves it as a trade's masks row says
    best = float(cover(base[None], tok, cl)[0])
    for _ in range(EXCHANGE_PASSES):
        trades = _trades(ph, cnt, node, cl.num_nodes)  # [C, 4] experts a1, a2 (node a), b1, b2 (node b)
        if not len(trades):
            break
        masks = np.tile(base, (len(trades), 1))
        rows = np.arange(len(trades))[:, None]
        masks[rows, trades[:, :2]] = base[trades[:, 2:3]]  # a's experts take b's node and the other way round
        masks[rows, trades[:, 2:]] = base[trades[:, 0:1]]
        nd = cover(masks, tok, cl)
        kept = None
        for j in np.argsort(nd, kind="stable")[:EXCHANGE_TRIES]:
            if nd[j] >= best - 1e-12:
                break
            kept = _repacked(ph, trades[j], w, cnt, node, cl, cap, spn)
            if kept is not None:
                ph, best, base = kept, float(nd[j]), masks[j]
                break
        if kept is None:
            break
    return ph


def _trades(ph: np.ndarray, cnt: np.ndarray, node: np.ndarray, n: int) -> np.ndarray:
    """[C, 4] the 2-for-2 trades of one-replica experts between two nodes (a1 < a2 on node a, b1 < b2 on node b,
    a < b), at most EXCHANGE_CANDIDATES."""
    lone = [np.sort(ph[(node == k) & (cnt[ph] == 1)]) for k in range(n)]
    out = []
    for a in range(n):
        for b in range(a + 1, n):
            ia, ja = np.triu_indices(len(lone[a]), 1)
            ib, jb = np.triu_indices(len(lone[b]), 1)
            pa, pb = np.repeat(np.arange(len(ia)), len(ib)), np.tile(np.arange(len(ib)), len(ia))
            out.append(np.stack([lone[a][ia[pa]], lone[a][ja[pa]], lone[b][ib[pb]], lone[b][jb[pb]]], 1))
    found = np.concatenate(out) if out else np.zeros((0, 4), dtype=np.int64)
    return found[:EXCHANGE_CANDIDATES]


def _repacked(ph: np.ndarray, trade: np.ndarray, w: np.ndarray, cnt: np.ndarray, node: np.ndarray, cl: Cluster,
              cap: float, spn: int) -> np.ndarray | None:
    """ph with the trade's four slots swapped and its two nodes' replicas packed onto their GPUs under cap, or
    None where either node does not pack."""
    slot = {int(x): int(np.flatnonzero(ph == x)[0]) for x in trade}  # one-replica experts: one slot each
    out = ph.copy()
    for x, y in ((trade[0], trade[2]), (trade[1], trade[3])):
        out[slot[int(x)]], out[slot[int(y)]] = y, x
    for k in (int(node[slot[int(trade[0])]]), int(node[slot[int(trade[2])]])):
        seg = slice(k * spn, (k + 1) * spn)
        ex = out[seg]
        gpu = pack_node(w[ex] / cnt[ex], cl.gpus_per_node, cl.slots_per_gpu, cap)
        if gpu is None:
            return None
        out[seg] = ex[np.argsort(gpu, kind="stable")]
    return out
