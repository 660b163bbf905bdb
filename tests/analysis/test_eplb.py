"""EPLB policies and our planner: invariants, a known case, node limit, churn.
Run: .venv/bin/pytest tests/analysis/test_eplb.py -q"""

from __future__ import annotations

import numpy as np
import pytest

from r3trace.analysis.synth import SynthConfig, route_windows
from r3trace.eplb import Cluster, PlannerConfig, churn, cross_node, global_policy, hierarchical, plan
from r3trace.eplb.packing import balanced_packing, replicate_experts
from r3trace.eplb.placement import check_placement, from_json, to_json
from r3trace.eplb.score import balancedness, even_gpu_load, heat_of, node_limited

POLICIES = {"hierarchical": hierarchical, "global": global_policy, "cross_node": cross_node,
            "ours": lambda w, c: plan(w, c)}


@pytest.mark.parametrize("name", list(POLICIES))
def test_invariants_on_random_loads(name: str) -> None:
    rng = np.random.default_rng(6)
    cl = Cluster(num_gpus=8, num_nodes=2, num_slots=40, num_groups=4)
    w = rng.pareto(1.2, (5, 32)) + 0.01
    pl = POLICIES[name](w, cl)
    check_placement(pl, cl)
    assert (pl.logcnt >= 1).all() and (pl.logcnt.sum(1) == 40).all()
    for layer in range(5):  # log2phy points back at slots holding that expert, -1 only as padding
        for e in range(32):
            slots = pl.log2phy[layer, e]
            real = slots[slots >= 0]
            assert len(real) == pl.logcnt[layer, e] and (pl.phy2log[layer, real] == e).all()
            assert (slots[len(real):] == -1).all()


def test_known_small_case() -> None:
    # 4 items onto 2 packs: 10 alone with 1; 6 with 5 -> loads 11 and 11
    idx, rank = balanced_packing(np.array([[10.0, 6.0, 5.0, 1.0]]), 2)
    assert idx.tolist() == [[0, 1, 1, 0]] and sorted(rank[0].tolist()) == [0, 0, 1, 1]
    # 2 extra slots go to the 9 (9 -> 4.5) then the 9 again (-> 3): max load per replica 4 (the 4)
    _, _, cnt = replicate_experts(np.array([[9.0, 4.0, 1.0]]), 5)
    assert cnt.tolist() == [[3, 1, 1]]
    # two experts of load 3 and 1 on 2 GPUs with 4 slots: each GPU gets half of every... best = 1.0
    cl = Cluster(2, 1, 4, num_groups=1)
    pl = global_policy(np.array([[3.0, 1.0]]), cl)
    assert balancedness(even_gpu_load(pl, np.array([[3.0, 1.0]]), cl)) == pytest.approx(1.0)


@pytest.mark.parametrize("packs", [2, 3, 5])
def test_balanced_packing_equals_a_plain_loop(packs: int) -> None:
    """Rows of random, tied and zero weights (packing.py sets the first `packs` steps at once only where the
    weights are positive): each item, heaviest first, into the lightest pack with room, the first such pack."""
    rng = np.random.default_rng(packs)
    n = packs * 3
    w = np.concatenate([rng.integers(0, 4, (6, n)).astype(float), rng.random((3, n)), np.zeros((1, n))])
    for rows in (w, w[1:2] + 1.0):  # with zeros somewhere, and one row of positive weights
        idx, rank = balanced_packing(rows, packs)
        for row, want_idx, want_rank in zip(rows, idx, rank, strict=True):
            load, count = np.zeros(packs), np.zeros(packs, dtype=int)
            for i in np.argsort(-row, kind="stable"):
                p = int(np.argmin(np.where(count < n // packs, load, np.inf)))
                assert (want_idx[i], want_rank[i]) == (p, count[p])
                load[p] += row[i]
                count[p] += 1


def test_replicate_experts_equals_a_plain_loop() -> None:
    """Rows of tied, zero and random weights: each extra slot to the first expert of the highest load per replica,
    its rank the replicas it had."""
    rng = np.random.default_rng(11)
    w = np.concatenate([rng.integers(0, 4, (5, 7)).astype(float), rng.random((3, 7)), np.zeros((1, 7))])
    phy2log, rank, cnt = replicate_experts(w, 19)
    for row, got_phy, got_rank, got_cnt in zip(w, phy2log, rank, cnt, strict=True):
        count = np.ones(7, dtype=int)
        for slot in range(7, 19):
            x = int(np.argmax(row / count))
            assert (got_phy[slot], got_rank[slot]) == (x, count[x])
            count[x] += 1
        assert got_cnt.tolist() == count.tolist() and got_phy[:7].tolist() == list(range(7))


def test_node_limit_and_hierarchical_locality() -> None:
    rng = np.random.default_rng(7)
    e, groups, k = 32, 8, 4
    cl = Cluster(8, 4, 40, num_groups=groups, node_limit=2)
    t = 400
    # group-limited tokens: each picks 2 of 8 groups (4 experts each), then 4 experts inside them
    tok = np.empty((t, 3, k), dtype=np.int64)
    for i in range(t):
        for li in range(3):
            gs = rng.choice(groups, 2, replace=False)
            tok[i, li] = rng.choice(np.concatenate([np.arange(g * 4, g * 4 + 4) for g in gs]), k, replace=False)
    w = heat_of(tok, e)
    keep = {"ours keep_groups": lambda w, c: plan(w, c, tokens=tok, cfg=PlannerConfig(keep_groups=True))}
    for name, f in {**{n: POLICIES[n] for n in ("hierarchical", "cross_node")}, **keep}.items():
        d = node_limited(f(w, cl), tok, cl)
        assert d.nodes.max() <= 2, name  # 2 groups -> at most 2 home nodes (2 groups per node)
        assert d.gpu_load.sum() == pytest.approx(t * 3 * k)
    # the default may move cold experts off their group's node for balance: more nodes on a few tokens
    d = node_limited(plan(w, cl, tokens=tok), tok, cl)
    assert d.nodes.mean() <= node_limited(POLICIES["global"](w, cl), tok, cl).nodes.mean()


def test_replan_on_same_loads_moves_nothing_and_exports() -> None:
    rng = np.random.default_rng(8)
    cl = Cluster(16, 4, 80, num_groups=8)
    hist = rng.pareto(1.0, (3, 6, 64)) + 0.1
    first = plan(hist, cl)
    again = plan(hist, cl, prev=first)
    # the re-plan continues the fresh plan's leveling swaps (48 per layer there) and lowers its hot GPUs other than
    # the hottest, which the fresh plan's polish alone works on (descent.hot_swaps): 26 of 480 slots (5.4%) measured,
    # of the 45 its 9.5% budget allows
    assert churn(first, again) <= 0.06
    moved = plan(hist[:, :, ::-1].copy(), cl, prev=first)  # a different workload does move replicas
    assert churn(first, moved) > 0
    back, cl2 = from_json(to_json(moved, cl))
    assert cl2 == cl and all(np.array_equal(a, b) for a, b in zip(back, moved, strict=True))


def test_hierarchical_reproduces_deepseek_readme_example() -> None:
    # the example of github.com/deepseek-ai/EPLB's README (2 layers x 12 experts, 16 slots, 4 groups, 2 nodes,
    # 8 GPUs) with its printed output; written from the description, same greedy order, same answer
    w = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                  [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]], dtype=float)
    pl = hierarchical(w, Cluster(num_gpus=8, num_nodes=2, num_slots=16, num_groups=4))
    assert pl.phy2log.tolist() == [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                                   [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]


def _skewed_windows(windows: int, tokens: int, experts: int = 64, k: int = 6) -> np.ndarray:
    """[W, T, L, K] routes of a small V3-shaped synthetic router (8 groups, top-4 groups, Zipf s = 1)."""
    cfg = SynthConfig(num_hidden_layers=7, first_k_dense=1, num_experts=experts, top_k=k, zipf_s=1.0,
                      bank_size=1024, seed=5)
    return route_windows(cfg, windows, tokens, np.random.default_rng(5))


def test_ours_beats_global_held_out_and_replans_with_low_churn() -> None:
    # plan on windows 0-2 (a re-plan of the plan made on 0-1), score on window 3, which no plan saw
    wins = _skewed_windows(4, 4096)
    heats = np.stack([heat_of(w, 64) for w in wins])
    cl = Cluster(16, 4, 80, num_groups=8)
    first = plan(heats[:2], cl)
    ours = plan(heats[:3], cl, prev=first)
    check_placement(ours, cl)
    theirs = global_policy(heats[2], cl)
    d_ours, d_glob = node_limited(ours, wins[3], cl), node_limited(theirs, wins[3], cl)
    assert balancedness(d_ours.gpu_load) >= balancedness(d_glob.gpu_load)
    assert d_ours.nodes.max() <= cl.node_limit
    assert churn(first, ours) <= 0.10
    # one node per expert: the dispatcher's load is exactly the even split the plan balanced
    onpe = plan(heats[:3], cl, cfg=PlannerConfig(spread_by_affinity=False))
    np.testing.assert_allclose(node_limited(onpe, wins[3], cl).gpu_load, even_gpu_load(onpe, heats[3], cl))


@pytest.mark.parametrize("experts,k,cluster", [(64, 6, Cluster(16, 4, 80, num_groups=8)),
                                               (128, 8, Cluster(72, 18, 144, num_groups=8))],
                         ids=["4-nodes", "18-nodes"])
def test_rolling_replans_beat_global_on_average_with_low_churn(experts: int, k: int, cluster: Cluster) -> None:
    # bench/analysis.py's protocol scaled down: plan at the end of window t (ours from its previous placement),
    # score on window t + 1, t = 2..8 (t = 1 is the cold start). One window is a noisy judge (ours minus
    # global per window: -0.03 to +0.12 here), so the mean decides. Measured: 0.868 vs 0.829 on 4 nodes,
    # 0.574 vs 0.548 on 18; churn at most 5.0% / 8.3% of slots per re-plan.
    wins = _skewed_windows(10, 2048, experts=experts, k=k)
    heats = np.stack([heat_of(w, experts) for w in wins])
    prev, ours, theirs = None, [], []
    for t in range(1, 9):
        pl = plan(heats[:t + 1], cluster, prev, tokens=wins[t])
        check_placement(pl, cluster)
        if prev is not None:
            assert churn(prev, pl) <= 0.10
            ours.append(balancedness(even_gpu_load(pl, heats[t + 1], cluster)))
            theirs.append(balancedness(even_gpu_load(global_policy(heats[t], cluster), heats[t + 1], cluster)))
        prev = pl
    assert np.mean(ours) >= np.mean(theirs)


def test_many_nodes_fewer_nodes_per_token_than_global_and_one_node_per_expert() -> None:
    # 144/18/288 scaled down: a group (16 experts) needs 2 nodes of 8 slots, 12.5% extra slots, 4 GPUs per node.
    # Plan on windows 0-2 with window 2's tokens, score on window 3.
    wins = _skewed_windows(4, 4096, experts=128, k=8)
    heats = np.stack([heat_of(w, 128) for w in wins])
    cl = Cluster(72, 18, 144, num_groups=8)
    glob = node_limited(global_policy(heats[2], cl), wins[3], cl)
    nodes, bal = {}, {}
    for name, cfg in (("ours", PlannerConfig()), ("one node per expert", PlannerConfig(spread_by_affinity=False))):
        first = plan(heats[:2], cl, tokens=wins[1], cfg=cfg)
        pl = plan(heats[:3], cl, prev=first, tokens=wins[2], cfg=cfg)
        check_placement(pl, cl)
        assert churn(first, pl) <= 0.10, name
        d = node_limited(pl, wins[3], cl)
        nodes[name], bal[name] = float(d.nodes.mean()), balancedness(d.gpu_load)
    # measured: 5.33 vs global 6.55 and one node per expert 7.21; balancedness 0.461 vs global 0.308
    assert nodes["ours"] <= float(glob.nodes.mean()) - 1.0
    assert nodes["ours"] <= nodes["one node per expert"] - 1.5
    assert bal["ours"] >= balancedness(glob.gpu_load)
