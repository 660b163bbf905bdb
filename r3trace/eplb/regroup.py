"""Regroup: which node each GPU's slot set sits on, chosen by co-activation; every GPU keeps its load.

Without a spare slot (P = E) a token's nodes are exactly the distinct nodes of its K experts, and moving a
whole GPU's slot set to another node changes no GPU's load, so nodes per token can be lowered at no cost to
balance. The GPU co-choice matrix A [G, G] counts, over the tokens, the pairs of a token's experts that sit on two
GPUs; each step swaps two GPUs of two nodes where that raises the co-choices inside nodes, Kernighan-Lin style:
for each ordered pair of nodes (n1, n2) the GPU of n1 that gains most by moving to n2, paired with the GPU of
n2 that gains most by moving to n1, the best such swap of the layer taken while its exact gain is positive.
Only the best GPU per node pair is looked at (G x N gains a step instead of G x G pairs: the exact best pair over
G x G made a fresh plan at [58, 256] on 16 nodes take 1.1 s), and all layers step together: such a plan takes
0.27 s with the regroups, 0.07 s without, DeepSeek's reference 1.14 s (bench/eplb_matrix.plan_times' protocol).
The pairwise count stands in for the distinct nodes, which do not split
over pairs, so candidates.regrouped keeps a regrouped layer only where held-out tokens say it has fewer.
On bench/eplb_matrix.py's 128 GPU / 16 node / 256 slot cells the layouts of DeepSeek's global policy (hottest
experts one per GPU on the first nodes) and of ours' group homes keep many of a token's experts apart.

Shape legend: L layers, P slots, E experts, G GPUs, N nodes, T tokens, K top-k.
"""

from __future__ import annotations

import numpy as np

from r3trace.eplb.placement import Cluster

REGROUP_STEPS = 1  # swaps per GPU at most (128 GPUs: 128 steps; a layer of the grouped router stopped after 60-100)
PAIR_CHUNK = 1 << 18  # token pairs counted per bincount in gpu_coactivation (2 MB of indices)


def gpu_coactivation(phy2log: np.ndarray, tokens: np.ndarray, cluster: Cluster) -> np.ndarray:
    """phy2log [L, P] with every expert once, tokens [T, L, K] -> [L, G, G] symmetric count of a token's expert
    pairs on GPUs g and h, zero diagonal.

    The [T, L, K (K - 1) / 2] pair indices are made and counted PAIR_CHUNK at a time (whole layers, each pair
    position a contiguous add over the tokens): built all at once (13 MB at [58, 256], T = 1024) the count took
    22-28 ms, in chunks that stay in cache 6-7 ms."""
    n_layers, e = phy2log.shape
    g, (t, _, k) = cluster.num_gpus, tokens.shape
    gpu_of = np.empty_like(phy2log)
    gpu_of[np.arange(n_layers)[:, None], phy2log] = cluster.slot_gpu()[None, :]  # [L, E]
    pairs = k * (k - 1) // 2
    chunk = max(1, PAIR_CHUNK // max(1, t * pairs))  # layers per chunk
    counts = np.empty((n_layers, g * g), dtype=np.intp)
    buf = np.empty((min(chunk, n_layers), pairs, t), dtype=np.intp)  # [m, pairs, T] pair indices of a chunk
    gk, hi = (np.empty((min(chunk, n_layers), k, t), dtype=np.intp) for _ in range(2))  # [m, K, T]
    for lo in range(0, n_layers, chunk):
        m = min(chunk, n_layers - lo)
        key = gk[:m]
        key[...] = tokens[:, lo:lo + m].transpose(1, 2, 0)
        key += (np.arange(lo, lo + m) * e)[:, None, None]  # (layer, expert) of each choice into [L, E] raveled
        np.take(gpu_of, key, out=key)  # GPU of each choice (out is buffered: mode "raise"); take_along_axis
        # instead made the whole count 2x as long
        np.multiply(key, g, out=hi[:m])
        hi[:m] += (np.arange(m) * g * g)[:, None, None]  # row of the first GPU in the chunk's [m, G, G] blocks
        p = 0
        for i in range(k - 1):  # pairs (i, j > i) of the K positions
            np.add(hi[:m, i, None], key[:, i + 1:], out=buf[:m, p:p + k - 1 - i])
            p += k - 1 - i
        counts[lo:lo + m] = np.bincount(buf[:m].ravel(), minlength=m * g * g).reshape(m, g * g)
    a = counts.reshape(n_layers, g, g).astype(np.float32)
    a += a.transpose(0, 2, 1)
    a[:, np.arange(g), np.arange(g)] = 0.0
    return a


def regroup(phy2log: np.ndarray, tokens: np.ndarray, cluster: Cluster) -> np.ndarray:
    """phy2log [L, P] with every expert once, tokens [T, L, K] -> [L, P]: the same GPU slot sets, GPUs placed on
    nodes by the swaps of the module doc (GPUs of one node in their old order)."""
    if cluster.num_nodes == 1 or not len(tokens) or not len(phy2log):
        return phy2log
    return reordered(phy2log, node_order(gpu_coactivation(phy2log, tokens, cluster), cluster), cluster)


def reordered(phy2log: np.ndarray, order: np.ndarray, cluster: Cluster) -> np.ndarray:
    """phy2log [L, P], order [L, G] (new GPU position -> old GPU) -> [L, P] with the GPUs' slot sets moved."""
    n_layers, g = order.shape
    if not n_layers:
        return phy2log
    spg = phy2log.shape[1] // g
    return np.take_along_axis(phy2log.reshape(n_layers, g, spg), order[:, :, None], 1).reshape(n_layers, -1)


def node_order(a: np.ndarray, cluster: Cluster) -> np.ndarray:
    """GPU co-choices a [L, G, G] (gpu_coactivation: symmetric integer counts) -> order [L, G]: new GPU position ->
    old GPU after the swaps of the module doc; a is left as it was.

    Per step and layer: for each ordered pair of nodes (n1, n2) the GPU of n1 with the largest gain
    d[p, n2] - d[p, n1] (d [G positions, N]: its co-choices with each node's GPUs; the first position among equal
    gains), the pair of nodes with the largest exact swap gain (the first in (n1, n2) order among equal ones), taken
    while that gain is > 0. The counts are integers, so it is done in int64: the same choices as in float32 where
    float32 is exact (counts < 2^24). d is held as dd [N2, G / N, L, N1] (dd[n2, j, l, n1] = gpn x d[position
    n1 gpn + j, n2], gpn = GPUs per node) so a step's gains are one subtraction broadcast over the outer axis and one
    max over an outer axis; adding gpn - 1 - j to the scaled gains makes that max also the first position among
    ties. With float32 [L, G, N] gains and argmax over G / N (a reduce over an inner axis of 8) the order of [58, 64
    GPUs] took 12-14 ms against 9-11 (36 steps; a step is ~20 small numpy calls, so fewer calls, not less data, is
    what is left to gain)."""
    n_layers, g, n, gpn = a.shape[0], cluster.num_gpus, cluster.num_nodes, cluster.gpus_per_node
    if n == 1 or not n_layers:
        return np.tile(np.arange(g), (n_layers, 1))
    members = np.tile(np.arange(g), (n_layers, 1))  # [L, G] the GPU at each position; position p is on node p // gpn
    a0 = a.astype(np.int64)  # [L, G, G] by GPU id
    dd = np.ascontiguousarray(a0.reshape(n_layers, n, gpn, n, gpn).sum(-1).transpose(3, 2, 0, 1)) * gpn
    jj, ll, nn = np.meshgrid(np.arange(gpn), np.arange(n_layers), np.arange(n), indexing="ij")  # [G / N, L, N]
    own = ((nn * gpn + jj) * n_layers + ll) * n + nn  # [G / N, L, N1] into dd raveled: the position's own node
    rank = (gpn - 1 - np.arange(gpn))[:, None, None]  # [G / N, 1, 1] the first position of a node ranks highest
    first_pos = np.arange(n) * gpn  # [N1]
    row = (np.arange(n_layers) * g)[None, :, None]  # [1, L, 1] into [L, G] raveled
    rows = np.arange(n_layers)
    for _ in range(REGROUP_STEPS * g):
        key = dd - (np.take(dd, own) - rank)  # [N2, G / N, L, N1]
        gain, r = np.divmod(key.max(1), gpn)  # [N2, L, N1]: gain of the best GPU of n1 moving to n2, and its rank
        pos = (gpn - 1 - r) + first_pos  # [N2, L, N1] its position
        who = np.take(members, row + pos)  # [N2, L, N1] its GPU id
        pair = np.take(a0, (row + who) * g + who.transpose(2, 1, 0))  # [N2, L, N1] co-choices of the two GPUs
        total = (gain + gain.transpose(2, 1, 0) - 2 * pair).transpose(1, 0, 2).reshape(n_layers, n * n)  # symmetric
        # in the two nodes, so its first max in (n2, n1) order is the first in (n1, n2) order, transposed
        best = total.argmax(1)
        live = np.flatnonzero(total[rows, best] > 0)
        if not len(live):
            break
        k = len(live)
        na, nb = np.divmod(best[live], n)
        pa, pb = pos[nb, live, na], pos[na, live, nb]  # [k] the GPU at pa (on na) and at pb (on nb) trade
        mem = members[live]
        x, y = mem[np.arange(k), pa], mem[np.arange(k), pb]
        delta = np.take(a0[live, y] - a0[live, x], (np.arange(k) * g)[:, None] + mem)  # [k, G positions], a symmetric
        delta = delta.reshape(k, n, gpn).transpose(0, 2, 1) * gpn  # [k, G / N, N1]
        dd[na, :, live, :] += delta  # y joins na, x leaves it
        dd[nb, :, live, :] -= delta
        (ma, ja), (mb, jb) = np.divmod(pa, gpn), np.divmod(pb, gpn)
        dd[:, ja, live, ma], dd[:, jb, live, mb] = dd[:, jb, live, mb], dd[:, ja, live, ma].copy()
        members[live, pa], members[live, pb] = y, x
    return np.sort(members.reshape(n_layers, n, gpn), axis=2).reshape(n_layers, g)  # GPUs of a node in old order
