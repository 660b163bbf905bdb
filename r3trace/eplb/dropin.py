"""Ours behind the EPLB entry points other tools call: swap `from eplb import rebalance_experts` for
`from r3trace.eplb.dropin import rebalance_experts` and the caller gets ours' plan in the reference's contract.

rebalance_experts: deepseek-ai/EPLB eplb.py at d52c72d (the function SGLang's deepseek algorithm mirrors): weight
[L, E] loads (a torch tensor there; it takes weight.float().cpu()), num_replicas P (a multiple of num_gpus),
num_groups, num_nodes, num_gpus (a multiple of num_nodes) -> (phy2log [L, P], log2phy [L, E, X], logcnt [L, E]),
int64, on the CPU: log2phy[l, e, :c] the slots of expert e's c replicas, the rest -1, X the largest count anywhere
(placement.from_phy2log builds the same).
vllm_rebalance_experts: vllm-project/vllm vllm/distributed/eplb/rebalance_algo.py at 07fb932, the same arguments and
tensors but log2phy X = P - E + 1 wide (the buffer vLLM's EPLB state keeps), on weight's device. vLLM's policy
classes (EPLB_POLICIES, 0.11 on): vllm_policy.py.
Where the references fall back to their global policy (num_groups not a multiple of num_nodes), ours plans as usual
(its layouts need no such divisibility).

What the references cannot take, keyword-only: `history` [W, L, E] (the windows weight came from, oldest first:
ours' forecast, picked by backtest, plans on them; planner.py step 1), `previous` phy2log [L, P] (a re-plan moves at
most ~9.5% of slots on an unchanged workload, where the reference moves 76-98%) and `tokens` [T, L, K] (the newest
routes: extra replicas by co-activation). Without them ours plans on weight alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from r3trace.eplb.config import PlannerConfig
from r3trace.eplb.placement import Cluster, PlacementError, from_phy2log
from r3trace.eplb.planner import plan


def rebalance_experts(weight: Any, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int, *,
                      history: Any = None, previous: Any = None, tokens: Any = None,
                      cfg: PlannerConfig = PlannerConfig()) -> tuple[Any, Any, Any]:
    """weight [L, E] (torch tensor or array), DeepSeek eplb.py's four sizes -> (phy2log [L, P], log2phy [L, E, X],
    logcnt [L, E]) int64, torch CPU tensors for a torch weight, else numpy arrays (module doc: the contract, and what
    history, previous and tokens add)."""
    out = planned_arrays(weight, num_replicas, num_groups, num_nodes, num_gpus, history=history, previous=previous,
                         tokens=tokens, cfg=cfg)
    return _as_torch(out, "cpu") if _is_torch(weight) else out


def vllm_rebalance_experts(weight: Any, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int, *,
                           history: Any = None, previous: Any = None, tokens: Any = None,
                           cfg: PlannerConfig = PlannerConfig()) -> tuple[Any, Any, Any]:
    """As rebalance_experts, in vLLM rebalance_algo.py's contract: log2phy [L, E, P - E + 1] and, for a torch weight,
    the tensors on its device."""
    phy2log, log2phy, logcnt = planned_arrays(weight, num_replicas, num_groups, num_nodes, num_gpus, history=history,
                                              previous=previous, tokens=tokens, cfg=cfg)
    wide = np.full((*log2phy.shape[:2], num_replicas - log2phy.shape[1] + 1), -1, dtype=np.int64)
    wide[:, :, :log2phy.shape[2]] = log2phy  # a count is at most 1 + the P - E spare slots
    out = (phy2log, wide, logcnt)
    return _as_torch(out, weight.device) if _is_torch(weight) else out


def planned_arrays(weight: Any, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int, *,
                   history: Any = None, previous: Any = None, tokens: Any = None,
                   cfg: PlannerConfig = PlannerConfig()) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The entry points' arguments -> ours' Placement as numpy (phy2log, log2phy, logcnt); PlacementError names the
    argument that does not fit."""
    w = as_array(weight, np.float64)
    if w.ndim != 2:
        raise PlacementError(f"weight has shape {list(w.shape)}; rebalance_experts takes [layers, experts]")
    n_layers, e = w.shape
    if num_replicas < e:
        raise PlacementError(f"num_replicas={num_replicas} is under the {e} experts: each needs a slot")
    if num_groups < 1 or e % num_groups:
        raise PlacementError(f"num_groups={num_groups} must divide the {e} experts")
    cluster = Cluster(num_gpus, num_nodes, num_replicas, num_groups=num_groups)
    loads = w
    if history is not None:
        loads = as_array(history, np.float64)
        if loads.ndim != 3 or loads.shape[1:] != w.shape:
            raise PlacementError(f"history has shape {list(loads.shape)}; it must be [windows, {n_layers}, {e}]")
    prev = None
    if previous is not None:
        old = as_array(previous, np.int64)
        if old.shape != (n_layers, num_replicas):
            raise PlacementError(f"previous has shape {list(old.shape)}; it must be [{n_layers}, {num_replicas}]")
        prev = from_phy2log(old, e)
    pl = plan(loads, cluster, prev, None if tokens is None else as_array(tokens, np.int64), cfg)
    return pl.phy2log, pl.log2phy, pl.logcnt


def _as_torch(arrays: tuple[np.ndarray, ...], device: Any) -> tuple[Any, Any, Any]:
    import torch  # only where the caller handed a torch tensor: the analysis side runs without it

    return tuple(torch.from_numpy(np.ascontiguousarray(x)).to(device) for x in arrays)  # type: ignore[return-value]


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def as_array(x: Any, dtype: type) -> np.ndarray:
    """A torch tensor (any device) or array-like -> numpy array of dtype."""
    if _is_torch(x):  # floats through float32 first, as the reference's weight.float() (numpy has no bfloat16)
        x = (x.detach().float() if x.is_floating_point() else x.detach()).cpu().numpy()
    return np.asarray(x, dtype=dtype)
