"""The dispatcher's cover: per token and layer, the fewest nodes holding all K of its experts (score.node_limited's
first step). Exact over the 2^N - 1 node subsets up to EXACT_COVER_NODES nodes (ties broken by random draws, so no
node is favoured), greedy set cover above. Shape legend: T tokens, L layers, K top-k, E experts, N nodes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from itertools import islice

import numpy as np


def flat_keys(topk_ids: np.ndarray, e: int) -> np.ndarray:
    """[T, L, K] expert ids -> [T, L, K] int64 (layer, expert) rows of an [L, E] table, raveled."""
    flat = topk_ids.astype(np.int64)
    flat += (np.arange(topk_ids.shape[1]) * e)[None, :, None]
    return flat


def expert_bits(cnt: np.ndarray) -> np.ndarray:
    """cnt [L, E, N] (N <= 8) -> [L E] uint8 node bitmask of each (layer, expert)."""
    n = cnt.shape[2]
    return ((cnt > 0).astype(np.uint16) << np.arange(n, dtype=np.uint16)).sum(-1, dtype=np.uint16).astype(
        np.uint8).ravel()


def chosen_nodes(cnt: np.ndarray, flat: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """cnt [L, E, N] replicas per node, flat [T, L, K] tokens' (layer, expert) rows -> chosen [T, L, N]: the cover
    node_limited dispatches each token over (exact below EXACT_COVER_NODES, greedy above, ties by rng)."""
    if n <= EXACT_COVER_NODES:  # node bitmask per (layer, expert), gathered per token: 1 byte, not N bools
        t, n_layers = flat.shape[:2]
        code = cover_codes(np.take(expert_bits(cnt), flat), n, tie_scores(rng, n, t, n_layers))
        return ((code[..., None] >> np.arange(n)) & 1).astype(bool)
    return _greedy_cover(np.take(cnt.reshape(-1, n), flat, axis=0) > 0, rng)  # has [T, L, K, N]


EXACT_COVER_NODES = 8  # 255 subsets: exact; 18 nodes would be 262K subsets, so greedy there


def tie_scores(rng: np.random.Generator, n: int, t: int, n_layers: int) -> Iterator[tuple[int, np.ndarray]]:
    """The cover search's order over node subsets (size, then subset; subset s is the bitmask s + 1) with each one's
    score where it covers, [T, L]: its size plus one random draw x 0.5 per (token, layer), drawn in that order as
    the search reads them (255 subsets of [2,048, 58] scores on 8 nodes would be 243 MB at once)."""
    size = np.bitwise_count(np.arange(1, 2**n))  # [S]
    for s in np.argsort(size, kind="stable"):
        yield int(s), size[s] + rng.random((t, n_layers)) * 0.5


def cover_codes(bits: np.ndarray, n: int, ties: Iterable[tuple[int, np.ndarray]]) -> np.ndarray:
    """bits [T, L, K] uint8 node bitmask of each expert (N <= 8 nodes), ties (tie_scores) -> [T, L] int64 the
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
    """cover_codes on two nodes, the same codes from the kinds of expert a token has (bit m of `seen` set where one
    has mask m): one node-1-only and one node-2-only expert need both nodes (3); else the node holding them all; where
    both nodes do (every expert on both), the lower of the two size-1 scores, as the general search's strict < keeps
    node 1 on equal scores. Reads only the first two ties (subsets {1} and {2}): 3x-4x faster at [2,048, 58, 8]."""
    (_, one), (_, two) = islice(ties, 2)  # [T, L] scores of node 1 alone, node 2 alone
    return two_node_code(or_over_k(np.left_shift(np.uint8(1), bits, dtype=np.uint8)), one, two)




def or_over_k(x: np.ndarray) -> np.ndarray:
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


def two_node_code(seen: np.ndarray, one: np.ndarray, two: np.ndarray) -> np.ndarray:
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
