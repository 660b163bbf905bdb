"""Trace-replay simulator: replay routed tokens forward by forward against a placement or a re-planning policy.

A policy re-plans every `window_steps` forwards from the loads of the windows seen so far (plan on window t,
score on t+1 and later); the new placement is rolled out `chunk_layers` layers per forward (chunked
per-layer updates, as SGLang's rebalance does), so the old and new maps coexist during the rollout.
Migration bytes = slots whose logical expert changed x `expert_bytes` (V3: 3 x 7168 x 2048 FP8 = 44 MB).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import polars as pl

from r3trace.eplb.placement import Cluster, Placement, from_phy2log
from r3trace.eplb.score import heat_of, node_limited
from r3trace.trace.reader import TokenRoutes

Policy = Callable[[np.ndarray, Placement | None, np.ndarray], Placement]  # (history [W,L,E], prev, tokens)
V3_EXPERT_BYTES = 3 * 7168 * 2048  # gate, up, down projections in FP8


@dataclass(frozen=True)
class ReplayConfig:
    window_steps: int = 256  # forwards per planning window
    chunk_layers: int = 8  # layers switched to the new placement per forward
    expert_bytes: int = V3_EXPERT_BYTES
    history_windows: int = 4  # windows of loads the policy sees


def replay(
    routes: TokenRoutes,
    cluster: Cluster,
    num_experts: int,
    placement: Placement | None = None,
    policy: Policy | None = None,
    cfg: ReplayConfig = ReplayConfig(),
) -> pl.DataFrame:
    """One row per forward: forward_id, tokens, max_over_mean (GPU load, mean over layers), balancedness
    (mean/max, mean over layers), mean_nodes, max_nodes, over_limit (share of token-layers above the node
    limit), mean_remote (nodes other than the token's own), replicas (extra slots, P - E), migration_bytes.

    Give a fixed `placement`, or a `policy` (then the first window runs on the policy's plan of itself:
    a cold start, marked by window 0 in the `window` column).
    """
    if (placement is None) == (policy is None):
        raise ValueError("replay needs exactly one of placement= or policy=")
    fwd = routes.forward_id
    bounds = np.flatnonzero(np.diff(fwd)) + 1
    starts, ends = np.r_[0, bounds], np.r_[bounds, len(fwd)]
    token_node = (routes.dp_rank.astype(np.int64) % cluster.num_gpus) // cluster.gpus_per_node
    current = placement
    pending: Placement | None = None
    next_layer = 0
    window_heat: list[np.ndarray] = []
    acc = np.zeros((routes.topk_ids.shape[1], num_experts))
    rows = []
    if policy is not None:  # cold start: plan on the first window (an oracle the later windows do not get)
        first = routes.topk_ids[: ends[min(cfg.window_steps, len(ends)) - 1]]
        current = policy(heat_of(first, num_experts)[None], None, first)
    assert current is not None
    for step, (lo, hi) in enumerate(zip(starts, ends, strict=True)):
        moved = 0
        if pending is not None:  # roll out chunk_layers layers of the new placement
            layers = slice(next_layer, next_layer + cfg.chunk_layers)
            phy = current.phy2log.copy()
            moved = int((phy[layers] != pending.phy2log[layers]).sum())
            phy[layers] = pending.phy2log[layers]
            current = from_phy2log(phy, num_experts)
            next_layer += cfg.chunk_layers
            if next_layer >= phy.shape[0]:
                pending, next_layer = None, 0
        ids = routes.topk_ids[lo:hi]
        d = node_limited(current, ids, cluster, token_node[lo:hi], seed=step)
        load = d.gpu_load
        mx, mean = load.max(1), load.mean(1)
        rows.append((int(fwd[lo]), step // cfg.window_steps, hi - lo, float((mx / np.maximum(mean, 1e-12)).mean()),
                     float((mean / np.maximum(mx, 1e-12)).mean()), float(d.nodes.mean()), int(d.nodes.max()),
                     float((d.nodes > cluster.node_limit).mean()), float(d.remote.mean()),
                     cluster.num_slots - num_experts, moved * cfg.expert_bytes))
        acc += heat_of(ids, num_experts)
        if policy is not None and (step + 1) % cfg.window_steps == 0:
            window_heat = [*window_heat, acc][-cfg.history_windows:]
            acc = np.zeros_like(acc)
            window_tokens = routes.topk_ids[starts[step + 1 - cfg.window_steps]:hi]
            pending, next_layer = policy(np.stack(window_heat), current, window_tokens), 0
    return pl.DataFrame(rows, orient="row", schema=[
        "forward_id", "window", "tokens", "max_over_mean", "balancedness", "mean_nodes", "max_nodes",
        "over_limit", "mean_remote", "replicas", "migration_bytes"])
