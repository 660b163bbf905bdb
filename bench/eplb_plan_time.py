"""Plan time at [58, 256]: ours (fresh, re-planned, drifting, for SGLang's static dispatch, without tokens) against
DeepSeek's eplb.py and r3trace's numpy global policy, in one process (BENCHMARKS.md, EPLB plan time).

Run: .venv/bin/python -m bench.eplb_matrix --plan-time --eplb-ref DIR [--idle S] [--shapes GxNxP ...]
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from bench.eplb_traces import TraceSpec, load_windows
from r3trace.eplb import Cluster, PlannerConfig, global_policy, plan
from r3trace.eplb.evaluate import planner_config
from r3trace.eplb.score import heat_of

# the main three of the matrix, two without a spare slot (P = E: candidates.py's per-layer layout choice; on 16
# nodes, two slots a GPU, a still re-plan ends with E[max] swaps, emax.py), and one and two nodes
# (static_one_node.py; the two-node replay contest and guard, dispatch_contest.py)
PLAN_TIME_SHAPES = [(32, 4, 288), (64, 8, 320), (144, 18, 288), (64, 8, 256), (128, 16, 256), (8, 1, 288),
                    (16, 2, 288)]
SEED_ALL = PlannerConfig(refresh_floor=-1.0)  # a drifting re-plan seeds every layer before deciding (replan.py)


def plan_times(ref_dir: str | None, rounds: int = 7, idle_s: float = 0.0,
               shapes: list[tuple[int, int, int]] | None = None) -> list[dict[str, Any]]:
    """Median seconds per plan at [58, 256] (grouped router, s = 0.6): ours fresh, re-planned from its previous
    placement (with the newest 2048 tokens) on an unchanged workload and on a drifting one (fast drift, 5 windows:
    forecast.drifts calls it, so the re-plan may refresh layers; also with every layer seeded first, SEED_ALL),
    ours for SGLang's static dispatch (`--dispatch static`: fresh and re-planned), ours without tokens (fresh, and
    the drifting re-plan from a plan without them, on 6 windows), the global policy of
    r3trace/eplb/deepseek.py,
    and DeepSeek's own eplb.py from ref_dir (rebalance_experts with the shape's groups and nodes, its default, and
    with one node). shapes: (GPUs, nodes, slots), default PLAN_TIME_SHAPES.

    Protocol, the same for every call, ours and the reference alike: `rounds` rounds per shape; each round calls
    every function once, in one order in even rounds and the reverse in odd ones, so no side always runs right
    after the other's longest call; each timed call comes right after an untimed call of the same function
    (warm); ratios are of the medians. Why warm: on the 2-core VM a call whose memory sat idle for about a
    second has taken up to 2-3x the CPU time of the same call repeated (ours fresh at [58, 256] on 8 nodes: 0.27-0.29
    vs 0.10 s, no page faults counted), and in a fixed order that lands on whichever call follows the reference's
    1.5-2 s global call. idle_s > 0 times that case instead, for every call alike: each timed call comes
    after idle_s seconds of sleep (no warm call); at 1.5 s ours fresh took 1.0-1.3x its warm time and the
    reference's default call 0.9-1.1x (bench/results/eplb-matrix-plan-time-idle.json)."""
    import importlib.util
    import statistics

    from r3trace.eplb.drift_call import drift_call
    from r3trace.eplb.forecast import backtest_errors, drifts

    ref = None
    if ref_dir:
        spec_ = importlib.util.spec_from_file_location("eplb_ref", Path(ref_dir) / "eplb.py")
        assert spec_ and spec_.loader
        ref = importlib.util.module_from_spec(spec_)
        spec_.loader.exec_module(ref)
    routes = load_windows(TraceSpec(num_layers=58, windows=3, window_tokens=2048))[0]
    heats = np.stack([heat_of(w, 256) for w in routes])
    # 6 windows: the first 5 (with tokens) and all 6 (without: 3 scored windows are too few for drift_t there, t =
    # 1.6, where 4 give 2.5, so a 5-window re-plan without tokens would be a still one)
    moving6 = load_windows(TraceSpec(num_layers=58, windows=6, window_tokens=2048, drift="fast"))[0]
    moved6 = np.stack([heat_of(w, 256) for w in moving6])
    moving, moved = moving6[:5], moved6[:5]
    if not drifts(moved, backtest_errors(moved), PlannerConfig().refresh_drift):
        raise RuntimeError("the fast-drift history no longer drifts (forecast.drifts): the drifting re-plan is untimed")

    rows = []
    for g, n, p in shapes or PLAN_TIME_SHAPES:
        cl = Cluster(g, n, p)
        first = plan(heats[:2], cl, tokens=routes[1])
        first_moved = plan(moved[:4], cl, tokens=moving[3])
        first_moved_loads = plan(moved6[:5], cl)
        call = drift_call(moved6, True, PlannerConfig(), cluster=cl)
        if not (call.moving or call.held):  # held: two nodes without routes (drift_call.py), timed as such
            raise RuntimeError(f"{g}x{n}x{p}: the re-plan without tokens no longer drifts ({call.note()})")
        static_cfg = planner_config("static")
        first_static = plan(heats[:2], cl, tokens=routes[1], cfg=static_cfg)
        calls: dict[str, Callable[[], object]] = {
            "ours_fresh": partial(plan, heats, cl, tokens=routes[2]),
            "ours_replan": partial(plan, heats, cl, first, tokens=routes[2]),
            "ours_replan_drift": partial(plan, moved, cl, first_moved, tokens=moving[4]),
            # the same re-plan seeding every layer before the refresh decision (how it ran before replan.py's skip)
            "ours_replan_drift_seed_all": partial(plan, moved, cl, first_moved, tokens=moving[4], cfg=SEED_ALL),
            "ours_static_fresh": partial(plan, heats, cl, tokens=routes[2], cfg=static_cfg),
            "ours_static_replan": partial(plan, heats, cl, first_static, tokens=routes[2], cfg=static_cfg),
            # no tokens (an SGLang dump, the server plugins): P = E swaps experts between nodes (node_swaps.py)
            "ours_fresh_no_tokens": partial(plan, heats, cl),
            "ours_replan_drift_no_tokens": partial(plan, moved6, cl, first_moved_loads),
            "global_numpy": partial(global_policy, heats[2], cl)}
        if ref is not None:
            import torch

            w = torch.tensor(heats[2])
            groups, nodes = (8, n) if 8 % n == 0 else (1, 1)  # what rebalance_experts does with 8 groups
            calls["ref_default"] = partial(ref.rebalance_experts, w, p, groups, nodes, g)
            calls["ref_global"] = partial(ref.rebalance_experts, w, p, 1, 1, g)
        took: dict[str, list[float]] = {k: [] for k in calls}
        for i in range(rounds):
            for k in (list(calls) if i % 2 == 0 else list(calls)[::-1]):
                if idle_s > 0:
                    time.sleep(idle_s)
                else:
                    calls[k]()
                t0 = time.perf_counter()
                calls[k]()
                took[k].append(time.perf_counter() - t0)
        row: dict[str, Any] = {"shape": f"{g}x{n}x{p}", "rounds": rounds, "idle_s": idle_s,
                               **{k: statistics.median(v) for k, v in took.items()}}
        if ref is not None:
            row["fresh_vs_default"] = row["ours_fresh"] / row["ref_default"]
            row["replan_vs_default"] = row["ours_replan"] / row["ref_default"]
            row["replan_drift_vs_default"] = row["ours_replan_drift"] / row["ref_default"]
        rows.append(row)
        print(row, flush=True)
    return rows
