"""EPLB planner: `r3trace eplb` on this run. A plan on the training window (policy chosen by backtest with
"auto"), scored in-sample and on the held-out window after it; the balancedness vs nodes-per-token trade-off over
policies and node limits; per-GPU load before (the placement the cluster runs, given by path, else SGLang's trivial
placement) and after the plan, with the running placement's own scores; the SGLang file."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import streamlit as st

from r3trace.dashboards import eplb_cache, figures, query_state, store_health
from r3trace.dashboards import store_cache as sc


def backtest_rows(bt: dict[str, Any]) -> list[dict[str, object]]:
    """One row per candidate of auto's backtest: its balancedness on each fold (what the rule ranks), their mean,
    nodes per token over the folds, and which one was chosen."""
    rows: list[dict[str, object]] = []
    for c in bt["candidates"]:
        folds = c.get("folds") or []
        row: dict[str, object] = {"policy": c["policy"], "forecast": c["forecast"],
                                  "chosen": [c["policy"], c["forecast"]] == bt["chosen"],
                                  "balancedness, mean of folds": float(np.mean(folds)) if folds else None,
                                  "nodes per token": c.get("nodes_per_token")}
        row.update({f"fold {i + 1}": b for i, b in enumerate(folds)})
        if c.get("note"):
            row["note"] = c["note"]
        rows.append(row)
    return rows


path, run_id = st.session_state["store"], st.session_state["run_id"]
st.header("EPLB planner")
store_health.require_routes(sc.run_row(path, run_id), "The planner replays the run's route rows through a "
                            "placement (its heat comes from the rollups).")
o = sc.overview(path, run_id)
c = st.columns(6)
gpus = query_state.number("GPUs", "gpus", 8, 1, 4096, where=c[0])
nodes = query_state.number("Nodes", "nodes", 2, 1, 512, where=c[1])
slots = query_state.number("Slots", "slots", max(o["experts"], gpus) + gpus, 1, 1 << 20, where=c[2])
# "ours, groups kept": `r3trace eplb --keep-groups` (whole groups on their home nodes; the trade-off's series of it)
policy = query_state.select("Policy", ["auto", "ours", eplb_cache.KEEP_GROUPS, "global", "hierarchical", "cross_node"],
                            "policy", where=c[3])
node_limit = query_state.number("Node limit", "nlim", 4, 1, 512, where=c[4])
max_tokens = query_state.number("Replay tokens", "ntok", 8192, 1, 10_000_000, where=c[5])
w = st.columns(2)
train = query_state.text("Training window (time=A..B s, forward=A..B or runs=ID,ID)", "train",
                         eplb_cache.eplb_default_train(path, run_id), where=w[0])
held_out = query_state.text("Held-out window (empty: what follows the training window)", "eval", "", where=w[1])
running = query_state.text("Placement the cluster runs (path: an `r3trace eplb --out` JSON or SGLang's "
                           "--init-expert-location .json / .pt; `recorded`: the map the run's engine ran at the "
                           "training window's end; empty: none, SGLang's trivial one)", "prev", "")
if history := eplb_cache.placement_history(path, run_id):
    st.caption(f"This run's recorded {history}")
try:
    rep = eplb_cache.eplb_report(path, run_id, gpus, nodes, slots, str(policy), node_limit, max_tokens, train, held_out,
                         running)
except ValueError as exc:  # PlacementError, WindowError and friends name the field and the limit
    st.error(str(exc))
    st.stop()

st.caption(f"trained on {rep['train']}; held out: {rep['held_out'] or rep['held_out_note']}")
bt = rep["backtest"]
if bt is not None and bt["chosen"] is not None:
    st.caption(f"auto: backtest folds: the history windows {bt['validate']}, each scored on a plan made from the "
               f"windows before it (the first fold fit on {bt['fit']}); rule: {bt['rule']}")
    st.dataframe(backtest_rows(bt), key="eplb_backtest")
elif bt is not None:
    st.caption(f"auto: {bt['note']}")
layout = f"; layout {rep['layout']['name']}: {rep['layout']['reason']}" if rep["layout"] else ""
if rep.get("origins"):
    o = rep["origins"]
    theirs = "hierarchical" if "hierarchical" in o or rep["layout"]["name"] == "groups_on_nodes" else "global"
    layout += f"; layers: {o.count('ours')} ours, {o.count(theirs)} DeepSeek {theirs}'s on the same forecast"
st.caption(f"plan: {rep['policy']} + {rep['forecast']} forecast{layout}")
if rep.get("load_source"):  # ours on ema: what token_mix.planning_loads handed it
    src = rep["load_source"]
    on = f"each history window at the long-run mix of its kinds of token ({src['name']})" if src["used"] else \
        "the raw windows"
    st.caption(f"forecast from: {on}; backtest squared rate error: "
               + ", ".join(f"{k} {v:.4g}" for k, v in src["backtest_errors"].items()))


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


ins, held = rep["in_sample"], rep["held_out_scores"] or {}
m = st.columns(3)
m[0].metric("Balancedness (replayed), held out", fmt(held.get("balancedness_replay"), ".4f"))
m[1].metric("Balancedness (replayed), in-sample", fmt(ins["balancedness_replay"], ".4f"))
m[2].metric("Nodes per token, held out", fmt(held.get("nodes_per_token"), ".3f"))
m = st.columns(3)
m[0].metric("Balancedness (even split), held out", fmt(held.get("balancedness_even"), ".4f"))
m[1].metric("Balancedness (even split), in-sample", fmt(ins["balancedness_even"], ".4f"))
m[2].metric(f"Over node limit ({node_limit}), held out", fmt(held.get("over_node_limit"), ".2%"))
m = st.columns(3)
m[0].metric("Balancedness (SGLang static), held out", fmt(held.get("balancedness_static"), ".4f"))
m[1].metric("Balancedness (SGLang static), in-sample", fmt(ins["balancedness_static"], ".4f"))
m[2].metric("Balancedness (SGLang dynamic), held out", fmt(held.get("balancedness_dynamic"), ".4f"))
kept = rep.get("previous_held_out") or rep.get("previous_in_sample")
if kept is not None:
    when = "held out" if rep.get("previous_held_out") else "in-sample"
    m = st.columns(3)
    m[0].metric(f"Balancedness (replayed), {when}, running placement kept", fmt(kept["balancedness_replay"], ".4f"))
    m[1].metric(f"Balancedness (even split), {when}, running placement kept", fmt(kept["balancedness_even"], ".4f"))
    m[2].metric("Slots the plan moves", fmt(rep["churn"], ".2%"))
sources = rep.get("static_sources") or "token t from rank t mod G"
st.caption(f"replayed {held.get('tokens') or 0:,} held-out and {ins['tokens']:,} in-sample tokens through "
           "node-limited dispatch (the fewest nodes covering a token's experts) and through SGLang's static dispatch "
           "(a rank's own replica, else its node's first, else one spread over the replicas; "
           f"{sources}) and its dynamic dispatch (the same, but a random replica a pair for the spread; in "
           "expectation); "
           "balancedness = mean/max GPU load, mean over layers")
if rep.get("held_out_bound") is not None:
    st.caption(f"every slot holds one expert: no placement reaches more than {rep['held_out_bound']:.4f} "
               "balancedness (even split) on the held-out window, known in hindsight (exact with two slots a GPU); "
               f"this plan {fmt(held.get('balancedness_even'), '.4f')}")

series: dict[str, tuple[list[float], list[float], list[str]]] = {}
for p in rep["tradeoff"]:
    x, y, t = series.setdefault(p["policy"], ([], [], []))
    x.append(p["nodes_per_token"] if p["nodes_per_token"] is not None else float("nan"))
    y.append(p["balancedness"])
    t.append(f"limit {p['node_limit']}")
st.plotly_chart(figures.points(series, f"Trade-off, {rep['scored_on']}: each policy at node limits 1.."
                               f"{min(nodes, 8)}", "nodes per token", "balancedness (replayed)"), key="eplb_tradeoff")

layers = rep["layers"]
worst = rep["per_layer"]["held_even"] if rep["per_layer"]["held_even"] is not None else rep["per_layer"]["in_even"]
layer = query_state.select("Layer to show", layers, "pl", default=int(np.nanargmin(worst)))
li = layers.index(layer)
before, after = rep["gpu_before"][li], rep["gpu_after"][li]
was = "before: the running placement" if running.strip() else "before: trivial placement"
st.plotly_chart(figures.bars(list(range(gpus)), {was: before / before.mean(),
                                                  "after: the plan": after / after.mean()},
                             f"Layer {layer}, {rep['scored_on']}: per-GPU load / mean (even split)", "GPU",
                             "load / mean"), key="eplb_gpu_load")
# the one key SGLang's init_by_mapping takes (another raises TypeError), a row per layer id: `r3trace eplb --sglang`
doc = {"physical_to_logical_map": np.asarray(rep["sglang_map"]).tolist()}
st.download_button("Download SGLang init-expert-location JSON", json.dumps(doc),
                   file_name=f"eplb-{run_id}-{rep['policy']}-{gpus}g{slots}s.json", mime="application/json")
st.caption(f"SGLang: --init-expert-location FILE --expert-parallel-size {gpus} --ep-num-redundant-experts "
           f"{slots - np.asarray(rep['logcnt']).shape[1]}")
