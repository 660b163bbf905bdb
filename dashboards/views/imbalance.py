"""Per-layer imbalance over time: max/mean expert load in each time window (from the rollups)."""

from __future__ import annotations

import numpy as np
import streamlit as st

from r3trace.dashboards import figures, query_state, store_health
from r3trace.dashboards import store_cache as sc

path, run_id = st.session_state["store"], st.session_state["run_id"]
run = sc.run_row(path, run_id)
base_s = run["rollup_window_ns"] / 1e9
st.header("Imbalance over time")
window_s = query_state.select("Window (s)", [base_s * m for m in (1, 5, 30, 300)], "iw")
windows, layers, mat = sc.imbalance_windows(path, run_id, window_s)
if not windows:
    st.info(store_health.no_rollups_message(run))
    st.stop()
st.plotly_chart(figures.heatmap(mat.T, windows, layers, "max/mean expert load per layer and window",
                                "window", "layer", "max/mean", colorscale="Cividis"), key="imbalance_map")
worst = np.nanmax(mat, axis=1)
st.plotly_chart(figures.lines(windows, {"mean over layers": np.nanmean(mat, axis=1), "worst layer": worst},
                              "Imbalance over time", "window", "max / mean"), key="imbalance_lines")
st.metric("Worst window-layer max/mean", f"{np.nanmax(mat):.2f}")
