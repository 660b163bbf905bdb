"""keep_groups' layout (`r3trace eplb --keep-groups`): which groups share a node (r3trace/eplb/group_pairing.py) and
the per-layer contest against DeepSeek's hierarchical layout (dispatch_contest.groups_contest), each checked against
a brute force written here: every split of the groups enumerated with itertools, every token's nodes counted.

Run: .venv/bin/pytest tests/analysis/test_group_pairing.py -q
"""

from __future__ import annotations

import itertools
from math import factorial

import numpy as np
import pytest

from r3trace.eplb import Cluster, PlannerConfig, hierarchical, plan
from r3trace.eplb.dispatch_contest import CAP_NODES, MODEL_TOKENS
from r3trace.eplb.group_pairing import even_splits, group_sets, paired_groups
from r3trace.eplb.node_model import model_tokens, two_node_dispatch
from r3trace.eplb.packing import balanced_packing
from r3trace.eplb.replay_max import node_limited_max
from r3trace.eplb.score import node_limited

E = 32


def _partitions(groups: int, nodes: int) -> set[frozenset[frozenset[int]]]:
    """Every split of range(groups) into `nodes` blocks of equal size, as sets of blocks (itertools, no recursion)."""
    size = groups // nodes
    out = set()
    for perm in itertools.permutations(range(groups)):
        out.add(frozenset(frozenset(perm[i:i + size]) for i in range(0, groups, size)))
    return out


def _as_partition(node_of: np.ndarray) -> frozenset[frozenset[int]]:
    return frozenset(frozenset(np.flatnonzero(node_of == k).tolist()) for k in np.unique(node_of))


@pytest.mark.parametrize(("groups", "nodes"), [(4, 2), (6, 2), (6, 3), (8, 2), (8, 4)])
def test_even_splits_are_every_split_once(groups: int, nodes: int) -> None:
    splits = even_splits(groups, nodes)
    size = groups // nodes
    assert len(splits) == factorial(groups) // (factorial(size) ** nodes * factorial(nodes))
    assert {_as_partition(s) for s in splits} == _partitions(groups, nodes)
    assert all((np.bincount(s, minlength=nodes) == size).all() for s in splits)


def test_group_sets_count_each_tokens_groups() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, E, size=(50, 3, 4))
    got = group_sets(tokens, E, 8)
    want = np.zeros((3, 256), dtype=np.int64)
    for t in range(50):
        for layer in range(3):
            want[layer, sum(1 << int(g) for g in set((tokens[t, layer] // 4).tolist()))] += 1
    np.testing.assert_array_equal(got, want)


def _nodes(tokens: np.ndarray, node_of_group: np.ndarray, gsize: int) -> float:
    """Summed nodes the tokens of one layer ([T, K]) reach with groups on nodes node_of_group [groups]."""
    return float(sum(len({int(node_of_group[x // gsize]) for x in row}) for row in tokens))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("nodes", "slack"), [(2, 0.0), (4, 0.0), (4, 0.05), (4, 10.0)])
def test_pairing_is_the_fewest_nodes_within_the_slack(seed: int, nodes: int, slack: float) -> None:
    """Against every split: the chosen one reaches the fewest nodes among those whose heaviest node is within slack
    of balanced packing's (and no fewer than balanced packing's own when none saves one)."""
    rng = np.random.default_rng(seed)
    groups, gsize, n_layers = 8, E // 8, 3
    w = rng.gamma(1.0, 1.0, size=(n_layers, E))
    # tokens choose groups in pairs {0, 5}, {1, 6}, {2, 7}, {3, 4} more often than by chance, plus noise
    pair = np.array([5, 6, 7, 4, 3, 0, 1, 2])
    g1 = rng.integers(0, groups, size=(200, n_layers))
    g2 = np.where(rng.random((200, n_layers)) < 0.7, pair[g1], rng.integers(0, groups, size=(200, n_layers)))
    tokens = np.stack([g1 * gsize + rng.integers(0, gsize, size=g1.shape),
                       g2 * gsize + rng.integers(0, gsize, size=g2.shape)], axis=2)  # [T, L, 2]
    cl = Cluster(nodes * 2, nodes, E, num_groups=groups)
    got = paired_groups(w, cl, tokens, slack)
    assert got is not None
    gw = w.reshape(n_layers, groups, gsize).sum(-1)
    pack, _ = balanced_packing(gw, nodes)
    for layer in range(n_layers):
        base_heavy = max(gw[layer][pack[layer] == k].sum() for k in range(nodes))
        allowed = []
        for part in _partitions(groups, nodes):
            node_of = np.empty(groups, dtype=np.int64)
            for k, block in enumerate(sorted(part, key=min)):
                node_of[list(block)] = k
            if max(gw[layer][node_of == k].sum() for k in range(nodes)) <= base_heavy * (1 + slack) + 1e-9:
                allowed.append(_nodes(tokens[:, layer], node_of, gsize))
        best = min(allowed)
        base = _nodes(tokens[:, layer], pack[layer], gsize)
        assert _nodes(tokens[:, layer], got[layer], gsize) == min(best, base)
        heavy = max(gw[layer][got[layer] == k].sum() for k in range(nodes))
        assert heavy <= base_heavy * (1 + slack) + 1e-9
        assert (np.bincount(got[layer], minlength=nodes) == groups // nodes).all()
    if slack >= 10:  # unconstrained: the co-chosen pairs share nodes on 4 nodes
        assert all(len({int(got[layer][g]), int(got[layer][pair[g]])}) == 1 for layer in range(n_layers)
                   for g in range(groups))


def test_pairing_keeps_balanced_packing_where_no_split_saves_a_node() -> None:
    """Tokens that each pick one group reach one node under every split: DeepSeek's balanced packing stays."""
    rng = np.random.default_rng(4)
    w = rng.gamma(1.0, 1.0, size=(2, E))
    g = rng.integers(0, 8, size=(100, 2))
    tokens = np.stack([g * 4, g * 4 + 1], axis=2)  # two experts of one group a token
    pack, _ = balanced_packing(w.reshape(2, 8, 4).sum(-1), 4)
    np.testing.assert_array_equal(paired_groups(w, Cluster(8, 4, E, num_groups=8), tokens, 10.0), pack)


def test_pairing_applies_only_to_several_groups_a_node() -> None:
    w = np.ones((1, E))
    tok = np.zeros((4, 1, 2), dtype=np.int64)
    assert paired_groups(w, Cluster(8, 8, E, num_groups=8), tok, 0.0) is None  # one group a node
    assert paired_groups(w, Cluster(6, 3, 36, num_groups=8), tok, 0.0) is None  # 3 nodes do not divide 8 groups
    assert paired_groups(np.ones((1, 64)), Cluster(8, 4, 64, num_groups=16), np.zeros((4, 1, 2), dtype=np.int64),
                         0.0) is None  # more than MAX_GROUPS


def _skewed(seed: int, n_tokens: int = 2048, layers: int = 4, e: int = 64, k: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """A grouped Zipf(1.2) router: tokens [T, L, K] (top groups by their best logit, 4 of 8) and their heat [L, E]."""
    rng = np.random.default_rng(seed)
    rank = np.stack([rng.permutation(e) for _ in range(layers)])  # [L, E]
    logits = -1.2 * np.log1p(rank)[None] + rng.gumbel(size=(n_tokens, layers, e))
    grp = logits.reshape(n_tokens, layers, 8, e // 8).max(-1)
    keep = np.argsort(-grp, axis=-1)[..., :4]
    mask = np.zeros_like(grp, dtype=bool)
    np.put_along_axis(mask, keep, True, axis=-1)
    logits = np.where(np.repeat(mask, e // 8, axis=-1), logits, -np.inf)
    tokens = np.argsort(-logits, axis=-1)[..., :k]
    heat = np.stack([np.bincount(tokens[:, li].ravel(), minlength=e) for li in range(layers)]).astype(float)
    return tokens, heat


@pytest.mark.parametrize(("gpus", "nodes", "slots"), [(16, 2, 80), (16, 4, 80), (8, 2, 64), (32, 8, 96)])
def test_keep_groups_contest_never_replays_worse_than_hierarchical(gpus: int, nodes: int, slots: int) -> None:
    """A fresh keep_groups plan with tokens: in every layer node-limited replay of those tokens gives a max GPU load
    at most hierarchical's / (1 - margin) (groups_contest takes hierarchical's layer otherwise), and every token's
    cover reaches no more nodes than it picks groups."""
    tokens, heat = _skewed(3)
    cl = Cluster(gpus, nodes, slots, num_groups=8, node_limit=nodes)
    cfg = PlannerConfig(keep_groups=True)
    pl = plan(heat, cl, tokens=tokens, cfg=cfg)
    seen = tokens if nodes <= CAP_NODES else tokens[-MODEL_TOKENS:]  # more nodes: the newest MODEL_TOKENS replayed
    ours, hier = node_limited_max([pl.phy2log, hierarchical(heat, cl).phy2log], 64, seen, cl)
    assert (ours <= hier / (1 - cfg.replay_margin) + 1e-9).all(), (ours, hier)
    picked = np.array([[len(set((row // 8).tolist())) for row in tokens[:, li]] for li in range(tokens.shape[1])]).T
    assert (node_limited(pl, tokens, cl).nodes <= picked).all()
    # a re-plan on a window 30% another router's keeps a previous layer wherever its own replay is worse
    # (replay_guard): without it, its swaps inside nodes for the even split replayed up to 1.38x worse here
    _, other = _skewed(13)
    again = plan(np.stack([heat, 0.7 * heat + 0.3 * other]), cl, pl, tokens=tokens, cfg=cfg)
    mine, = node_limited_max([again.phy2log], 64, seen, cl)
    assert (mine <= ours * (1 + cfg.replay_margin) + 1e-9).all(), mine / ours
    assert (node_limited(again, tokens, cl).nodes <= picked).all()  # the re-plan keeps the bound too


@pytest.mark.parametrize(("gpus", "slots"), [(16, 80), (8, 64), (16, 96)])
def test_keep_groups_contest_without_tokens_on_two_nodes(gpus: int, slots: int) -> None:
    """Heat alone (an SGLang dump) on two nodes: the contest by the router model's expected node-limited loads
    (node_model.two_node_dispatch, computed here for both layouts): no layer expected worse than hierarchical's."""
    _, heat = _skewed(5)
    cl = Cluster(gpus, 2, slots, num_groups=8, node_limit=2)
    cfg = PlannerConfig(keep_groups=True, router_top_k=4, router_topk_group=4)
    pl = plan(heat, cl, cfg=cfg)
    ours, _ = two_node_dispatch(pl.phy2log, heat, cl, 4, 4)
    hier, _ = two_node_dispatch(hierarchical(heat, cl).phy2log, heat, cl, 4, 4)
    assert (ours.max(1) <= hier.max(1) / (1 - cfg.replay_margin) + 1e-9).all(), (ours.max(1), hier.max(1))


@pytest.mark.parametrize(("gpus", "nodes", "slots"), [(16, 4, 80), (32, 8, 96)])
def test_keep_groups_contest_without_tokens_on_more_nodes(gpus: int, nodes: int, slots: int) -> None:
    """Heat alone on 4 and 8 nodes: the contest replays tokens drawn from the router model (node_model.model_tokens),
    the same draw here: no layer's replayed max load above hierarchical's / (1 - margin)."""
    _, heat = _skewed(6)
    cl = Cluster(gpus, nodes, slots, num_groups=8, node_limit=nodes)
    cfg = PlannerConfig(keep_groups=True, router_top_k=4, router_topk_group=4)
    pl = plan(heat, cl, cfg=cfg)
    drawn = model_tokens(heat, 8, 4, 4, MODEL_TOKENS)
    ours, hier = node_limited_max([pl.phy2log, hierarchical(heat, cl).phy2log], 64, drawn, cl)
    assert (ours <= hier / (1 - cfg.replay_margin) + 1e-9).all(), (ours, hier)


def test_model_tokens_follow_the_router_model() -> None:
    """Each drawn token: top_k distinct experts from at most topk_group groups; an expert without load is never drawn,
    a group's share of draws follows its load, and the draw is the same for the same seed."""
    rng = np.random.default_rng(8)
    w = rng.gamma(0.7, 1.0, size=(3, E))
    w[:, 5] = 0.0
    tok = model_tokens(w, 8, 4, 2, 4000)
    assert tok.shape == (4000, 3, 4)
    assert all(len(set(row.tolist())) == 4 and len(set((row // 4).tolist())) <= 2 for row in tok.reshape(-1, 4))
    assert not (tok == 5).any()
    np.testing.assert_array_equal(tok, model_tokens(w, 8, 4, 2, 4000))
    drawn = np.stack([np.bincount(tok[:, li].ravel() // 4, minlength=8) for li in range(3)]) / (4000 * 4)
    load = w.reshape(3, 8, 4).sum(2) / w.sum(1, keepdims=True)
    assert np.corrcoef(drawn.ravel(), load.ravel())[0, 1] > 0.9


def test_origins_name_the_layers_that_took_hierarchicals_layout() -> None:
    """`r3trace eplb --keep-groups` prints how many layers took hierarchical's layout (origins.py): a layer is
    "hierarchical" exactly where its GPUs hold what hierarchical's plan on the same forecast holds."""
    from r3trace.eplb.origins import gpu_contents, layer_origins, origins_line

    tokens, heat = _skewed(3)
    cl = Cluster(16, 2, 80, num_groups=8, node_limit=2)
    cfg = PlannerConfig(keep_groups=True)
    pl = plan(heat, cl, tokens=tokens, cfg=cfg)  # the contest takes hierarchical's layout in some layers here
    got = layer_origins(pl, heat, cl, cfg=cfg)
    want = [m == h for m, h in zip(gpu_contents(pl.phy2log, cl), gpu_contents(hierarchical(heat, cl).phy2log, cl),
                                   strict=True)]
    assert [o == "hierarchical" for o in got] == want and any(want) and "global" not in got
    n = got.count("hierarchical")
    assert origins_line(got, False, "hierarchical") == (f"layers: {len(got) - n} ours, {n} DeepSeek hierarchical's "
                                                        "on the same forecast")
