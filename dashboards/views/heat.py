"""Heat map: selections per (layer, expert) over a chosen range of time windows (from the rollups)."""

from __future__ import annotations

import polars as pl
import streamlit as st

from r3trace.dashboards import figures, query_state, store_health
from r3trace.dashboards import store_cache as sc

path, run_id = st.session_state["store"], st.session_state["run_id"]
run = sc.run_row(path, run_id)
base_s = run["rollup_window_ns"] / 1e9
st.header("Layer x expert heat")
window_s = query_state.select("Window (s)", [base_s * m for m in (1, 5, 30, 300)], "hw")
frame = sc.heat_windows(path, run_id, window_s)
windows = frame["window_start"].unique().sort().to_list()
if not windows:
    st.info(store_health.no_rollups_message(run))
    st.stop()
lo, hi = query_state.index_range("Time windows", len(windows), "hwin")
chosen = frame.filter(pl.col("window_start").is_between(windows[lo], windows[hi]))
layers = list(run["moe_layer_ids"])
z = sc.heat_matrix(chosen, layers, int(run["num_experts"]))
st.caption(f"windows {lo}..{hi} of {len(windows)} ({windows[lo]} .. {windows[hi]}): "
           f"{int(z.sum()):,} selections")
st.plotly_chart(figures.heatmap(z, list(range(z.shape[1])), layers, "Selections per layer and expert",
                                "expert", "layer", "selections"), key="heat_map")
