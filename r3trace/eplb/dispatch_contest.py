"""On two nodes, per layer of a fresh plan: ours' layout or DeepSeek global's, by node-limited replay of the newest
tokens. Runs in fresh.fresh_plan where replicas spread over nodes (spare slots, tokens given, not keep_groups),
when ours plans for node-limited dispatch (evaluate.planner_config: `r3trace eplb --dispatch`'s default).

Why: ours plans for the even split, and its co-located layout lets many tokens fit on one node. A dispatcher that
covers each token with the fewest nodes (score.node_limited) then sends all of those to that node's replicas: on
bench/eplb_matrix.py's grouped s = 1.2, 16 GPUs / 2 nodes / 320 slots (a fresh plan on windows 0-7, window 8
replayed), 30-42% of a layer's tokens fit on one node under ours (global: 2-13%), a hot expert's replicas sat 7 : 1
over the nodes, and the other node's one-node tokens all went to its one replica: held-out replayed balancedness
0.675 against global's 0.891, where ours led global's even-split balancedness. Global's layout spreads hot experts
over both nodes, so nearly every token reaches both and the work splits by replica counts.

Rules: a fresh plan's layer takes global's layout (planned on the same forecast) where its replayed max GPU load on
the newest tokens is below ours' by more than `margin` of ours' (replay_contest); a still re-plan's layer keeps the
previous placement's where its own replayed max load is above the previous one's by more than `margin`
(replay_guard: the seeded re-plans level the even split and had undone the contest, below); a drifting re-plan's
layers are contested as a fresh plan's, within global's nodes per token (drift_replay, drift_contest). The tokens
are those ours placed its extra replicas by, so the contest leans to ours; `margin` is PlannerConfig.replay_margin,
0.02: at 0.1 a fresh-plan probe (not committed) took fewer layers and gained less (16 / 2 / 320, s = 0.9: 0.863
against 0.895 held out). Over bench/eplb_matrix.py's 118 cells the verdicts under node-limited replay went from 94 /
18 / 6 to 97 / 19 / 2 with the contest and to 99 / 18 / 1 with the guard too (that cell 0.675 -> 0.829 -> 0.896,
global 0.891; the one left is the even split's own), under the even split they stayed 88 / 29 / 1, under SGLang's
static dispatch 88 / 26 / 4 (89 / 25 / 4 between), and nodes per token stayed under global's in every cell (the
synthetic 2-node cells 0.03-0.09 under it). Two nodes only: a probe of the contest on the re-plan protocol (not
committed) moved 4-node cells' replay -0.02 .. +0.01 at 0.05-0.24 more nodes per token and took no layer on 8 nodes;
a 2-node replay is an exact cover over 3 node sets, cheap beside the plan. The drifting re-plan's contest, on the
160-cell matrix's two-node cells over trace seeds 0-2 pooled: node-limited replay 124 / 28 / 8 -> 130 / 26 / 4 over
all cells (the fast-drift "no"s of -0.015 .. -0.018 gone), the even split 123 / 37 / 0 -> 125 / 35 / 0, at 23-42% of
slots a re-plan on fast drift (12-20% before) and 10-17% where the backtest calls a slow trace drifting (4-8%).
Shape legend: T tokens, L layers, K top-k, E experts, P slots.
"""

from __future__ import annotations

import numpy as np

from r3trace.eplb.alignment import align
from r3trace.eplb.deepseek import global_phy2log, hierarchical
from r3trace.eplb.node_model import model_tokens, two_node_dispatch
from r3trace.eplb.placement import Cluster
from r3trace.eplb.replay_max import node_limited_max, node_limited_replay
from r3trace.eplb.static_ladder import NODE_MARGIN


def applies(cluster: Cluster, num_experts: int, margin: float) -> bool:
    """Whether fresh plans on this cluster hold the contest: two nodes, spare slots, margin >= 0."""
    return margin >= 0 and cluster.num_nodes == 2 and cluster.num_slots > num_experts


def replay_contest(phy2log: np.ndarray, w: np.ndarray, cluster: Cluster, tokens: np.ndarray,
                   margin: float) -> np.ndarray:
    """Ours' phy2log [L, P], forecast w [L, E], newest tokens [T, L, K] -> phy2log [L, P]: per layer global's layout
    on w where node-limited replay of the tokens gives it a max GPU load below (1 - margin) x ours', else ours."""
    glob = global_phy2log(w, cluster)
    theirs, ours = node_limited_max([glob, phy2log], w.shape[1], tokens, cluster)
    take = theirs < ours * (1 - margin)
    return np.where(take[:, None], glob, phy2log)


# tokens a keep_groups contest replays without tokens on more than two nodes, drawn from the router model, and on more
# than CAP_NODES nodes the newest of those given: a greedy cover per token, 2,048 tokens on 8 nodes at [58, 256] took
# 0.42 s a layout; on 4 nodes the cap cost held-out node-limited balancedness (bench/eplb_keep_groups.py: 73 -> 69 of
# 78 cells above hierarchical's) where all tokens cost 0.06-0.09 s a plan
MODEL_TOKENS = 1024
CAP_NODES = 4


def groups_apply(cluster: Cluster, margin: float) -> bool:
    """Whether keep_groups' plans hold the contest against DeepSeek's hierarchical layout: several nodes dividing the
    groups (where that layout exists), margin >= 0 (node-limited dispatch)."""
    return margin >= 0 and cluster.num_nodes > 1 and cluster.num_groups % cluster.num_nodes == 0


def groups_contest(phy2log: np.ndarray, w: np.ndarray, cluster: Cluster, tokens: np.ndarray | None, margin: float,
                   router: tuple[int, int]) -> np.ndarray:
    """keep_groups' phy2log [L, P], forecast w [L, E], newest tokens [T, L, K] or None -> phy2log [L, P]: per layer
    DeepSeek's hierarchical layout on w where node-limited dispatch gives it a max GPU load below (1 - margin) x ours',
    else ours' (dispatch_max: the tokens replayed, without them the router model's).
    keep_groups spreads extra replicas over nodes as choices for a token's cover; a dispatcher that covers a token
    with its home node alone sends it to the home replicas, so on two nodes a hot expert's home replicas carried most
    of its load (grouped s = 1.2, 16 / 2 / 320: node-limited balancedness 0.143 under hierarchical's held out, whose
    replicas all sit on the group's node; with the contest +0.009). Either layout keeps every token's cover within
    its groups' nodes, so keep_groups' bound holds per layer."""
    hier = hierarchical(w, cluster).phy2log
    theirs, ours = dispatch_max([hier, phy2log], w, cluster, tokens, router)
    return np.where((theirs < ours * (1 - margin))[:, None], hier, phy2log)


def dispatch_max(layouts: list[np.ndarray], w: np.ndarray, cluster: Cluster, tokens: np.ndarray | None,
                 router: tuple[int, int]) -> np.ndarray:
    """phy2log layouts [L, P] each, forecast w [L, E] -> [layouts, L] the max GPU loads under node-limited dispatch:
    of the tokens [T, L, K] replayed; without them under the router model (top_k, topk_group) with loads w, expected
    on two nodes (node_model.two_node_dispatch), else of MODEL_TOKENS tokens drawn from it (node_model.model_tokens:
    the SGLang-dump cells of 32 GPUs / 4 nodes / 288 slots replayed 0.018-0.036 under hierarchical held out without a
    contest)."""
    if tokens is None and cluster.num_nodes != 2:
        tokens = model_tokens(w, cluster.num_groups, *router, MODEL_TOKENS)
    elif tokens is not None and cluster.num_nodes > CAP_NODES:
        tokens = tokens[-MODEL_TOKENS:]
    if tokens is not None:
        return node_limited_max(layouts, w.shape[1], tokens, cluster)
    load, _ = two_node_dispatch(np.concatenate(layouts), np.concatenate([w] * len(layouts)), cluster, *router)
    return load.max(1).reshape(len(layouts), -1)


def replay_guard(phy2log: np.ndarray, prev: np.ndarray, cluster: Cluster, tokens: np.ndarray,
                 margin: float) -> np.ndarray:
    """A re-plan's phy2log [L, P], the previous placement's [L, P], newest tokens [T, L, K] -> phy2log [L, P]: per
    layer the previous layer where the re-plan's replayed max GPU load on the tokens exceeds its by more than
    `margin`, else the re-plan's. A seeded re-plan levels the even split; on grouped s = 1.2, 16 / 2 / 320 its first
    step moved a layer that had taken global's layout from 1.07x to 1.55x the mean GPU load held out (node-limited),
    and it stayed there (1.47-1.93x); keeping a layer moves no slot."""
    new, old = node_limited_max([phy2log, prev], int(phy2log.max()) + 1, tokens, cluster)
    worse = new > old * (1 + margin)
    return np.where(worse[:, None], prev, phy2log)


def drift_replay(phy2log: np.ndarray, glob: np.ndarray, prev: np.ndarray, cluster: Cluster, tokens: np.ndarray,
                 margin: float) -> np.ndarray:
    """A drifting re-plan's phy2log [L, P], DeepSeek global's on its forecast [L, P], the previous placement's [L, P],
    newest tokens [T, L, K] -> phy2log [L, P]: the layers drift_contest picks take global's layout, aligned to the
    previous layer (alignment.align; ~83% of their slots move anyway: global's plan does not look at prev). In place
    of replay_guard: the previous placement was planned for windows the drift has left, and every layer here is
    contested against a layout of the newest forecast instead. With the guard as well (one more replayed layout), on 9
    of bench/eplb_matrix.py's two-node cells x 3 trace seeds: held-out node-limited balancedness -0.0020 .. +0.0023 a
    cell (5 cells unmoved), the even split -0.0030 .. +0.0011."""
    (ours, theirs), nodes = node_limited_replay([phy2log, glob], int(phy2log.max()) + 1, tokens, cluster)
    take = drift_contest(ours, theirs, nodes[0], nodes[1], margin)
    if not take.any():
        return phy2log
    out = phy2log.copy()
    out[take] = align(glob[take], prev[take], cluster)
    return out


def drift_contest(ours: np.ndarray, theirs: np.ndarray, ours_nodes: np.ndarray, their_nodes: np.ndarray,
                  margin: float) -> np.ndarray:
    """A drifting re-plan's and global's replayed max GPU loads [L] and nodes per token [L] on the newest tokens -> [L]
    the layers that take global's layout: those whose max load it lowers below (1 - margin) x ours', biggest ratio
    first, while the layers' summed nodes per token stay within global's less NODE_MARGIN (the goal's nodes per
    token, as static_ladder.py keeps it); a layer where global's spends no more nodes is taken whatever is spent.

    Why: every layer of a drifting re-plan is a fresh choice, but its refreshed layers were picked by the even split
    (candidates.Contest) and its seeded ones keep the previous layout's co-location; bench/eplb_matrix.py's two-node
    fast-drift cells trailed global on the newest window under node-limited dispatch by up to 0.018 (pooled over trace
    seeds 0-2). Without the node budget, layers of the independent router (ours 1.94 nodes per token, global 1.98)
    all went over to global's and ours' nodes per token passed global's (1.981 against 1.975)."""
    better = theirs < ours * (1 - margin)
    take = np.zeros(len(ours), dtype=bool)
    spent, budget = float(ours_nodes.sum()), float(their_nodes.sum()) * (1 - NODE_MARGIN)
    for layer in np.argsort(-(ours / np.maximum(theirs, 1e-12)), kind="stable"):
        if not better[layer]:
            continue
        step = float(their_nodes[layer] - ours_nodes[layer])
        if step <= 0 or spent + step <= budget + 1e-12:  # fewer nodes too: taken whatever is spent
            take[layer] = True
            spent += step
    return take
