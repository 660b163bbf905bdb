"""Co-activation: expert pairs chosen by the same token in one layer, with lift over independence."""

from __future__ import annotations

import numpy as np
import streamlit as st

from r3trace.dashboards import figures, query_state, store_health
from r3trace.dashboards import store_cache as sc

path, run_id = st.session_state["store"], st.session_state["run_id"]
run = sc.run_row(path, run_id)
st.header("Co-activation")
store_health.require_routes(run, "Co-activation counts the experts each token chose together, from route rows.")
layer = query_state.select("MoE layer", list(run["moe_layer_ids"]), "cl")
min_count = query_state.number("Minimum tokens per pair", "cmin", 1, 1, 1_000_000)
pairs = sc.coactivation_pairs(path, run_id, int(layer), min_count)
e = int(run["num_experts"])
lift = np.full((e, e), np.nan)
a, b, v = pairs["expert_a"].to_numpy(), pairs["expert_b"].to_numpy(), pairs["lift"].to_numpy()
lift[a, b] = v
lift[b, a] = v
st.plotly_chart(figures.heatmap(lift, list(range(e)), list(range(e)), f"Lift of expert pairs, layer {layer}",
                                "expert", "expert", "lift", colorscale="RdBu_r"), key="coactivation_map")
st.caption(f"{pairs.height:,} pairs with >= {min_count} tokens; lift 1 = independent")
st.dataframe(pairs.head(50), hide_index=True)
