"""What the dashboard's EPLB page draws from a Report (report.py) beyond its scores: the balancedness vs nodes-per-token
trade-off over policies and node limits, and per-GPU loads before and after the plan."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from r3trace.eplb.evaluate import POLICIES, PolicyName, Score, plan_policy, score_placement
from r3trace.eplb.placement import Cluster, Placement, PlacementError, from_phy2log
from r3trace.eplb.plan_request import DEFAULT_FORECAST
from r3trace.eplb.report import Report
from r3trace.eplb.score import even_gpu_load

KEEP_GROUPS = "ours, groups kept"  # the trade-off's series of ours with PlannerConfig.keep_groups (--keep-groups)


class TradeoffPoint(NamedTuple):
    policy: str  # a PolicyName, or KEEP_GROUPS
    node_limit: int
    balancedness: float  # replayed (even split when there are no tokens), on the scored window
    nodes_per_token: float | None
    over_limit: float | None


def tradeoff(rep: Report, cluster: Cluster, node_limits: Sequence[int]) -> list[TradeoffPoint]:
    """Every policy (its default forecast) planned on the report's training window with each node limit, scored
    on the held-out window (in-sample when there is none): the balancedness vs nodes-per-token trade-off; on several
    nodes under node-limited dispatch also ours with groups kept on their nodes (KEEP_GROUPS)."""
    assert rep.history is not None
    heat, tokens = ((rep.held_heat, rep.held_tokens) if rep.held_heat is not None
                    else (rep.history.sum(0), rep.train_tokens))
    out = []
    scored: dict[bytes, Score] = {}  # a placement is replayed once: DeepSeek's policies ignore the node limit
    series: list[tuple[str, PolicyName, bool]] = [(p, p, False) for p in POLICIES]
    if cluster.num_nodes > 1 and rep.dispatch == "node-limited":
        series.append((KEEP_GROUPS, "ours", True))
    for name, policy, keep in series:
        try:  # no policy's plan reads the node limit (it only counts tokens over it): planned once
            pl = plan_policy(policy, rep.history, DEFAULT_FORECAST[policy], cluster, rep.train_tokens,
                             dispatch=rep.dispatch, top_k=rep.top_k, keep_groups=keep)
        except PlacementError:  # hierarchical when groups do not divide over nodes
            continue
        for limit in node_limits:
            c = Cluster(cluster.num_gpus, cluster.num_nodes, cluster.num_slots, cluster.num_groups, limit)
            key = pl.phy2log.tobytes()
            s = scored[key] = scored[key] if key in scored else score_placement(pl, heat, tokens, c)
            r = s.balancedness_replay
            over = None if s.token_nodes is None else float((s.token_nodes > limit).mean())
            out.append(TradeoffPoint(name, limit, s.balancedness_even if r is None else r, s.nodes_mean, over))
    return out


def gpu_loads(rep: Report, cluster: Cluster, before: Placement | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per-GPU load [L, G] on the scored window (held out, else in-sample), each expert's heat split evenly over
    its replicas: before the plan (`before`, the placement the cluster runs; None: SGLang's trivial placement, slot p
    holds expert p % E) and after it."""
    assert rep.history is not None
    heat = rep.held_heat if rep.held_heat is not None else rep.history.sum(0)
    n_layers, e = heat.shape
    if before is None:
        before = from_phy2log(np.tile(np.arange(cluster.num_slots) % e, (n_layers, 1)), e)
    return even_gpu_load(before, heat, cluster), even_gpu_load(rep.placement, heat, cluster)
