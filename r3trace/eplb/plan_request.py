"""What `r3trace eplb` (and the dashboard's EPLB page) asks of one plan: the cluster, the policy and forecast, the
training and held-out windows, and what ours plans for (report.make_report takes it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from r3trace.eplb import window as win
from r3trace.eplb.evaluate import DispatchName, Forecast
from r3trace.eplb.loads import HeatSource
from r3trace.eplb.placement import Cluster, Placement

PolicyChoice = Literal["auto", "ours", "global", "hierarchical", "cross_node"]
DEFAULT_FORECAST: dict[str, Forecast] = {"ours": "ema", "global": "mean", "hierarchical": "mean",
                                         "cross_node": "mean"}


@dataclass(frozen=True)
class PlanRequest:
    cluster: Cluster
    policy: PolicyChoice = "auto"
    forecast: Forecast | None = None  # None: auto tries every forecast; a named policy takes DEFAULT_FORECAST
    train: win.WindowSpec | None = None  # None: the whole run (or what precedes `held_out`)
    held_out: win.WindowSpec | None = None  # None: what follows the training window, if anything
    run_id: str | None = None  # the run of time and forward windows
    windows: int = 8  # history windows the training window is cut into
    window_s: float | None = None  # or history windows of this length
    replay_tokens: int = 8192  # tokens replayed per scored window (first ones held out, newest ones in-sample)
    source: HeatSource | None = None  # None: rollups, routes for forward windows
    previous: Placement | str | None = None  # previous.RECORDED: the run's map at the training window's end
    dispatch: DispatchName = "node-limited"  # what auto's backtest and the worst layers judge balancedness by
    # ours with every first replica on its group's home node (PlannerConfig.keep_groups): no backtest, ours planned
    keep_groups: bool = False
    # tokens a history window the token-mix fit reads (token_mix.py; ours + ema; with groups kept only for the early
    # drift test); 0: the raw windows
    mix_tokens: int = 2048
