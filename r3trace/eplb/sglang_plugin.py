"""Ours as SGLang's EPLB algorithm: `pip install r3trace` beside SGLang, set R3TRACE_SGLANG_EPLB=1, and every
rebalance of `--enable-eplb` (and a placement made from `--init-expert-location` counts) is planned by ours.

The contract (SGLang 0.5.23's wheel): ExpertLocationMetadata.init_by_eplb (srt/eplb/expert_location.py) calls
`sglang.srt.eplb.eplb_algorithms.rebalance_experts(tokens_per_expert, num_physical_experts,
num_local_physical_experts, num_groups, num_nodes, algorithm)` with the recorder's logical counts [S, L, E] (a
circular buffer of forward passes, all-reduced over ranks, on the device; L counts every hidden layer, dense ones
all zero), num_groups None for a model without groups, and an EplbAlgorithm; it takes back (phy2log [L, P],
log2phy [L, E, X], logcnt [L, E]) in DeepSeek eplb.py's contract (X the largest count; SGLang pads it to P and moves
the maps to the device). That is dropin.rebalance_experts' contract.

How it is wired: pyproject.toml registers `register` under SGLang's plugin group `sglang.srt.plugins`, which SGLang
loads in every process (engine, schedulers, detokenizer); with the variable set it registers an AROUND hook on that
function in SGLang's HookRegistry. The hook plans with ours unless the algorithm is an elasticity-aware one (its
active-rank mask is SGLang's alone: the original runs). Unset or 0: nothing is registered.

What ours adds there: the buffer's order is the circular buffer's (rotated), so its rows are summed into one window,
and the hook keeps the windows of earlier rebalances (window_history.py) for ours' forecast, and its own last plan of
those sizes as the map in service (init_by_eplb hands none): a re-plan on an unchanged workload moves <= ~10% of
slots where DeepSeek's algorithm re-packs from scratch. SGLang dispatches a loaded placement by `ep_dispatch_algorithm`
(static with an all-to-all backend, dynamic without); ours plans for the one read from SGLang's runtime context at the
first call (evaluate.planner_config), the even split where it is another or cannot be read.

Every rank's hook sees the same calls, so the ranks' plans agree (window_history.py): SGLang's EPLBManager calls
init_by_eplb on every rank with the all-reduced counts, and after an elastic scale only rank 0 plans (flat topology,
other sizes: its windows and last plan start afresh) and broadcasts the map.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from r3trace.eplb.config import PlannerConfig
from r3trace.eplb.dropin import rebalance_experts
from r3trace.eplb.evaluate import planner_config
from r3trace.eplb.served import plan_line, router_config, switched_on
from r3trace.eplb.window_history import WindowHistory

ENV = "R3TRACE_SGLANG_EPLB"
TARGET = "sglang.srt.eplb.eplb_algorithms.rebalance_experts"
log = logging.getLogger("r3trace.eplb")  # SGLang configures the root logger, which prints it
# SGLang's ep_dispatch_algorithm -> what ours plans for; "fake", "lp" and an unread one: the even split
DISPATCH_CONFIGS = {"static": planner_config("static"), "dynamic": planner_config("dynamic")}


class SglangHook:
    """The AROUND hook: hook(original, *args, **kwargs) with rebalance_experts' arguments. dispatch: SGLang's
    ep_dispatch_algorithm, or a callable read once at the first call (SGLang's runtime context is set after plugins
    load)."""

    def __init__(self, dispatch: str | None | Callable[[], str | None], env: Mapping[str, str] | None = None) -> None:
        self.dispatch, self.env = dispatch, {} if env is None else env
        router_config(self.env, PlannerConfig())  # a bad router variable fails at install, not at the first rebalance
        self.cfg: PlannerConfig | None = None
        self.history = WindowHistory()
        self.previous: dict[tuple[int, ...], Any] = {}

    def clear(self) -> None:
        """Forgets the windows and plans of earlier calls, as a fresh process."""
        self.history.clear()
        self.previous.clear()

    def __call__(self, original: Callable[..., Any], tokens_per_expert: Any, num_physical_experts: int,
                 num_local_physical_experts: int, num_groups: int | None, num_nodes: int, algorithm: Any) -> Any:
        if getattr(algorithm, "name", str(algorithm)).startswith("elasticity_aware"):
            return original(tokens_per_expert, num_physical_experts, num_local_physical_experts, num_groups,
                            num_nodes, algorithm)
        if self.cfg is None:
            dispatch = self.dispatch() if callable(self.dispatch) else self.dispatch
            self.cfg = router_config(self.env, DISPATCH_CONFIGS.get(dispatch or "", PlannerConfig()))
        counts = tokens_per_expert if tokens_per_expert.dim() == 3 else tokens_per_expert.unsqueeze(0)
        weight = counts.sum(0)
        gpus = num_physical_experts // num_local_physical_experts
        groups = num_groups if num_groups and num_groups > 0 else 1
        sizes = (num_physical_experts, gpus, num_nodes, groups)
        history = self.history.add(weight, sizes)
        key = (*weight.shape, *sizes)
        previous = self.previous.get(key)
        t0 = time.perf_counter()
        out = rebalance_experts(weight, num_physical_experts, groups, num_nodes, gpus, history=history,
                                previous=previous, cfg=self.cfg)
        if log.isEnabledFor(logging.INFO):
            log.info(plan_line("SGLang", weight, out[0], previous, 0 if history is None else len(history), gpus,
                               num_nodes, time.perf_counter() - t0))
        self.previous = {key: out[0].numpy()}
        return out


def install(register_hook: Callable[..., Any], around: Any, env: Mapping[str, str],
            dispatch: str | None | Callable[[], str | None]) -> SglangHook | None:
    """register_hook(TARGET, hook, around) when env[ENV] is "1" (SGLang: HookRegistry.register, HookType.AROUND);
    returns the hook, or None when the variable is unset or "0". Any other value is an error naming the variable; the
    router variables (served.router_config) set the router ours assumes."""
    if not switched_on(env, ENV, "SGLang"):
        return None
    hook = SglangHook(dispatch, env)
    register_hook(TARGET, hook, around)
    log.info("r3trace EPLB: ours plans SGLang's EPLB rebalances (%s=1)", ENV)
    return hook


def register() -> None:
    """SGLang's general-plugin entry point: runs in every SGLang process; a no-op unless R3TRACE_SGLANG_EPLB=1."""
    if not switched_on(os.environ, ENV, "SGLang"):
        return
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # type: ignore[import-not-found]
    except ImportError as exc:
        raise ImportError(f"{ENV}=1 needs SGLang with sglang.srt.plugins (0.5.23 or later): {exc}") from exc
    install(HookRegistry.register, HookType.AROUND, os.environ, _sglang_dispatch)


def _sglang_dispatch() -> str | None:
    """SGLang's ep_dispatch_algorithm from its runtime context (0.5.23), or None where it cannot be read."""
    try:
        from sglang.srt.runtime_context import get_exec  # type: ignore[import-not-found]

        return str(get_exec().moe.ep_dispatch_algorithm)
    except Exception:  # an SGLang without that context: plan for the even split
        return None
