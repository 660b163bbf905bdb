"""What the vLLM and SGLang plugins share (vllm_policy.py, sglang_plugin.py): the reading of their switch variable
and of the router variables, and the line ours logs at INFO at each rearrangement it plans inside a server, so the
server's own log shows that ours planned and what it did: the sizes, the windows it planned on, the share of slots it
moved from the map in service and the balancedness its plan gives the window it was handed. Each plugin logs under a
name its server prints: vLLM configures only its "vllm" logger tree (vllm_policy.py: "vllm.r3trace_eplb"), SGLang
the root logger (sglang_plugin.py: "r3trace.eplb")."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from r3trace.eplb.config import PlannerConfig
from r3trace.eplb.dropin import as_array
from r3trace.eplb.placement import Cluster
from r3trace.eplb.score import balancedness, phy2log_gpu_load


def plan_line(server: str, weight: Any, phy2log: Any, previous: np.ndarray | None, windows: int, gpus: int,
              nodes: int, seconds: float) -> str:
    """weight [L, E] (the window handed in), phy2log [L, P] planned, previous [L, P] (the map it came from, or None)
    -> one line."""
    w, ph = as_array(weight, np.float64), as_array(phy2log, np.int64)
    n_layers, slots = ph.shape
    bal = balancedness(phy2log_gpu_load(ph, w, Cluster(gpus, nodes, slots)))
    moved = "a fresh plan" if previous is None else f"{float((ph != previous).mean()):.1%} of slots moved"
    return (f"r3trace EPLB in {server}: {n_layers} layers x {slots} slots on {gpus} GPUs / {nodes} nodes, planned on "
            f"{windows} window(s) in {seconds:.3f} s: {moved}, balancedness {bal:.3f} on the window handed in")


def switched_on(env: Mapping[str, str], var: str, server: str) -> bool:
    """env[var] "1": ours plans the server's EPLB; unset or "0": the server's own; any other value is an error naming
    the variable."""
    flag = env.get(var, "0")
    if flag not in ("0", "1"):
        raise ValueError(f"{var}={flag!r}: use 1 (ours plans {server}'s EPLB) or 0 ({server}'s own)")
    return flag == "1"


TOP_K_ENV, TOPK_GROUP_ENV = "R3TRACE_EPLB_TOP_K", "R3TRACE_EPLB_TOPK_GROUP"


def router_config(env: Mapping[str, str], cfg: PlannerConfig) -> PlannerConfig:
    """cfg with the model's router from env: R3TRACE_EPLB_TOP_K (experts a token picks, >= 1; unset: cfg's, 8 as
    DeepSeek V3) and R3TRACE_EPLB_TOPK_GROUP (groups they come from, >= 0, 0: half the groups). A server hands its
    EPLB policy loads only, and ours ranks layouts without a spare slot by nodes per token expected from them
    (node_model.py, node_swaps.py) for that router. A value that is not such an integer is an error naming the
    variable and its limit."""
    top_k = _int_var(env, TOP_K_ENV, 1, cfg.router_top_k)
    topk_group = _int_var(env, TOPK_GROUP_ENV, 0, cfg.router_topk_group)
    return replace(cfg, router_top_k=top_k, router_topk_group=topk_group)


def _int_var(env: Mapping[str, str], var: str, low: int, default: int) -> int:
    """env[var] as an integer >= low, default where unset; else an error naming the variable and the limit."""
    raw = env.get(var)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if value < low:
        raise ValueError(f"{var}={raw!r}: must be an integer >= {low}")
    return value
