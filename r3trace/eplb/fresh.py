"""The fresh layout of our placement planner (planner.py's steps 3 and 4): where every replica goes on a cluster
with no previous placement to keep, and which layout `r3trace eplb` reports.

3. Layout (`layout` says which and why). On one node every replica sits on it. On several nodes
   each group gets home nodes (whole groups packed onto nodes by load when the nodes divide the groups,
   runs of whole nodes when a group needs several), every expert's first replica goes to a home node of
   its group, and each extra replica goes to the node whose experts it is chosen with most in the window's
   tokens (affinity.py), so a token's cover has choices. Held out (BENCHMARKS.md, EPLB; bench/eplb_matrix.py,
   grouped router, slow drift) against DeepSeek's global policy planned on the same windows: nodes per
   token 2.3-3.6 vs 3.1-3.6 on 4 nodes, 3.0-5.2 vs 4.4-5.3 on 8, 4.6-5.7 vs 6.2-6.6 on 18, at even-split
   balancedness within -0.02 .. +0.02 of it (the high ends on 4 and 8 nodes: 256 slots, where layers may take
   global's layout, below) (DeepSeek's hierarchical layout, which this planner used on 8
   nodes before, lost 0.05-0.38 there). Replicas on several nodes let the dispatcher's cover load some
   more than their even share, so node-limited balancedness sits below the even one. One node per expert
   (`spread_by_affinity` off, homing.py) keeps the two equal at more nodes per token; `keep_groups` keeps
   every first replica on its group's home (whole groups on nodes), so a token reaches no more nodes than it picks
   groups, as under DeepSeek's hierarchical layout.
   Counts follow the global policy's rule capped at max(N, GPUs per node) replicas. Without a spare slot
   (P = E) each layer takes ours, DeepSeek global's or global's with GPUs grouped by expert group, whichever
   has the lowest forecast max GPU load, then the fewest nodes per token on the newest tokens (candidates.py). With
   spare slots on two nodes a layer takes global's layout where node-limited replay of the newest tokens gives it
   a max GPU load lower by more than `replay_margin`, and a re-plan keeps the previous layer where its own replay
   is that much worse (dispatch_contest.py: held-out node-limited replay 0.675 ->
   0.896 on grouped s = 1.2, 16 / 2 / 320, global 0.891; one-node tokens had overloaded a hot expert's lone
   replica on the other node); a drifting re-plan contests every layer so instead, biggest replay gains first while
   nodes per token stay within global's less 1% (dispatch_contest.drift_replay). Then the layers of a fresh or still
   plan whose replayed max load sits over the even split's climb the static-even ladder scored by that replay, within
   global's nodes per token (static_ladder.token_ladder); without tokens every plan's layers climb it scored by a
   router model (replay_ladder).
4. Each node's replicas are packed onto its GPUs (balanced packing), then up to `fresh_swaps` swaps
   lower the hottest GPUs (refine.swap_refine; 0.925 -> 0.944 held out on 32 GPUs). In the multi-node layout
   leveling swaps lower the sum of squared GPU loads instead (leveling.py: 0.835 / 0.744 / 0.535 ->
   0.837 / 0.749 / 0.543 held out at s = 0.3 / 0.6 / 1.0). Layers of <= 128 slots then get polish.py's
   node-aware search on the max GPU load itself (swaps, recounts, 2-for-2 exchanges; fresh plans only). With two
   slots per GPU (16 and 18 nodes) every GPU's lighter replica is then re-picked over all nodes, heaviest with
   lightest (pairing.py; a seeded re-plan with what its leveling left of the budget): on bench/eplb_matrix.py's
   18-node slow-drift cells ours - global went from -0.025 .. 0.000 to -0.020 .. 0.000 (median -0.009 -> -0.006)
   at 0.07-0.35 more nodes per token (4.64-6.05, global 6.18-6.63).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import numpy as np

from r3trace.eplb.affinity import CoChoices, affinity_replicas, home_primaries
from r3trace.eplb.candidates import best_layout
from r3trace.eplb.config import PlannerConfig
from r3trace.eplb.deepseek import group_nodes, pack_nodes, spread_replicas
from r3trace.eplb.descent import hot_swaps
from r3trace.eplb.dispatch_contest import applies as replays
from r3trace.eplb.dispatch_contest import groups_apply, groups_contest, replay_contest
from r3trace.eplb.homing import capped_counts, expert_nodes
from r3trace.eplb.leveling import level_refine, noise_gain
from r3trace.eplb.node_copies import copies_fit
from r3trace.eplb.pairing import paired
from r3trace.eplb.placement import Cluster, Placement, from_phy2log
from r3trace.eplb.polish import NodeRule, applies, polish
from r3trace.eplb.refine import swap_refine


def spreads(cluster: Cluster, cfg: PlannerConfig) -> bool:
    """True for the layout of affinity.py: group homes and co-activation replicas, on every multi-node cluster."""
    return cfg.spread_by_affinity and cluster.num_nodes > 1


def spread_cap(cluster: Cluster) -> int:
    """Most replicas of one expert in the multi-node layout: one per node, or one per GPU of a node where that
    is more (2 nodes of 8 GPUs: a cap of 2 would leave the hottest expert of s = 1.2 on two GPUs)."""
    return max(cluster.num_nodes, cluster.gpus_per_node)


class Layout(NamedTuple):
    """The layout fresh_plan builds on a cluster, and why, for reports (`r3trace eplb` prints it)."""

    name: Literal["spread", "groups_on_nodes", "expert_per_node", "node_copies"]
    reason: str


def layout(cluster: Cluster, cfg: PlannerConfig = PlannerConfig(), num_experts: int | None = None) -> Layout:
    """Which of fresh_plan's layouts this cluster gets, and why, in one line (num_experts: where known, whether
    node copies fit)."""
    g, n = cluster.num_groups, cluster.num_nodes
    if num_experts is not None and copies_fit(cluster, num_experts, cfg):
        return Layout("node_copies", f"{cluster.slots_per_node} slots a node hold all {num_experts} experts: every "
                                     f"node the same one-node plan, so a token reaches one node and node-limited "
                                     f"dispatch splits every expert evenly over the {n} nodes (node_copies.py); a "
                                     f"layer whose newest window's hottest expert would put more than "
                                     f"{cfg.copies_hot:g}x a GPU's mean load on each of its replicas, or whose "
                                     f"previous layer is no copy, is planned in the spread layout")
    if n == 1:
        static = (f"; for SGLang's static dispatch, each expert's replica count a divisor of the {cluster.num_gpus} "
                  "GPUs, its replicas on distinct GPUs, so every replica serves as many ranks, in the layers where "
                  "that lowers the forecast max GPU load under it (static_one_node.py)"
                  ) if cfg.static_even and cfg.sglang_dispatch == "static" else ""
        return Layout("expert_per_node", f"one node: every replica on it, GPUs balanced by packing and swaps{static}")
    if not spreads(cluster, cfg):
        return Layout("expert_per_node", "spread_by_affinity off: each expert's replicas on one node, so the "
                                         "node-limited load equals the even split")
    how = ("whole groups packed onto nodes by load" if g % n == 0 and g > n else "each group on a run of whole nodes")
    extras = ("extra replicas beside the experts they are chosen with in the newest tokens (without tokens: on "
              "the lightest nodes)")
    if cfg.keep_groups:
        pairing = ("; without a spare slot, groups share nodes by the even split whose newest tokens reach the "
                   "fewest nodes, its heaviest node within balanced packing's (group_pairing.py)"
                   ) if g % n == 0 and g > n else ""
        contest = ("; a layer takes DeepSeek's hierarchical layout where node-limited dispatch (the newest tokens "
                   "replayed; without routes, a router model of the loads) gives it a lower max GPU load, and a "
                   "re-plan keeps a previous layer that dispatch favours (dispatch_contest.groups_contest)"
                   ) if g % n == 0 and cfg.replay_margin >= 0 else ""
        return Layout("groups_on_nodes", f"{g} groups on {n} nodes, keep_groups: first replicas stay on their "
                                         f"group's home nodes ({how}), so a token reaches no more nodes than it "
                                         f"picks groups, as under DeepSeek's hierarchical layout; "
                                         f"{extras}{pairing}{contest}")
    if n == 2 and cfg.replay_margin >= 0:
        extras += ("; with spare slots and routes, a layer takes DeepSeek global's layout where node-limited replay "
                   "of the newest tokens gives it a lower max GPU load (a drifting re-plan's layers too, within "
                   "global's nodes per token), and a still re-plan keeps a previous layer that replay favours "
                   "(dispatch_contest.py); then a fresh or still plan's experts are made static-even (all of an "
                   "expert's replicas on one node or one a node) in the layers replay skews, as far as global's nodes "
                   "per token allows (token_ladder); without routes, each plan's experts so by a router model's "
                   "node-limited loads (replay_ladder)")
    if cfg.static_even:
        extras += (f"; then for SGLang's {cfg.sglang_dispatch} dispatch, hottest first, experts' replicas put all on "
                   "one node or at most one a node, which its node rule splits evenly (static_spread.py), as far as "
                   "DeepSeek global's nodes per token on the newest tokens allows (static_ladder.py; without tokens "
                   "all)")
    return Layout("spread", f"{g} groups on {n} nodes: first replicas on their group's home nodes ({how}), "
                            f"lone cold ones moved off for balance; {extras}")


def fresh_plan(w: np.ndarray, home: np.ndarray | None, cluster: Cluster, cfg: PlannerConfig,
               tokens: np.ndarray | None = None) -> Placement:
    """Forecast loads w [L, E], preferred nodes home [L, E] (None: group_nodes'), tokens [T, L, K] or None ->
    Placement with group homes plus co-activation replicas on several nodes, else one node per expert. On several
    nodes global's layouts compete per layer (candidates.best_layout) without a spare slot; with spare slots on two
    nodes, global's layout by node-limited replay of the tokens (dispatch_contest.py)."""
    n_layers, e = w.shape
    if spreads(cluster, cfg):
        phy2log = spread_layout(w, cluster, cfg, tokens)
        if cluster.num_slots == e and not cfg.keep_groups:
            if not applies(cluster):  # ours' max load down to global's (contest_swaps;
                # where polish ran it already lowered the max load without costing nodes per token)
                swaps = np.full(n_layers, cfg.contest_swaps)
                phy2log = hot_swaps(phy2log, w, np.ones(w.shape, dtype=np.int64), cluster, swaps, 0.0, cfg.level_cold)
            phy2log = best_layout(phy2log, w, cluster, tokens, cfg.router, cfg.node_swap_cap)
        elif tokens is not None and not cfg.keep_groups and replays(cluster, e, cfg.replay_margin):
            phy2log = replay_contest(phy2log, w, cluster, tokens, cfg.replay_margin)  # two nodes: dispatch_contest.py
        if cfg.keep_groups and groups_apply(cluster, cfg.replay_margin):
            phy2log = groups_contest(phy2log, w, cluster, tokens, cfg.replay_margin, cfg.router)
        return from_phy2log(phy2log, e)
    logcnt = capped_counts(w, cluster.num_slots, cluster.gpus_per_node)
    node = expert_nodes(w, logcnt, group_nodes(w, cluster) if home is None else home, cluster, cfg.home_slack)
    cnt = np.zeros((n_layers, e, cluster.num_nodes), dtype=np.int64)
    cnt[np.arange(n_layers)[:, None], np.arange(e)[None, :], node] = logcnt
    split = (cnt.sum(1) != cluster.slots_per_node).any(1)  # [L] replica counts that no node split fits
    if split.any():  # e.g. counts 3, 3, 2 on two 4-slot nodes: replicas spread over nodes (cross-node layout)
        cnt[split] = spread_replicas(w[split], logcnt[split], group_nodes(w[split], cluster), cluster)
    phy2log = swap_refine(pack_nodes(w, logcnt, cnt, cluster), w, logcnt, cluster, cfg.fresh_swaps, cfg.min_gain,
                          cross_nodes=not cfg.keep_groups)
    return from_phy2log(polish(phy2log, w, cluster, tokens, cfg.polish_steps, "fixed"), e)


def spread_layout(w: np.ndarray, cluster: Cluster, cfg: PlannerConfig, tokens: np.ndarray | None,
                  losing: np.ndarray | None = None, logcnt: np.ndarray | None = None) -> np.ndarray:
    """Forecast loads w [L, E], tokens [T, L, K] or None -> phy2log [L, P]: the multi-node layout of fresh_plan
    (group homes, co-activation replicas, leveling, polish, pairing) before global's layouts compete.

    losing [L] or None: the max GPU load above which a layer's layout goes unused (candidates.losing_load); where
    neither polish nor pairing follows, such a layer's leveling stops once it cannot get below (level_refine's
    out_of_reach), its max load still above. The drifting re-plan at [58, 320] on 8 nodes: ours lost to global's
    layout in 44 of 58 layers, and 42 of them stopped, 823 of 2746 layer-steps of leveling left out. logcnt: the
    capped counts where the caller has them."""
    logcnt = capped_counts(w, cluster.num_slots, spread_cap(cluster)) if logcnt is None else logcnt
    # keep_groups without a spare slot: groups share nodes by their tokens (group_pairing.py); with spare slots the
    # extra replicas set a token's cover, and the pairing cost independent s = 1.2, 32 / 4 / 288 0.08 nodes per
    # token and 0.03 balancedness held out
    pairs = tokens if cfg.keep_groups and cluster.num_slots == w.shape[1] else None
    cnt = affinity_replicas(w, logcnt, home_primaries(w, cluster, pairs, cfg.group_pair_slack),
                            CoChoices(tokens, w.shape[1]), cluster)
    final = not applies(cluster) and cluster.slots_per_gpu != 2  # the leveling's layout is the last (polish, paired)
    gain = noise_gain(cfg.level_min_gain, w, cluster, cfg.level_gain_count)
    phy2log = level_refine(pack_nodes(w, logcnt, cnt, cluster), w, logcnt, cluster, cfg.level_swaps, gain,
                           cfg.level_cold, cross_nodes=not cfg.keep_groups,
                           out_of_reach=losing if final else None)
    rule: NodeRule = "keep" if cfg.keep_groups else "cover"
    phy2log = polish(phy2log, w, cluster, tokens, cfg.polish_steps, rule)
    if not cfg.keep_groups:  # two slots per GPU: the sorted pairing across nodes (pairing.py)
        phy2log = paired(phy2log, w, cluster, tokens)
    return phy2log
