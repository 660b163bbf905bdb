"""Nodes that are copies of one another: where a node's slots hold every expert (P / N >= E), each node gets the
same one-node plan, so any one node covers every token (nodes per token 1.0, the floor) and node-limited dispatch
splits each expert's load evenly over the nodes, as the even split does.

The one-node plan is plan() itself on one node's slice of the cluster (its forecast, drift call, churn budget and
swaps), so a re-plan moves the same replicas on every node and its churn is the slice's. Each expert then has c replicas
a node (the one-node plan's count: 1 where P / N = E), so a layer with an expert whose load over N c is above a GPU's
mean load has that replica for its max GPU, where the spread layout splits the expert over up to max(N, GPUs a node)
replicas: such a layer (its newest window's loads) is planned in the spread layout instead, and stays there. On the
sample model's router at 16 GPUs / 2 nodes / 64 slots under fast drift (bench/eplb_matrix.py's sample-mix cells) one
layer's hottest expert carried 2.1-3.2x a GPU's mean load in the later windows (1.0-1.6x on each of its two copies), and
copies there trailed the spread layout by 0.14-0.25 balancedness in that layer. A layer whose previous placement is not
a copy (the spread layout's, another planner's) stays in the spread layout too: moving it to copies would move most of
its slots, more than the churn budget.

Shape legend: L layers, E experts, P slots, N nodes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from r3trace.eplb.config import PlannerConfig
from r3trace.eplb.homing import capped_counts
from r3trace.eplb.placement import Cluster, Placement, from_phy2log


def copies_fit(cluster: Cluster, num_experts: int, cfg: PlannerConfig) -> bool:
    """Whether plan() gives this cluster node copies: several nodes, each with a slot for every expert, in the
    spread layout's place (not with spread_by_affinity off or keep_groups, whose layouts their own flags ask for).
    A static-even plan (SGLang's dispatch) takes them too: a rank's tokens stay on its node's copy there, so each
    node is the one-node case that the slice's plan makes static-even (static_one_node.py)."""
    return (cfg.node_copies and cluster.num_nodes > 1 and cluster.slots_per_node >= num_experts
            and cfg.spread_by_affinity and not cfg.keep_groups)


def node_slice(cluster: Cluster) -> Cluster:
    """The one node whose plan every node copies."""
    return Cluster(cluster.gpus_per_node, 1, cluster.slots_per_node, cluster.num_groups, cluster.node_limit)


def copy_layers(loads: np.ndarray, prev: Placement | None, cluster: Cluster, hot: float = 1.0) -> np.ndarray:
    """loads [W, L, E] or [L, E], prev -> [L] the layers planned as node copies: no replica of the newest window's
    experts heavier than `hot` x a GPU's mean load (an expert's load over N x its one-node count, DeepSeek's
    replication rule on a node's slots), and (re-plans) a previous layer that every node copies."""
    newest = loads[-1] if loads.ndim == 3 else loads  # [L, E]
    total = newest.sum(1)  # [L]
    per_node = capped_counts(newest, cluster.slots_per_node, cluster.gpus_per_node)  # [L, E]
    heaviest = (newest / per_node).max(1)  # [L] one replica's load on each of the N nodes, times N
    ok = heaviest * cluster.num_gpus <= hot * cluster.num_nodes * total
    if prev is not None:
        nodes = prev.phy2log.reshape(len(ok), cluster.num_nodes, cluster.slots_per_node)  # [L, N, P / N]
        ok &= (nodes == nodes[:, :1]).all((1, 2))
    return ok


Planner = Callable[..., Placement]


def copies_plan(plan: Planner, loads: np.ndarray, cluster: Cluster, prev: Placement | None,
                tokens: np.ndarray | None, cfg: PlannerConfig, mixed: np.ndarray | None,
                demixed: np.ndarray | None) -> Placement:
    """planner.plan's arguments -> its placement with copy_layers' layers planned by `plan` on one node's slice and
    tiled over the nodes, the others by `plan` on the cluster with node copies off."""
    keep = copy_layers(loads, prev, cluster, cfg.copies_hot)  # [L]
    e = loads.shape[-1]
    out = np.zeros((len(keep), cluster.num_slots), dtype=np.int64)  # [L, P]
    for part, one in ((keep, True), (~keep, False)):
        if not part.any():
            continue
        sub = node_slice(cluster) if one else cluster
        old = None
        if prev is not None:
            rows = prev.phy2log[part]
            old = from_phy2log(rows[:, :cluster.slots_per_node] if one else rows, e)
        pl = plan(loads[..., part, :], sub, old, None if tokens is None else tokens[:, part],
                  cfg if one else replace(cfg, node_copies=False),
                  None if mixed is None else mixed[:, part], None if demixed is None else demixed[:, part])
        out[part] = np.tile(pl.phy2log, (1, cluster.num_nodes)) if one else pl.phy2log
    return from_phy2log(out, e)
