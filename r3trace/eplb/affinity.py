"""Group homes and co-activation replicas: the planner's layout when a group does not fit one node.

On 18 nodes of 16 slots (144 GPUs, 288 slots) each of the 8 groups of 32 experts needs 2-3 nodes, so a
token that picks 4 groups cannot stay within 4 nodes by placement alone. Two things bring it closer
(window 3 of the s = 0.6 benchmark, nodes per token-layer; one node per expert reached 6.77):
1. Group homes: each group gets a contiguous run of whole nodes, as many as its share of the load
   (largest remainder), and every expert's first replica goes to the lightest home node with room. A
   group then spans 2-3 nodes instead of the 3 that contiguous expert order gave it: 6.31 -> 6.19.
2. Extra replicas by co-activation: each extra replica of a hot expert goes to a node without one, the
   node whose homed experts the expert is chosen with most often in the window's tokens, so a token that
   picks the expert with those experts skips its home node: 6.19 -> 5.34 (cross-node policy 5.47).
Tried and dropped: swaps that raise within-node co-activation (6.31 -> 6.22 at 3-13 s per plan: inside a
group the synthetic experts co-activate little beyond chance); keeping the hottest experts' replicas home
(node-limited balancedness fell, 0.605 -> 0.43-0.48, and nodes rose to 5.4-5.7).
Cost: replicas on several nodes let the dispatcher's cover load some of them more than their even share,
so node-limited balancedness falls below the even one (s = 0.6: 0.744 even, 0.605 node-limited).

Shape legend: T tokens, L layers, K top-k, E experts, N nodes.
"""

from __future__ import annotations

import numpy as np

from r3trace.eplb.group_pairing import paired_groups
from r3trace.eplb.packing import balanced_packing
from r3trace.eplb.placement import Cluster, PlacementError

COACT_TOKENS = 1024  # newest tokens counted: 1024 x 58 layers x 28 pairs, 0.09 s of bincount on busy cores (2048: 0.22)


def coactivation_counts(tokens: np.ndarray, num_experts: int) -> np.ndarray:
    """tokens [T, L, K] -> [L, E, E] symmetric counts of tokens choosing both experts (zero diagonal), float32
    (exact below 2^24 tokens). Dense: for baselines and tests; the planner counts only what it reads (CoChoices)."""
    tok = np.asarray(tokens[-COACT_TOKENS:], dtype=np.int64)
    _, n_layers, k = tok.shape
    iu, ju = np.triu_indices(k, 1)
    off = (np.arange(n_layers) * num_experts * num_experts)[None, :, None]
    flat = off + tok[:, :, iu] * num_experts + tok[:, :, ju]
    c = np.bincount(flat.ravel(), minlength=n_layers * num_experts**2).reshape(n_layers, num_experts, num_experts)
    c = c.astype(np.float32)
    return c + c.transpose(0, 2, 1)


class CoChoices:
    """The newest COACT_TOKENS tokens' co-choices, counted only where the planner reads them.

    Equal to coactivation_counts' matrix C [L, E, E] (same integers), without building it: at [58, 256] the
    dense matrix (bincount into 3.8M bins, float32 conversion, transposed add) and its [E, E] @ [E, N] products
    were 0.06-0.15 s of a 0.13-0.23 s fresh plan; node_affinity reads the same pairs in one bincount over
    L x E x N bins, and a re-plan reads only the rows of the few experts whose counts change (rows)."""

    def __init__(self, tokens: np.ndarray | None, num_experts: int) -> None:
        self.e = num_experts
        # [T, L, K] the newest COACT_TOKENS tokens as given (int16 from a trace), read in blocks of ROWS_BLOCK choices:
        # int64 copies of all of them ([1024, 58, 8]: 3.8 MB each) were page-faulted in on every plan
        self._given = None if tokens is None or not len(tokens) else np.asarray(tokens[-COACT_TOKENS:])

    def node_affinity(self, node: np.ndarray, num_nodes: int, rows: np.ndarray | None = None) -> np.ndarray:
        """node [L, E] (one node per expert) -> [L, E, N] = C @ onehot(node): the co-choices of each expert with
        the experts on each node, counted over ordered pairs of a token's K positions (i != j). rows [L, E] bool:
        only those experts' rows are counted, the others stay 0 (affinity_replicas reads only experts with extra
        replicas: 31-43% of the choices at [58, 256], 0.009-0.013 s instead of 0.020-0.025)."""
        n_layers, e = node.shape[0], self.e
        if (rows is not None and not rows.any()) or self._given is None:  # P = E: no expert has an extra replica
            return np.zeros((n_layers, e, num_nodes))
        wanted = np.ones(n_layers * e, dtype=bool) if rows is None else np.asarray(rows, dtype=bool).ravel()
        row_of = np.where(wanted, np.arange(n_layers * e), -1)  # [L E] a (layer, expert) is its own row
        node_of = np.asarray(node, dtype=np.int64).ravel()
        if num_nodes <= NODE_SUMS_NODES:
            return self._node_sums(row_of, node_of, num_nodes).reshape(n_layers, e, num_nodes)
        return self._pairs(row_of, n_layers * e, node_of, num_nodes, node_of).reshape(n_layers, e, num_nodes)

    def _node_sums(self, row_of: np.ndarray, node_of: np.ndarray, num_nodes: int) -> np.ndarray:
        """_pairs' counts [L E * N] for node_affinity on few nodes: each (token, layer)'s choices per node counted
        once ([T' L, N]), then added to each counted choice's row, one weighted bincount per node (N x Q entries
        instead of _pairs' K x Q: at [58, 256] on 2 nodes 5.9 ms against 8.4, on 4 nodes 7.4 against 8.8, on 8 nodes
        10 against 8.3). Integer counts in float64 (exact below 2^53), so the same numbers."""
        given = self._given
        assert given is not None
        t, n_layers, k = given.shape
        off = (np.arange(n_layers) * self.e)[None, :, None]
        n_rows = len(row_of)
        out = np.zeros((num_nodes, n_rows))
        own = np.zeros(n_rows, dtype=np.int64)  # [rows] choices of each row's expert
        step = max(1, ROWS_BLOCK // (n_layers * k))
        for lo in range(0, t, step):
            key = given[lo:lo + step] + off  # [T', L, K] (layer, expert) of each choice
            tl = key.shape[0] * n_layers
            nodes = np.take(node_of, key).reshape(tl, k)  # [T' L, K]
            nodes += (np.arange(tl) * num_nodes)[:, None]
            per_tl = np.bincount(nodes.ravel(), minlength=tl * num_nodes).reshape(tl, num_nodes)  # [T' L, N]
            row = np.take(row_of, key).ravel()  # [T' L K]
            q = np.flatnonzero(row >= 0)  # [Q] the counted choices
            r, at = np.take(row, q), q // k
            for j in range(num_nodes):
                out[j] += np.bincount(r, weights=np.take(per_tl[:, j], at), minlength=n_rows)
            own += np.bincount(r, minlength=n_rows)
        out[node_of, np.arange(n_rows)] -= own  # the pair of each choice with itself
        return out.T.ravel()

    def rows(self, want: np.ndarray) -> np.ndarray:
        """want [L, E] bool -> C[want] [X, E]: the rows of the X wanted (layer, expert) pairs, in (layer, expert)
        order (np.nonzero's).

        A seeded re-plan wants ~13 experts a layer (the ones whose counts change) and reads ~1/4 of the choices. Per
        layer from an index sorted by (layer, expert) this took 6.5 ms at [54, 256] on 1,024 tokens (the sort and its
        3.5 MB of fresh pages), 2.1 ms in one pass."""
        want = np.asarray(want, dtype=bool)
        x = int(want.sum())
        if self._given is None or not x:
            return np.zeros((x, self.e))
        row_of = np.full(want.size, -1, dtype=np.int64)  # [L E] each wanted pair's row, -1 elsewhere
        row_of[want.ravel()] = np.arange(x)
        return self._pairs(row_of, x, None, self.e, np.nonzero(want)[1]).reshape(x, self.e)

    def _pairs(self, row_of: np.ndarray, n_rows: int, value_of: np.ndarray | None, width: int,
               own_value: np.ndarray) -> np.ndarray:
        """The co-choice counts [n_rows * width] (float64) under row_of [L E] (each (layer, expert)'s row, -1: not
        counted) and value_of [L E] (the column each choice adds to, per (layer, expert); None: its expert id).

        Each choice of a counted (layer, expert) adds every choice of its token (itself included) to its row, at
        that choice's value; then each row gives back one pair per choice at own_value [n_rows] (its own value): the
        pair of a choice with itself. Tokens in blocks of ROWS_BLOCK choices, pairs in blocks of PAIR_BLOCK: integer
        counts, exact in any order."""
        given = self._given
        assert given is not None  # the callers return zeros without tokens
        t, n_layers, k = given.shape
        off = (np.arange(n_layers) * self.e)[None, :, None]
        out = np.zeros(n_rows * width, dtype=np.int64)
        own = np.zeros(n_rows, dtype=np.int64)  # [rows] choices of each row's expert
        step = max(1, ROWS_BLOCK // (n_layers * k))
        for lo in range(0, t, step):
            ids = given[lo:lo + step]  # [T', L, K] as given (int16 from a trace)
            key = ids + off  # [T', L, K] (layer, expert) of each choice
            row = np.take(row_of, key)
            value = (ids if value_of is None else np.take(value_of, key)).reshape(-1, k)  # [T' L, K]
            q = np.flatnonzero(row >= 0)  # [Q] the counted choices
            for c in range(0, len(q), PAIR_BLOCK):
                qc = q[c:c + PAIR_BLOCK]
                r = np.take(row, qc)
                # each choice's token's K values, gathered by np.take (nd.reshape(-1, K)[q // K] took 15 ms at
                # [58, 256] on 8 nodes, np.take 8 ms)
                idx = (r * width)[:, None] + np.take(value, qc // k, axis=0)  # [Q', K]
                out += np.bincount(idx.ravel(), minlength=len(out))
                own += np.bincount(r, minlength=n_rows)
        counts = out.reshape(n_rows, width)
        counts[np.arange(n_rows), own_value] -= own
        return counts.ravel().astype(np.float64)


NODE_SUMS_NODES = 4  # node_affinity sums per node (_node_sums) up to this many nodes, else pairs (_pairs)
ROWS_BLOCK = 1 << 17  # tokens' choices CoChoices reads at once: [T', L, K] int64 keys, 1 MB
PAIR_BLOCK = 1 << 14  # choices it pairs at once: [16K, K] int64 keys, 1 MB at K = 8 (the [Q, K] array at once, ~12
# MB at [58, 256], cost page faults: 0.005-0.015 s a fresh plan by the allocator's mood)


def group_home_nodes(weight: np.ndarray, cluster: Cluster) -> tuple[np.ndarray, np.ndarray]:
    """weight [L, E] -> (first node [L, groups], node count [L, groups]): contiguous runs of whole nodes,
    >= 1 per group, counts proportional to group load by largest remainder (sum N per layer)."""
    n_layers, e = weight.shape
    gr, n = cluster.num_groups, cluster.num_nodes
    if e % gr or gr > n:
        raise PlacementError(f"num_groups={gr} must divide E={e} and be <= num_nodes={n}")
    gl = weight.reshape(n_layers, gr, e // gr).sum(-1)
    quota = gl / np.maximum(gl.sum(1, keepdims=True), 1e-12) * n
    count = np.maximum(np.floor(quota).astype(np.int64), 1)
    for layer in range(n_layers):  # at most `gr` corrections per layer
        while count[layer].sum() < n:
            count[layer, np.argmax(quota[layer] - count[layer])] += 1
        while count[layer].sum() > n:
            count[layer, np.argmin(np.where(count[layer] > 1, quota[layer] - count[layer], np.inf))] -= 1
    return np.cumsum(count, 1) - count, count


def group_home_mask(weight: np.ndarray, cluster: Cluster, tokens: np.ndarray | None = None,
                    pair_slack: float = 0.0) -> np.ndarray:
    """weight [L, E] -> [L, groups, N] the home nodes of each group: runs of whole nodes (group_home_nodes) when
    groups <= nodes; whole groups packed onto nodes by load (DeepSeek's balanced packing, groups / N per node)
    when the nodes divide the groups, or with tokens [T, L, K] the even split whose tokens reach the fewest nodes
    within pair_slack of that packing's heaviest node (group_pairing.py); else the nodes its experts reach in
    contiguous order."""
    n_layers, e = weight.shape
    gr, n = cluster.num_groups, cluster.num_nodes
    if e % gr:
        raise PlacementError(f"num_groups={gr} must divide E={e}")
    nid = np.arange(n)
    if gr <= n:
        first, count = group_home_nodes(weight, cluster)
        return (nid >= first[:, :, None]) & (nid < (first + count)[:, :, None])
    if gr % n == 0:
        paired = None if tokens is None else paired_groups(weight, cluster, tokens, pair_slack)
        pack = balanced_packing(weight.reshape(n_layers, gr, e // gr).sum(-1), n)[0] if paired is None else paired
        return pack[:, :, None] == nid  # [L, groups, N]
    mask = np.zeros((gr, n), dtype=bool)
    mask[np.arange(e) // (e // gr), np.arange(e) * n // e] = True
    return np.broadcast_to(mask, (n_layers, gr, n)).copy()


def home_primaries(weight: np.ndarray, cluster: Cluster, tokens: np.ndarray | None = None,
                   pair_slack: float = 0.0) -> np.ndarray:
    """weight [L, E] -> node of each expert's first replica [L, E]: heaviest first onto the lightest home
    node (group_home_mask; tokens, pair_slack: its pairing of groups) with a free primary slot, else the lightest node
    with one. Each node keeps room for
    its share of the P - E extra replicas, so nodes hold E primaries in all and the extras fill the rest exactly.

    Node loads are left unbalanced on purpose: the hottest replicas cap balancedness (0.54-0.84 on 144
    GPUs), and GPU packing inside a node plus swaps reach that cap while nodes differ by up to 20-80%.
    """
    n_layers, e = weight.shape
    n = cluster.num_nodes
    homes = group_home_mask(weight, cluster, tokens, pair_slack)
    extra = cluster.num_slots - e
    cap = np.full(n, cluster.slots_per_node - extra // n)
    cap[: extra % n] -= 1
    gsize = e // cluster.num_groups
    if (homes.sum(2) == 1).all() and (homes.sum(1) * gsize <= cap).all():
        # one home node per group, each with room for all its groups' experts (nodes dividing the groups: 4 and 8
        # nodes at [58, 256]): the loop below puts every expert there, so skip it (5 ms of a 55 ms plan)
        return np.take_along_axis(homes.argmax(2), np.arange(e)[None, :] // gsize, 1)
    rows = np.arange(n_layers)
    load = np.zeros((n_layers, n))
    free = np.tile(cap, (n_layers, 1))
    node = np.empty((n_layers, e), dtype=np.int64)
    for ex in np.argsort(-weight, axis=1, kind="stable").T:  # [L] per step
        home = homes[rows, ex // gsize]  # [L, N]
        open_ = free > 0
        at_home = np.where(home & open_, load, np.inf)
        k = np.argmin(at_home, 1)
        away = np.isinf(at_home[rows, k])  # [L] no home node with a free slot
        if away.any():
            k[away] = np.argmin(np.where(open_[away], load[away], np.inf), 1)
        node[rows, ex] = k
        load[rows, k] += weight[rows, ex]
        free[rows, k] -= 1
    return node


def affinity_replicas(weight: np.ndarray, logcnt: np.ndarray, node: np.ndarray, co: CoChoices,
                      cluster: Cluster) -> np.ndarray:
    """Replicas per (layer, expert, node) [L, E, N]: the first on node [L, E], each extra (highest load per
    replica first) on a node with a free slot and no replica of it yet, the one whose homed experts it is
    chosen with most (co: the newest tokens' co-choices); a node holding it only when every free node does
    already. Ties (no tokens: no co-choices) go to the node with the least load per replica placed so far."""
    n_layers, e = weight.shape
    rows = np.arange(n_layers)
    cnt = np.zeros((n_layers, e, cluster.num_nodes), dtype=np.int64)
    cnt[rows[:, None], np.arange(e)[None, :], node] = 1
    free = cluster.slots_per_node - cnt.sum(1)  # [L, N]
    if (free < 0).any():
        raise PlacementError(f"a node holds more first replicas than its {cluster.slots_per_node} slots")
    aff = co.node_affinity(node, cluster.num_nodes, logcnt > 1)  # [L, E, N] co-choices with each node's experts
    per_rep = weight / logcnt
    load = np.einsum("le,len->ln", per_rep, cnt.astype(np.float64))  # [L, N]
    tie = 1e-6 / np.maximum(weight.sum(1, keepdims=True), 1e-12)  # below one co-choice
    n = cluster.num_nodes
    ids = np.repeat(np.arange(n_layers * e), (logcnt - 1).ravel()).reshape(n_layers, -1)  # [L, P - E] (layer, expert)
    ids = np.take_along_axis(ids, np.argsort(-np.take(per_rep, ids), 1, kind="stable"), 1)  # highest per replica first
    # per step: the expert's co-choices and load per replica, gathered for all steps at once ([P - E, L, N] and
    # [P - E, L]); [L, E, N] and [L, N] state updated through raveled indices
    aff_seq = np.take(aff.reshape(n_layers * e, n), ids.T, axis=0)
    per_seq = np.take(per_rep, ids.T)
    cnt_flat, load_flat, free_flat = cnt.reshape(-1), load.reshape(-1), free.reshape(-1)  # views
    base = np.arange(n_layers) * n
    for step, ex in enumerate(ids.T):  # ex [L]: layer * E + expert
        held = np.take(cnt.reshape(n_layers * e, n), ex, axis=0) > 0
        score = aff_seq[step] - tie * load - np.where(held, 1e18, 0.0) + np.where(free > 0, 0.0, -np.inf)
        k = np.argmax(score, 1)
        cnt_flat[ex * n + k] += 1
        load_flat[base + k] += per_seq[step]
        free_flat[base + k] -= 1
    return cnt
