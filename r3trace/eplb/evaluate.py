"""Plan a placement with one policy and score it on a trace's tokens: what the demo, the dashboard and the
CLI all report.

weight: [L, E] expert heat; tokens: [T, L, K] logical topk_ids of the tokens to replay.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from r3trace.eplb import deepseek, planner, score
from r3trace.eplb.placement import Cluster, Placement

PolicyName = Literal["ours", "global", "hierarchical", "cross_node"]
POLICIES: tuple[PolicyName, ...] = ("ours", "global", "hierarchical", "cross_node")


def make_placement(policy: PolicyName, weight: np.ndarray, cluster: Cluster, tokens: np.ndarray) -> Placement:
    if policy == "ours":
        return planner.plan(weight, cluster, tokens=tokens)
    if policy == "global":
        return deepseek.global_policy(weight, cluster)
    if policy == "hierarchical":
        return deepseek.hierarchical(weight, cluster)
    if policy == "cross_node":
        return deepseek.cross_node(weight, cluster)
    raise ValueError(f"policy={policy!r}: expected one of {POLICIES}")


def evaluate_policy(policy: PolicyName, weight: np.ndarray, tokens: np.ndarray, cluster: Cluster) -> dict[str, Any]:
    """-> placement (phy2log [L, P], logcnt [L, E]), balancedness under an even split of each expert's load
    over its replicas and replayed through node-limited dispatch (mean/max GPU load), nodes per token
    (mean, max), tokens replayed."""
    placement = make_placement(policy, weight, cluster, tokens)
    dispatch = score.node_limited(placement, tokens, cluster)
    return {
        "policy": policy, "placement": placement, "phy2log": placement.phy2log, "logcnt": placement.logcnt,
        "balancedness_even": score.balancedness(score.even_gpu_load(placement, weight, cluster)),
        "balancedness_replay": score.balancedness(dispatch.gpu_load),
        "nodes_mean": float(dispatch.nodes.mean()) if dispatch.nodes.size else 0.0,
        "nodes_max": int(dispatch.nodes.max()) if dispatch.nodes.size else 0,
        "tokens": int(tokens.shape[0]), "slots_per_gpu": cluster.slots_per_gpu,
    }
