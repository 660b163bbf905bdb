"""Nodes that are copies of one another: where a node's slots hold every expert (P / N >= E), each node gets the
same one-node plan, so any one node covers every token (nodes per token 1.0, the floor) and node-limited dispatch
splits each expert's load evenly over the nodes, as the even split does.

The one-node plan is plan() itself on one node's slice of the cluster (its forecast, drift call, churn budget and
swaps), so a re-plan moves the same replicas on every node and its churn is the slice's. A previous placement that
is not such a copy (another planner's, another layout's) is re-planned in the spread layout instead: moving it to
copies would spend more than the churn budget.

Shape legend: L layers, E experts, P slots, N nodes.
"""

from __future__ import annotations

import numpy as np

from r3trace.eplb.config import PlannerConfig
from r3trace.eplb.placement import Cluster, Placement, from_phy2log


def copies_fit(cluster: Cluster, num_experts: int, cfg: PlannerConfig) -> bool:
    """Whether plan() gives this cluster node copies: several nodes, each with a slot for every expert, in the
    spread layout's place (not with spread_by_affinity off, keep_groups or a static-even plan, whose layouts their
    own flags ask for)."""
    return (cfg.node_copies and cluster.num_nodes > 1 and cluster.slots_per_node >= num_experts
            and cfg.spread_by_affinity and not cfg.keep_groups and not cfg.static_even)


def node_slice(cluster: Cluster) -> Cluster:
    """The one node whose plan every node copies."""
    return Cluster(cluster.gpus_per_node, 1, cluster.slots_per_node, cluster.num_groups, cluster.node_limit)


def sliced(prev: Placement | None, cluster: Cluster) -> tuple[bool, Placement | None]:
    """prev -> (whether every node copies its first node's placement, that placement); (True, None) for no
    previous placement."""
    if prev is None:
        return True, None
    nodes = prev.phy2log.reshape(prev.phy2log.shape[0], cluster.num_nodes, cluster.slots_per_node)  # [L, N, P / N]
    if not (nodes == nodes[:, :1]).all():
        return False, None
    return True, from_phy2log(nodes[:, 0], prev.logcnt.shape[1])


def tiled(one: Placement, cluster: Cluster) -> Placement:
    """One node's placement [L, P / N] -> the cluster's, every node holding it."""
    return from_phy2log(np.tile(one.phy2log, (1, cluster.num_nodes)), one.logcnt.shape[1])
