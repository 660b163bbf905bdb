"""Locality of re-plans without a spare slot (P = E): a re-plan's layer gives up nodes per token only for a lower max
GPU load, and a drifting re-plan takes the fresh layout where it holds the max load with fewer nodes per token.

With every slot one expert, a token's nodes are its experts' distinct nodes: counted on the newest tokens where the
planner has them, else estimated from loads (node_model.expected_nodes, PlannerConfig.router_top_k and
router_topk_group).

Why the drifting rule: a drifting re-plan seeds its layers from the previous placement (replan.refreshed) and takes
the fresh layout only where that lowers the forecast max load; on 16 nodes at s = 1.2 the hottest expert sets the max
load of every layout, so the seeded layers stayed where the older windows' hot experts had been placed while DeepSeek
global re-sorts every window (89% of slots a re-plan). bench/eplb_matrix.py's SGLang-dump cell (128 GPUs / 16 nodes /
256 slots, s = 1.2, fast drift, no tokens): 5.18 nodes per token against global's 4.85.

Shape legend: L layers, E experts, P slots, T tokens, K top-k.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from r3trace.eplb.alignment import align
from r3trace.eplb.candidates import MAX_LOAD_TIE, nodes_per_token
from r3trace.eplb.deepseek import global_phy2log
from r3trace.eplb.node_model import expected_nodes
from r3trace.eplb.placement import Cluster, Placement
from r3trace.eplb.replan import SLACK_TOKENS
from r3trace.eplb.score import phy2log_gpu_load

if TYPE_CHECKING:
    from r3trace.eplb.candidates import Contest
    from r3trace.eplb.config import PlannerConfig


def layer_nodes(phy2log: np.ndarray, w: np.ndarray, cluster: Cluster, cfg: PlannerConfig,
                tokens: np.ndarray | None) -> np.ndarray:
    """phy2log [L, P] with every expert once, forecast w [L, E], tokens [T, L, K] or None -> [L] nodes per token: the
    mean over the newest SLACK_TOKENS tokens, else node_model's expectation."""
    if tokens is None:
        return expected_nodes(phy2log, w, cluster, *cfg.router)
    return nodes_per_token(phy2log, tokens[-SLACK_TOKENS:], cluster)


def locality_kept(new: np.ndarray, prev: Placement, w: np.ndarray, cluster: Cluster, cfg: PlannerConfig,
                  tokens: np.ndarray | None, glob: np.ndarray | None = None) -> np.ndarray:
    """Every slot one expert (P = E): a re-plan's phy2log [L, P] on the forecast w [L, E] -> the same with each layer
    back to prev's where it lowers the forecast max GPU load by no more than min_gain of it, spreads the newest tokens
    (without tokens: node_model's expectation) over more nodes than prev's layer, and is not locality_slack under
    DeepSeek global's plan on w (glob [L, P], where the caller has it) in nodes per token. There the hottest expert
    alone sets the max load in most layers (s = 1.2 on 128 GPUs / 16 nodes: 8-13x the mean), so the seeded re-plans'
    pairing, hot and E[max] swaps barely lower it, but each moved a few replicas across nodes: nodes per token crept
    from 4.44 (global 4.72) to 4.98 over 17 still re-plans (independent router, s = 1.2, slow drift); with this, 4.53
    on average."""
    e = w.shape[1]
    if cluster.num_slots != e:
        return new
    old = phy2log_gpu_load(prev.phy2log, w, cluster).max(1)  # [L]
    same = phy2log_gpu_load(new, w, cluster).max(1) >= old * (1 - cfg.min_gain)  # [L] no lower max load
    rows = np.flatnonzero(same & (new != prev.phy2log).any(1))
    if not len(rows):
        return new
    ref = global_phy2log(w[rows], cluster) if glob is None else glob[rows]
    tok = None if tokens is None else tokens[-SLACK_TOKENS:, rows]
    mine = layer_nodes(new[rows], w[rows], cluster, cfg, tok)  # [R]
    worse = ((mine > layer_nodes(prev.phy2log[rows], w[rows], cluster, cfg, tok))
             & (1 - mine / layer_nodes(ref, w[rows], cluster, cfg, tok) <= cfg.locality_slack))
    out = new.copy()
    out[rows[worse]] = prev.phy2log[rows[worse]]
    return out


def locality_refresh(low: np.ndarray, fresh: Contest, w: np.ndarray, prev: Placement, cluster: Cluster,
                     cfg: PlannerConfig, tokens: np.ndarray | None, glob: np.ndarray | None = None) -> np.ndarray:
    """P = E, a drifting re-plan's phy2log [L, P] (refreshed's) -> the same with each layer over DeepSeek global's
    nodes per token (glob [L, P], global's plan on w, where the caller has it) taking the fresh layout (the Contest's
    choice, aligned to prev) where that has a max GPU load on w within MAX_LOAD_TIE of the layer's or lower and fewer
    nodes per token (layer_nodes) by more than locality_gain of the layer's (module doc)."""
    e = w.shape[1]
    if cluster.num_slots != e or cluster.num_nodes == 1 or cfg.locality_gain < 0:
        return low
    mine = layer_nodes(low, w, cluster, cfg, tokens)  # [L]
    ref = global_phy2log(w, cluster) if glob is None else glob
    rows = np.flatnonzero(mine > layer_nodes(ref, w, cluster, cfg, tokens))  # layers over global's
    if not len(rows):
        return low
    new = fresh.layouts(rows)
    held = (phy2log_gpu_load(new, w[rows], cluster).max(1)
            <= phy2log_gpu_load(low[rows], w[rows], cluster).max(1) * (1 + MAX_LOAD_TIE))
    fewer = layer_nodes(new, w[rows], cluster, cfg, None if tokens is None else tokens[:, rows]) < mine[rows] * (
        1 - cfg.locality_gain)
    take = held & fewer
    if not take.any():
        return low
    out = low.copy()
    out[rows[take]] = align(new[take], prev.phy2log[rows[take]], cluster)
    return out
