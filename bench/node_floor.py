"""How few nodes can a token reach on 144 GPUs / 18 nodes / 288 slots when balance does not matter at all?

DeepSeek-V3's node limit (a token's K = 8 experts on at most 4 nodes) holds by construction only when each of
the router's groups sits on one node. With 8 groups of 32 experts and 16 slots per node no group fits a node,
so the limit can only hold if the placement co-locates the experts that tokens choose together. This builds
placements for co-location alone and scores them on held-out tokens, as a floor for what any balanced
placement can reach (BENCHMARKS.md, "EPLB"):

1. partition: the 256 experts in 18 bins of 14-15 (a balanced partition of the co-choice graph, greedy
   pairwise swaps that raise within-bin co-choices, from a random start), one copy each;
2. + replicas: the 32 spare slots (1-2 per node) get the experts most co-chosen with that node's experts.

Nodes per token = the greedy node cover of score.node_limited (the same dispatcher the EPLB table uses).
Run:   .venv/bin/python -m bench.node_floor [--layers 8] [--window-tokens 16384]
Smoke: .venv/bin/python -m bench.node_floor --smoke   (1 layer at s = 0.6, 512-token windows)
"""

from __future__ import annotations

import argparse

import numpy as np

from r3trace.analysis.synth import SynthConfig, route_windows
from r3trace.eplb import Cluster
from r3trace.eplb.placement import from_phy2log
from r3trace.eplb.score import node_limited

E, K = 256, 8


def co_choices(ids: np.ndarray) -> np.ndarray:
    """ids [T, K] of one layer -> [E, E] tokens that chose both (zero diagonal)."""
    onehot = np.zeros((len(ids), E), dtype=np.float32)
    np.put_along_axis(onehot, ids.astype(np.int64), 1.0, axis=1)
    c = onehot.T @ onehot
    np.fill_diagonal(c, 0)
    return c.astype(np.float64)


def partition(c: np.ndarray, sizes: np.ndarray, rng: np.random.Generator, max_swaps: int = 5000) -> np.ndarray:
    """[E, E] co-choices, bin sizes [N] -> bin of each expert [E], greedy best swap until none gains."""
    bins = np.repeat(np.arange(len(sizes)), sizes)
    rng.shuffle(bins)
    same = bins[:, None] == bins[None, :]
    for _ in range(max_swaps):
        m = np.stack([c[:, bins == b].sum(1) for b in range(len(sizes))], 1)  # [E, N] co-choices per bin
        own = m[np.arange(E), bins]
        cross = m[:, bins]  # cross[a, b] = co-choices of a with b's bin
        gain = cross - own[:, None] + cross.T - own[None, :] - 2 * c  # swap a <-> b
        gain[same] = -1
        a, b = np.unravel_index(np.argmax(gain), gain.shape)
        if gain[a, b] <= 0:
            break
        bins[a], bins[b] = bins[b], bins[a]
        same = bins[:, None] == bins[None, :]
    return bins


def layer_slots(c: np.ndarray, cl: Cluster, rng: np.random.Generator, replicas: bool) -> np.ndarray:
    """One layer's phy2log [P]: partition bins as nodes, spare slots filled with co-chosen replicas or copies."""
    n, spn = cl.num_nodes, cl.slots_per_node
    sizes = np.full(n, E // n)
    sizes[: E % n] += 1  # 256 over 18 nodes: 4 of 15, 14 of 14
    bins = partition(c, sizes, rng)
    phy = np.empty(cl.num_slots, dtype=np.int64)
    for node in range(n):
        members = np.flatnonzero(bins == node)
        spare = spn - len(members)
        if replicas:  # the outside experts most co-chosen with this node's experts
            score = c[:, members].sum(1)
            score[members] = -1
            extra = np.argsort(-score, kind="stable")[:spare]
        else:  # spare slots hold second copies of the node's own members: no new co-location
            extra = members[:spare]
        phy[node * spn:(node + 1) * spn] = np.r_[members, extra]
    return phy


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8, help="MoE layers scored (evenly spaced over 58)")
    ap.add_argument("--window-tokens", type=int, default=16384)
    ap.add_argument("--s", type=float, nargs="*", default=[0.3, 0.6, 1.0], help="Zipf skews")
    ap.add_argument("--smoke", action="store_true", help="1 layer at s = 0.6, 512-token windows (make test)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.window_tokens, args.s = 1, 512, [0.6]
    cl = Cluster(144, 18, 288)
    layers = np.linspace(0, 57, args.layers).round().astype(int)
    print("| s | placement | nodes/token mean | > 4 nodes |\n|---|---|---|---|")
    for s in args.s:
        wins = route_windows(SynthConfig(zipf_s=s, seed=3), 2, args.window_tokens, np.random.default_rng(0))
        train, test = wins[0][:, layers], wins[1][:, layers]  # [T, L', K]
        for name, replicas in (("partition", False), ("partition + co-chosen replicas", True)):
            phy = np.stack([layer_slots(co_choices(train[:, i]), cl, np.random.default_rng(i), replicas)
                            for i in range(len(layers))])
            d = node_limited(from_phy2log(phy, E), test, cl)
            print(f"| {s} | {name} | {d.nodes.mean():.2f} | {(d.nodes > 4).mean():.1%} |", flush=True)


if __name__ == "__main__":
    main()
