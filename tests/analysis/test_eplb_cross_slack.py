"""Cross-node leveling under slack (PlannerConfig.cross_slack, replan.node_slack): a seeded re-plan's leveling swaps
may move any replica across nodes only in layers whose nodes per token is well under DeepSeek global's.
Run: .venv/bin/pytest tests/analysis/test_eplb_cross_slack.py -q"""

from __future__ import annotations

import numpy as np

from r3trace.eplb import Cluster, PlannerConfig, churn, plan
from r3trace.eplb.cover import cover_sizes, node_masks
from r3trace.eplb.deepseek import global_phy2log
from r3trace.eplb.placement import from_phy2log
from r3trace.eplb.replan import crosses, node_slack
from r3trace.eplb.score import heat_of, node_limited

CL = Cluster(16, 4, 80, num_groups=8)  # 64 experts, 8 groups, 5 slots a GPU
E, K, N_LAYERS = 64, 4, 3


def grouped_windows(seed: int, windows: int = 3, tokens: int = 2048) -> list[np.ndarray]:
    """[T, L, K] routes per window from one router: each token's K experts from one group (Zipf-skewed), so group
    homes keep a token on few nodes while global's packing spreads it."""
    rng = np.random.default_rng(seed)
    pop = 1.0 / np.arange(1, E + 1) ** 0.9
    pop = np.stack([rng.permutation(pop) for _ in range(N_LAYERS)])  # [L, E]
    gsize = E // CL.num_groups
    out = []
    for _ in range(windows):
        t = np.empty((tokens, N_LAYERS, K), dtype=np.int64)
        for layer in range(N_LAYERS):
            gw = pop[layer].reshape(CL.num_groups, gsize)
            grp = rng.choice(CL.num_groups, tokens, p=gw.sum(1) / gw.sum())
            for i, g in enumerate(grp):
                t[i, layer] = g * gsize + rng.choice(gsize, K, replace=False, p=gw[g] / gw[g].sum())
        out.append(t)
    return out


def moved_hot_lone(a: np.ndarray, b: np.ndarray, w: np.ndarray) -> int:
    """phy2log [L, P] before and after, loads w [L, E] -> experts with one replica in both, at or above 0.5 x the mean
    slot load (leveling.py's cold line), that moved to a node holding none of their group's experts before: the leveling
    lets a lone replica trade nodes with another expert of its own group where both nodes held the group (it stays on
    its group's nodes), and without slack nothing else hot."""
    node, n = CL.slot_node(), 0
    gsize = E // CL.num_groups
    cold = 0.5 * w.sum(1) / CL.num_slots
    for layer in range(len(a)):
        ids, cnt = np.unique(a[layer], return_counts=True)
        homes = {(int(node[s]), int(a[layer, s]) // gsize) for s in range(CL.num_slots)}  # (node, group) before
        for x in ids[cnt == 1]:
            if (b[layer] == x).sum() == 1 and w[layer, x] >= cold[layer]:
                to = int(node[b[layer] == x][0])
                n += to != node[a[layer] == x][0] and (to, int(x) // gsize) not in homes
    return n


def test_node_slack_is_zero_for_global_and_positive_for_group_homes() -> None:
    routes = grouped_windows(0)
    heats = np.stack([heat_of(r, E) for r in routes])
    first = plan(heats[:2], CL, tokens=routes[1])
    glob = global_phy2log(heats[1], CL)
    np.testing.assert_allclose(node_slack(glob, glob, routes[1], E, CL), 0.0)
    slack = node_slack(first.phy2log, glob, routes[1], E, CL)
    assert (slack > PlannerConfig().cross_slack).all()  # measured: 0.51-0.54


def test_replans_cross_nodes_with_hot_lone_replicas_only_under_slack_and_keep_the_budget() -> None:
    routes = grouped_windows(1)
    heats = np.stack([heat_of(r, E) for r in routes])
    first = plan(heats[:2], CL, tokens=routes[1])
    cfg = PlannerConfig()
    on = plan(heats, CL, first, tokens=routes[2])
    off = plan(heats, CL, first, tokens=routes[2], cfg=PlannerConfig(cross_slack=-1.0))
    for pl in (on, off):
        assert churn(first, pl) <= cfg.seeded_churn_budget
    w = heats.sum(0)  # the ranking of loads the cold line reads; every window is one router's
    assert moved_hot_lone(first.phy2log, off.phy2log, w) == 0  # without slack no hot lone replica leaves home
    assert moved_hot_lone(first.phy2log, on.phy2log, w) >= 1  # measured: 9, both plans moving 8.75% of slots
    # no layer has 99% fewer nodes per token than global: the rule takes nothing; without tokens it cannot count
    np.testing.assert_array_equal(plan(heats, CL, first, tokens=routes[2], cfg=PlannerConfig(cross_slack=0.99)).phy2log,
                                  off.phy2log)
    np.testing.assert_array_equal(plan(heats, CL, first).phy2log,
                                  plan(heats, CL, first, cfg=PlannerConfig(cross_slack=-1.0)).phy2log)


def test_crosses_only_on_exact_cover_nodes_with_more_than_two_slots_a_gpu() -> None:
    cfg = PlannerConfig()
    assert crosses(Cluster(32, 4, 288), cfg) and crosses(Cluster(64, 8, 320), cfg)
    assert not crosses(Cluster(144, 18, 288), cfg)  # two slots a GPU: pairing.paired crosses nodes there
    assert not crosses(Cluster(16, 2, 32), cfg)  # two slots a GPU
    assert not crosses(Cluster(32, 4, 288), PlannerConfig(cross_slack=-1.0))


def test_node_cover_equals_the_dispatchers_cover() -> None:
    # score.node_limited's exact cover, on ours' and global's layouts, with tokens sliced as seeded_plan slices them
    # (newest tokens, some layers: a non-contiguous array, whose raveled view is a copy, so in-place counts on it
    # were lost)
    routes = grouped_windows(2)
    heats = np.stack([heat_of(r, E) for r in routes])
    first = plan(heats[:2], CL, tokens=routes[1])
    rows = np.array([0, 2])
    tok = routes[2][-512:, rows]
    assert not tok.flags.c_contiguous
    for ph in (first.phy2log[rows], global_phy2log(heats[2][rows], CL)):
        want = node_limited(from_phy2log(ph, E), tok, CL).nodes
        np.testing.assert_array_equal(cover_sizes(node_masks(ph, E, CL), tok, CL.num_nodes).T, want)
    ours, theirs = (node_limited(from_phy2log(ph, E), tok, CL).nodes.mean(0)
                    for ph in (first.phy2log[rows], global_phy2log(heats[2][rows], CL)))
    np.testing.assert_allclose(node_slack(first.phy2log[rows], global_phy2log(heats[2][rows], CL), tok, E, CL),
                               1 - ours / theirs, rtol=1e-12)
