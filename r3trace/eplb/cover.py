"""Cover: fewer nodes per token at a fixed max GPU load, the search polish.py runs after its search on the max load.

Nodes per token here is the mean over a layer's newest tokens of the fewest nodes that hold all K of a token's
experts (exact cover over the 2^N - 1 node subsets, N <= 8), as score.node_limited counts it. polish's moves
never raise it but only move to lower the max GPU load, so they stop where the first balanced layout stops: at
its own max load, bench/eplb_milp.py's exact program found 1.000 nodes per token (proven) on synth-e16 against
polish's 1.150, and 1.135 against 1.281 on sample-e32.

lower_cover is an iterated local search on the cover at that max load M (the input's): each round perturbs the
best layout so far by COVER_STEPS steps, each the move with the fewest nodes per token among COVER_TRIES random
ones (a swap of two slots on different nodes, or one replica of an expert with >= 2 given to another expert, up
to the replica cap), taken where it lowers the cover, or at random (COVER_WALK) where it does not; the loads
this leaves uneven are then brought back down by polish's descent, whose moves never raise the cover. A round
is kept where its max GPU load is <= M and its cover is lower (or equal with a lower max load). Moving only
under the load cap got nowhere: at the optimum most GPUs sit at M and nearly every swap overloads one (0.3% of
random swaps were accepted on sample-e32); annealing with a penalty on the overload rarely came back to <= M.
In sample on bench/eplb_milp.py's instances (nodes per token, max GPU load): synth-e16 1.150 -> 1.000 at 20.0
(one node a token: nothing is lower), synth-e32 1.427 -> 1.323 at 48.25 -> 48.17, sample-e32 1.281 -> 1.135 at
48.17 -> 48.0 (the proven least max load), synth-e64 2.333 -> 2.135 at 36.0; a plan of them took 0.01 / 1.0 /
0.35 / 3.4 s. (Measured when the search was built; the plans' current figures: BENCHMARKS.md#eplb-placement-milp.)
Seeded, so a plan is reproducible.

Shape legend: E experts, P slots, T tokens, K top-k, N nodes, C candidates.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from r3trace.eplb.placement import Cluster

COVER_BLOCK = 1 << 18  # bytes of node masks cover_sizes handles at once (L2-sized temporaries)
COVER_ROUNDS = 200  # rounds a layer gets at most (synth-e64 went 2.250 after 50 rounds, 2.198 after 200)
COVER_PATIENCE = 64  # rounds in a row without a lower cover that end them
COVER_STEPS = 2  # perturbation steps a round (1: synth-e16 stays at 1.025; 3: no better, 1.6x the time)
COVER_TRIES = 30  # random moves scored a step, the one with the fewest nodes per token taken
COVER_WALK = 0.3  # chance a step takes its best move where that does not lower the cover (crosses plateaus)
COVER_RECOUNT = 0.1  # share of the random moves that recount a replica instead of swapping two slots (0.05: synth-e16
# stays at 1.025; 0.2-0.3: synth-e32 1.365, synth-e64 2.19-2.22 against 1.323 and 2.135 at 0.1)
COVER_BUDGET = COVER_ROUNDS * 96 * 15  # token x node-subset covers a plan's rounds may cost, over its layers: 200
# rounds of one layer of 96 tokens on 4 nodes (synth-e64), 93 of one layer of 1024 tokens on 2 nodes
COVER_MIN_ROUNDS = 32  # a layer's share below this gets none: the sample model's 4 layers of 1024 tokens on 2 nodes
# would get 23, and `r3trace eplb` on its traces (8 GPUs / 2 nodes / 40 slots) took 15.8 s with them, 4.5 s without
# (--policy auto: a backtest plans many times; --policy ours 4.0 s against 3.2 s, 2.5 s of it imports)


def node_masks(cand: np.ndarray, e: int, cl: Cluster) -> np.ndarray:
    """[C, P] -> [C, E] bitmask of the nodes holding each expert (node k = bit k)."""
    c = len(cand)
    bits = (np.int64(1) << cl.slot_node()).astype(np.int64)
    out = np.zeros((c, e), dtype=np.int64)
    np.bitwise_or.at(out, (np.repeat(np.arange(c), cand.shape[1]), cand.ravel()), np.tile(bits, c))
    return out


def cover(masks: np.ndarray, tok: np.ndarray | None, cl: Cluster) -> np.ndarray:
    """[B, E] node masks (every expert on some node), tokens [T, K] -> [B] mean over tokens of the fewest nodes
    holding all K experts: cover_sizes' with every mask on the one layer of tok (at 64 layouts of 1,024 tokens on 2
    nodes 1.2 ms, where testing every node subset of each token took 7.7 ms)."""
    if tok is None or cl.num_nodes == 1:
        return np.ones(len(masks))
    sizes = cover_sizes(masks, np.asarray(tok)[:, None, :], cl.num_nodes, np.zeros(len(masks), dtype=np.intp))
    return sizes.mean(1)


def cover_sizes(masks: np.ndarray, tok: np.ndarray, n: int, layer: np.ndarray | None = None) -> np.ndarray:
    """masks [M, E] node bits of each expert (every expert on some node), tokens [T, L, K] (N <= 8 nodes), layer
    [M] the token layer of each mask row (None: row l is layer l, M = L) -> [M, T] the fewest nodes holding all K of
    each token's experts (uint8): score.node_limited's cover size without its loads.

    A node that is an expert's only one is in every cover (the forced nodes F), and where the experts F misses
    share a node one more covers them; only the tokens left (two or more nodes beyond F) are solved by subsets
    (_hitting_size). 84-92% of experts sit on one node in ours' layouts on 4-8 nodes, and one byte a mask
    suffices. Rows go COVER_BLOCK bytes of [K, rows, T] masks at a time (each layer's token row copied whole):
    222 layouts x 2,048 tokens on 4 nodes in ~0.009 s, where all rows at once took 0.010-0.016 s by how the
    allocator served its 3.6 MB temporaries (fresh pages: page faults), and 0.07 s solving every token by subsets."""
    rows, e = masks.shape
    layer = np.arange(rows) if layer is None else np.asarray(layer)
    top_k, n_tok = tok.shape[2], tok.shape[0]
    table = masks.astype(np.uint8).ravel()  # [M E]
    index = np.intp if rows * e >= 1 << 31 else np.int32
    by_k = np.ascontiguousarray(np.transpose(tok, (2, 1, 0)))  # [K, L, T] in the tokens' dtype (int16 from a trace)
    offset = (np.arange(rows, dtype=index) * e)[:, None]  # [M, 1] each row's place in table
    out = np.empty((rows, n_tok), dtype=np.uint8)  # sizes <= 8 (int64: 4.7 MB of fresh pages at 290 x 2,048)
    block = max(1, COVER_BLOCK // max(top_k * n_tok, 1))
    buf = np.empty((top_k, min(block, rows), n_tok), dtype=np.uint8)
    for r0 in range(0, rows, block):
        r1 = min(r0 + block, rows)
        mk = buf[:, : r1 - r0]  # [K, R, T] each token's experts' node masks
        for k in range(top_k):
            idx = np.add(by_k[k, layer[r0:r1]], offset[r0:r1], dtype=index)
            np.take(table, idx, out=mk[k])
        _block_cover(mk, n, out[r0:r1])
    return out


def _block_cover(mk: np.ndarray, n: int, out: np.ndarray) -> None:
    """mk [K, R, T] node masks -> out [R, T] the cover sizes (cover_sizes' doc)."""
    one = (mk & (mk - 1)) == 0  # [K, R, T] expert on one node
    forced = np.bitwise_or.reduce(mk * one, axis=0)  # [R, T] (multiplying: 6x np.where's speed on uint8)
    if n <= 2:  # an expert on both nodes meets any node: a token needs both only where each holds one of its own
        np.add(forced == 3, 1, out=out, casting="unsafe")
        return
    # the experts no forced node holds keep their masks, the rest (every one-node expert among them) read 0xFF
    missed = mk | np.uint8(0xFF) * ((mk & forced) != 0)  # [K, R, T]
    shared = np.bitwise_and.reduce(missed, axis=0)  # [R, T] nodes holding every missed one (0xFF: none missed)
    # a missed expert holds no forced node, so its mask is below 0xFF where F is not empty
    more = (forced == 0) | (shared != 0xFF)
    np.add(np.bitwise_count(forced), more, out=out, casting="unsafe")
    hard = more & (shared == 0)
    if hard.any():
        out[hard] += (_hitting_size(missed[:, hard], n) - 1).astype(out.dtype)


def _hitting_size(missed: np.ndarray, n: int) -> np.ndarray:
    """missed [K, H] node masks of each token's experts outside its forced nodes (0xFF: held by one), no node
    shared by all -> [H] the fewest nodes meeting every mask, from 2 up: which subsets of each size meet a mask
    are packed into 64-bit words (_meeting), a token's the AND of its K masks' words; N where no smaller size
    does (the N nodes always do)."""
    out = np.full(missed.shape[1], n, dtype=np.int64)
    left = np.arange(missed.shape[1])
    for size, table in enumerate(_meeting(n), start=2):
        met = np.bitwise_and.reduce(table[missed[:, left]], axis=0).any(-1)  # [H']
        out[left[met]] = size
        left = left[~met]
        if not len(left):
            break
    return out


@functools.cache
def _meeting(n: int) -> tuple[np.ndarray, ...]:
    """Per subset size 2 .. N - 1: [256, W] uint64, bit j of a row set where the j-th node subset of that size
    meets the row's node mask (every subset meets 0xFF)."""
    tables = []
    node_mask = np.arange(256)[:, None]
    for size in range(2, n):
        subsets = np.array([s for s in range(1, 1 << n) if bin(s).count("1") == size])
        packed = np.packbits((node_mask & subsets) != 0, axis=-1, bitorder="little")  # [256, ceil(C / 8)]
        words = -(-len(subsets) // 64)
        tables.append(np.pad(packed, ((0, 0), (0, words * 8 - packed.shape[1]))).view(np.uint64))
    return tuple(tables)


def cover_rounds(cl: Cluster, n_layers: int, n_tokens: int) -> int:
    """Rounds each of a plan's n_layers layers gets: COVER_ROUNDS, or COVER_BUDGET's share where less, and none
    below COVER_MIN_ROUNDS."""
    per_round = max(n_layers * n_tokens * ((1 << cl.num_nodes) - 1), 1)
    rounds = min(COVER_ROUNDS, COVER_BUDGET // per_round)
    return rounds if rounds >= COVER_MIN_ROUNDS else 0


def max_load(ph: np.ndarray, w: np.ndarray, cl: Cluster) -> float:
    """One layer [P], loads [E] -> the max GPU load under the even split of each expert's load over its replicas."""
    cnt = np.bincount(ph, minlength=len(w))
    return float((w[ph] / cnt[ph]).reshape(cl.num_gpus, -1).sum(1).max())


def lower_cover(ph: np.ndarray, w: np.ndarray, tok: np.ndarray, cl: Cluster, rounds: int,
                descend: Callable[[np.ndarray], np.ndarray], max_count: int) -> np.ndarray:
    """One layer ph [P], forecast loads w [E], tokens [T, K] -> ph [P] with max GPU load <= ph's and nodes per token
    <= ph's (module doc). descend: polish's descent on the max load (never raises the cover); max_count: most
    replicas one expert may get (recounts stop there)."""
    e = len(w)
    if rounds <= 0 or cl.num_nodes == 1 or not len(tok):
        return ph
    node = cl.slot_node()
    tol = 1e-9 * max(float(w.sum()) / cl.num_gpus, 1e-12)
    cap = max_load(ph, w, cl) + tol
    rng = np.random.default_rng(0)
    best, best_load = ph, cap
    best_cover = float(cover(node_masks(ph[None], e, cl), tok, cl)[0])
    stale = 0
    for _ in range(rounds):
        if stale >= COVER_PATIENCE or best_cover <= 1 + 1e-12:
            break
        x, x_cover = best, best_cover
        for _ in range(COVER_STEPS):
            cands = _moves(x, rng, e, node, max_count)  # [C, P]
            if not len(cands):
                continue
            nd = cover(node_masks(cands, e, cl), tok, cl)
            j = int(np.argmin(nd))
            if nd[j] < x_cover - 1e-12 or rng.random() < COVER_WALK:
                x, x_cover = cands[j], float(nd[j])
        x = descend(x)
        x_load = max_load(x, w, cl)
        x_cover = float(cover(node_masks(x[None], e, cl), tok, cl)[0])
        lower = x_cover < best_cover - 1e-12 or (x_cover <= best_cover + 1e-12 and x_load < best_load - tol)
        if x_load <= cap and lower:
            best, best_cover, best_load, stale = x, x_cover, x_load, 0
        else:
            stale += 1
    return best


def _moves(x: np.ndarray, rng: np.random.Generator, e: int, node: np.ndarray, max_count: int) -> np.ndarray:
    """[C, P] up to COVER_TRIES random moves of x: swaps of two slots on different nodes holding different
    experts, and recounts (a slot of an expert with >= 2 replicas given to an expert below max_count)."""
    p = len(x)
    cnt = np.bincount(x, minlength=e)
    n_re = int(rng.binomial(COVER_TRIES, COVER_RECOUNT))
    a, b = rng.integers(p, size=(2, COVER_TRIES - n_re))
    ok = (node[a] != node[b]) & (x[a] != x[b])
    a, b = a[ok], b[ok]
    swaps = np.tile(x, (len(a), 1))
    swaps[np.arange(len(a)), a], swaps[np.arange(len(a)), b] = x[b], x[a]
    s, f = rng.integers(p, size=n_re), rng.integers(e, size=n_re)
    ok = (cnt[x[s]] > 1) & (cnt[f] < max_count) & (x[s] != f)
    recounts = np.tile(x, (int(ok.sum()), 1))
    recounts[np.arange(len(recounts)), s[ok]] = f[ok]
    return np.concatenate([swaps, recounts])
