"""Static-even layouts: every expert's replicas all on one node, or at most one a node, so that SGLang's static
dispatch splits an expert's load as the even split does.

Why: under SGLang's node rule (static.py's rule 3) a rank without its own replica of expert e sends to its node's
first replica whenever the node holds some but not all of e's replicas. With c replicas at most one a node, each
serves its node's G / N ranks plus an even share of the ranks on nodes without one: G / c ranks each, the even
split. All c on one node: the rule never applies and the G - c ranks without a copy are spread evenly over the c
replicas: again G / c each. Any other layout is "mixed" (a node holding 2 .. c - 1 of them) and gives that node's
first replica its node's ranks while the others serve their own rank alone (2 nodes x 8 GPUs, e on GPUs 0, 1 and 8:
7 / 16, 1 / 16 and 8 / 16 of e's load against an even 1 / 3).

When: plan() runs this last where ours plans for static dispatch (`r3trace eplb --dispatch static`,
PlannerConfig.static_even) on a cluster of several nodes (one node never has a mixed layout).

How, per layer, hottest expert first: a mixed expert moves one replica at a time by swapping it with a slot of
another expert, towards one a node (when c <= N and that takes no more moves than gathering them) or onto the node
holding most of them. Of the swaps whose other expert's layout stays static-even, the one whose two GPUs' higher
even-split load after it is lowest; an expert with no such swap is left as it is. Then, as the moves raised some GPU
loads, the hottest GPU's slots are swapped with any other slot while that lowers the higher of the two GPUs' loads
below the hottest and keeps both experts static-even (at most LEVEL_SHARE of the slots a layer).
Shape legend: L layers, P slots, E experts, N nodes.
"""

from __future__ import annotations

import numpy as np

from r3trace.eplb.placement import Cluster

LEVEL_SHARE = 0.02  # slots a layer the leveling may move (two a swap), as a share of P; the churn goal is 10%


def bad_nodes(node_count: np.ndarray, count: np.ndarray | int) -> np.ndarray:
    """node_count [..., N] replicas of an expert on each node, count its replicas (broadcast) -> [..., N] the nodes
    holding 2 .. c - 1 of them: an expert is mixed where any node is."""
    return (node_count >= 2) & (node_count < count)


def mixed(node_count: np.ndarray) -> bool:
    """node_count [N] one expert's replicas on each node -> whether its layout is mixed (module doc); EvenMoves keeps
    the same answer as counts, and is tested against this."""
    return bool(bad_nodes(node_count, int(node_count.sum())).any())


def static_even(phy2log: np.ndarray, weight: np.ndarray, cluster: Cluster, tau: float = 0.0) -> np.ndarray:
    """phy2log [L, P], weight [L, E] (the forecast planned on) -> phy2log [L, P] with no mixed expert of load >=
    tau x the mean GPU load where a swap could fix it (module doc); a new array, the input unchanged."""
    out = phy2log.copy()
    if cluster.num_nodes == 1:
        return out
    for layer in range(out.shape[0]):
        _layer(out[layer], weight[layer], cluster, tau * float(weight[layer].sum()) / cluster.num_gpus)
    return out


def _layer(ph: np.ndarray, w: np.ndarray, cl: Cluster, floor: float) -> None:
    """ph [P] in place; only experts of load >= floor are fixed."""
    e, n = len(w), cl.num_nodes
    spg, slots_per_node = cl.slots_per_gpu, cl.slots_per_gpu * cl.gpus_per_node
    node_of = np.arange(len(ph)) // slots_per_node  # [P]
    cnt = np.bincount(ph, minlength=e)  # [E]
    share = w / np.maximum(cnt, 1)  # [E] one replica's even-split load
    per_node = np.zeros((e, n), dtype=np.int64)  # [E, N]
    np.add.at(per_node, (ph, node_of), 1)
    gpu_load = np.bincount(np.arange(len(ph)) // spg, weights=share[ph], minlength=cl.num_gpus)  # [G]
    ok = EvenMoves(per_node, cnt)  # its bad-node counts say which experts are mixed, kept by every swap
    for x in np.argsort(-w, kind="stable"):
        if w[x] < floor:
            break
        while ok.bad[x] > 0:
            k = per_node[x]
            spread_moves = int(np.maximum(k - 1, 0).sum())
            gather_moves = int(cnt[x] - k.max())
            if cnt[x] <= n and spread_moves <= gather_moves:
                src_nodes, dst_nodes = k >= 2, k == 0  # one a node
            else:
                home = int(np.argmax(k))
                src_nodes, dst_nodes = np.arange(n) != home, np.arange(n) == home  # all on one node
            if not _swap_one(ph, x, src_nodes & (k > 0), dst_nodes, node_of, share, gpu_load, spg, ok):
                break
    _level(ph, share, gpu_load, node_of, spg, int(LEVEL_SHARE * len(ph) / 2), ok)


def _level(ph: np.ndarray, share: np.ndarray, gpu_load: np.ndarray, node_of: np.ndarray, spg: int, steps: int,
           ok: EvenMoves) -> None:
    """Up to `steps` swaps off the hottest GPU that keep every expert they move static-even (module doc): each the
    swap of a slot of the hottest GPU h with a slot elsewhere whose two GPUs' higher load after it is lowest, taken
    while that is below h's load. ok: the layer's node counts, kept by each swap."""
    gpu_of = np.arange(len(ph)) // spg  # [P]
    for _ in range(steps):
        h = int(np.argmax(gpu_load))
        top = gpu_load[h]
        mine, others = np.flatnonzero(gpu_of == h), np.flatnonzero(gpu_of != h)
        x, f = ph[mine][:, None], ph[others][None, :]  # [S, 1], [1, O]
        a, b = node_of[mine][:, None], node_of[others][None, :]
        delta = share[f] - share[x]  # [S, O]: GPU h swaps x for f, the other GPU f for x
        worst = np.maximum(top + delta, gpu_load[gpu_of[others]][None, :] - delta)
        legal = (f != x) & ((a == b) | (ok.after(x, a, b) & ok.after(f, b, a))) & (worst < top * (1 - 1e-9))
        if not legal.any():
            return
        i, j = np.unravel_index(int(np.argmin(np.where(legal, worst, np.inf))), worst.shape)
        _apply(ph, int(mine[i]), int(others[j]), node_of, share, gpu_load, spg, ok)


class EvenMoves:
    """Whether moving one replica of an expert from node a to another node b leaves its layout not mixed: an expert
    is mixed while some node holds 2 .. c - 1 of its c replicas ("bad" nodes), and a move changes only a's and b's
    counts, so a count of bad nodes per expert answers it for any number of moves at once."""

    def __init__(self, per_node: np.ndarray, count: np.ndarray) -> None:
        self.per_node, self.count = per_node, count  # [E, N] (kept by _apply's swaps), [E]
        self.bad = bad_nodes(per_node, count[:, None]).sum(1)  # [E]

    def after(self, e: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """e, a, b broadcast together (a holding a replica of e, a != b) -> whether e stays not mixed."""
        ka, kb, c = self.per_node[e, a], self.per_node[e, b], self.count[e]
        return self.bad[e] - bad_nodes(ka, c) - bad_nodes(kb, c) + bad_nodes(ka - 1, c) + bad_nodes(kb + 1, c) == 0

    def moved(self, experts: list[int]) -> None:
        """Recount the bad nodes of `experts` after a swap changed their per_node rows."""
        self.bad[experts] = bad_nodes(self.per_node[experts], self.count[experts][:, None]).sum(1)


def _swap_one(ph: np.ndarray, x: int, src_nodes: np.ndarray, dst_nodes: np.ndarray, node_of: np.ndarray,
              share: np.ndarray, gpu_load: np.ndarray, spg: int, ok: EvenMoves) -> bool:
    """Swap one replica of x on a src node with another expert's slot on a dst node (module doc's choice); False
    where none keeps that expert static-even. ok: the layer's node counts."""
    src = np.flatnonzero((ph == x) & src_nodes[node_of])
    dst = np.flatnonzero((ph != x) & dst_nodes[node_of])
    if not len(src) or not len(dst):
        return False
    f = ph[dst][None, :]  # [1, D] the experts that would move to a src slot's node
    delta = share[f] - share[x]  # GPU of s gains f's share and loses x's; GPU of d the reverse
    worst = np.maximum(gpu_load[src // spg][:, None] + delta, gpu_load[dst // spg][None, :] - delta)  # [S, D]
    legal = ok.after(f, node_of[dst][None, :], node_of[src][:, None])  # f moving from d's node to s's stays even
    if not legal.any():
        return False
    i, j = np.unravel_index(int(np.argmin(np.where(legal, worst, np.inf))), worst.shape)
    _apply(ph, int(src[i]), int(dst[j]), node_of, share, gpu_load, spg, ok)
    return True


def _apply(ph: np.ndarray, s: int, d: int, node_of: np.ndarray, share: np.ndarray, gpu_load: np.ndarray, spg: int,
           ok: EvenMoves) -> None:
    """Swap slots s and d in place, with the GPU loads and ok's node and bad-node counts kept."""
    x, f = ph[s], ph[d]
    per_node = ok.per_node
    gpu_load[s // spg] += share[f] - share[x]
    gpu_load[d // spg] += share[x] - share[f]
    per_node[x, node_of[s]] -= 1
    per_node[x, node_of[d]] += 1
    per_node[f, node_of[d]] -= 1
    per_node[f, node_of[s]] += 1
    ok.moved([int(x), int(f)])
    ph[s], ph[d] = f, x
