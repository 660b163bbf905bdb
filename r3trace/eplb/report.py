"""One EPLB plan from a trace and what it scores, in-sample and held out: what `r3trace eplb` prints and the
dashboard's EPLB page draws.

Steps: resolve the training and held-out windows (window.py); read the training window's heat per history
window (rollups unless the windows are forward ranges) and bounded token samples (loads.py); with policy
"auto" pick the policy and forecast by backtest (backtest.py); plan on the whole training window; score the plan
on the training window (in-sample) and on the held-out window; a previous placement (the one a cluster runs,
previous.py) is scored beside it on the same windows and tokens, kept as is.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from r3trace.analysis.store import TraceStore
from r3trace.eplb import window as win
from r3trace.eplb.backtest import RULE, Candidate, backtest, choose, fold_windows, rule
from r3trace.eplb.drift_call import drift_call
from r3trace.eplb.early_drift import EARLY_WINDOWS
from r3trace.eplb.evaluate import (
    FORECASTS,
    POLICIES,
    DispatchName,
    Forecast,
    PolicyName,
    Score,
    plan_policy,
    planner_config,
    policy_input,
    score_placement,
)
from r3trace.eplb.fresh import Layout, layout
from r3trace.eplb.hindsight import bound
from r3trace.eplb.loads import HeatSource, TokenSample, run_facts, span_heat, span_sample, window_routes
from r3trace.eplb.origins import Origin, layer_origins
from r3trace.eplb.placement import Cluster, Placement, churn
from r3trace.eplb.plan_forecast import forecasts_from_mix
from r3trace.eplb.plan_request import DEFAULT_FORECAST, PlanRequest
from r3trace.eplb.previous import recorded_at_end
from r3trace.eplb.score import node_counts
from r3trace.eplb.static import TokenSources, token_sources
from r3trace.eplb.token_mix import Source, planning_loads
from r3trace.errors import StoreError
from r3trace.trace.schema import Manifest


@dataclass(frozen=True)
class Backtest:
    fit: str  # the first fold's fit: the history windows before the first one scored
    validate: str  # the history windows scored in turn, each from a plan on the windows before it
    candidates: list[Candidate]
    chosen: Candidate | None
    note: str = ""  # why there was no backtest
    rule: str = RULE


@dataclass(frozen=True)
class Report:
    train: win.Selection
    held_out: win.Selection | None
    held_out_note: str  # why there is no held-out score
    policy: PolicyName
    forecast: Forecast
    placement: Placement
    layout: Layout | None  # ours only
    spread_layers: int  # layers with an expert whose replicas sit on more than one node
    backtest: Backtest | None
    in_sample: Score
    held: Score | None
    churn: float | None
    source: HeatSource
    history_windows: int
    seconds: dict[str, float] = field(default_factory=dict)
    # what the plan was made and scored on: history [W, L, E], tokens [T, L, K] (None: heat-only), held_heat [L, E]
    history: np.ndarray | None = None
    train_tokens: np.ndarray | None = None
    held_heat: np.ndarray | None = None
    held_tokens: np.ndarray | None = None
    dispatch: DispatchName = "node-limited"  # what the backtest and the worst layers judged balancedness by
    static_sources: str = ""  # where SGLang's static replay sends tokens from (static.token_sources' rule)
    origins: list[Origin] | None = None  # ours only: each layer's origin (origins.py)
    top_k: int | None = None  # the trace's experts a token (ours' expectation of nodes per token without tokens)
    # the request's previous placement kept as is, scored on the same windows and tokens (None: no --previous)
    kept_in_sample: Score | None = None
    kept_held: Score | None = None
    previous: Placement | None = None  # the request's, or the map recorded at the training window's end
    previous_at: str = ""  # where a recorded previous placement was read
    # every slot one expert (P = E): the most even-split balancedness any placement reaches on the held-out window's
    # loads (hindsight.bound; exact with two slots a GPU), None otherwise or without a held-out score
    held_bound: float | None = None
    load_source: Source | None = None  # what ours could forecast from (token_mix.planning_loads), None: not tried
    mix_used: bool = False  # whether it did (plan_forecast.forecasts_from_mix: the history drifts)
    replan: str = ""  # ours re-planned from --previous: its drift call in words (drift_call.DriftCall.note), else ''

    def to_dict(self) -> dict[str, Any]:
        """The figures as JSON-able data (`--out`'s meta.report)."""
        bt = None
        if self.backtest is not None:
            bt = {"fit": self.backtest.fit, "validate": self.backtest.validate, "rule": self.backtest.rule,
                  "note": self.backtest.note,
                  "chosen": None if self.backtest.chosen is None else
                  [self.backtest.chosen.policy, self.backtest.chosen.forecast],
                  "candidates": [{"policy": c.policy, "forecast": c.forecast, "note": c.note,
                                  **c.summary()} for c in self.backtest.candidates]}
        return {
            "train": self.train.label, "held_out": None if self.held_out is None else self.held_out.label,
            "held_out_note": self.held_out_note, "policy": self.policy, "forecast": self.forecast,
            "layout": None if self.layout is None else self.layout._asdict(), "spread_layers": self.spread_layers,
            "backtest": bt, "in_sample": self.in_sample.summary(),
            "held_out_scores": None if self.held is None else self.held.summary(), "churn": self.churn,
            "heat_source": self.source, "history_windows": self.history_windows, "seconds": self.seconds,
            "dispatch": self.dispatch, "static_sources": self.static_sources, "origins": self.origins,
            "previous_in_sample": None if self.kept_in_sample is None else self.kept_in_sample.summary(),
            "previous_held_out": None if self.kept_held is None else self.kept_held.summary(),
            "held_out_bound": self.held_bound,
            "load_source": None if self.load_source is None else {
                "name": self.load_source.name, "used": self.mix_used, "backtest_errors": self.load_source.errors,
                "aic": {str(k): v for k, v in self.load_source.aic.items()}},
            "replan": self.replan,
        }


def resolve_windows(facts: dict[str, win.RunFacts], req: PlanRequest) -> tuple[win.Selection,
                                                                              win.Selection | None, str]:
    """(training window, held-out window or None, why none) by the defaults of docs/cli.md."""
    def sel(spec: win.WindowSpec, flag: str) -> win.Selection:
        return win.resolve(spec, facts, req.run_id, flag, req.windows, req.window_s)

    if req.train is None and req.held_out is not None:
        held = sel(req.held_out, "--eval")
        train = sel(win.earlier(held, facts), "--train")
    else:
        train = sel(req.train or _whole(facts, req), "--train")
        spec = req.held_out or win.later(train, facts)
        if spec is None:
            return train, None, "none: the training window reaches the end of the trace (give --train to hold " \
                                "out what follows it)"
        held = sel(spec, "--eval")
    win.check_disjoint(train, held)
    return train, held, ""


def _whole(facts: dict[str, win.RunFacts], req: PlanRequest) -> win.WindowSpec:
    """The default training window, the whole run: by time, or by forward when the run spans fewer than 2 rollup
    windows (a short trace: time would give one history window) and has routes."""
    f = facts[req.run_id] if req.run_id else None
    if f is not None and f.end_ns - f.start_ns < 2 * f.rollup_ns and f.has_routes and req.window_s is None:
        return win.WindowSpec("forward")
    return win.WindowSpec("time")


def make_report(store: TraceStore, req: PlanRequest, progress: bool | None = False) -> Report:
    """Plans and scores as the module doc says. Raises WindowError / StoreError / PlacementError naming the
    flag and the limit. `progress`: percent bars `heat` and `held-out heat` while DuckDB scans."""
    t0 = time.perf_counter()
    facts = run_facts(store.con, store.runs)
    train, held, held_note = resolve_windows(facts, req)
    runs = {r.manifest.run_id: r for r in store.runs}
    m = _one_shape([runs[r].manifest for r in (*train.runs, *(held.runs if held else ()))])
    fwd = any(s.field == "forward_id" for s in train.spans)
    source: HeatSource = req.source or ("routes" if fwd else "rollups")
    history = span_heat(store.con, train.spans, m, source, progress, "heat")
    keep = history.sum((1, 2)) > 0  # empty history windows (an idle gap) say nothing of the next one
    if not keep.any():
        raise StoreError(f"run {m.run_id}: no routes in the training window {train.label} to plan from (0 rows)")
    kept = tuple(s for s, k in zip(train.spans, keep, strict=True) if k)
    train = win.Selection(train.spec, kept, win.describe(kept, facts) if not keep.all() else train.label)
    history = history[keep]
    previous, previous_at = req.previous, ""
    if isinstance(previous, str):  # previous.RECORDED
        previous, previous_at = recorded_at_end(store.con, runs, train, req.cluster)
    seconds = {"heat": time.perf_counter() - t0}
    train_sample = span_sample(runs, train.spans, req.replay_tokens, newest=True)
    train_tokens = _ids(train_sample)
    train_src = _sources(train_sample, req.cluster)

    t1 = time.perf_counter()
    bt = None
    policy: PolicyName
    how: Forecast
    if req.keep_groups:  # a layout of ours: the backtest's other candidates would not keep the groups
        policy, how = "ours", req.forecast or DEFAULT_FORECAST["ours"]
    elif req.policy == "auto":
        bt = _backtest(runs, facts, train, history, req, m.top_k)
        chosen = bt.chosen
        policy = chosen.policy if chosen else "ours"
        how = chosen.forecast if chosen else (req.forecast or "ema")
    else:
        policy, how = req.policy, req.forecast or DEFAULT_FORECAST[req.policy]
    seconds["backtest"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    src = None
    # with groups kept the fit serves the early drift test alone: a re-plan on EARLY_WINDOWS history windows
    fits = not req.keep_groups or (previous is not None and len(history) == EARLY_WINDOWS)
    if policy == "ours" and how == "ema" and req.mix_tokens > 0 and fits:
        src = planning_loads(history, window_routes(runs, train.spans, req.mix_tokens))
        seconds["token mix"] = time.perf_counter() - t2
    mixed, demixed = (None, None) if src is None else (src.mixed, src.demixed)
    t3 = time.perf_counter()
    pl = plan_policy(policy, history, how, req.cluster, train_tokens, previous, req.dispatch, m.top_k,
                     req.keep_groups, mixed, demixed)
    seconds["plan"] = time.perf_counter() - t3

    in_sample = score_placement(pl, history.sum(0), train_tokens, req.cluster, train_src.rank)
    kept_in = None if previous is None else score_placement(previous, history.sum(0), train_tokens,
                                                                req.cluster, train_src.rank)
    scored, kept_held, held_heat, held_tokens, held_src = None, None, None, None, None
    if held is not None:
        held_heat = span_heat(store.con, held.spans, m, source, progress, "held-out heat").sum(0)
        if held_heat.any():
            held_sample = span_sample(runs, held.spans, req.replay_tokens)
            held_tokens = _ids(held_sample)
            held_src = _sources(held_sample, req.cluster)
            scored = score_placement(pl, held_heat, held_tokens, req.cluster, held_src.rank)
            if previous is not None:
                kept_held = score_placement(previous, held_heat, held_tokens, req.cluster, held_src.rank)
        else:
            held_note = f"none: the held-out window {held.label} holds no routes"
            held_heat = None
    multi = (node_counts(pl, req.cluster) > 0).sum(2) > 1  # [L, E] experts on more than one node
    lay, origins, mix_used, note = None, None, False, ""
    if policy == "ours":
        cfg = planner_config(req.dispatch, m.top_k, req.keep_groups)
        lay = layout(req.cluster, cfg, m.num_experts)
        ours_in = policy_input(policy, history, how)
        call = drift_call(ours_in, previous is not None, cfg, train_tokens, demixed, req.cluster)  # plan()'s again
        origins = layer_origins(pl, ours_in, req.cluster, previous, cfg, mixed, train_tokens, demixed, call)
        mix_used = not call.early and forecasts_from_mix(history, mixed, cfg, call.err)
        note = "" if previous is None else call.note()
    seconds["total"] = time.perf_counter() - t0  # the origins too: they plan DeepSeek global (and import torch)
    return Report(train, held, held_note, policy, how, pl, lay,
                  int(multi.any(1).sum()), bt, in_sample, scored,
                  None if previous is None else churn(previous, pl), source, len(history), seconds,
                  history, train_tokens, held_heat, held_tokens, req.dispatch, _says(train_src, held_src), origins,
                  m.top_k, kept_in, kept_held, previous, previous_at,
                  bound(held_heat, req.cluster.num_gpus) if scored is not None and held_heat is not None
                  and req.cluster.num_slots == m.num_experts else None, src, mix_used, note)


def _sources(sample: TokenSample | None, cluster: Cluster) -> TokenSources:
    """Where static dispatch sends a sample's tokens from on the cluster (static.token_sources)."""
    if sample is None:
        return token_sources(None, None, cluster.num_gpus)
    return token_sources(sample.dp_rank, sample.dp_size, cluster.num_gpus)


def _says(train: TokenSources, held: TokenSources | None) -> str:
    """The report's line on static dispatch's token sources: one rule, or the in-sample and held-out ones."""
    if held is None or held.how == train.how:
        return train.how
    return f"in-sample {train.how}; held out {held.how}"


def _backtest(runs: dict[str, Any], facts: dict[str, win.RunFacts], train: win.Selection, history: np.ndarray,
              req: PlanRequest, top_k: int) -> Backtest:
    """Rolling folds (backtest.py): each of the newest history windows scored from a plan on the windows before it,
    replaying its first routes; ours gets the newest routes before it and the trace's top_k."""
    if len(history) < 2:
        note = (f"no backtest: the training window has {len(history)} history window (needs 2); "
                f"planned with ours + {req.forecast or 'ema'}")
        return Backtest("", "", [], None, note)
    spans = train.spans  # one per history window (empty windows were dropped from both)
    held = fold_windows(len(history))
    fit_tokens = [_ids(span_sample(runs, spans[:t], req.replay_tokens, newest=True)) for t in held]
    samples = [span_sample(runs, spans[t:t + 1], req.replay_tokens) for t in held]
    forecasts: Sequence[Forecast] = (req.forecast,) if req.forecast else FORECASTS
    cands = backtest(history, held, fit_tokens, [_ids(x) for x in samples], req.cluster, POLICIES, forecasts,
                     req.dispatch, [_sources(x, req.cluster).rank for x in samples], top_k)
    return Backtest(win.describe(spans[:held[0]], facts), win.describe(spans[held[0]:], facts), cands,
                    choose(cands), rule=rule(req.dispatch))


def _ids(sample: TokenSample | None) -> np.ndarray | None:
    return None if sample is None else sample.ids


def _one_shape(manifests: Sequence[Manifest]) -> Manifest:
    """The model shape all selected runs share; a window over runs of two shapes is refused."""
    key = {(m.moe_layer_ids, m.num_experts, m.top_k) for m in manifests}
    if len(key) > 1:
        names = ", ".join(m.run_id for m in manifests)
        raise StoreError(f"runs {names} differ in model shape (moe_layer_ids, num_experts, top_k); plan one shape")
    return manifests[0]
