"""EPLB planner: a placement for this run's heat, replayed on its tokens, downloadable for SGLang."""

from __future__ import annotations

import json

import numpy as np
import streamlit as st

from r3trace.dashboards import figures, query_state, store_health
from r3trace.dashboards import store_cache as sc

path, run_id = st.session_state["store"], st.session_state["run_id"]
st.header("EPLB planner")
store_health.require_routes(sc.run_row(path, run_id), "The planner replays the run's route rows through a "
                            "placement (its heat comes from the rollups).")
o = sc.overview(path, run_id)
c = st.columns(6)
gpus = query_state.number("GPUs", "gpus", 8, 1, 4096, where=c[0])
nodes = query_state.number("Nodes", "nodes", 2, 1, 512, where=c[1])
slots = query_state.number("Slots", "slots", max(o["experts"], gpus) + gpus, 1, 1 << 20, where=c[2])
policy = query_state.select("Policy", ["ours", "global", "hierarchical", "cross_node"], "policy", where=c[3])
node_limit = query_state.number("Node limit", "nlim", 4, 1, 512, where=c[4])
max_tokens = query_state.number("Replay tokens", "ntok", 20000, 1, 10_000_000, where=c[5])
try:
    plan = sc.eplb_plan(path, run_id, gpus, nodes, slots, str(policy), node_limit, max_tokens)
except ValueError as exc:  # PlacementError and friends name the field and the limit
    st.error(str(exc))
    st.stop()
m = st.columns(4)
m[0].metric("Balancedness (even split)", f"{plan['balancedness_even']:.4f}")
m[1].metric("Balancedness (replayed)", f"{plan['balancedness_replay']:.4f}")
m[2].metric("Nodes per token (mean)", f"{plan['nodes_mean']:.3f}")
m[3].metric("Nodes per token (max)", f"{plan['nodes_max']}")
st.caption(f"replayed {plan['tokens']:,} tokens through node-limited dispatch; "
           "balancedness = mean/max GPU load")
layers = plan["layers"]
layer = query_state.select("Layer to show", layers, "pl")
row = plan["phy2log"][layers.index(layer)].reshape(gpus, plan["slots_per_gpu"])
st.plotly_chart(figures.heatmap(row, list(range(plan["slots_per_gpu"])), [f"GPU {g}" for g in range(gpus)],
                                f"Placement of layer {layer}: logical expert per slot", "slot on GPU", "GPU",
                                "expert", colorscale="Turbo", text=row.astype(str)), key="eplb_grid")
doc = {"physical_to_logical_map": np.asarray(plan["phy2log"]).tolist(),
       "logical_count": np.asarray(plan["logcnt"]).tolist()}
st.download_button("Download SGLang init-expert-location JSON", json.dumps(doc),
                   file_name=f"eplb-{run_id}-{policy}-{gpus}g{slots}s.json", mime="application/json")
