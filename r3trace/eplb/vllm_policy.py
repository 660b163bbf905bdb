"""Ours as vLLM's EPLB policy: `pip install r3trace` beside vLLM, set R3TRACE_VLLM_EPLB=1, and every vLLM process
plans its expert rearrangements with ours in place of the built-in DefaultEplbPolicy.

The contract (vLLM 0.33.0, vllm/distributed/eplb/policy/abstract.py, and its one caller, EplbState.rearrange in
eplb_state.py): a class whose classmethod rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_ranks,
old_global_expert_indices=None) returns phy2log [L, P] (int64, CPU) alone; vLLM derives log2phy and the replica counts
itself. weight is [L, E] expert loads summed over vLLM's load window (int32, CPU); old_global_expert_indices is the
phy2log in service, whose width differs from P after an elastic scale-down and whose new slots hold -1 after a
scale-up. num_groups is the model's num_expert_groups (0 or None where the config has no n_group). Older vLLM
(vllm/distributed/eplb/policy/abstract.py at 0b79b64, five arguments; and after vllm-project/vllm PR #29499 added
old_global_expert_indices) returns the triple (phy2log, log2phy [L, E, P - E + 1], logcnt) from the same call:
`install` reads which from the abstract method's return annotation, once.

What ours adds there: the old map as `previous`, so a re-plan on an unchanged workload moves <= ~10% of slots where
the built-in policy re-packs from scratch and keeps only the experts that land on the same GPU again; and the windows
of earlier calls. vLLM hands one summed window a call and keeps none, so the installed class keeps the newest 8
of its process (window_history.py) and plans on them as dropin's `history`: ours' forecast and drift test
run as in `r3trace eplb` (measured beside vLLM's own policy: BENCHMARKS.md, "EPLB inside vLLM").

How it is wired: pyproject.toml registers `register` under vLLM's plugin group `vllm.general_plugins`, which vLLM
loads in every process (API server, engine core, workers) before the EPLB state picks EPLB_POLICIES[policy]; it
replaces the "default" entry (EPLBPolicyOption is a closed Literal, so a new name would not pass vLLM's config check)
only when R3TRACE_VLLM_EPLB is set to 1, so installing r3trace beside vLLM changes nothing by itself.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, MutableMapping
from typing import Any

import numpy as np

from r3trace.eplb.config import PlannerConfig
from r3trace.eplb.dropin import as_array, planned_arrays, vllm_rebalance_experts
from r3trace.eplb.placement import PlacementError, from_phy2log
from r3trace.eplb.served import plan_line, router_config, switched_on
from r3trace.eplb.window_history import WindowHistory

ENV = "R3TRACE_VLLM_EPLB"
log = logging.getLogger("vllm.r3trace_eplb")  # under vLLM's "vllm" logger tree, the one vLLM's logging prints


def rebalance_phy2log(weight: Any, num_replicas: int, num_groups: int | None, num_nodes: int, num_ranks: int,
                      old_global_expert_indices: Any = None, *, history: Any = None,
                      cfg: PlannerConfig = PlannerConfig()) -> Any:
    """vLLM 0.33.0's rebalance_experts: phy2log [L, P] int64 on the CPU (module doc: the arguments). The old map is
    ours' `previous` where it is a placement of this shape (every expert present, no -1); else ours plans fresh.
    history: the windows [W, L, E] weight ends (WindowHistory.add), else weight alone."""
    import torch

    groups, nodes = _sizes(num_groups, num_nodes, num_ranks)
    previous = _previous(old_global_expert_indices, weight, num_replicas)
    phy2log, _, _ = planned_arrays(weight, num_replicas, groups, nodes, num_ranks, history=history,
                                   previous=previous, cfg=cfg)
    return torch.from_numpy(np.ascontiguousarray(phy2log))


def rebalance_triple(weight: Any, num_replicas: int, num_groups: int | None, num_nodes: int, num_ranks: int,
                     old_global_expert_indices: Any = None, *, history: Any = None,
                     cfg: PlannerConfig = PlannerConfig()) -> Any:
    """The older policy contract: (phy2log, log2phy [L, E, P - E + 1], logcnt) on weight's device."""
    groups, nodes = _sizes(num_groups, num_nodes, num_ranks)
    previous = _previous(old_global_expert_indices, weight, num_replicas)
    return vllm_rebalance_experts(weight, num_replicas, groups, nodes, num_ranks, history=history,
                                  previous=previous, cfg=cfg)


def install(policies: MutableMapping[str, Any], abstract: type, env: Mapping[str, str]) -> type | None:
    """Puts ours in policies["default"] as a subclass of vLLM's AbstractEplbPolicy when env[ENV] is "1"; returns the
    class (its `history`, a WindowHistory, holds the windows it was handed), or None (left alone) when the variable is
    unset or "0". Any other value is an error naming the variable; the router variables (served.router_config) set
    the router ours assumes."""
    if not switched_on(env, ENV, "vLLM"):
        return None
    cfg = router_config(env, PlannerConfig())
    returns = str(getattr(getattr(abstract, "rebalance_experts", None), "__annotations__", {}).get("return", ""))
    fn = rebalance_triple if "tuple" in returns else rebalance_phy2log

    def rebalance_experts(cls: Any, weight: Any, num_replicas: int, num_groups: int, num_nodes: int,
                          num_ranks: int, old_global_expert_indices: Any = None) -> Any:
        sizes = (num_replicas, num_ranks, num_nodes, num_groups or 0)
        history = cls.history.add(weight, sizes)
        t0 = time.perf_counter()
        out = fn(weight, num_replicas, num_groups, num_nodes, num_ranks, old_global_expert_indices, history=history,
                 cfg=cfg)
        if log.isEnabledFor(logging.INFO):
            seconds, nodes = time.perf_counter() - t0, _sizes(num_groups, num_nodes, num_ranks)[1]
            previous = _previous(old_global_expert_indices, weight, num_replicas)
            log.info(plan_line("vLLM", weight, out[0] if isinstance(out, tuple) else out, previous,
                               0 if history is None else len(history), num_ranks, nodes, seconds))
        return out

    policy = type("R3traceEplbPolicy", (abstract,), {
        "rebalance_experts": classmethod(rebalance_experts), "history": WindowHistory(), "__module__": __name__,
        "__doc__": "r3trace's EPLB planner in vLLM's policy contract (r3trace/eplb/vllm_policy.py)."})
    policies["default"] = policy
    log.info("r3trace EPLB: ours is vLLM's default EPLB policy (%s=1)", ENV)
    return policy


def register() -> None:
    """vLLM's general-plugin entry point: runs in every vLLM process; a no-op unless R3TRACE_VLLM_EPLB=1."""
    if not switched_on(os.environ, ENV, "vLLM"):
        return
    try:
        from vllm.distributed.eplb import policy as vllm_policies  # type: ignore[import-not-found]
    except ImportError as exc:
        raise ImportError(f"{ENV}=1 needs vLLM with vllm.distributed.eplb.policy (0.11 or later): {exc}") from exc
    install(vllm_policies.EPLB_POLICIES, vllm_policies.AbstractEplbPolicy, os.environ)


def _sizes(num_groups: int | None, num_nodes: int, num_ranks: int) -> tuple[int, int]:
    """vLLM's num_expert_groups is 0 before a model sets it and None where the config has no n_group: one group.
    Nodes that do not divide the ranks: one node, as vLLM's caller does."""
    groups = num_groups if num_groups and num_groups > 0 else 1
    nodes = num_nodes if num_nodes > 0 and num_ranks % num_nodes == 0 else 1
    return groups, nodes


def _previous(old: Any, weight: Any, num_replicas: int) -> np.ndarray | None:
    """The old phy2log as ours' previous placement, or None where it cannot be one: another width (elastic scaling),
    -1 slots (a scale-up's new slots) or an expert with no slot."""
    if old is None:
        return None
    prev = as_array(old, np.int64)
    if prev.shape != (weight.shape[0], num_replicas):
        return None
    try:
        from_phy2log(prev, weight.shape[1])  # its checks: every id an expert, every expert a slot
    except PlacementError:
        return None
    return prev
