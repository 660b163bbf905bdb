"""Overview: what the run holds (tokens, requests, layers, experts, bytes) and its per-layer imbalance."""

from __future__ import annotations

import streamlit as st

from r3trace.dashboards import figures, store_health
from r3trace.dashboards import store_cache as sc

path, run_id = st.session_state["store"], st.session_state["run_id"]
st.header(f"Overview of {run_id}")
run = sc.run_row(path, run_id)
o = sc.overview(path, run_id)
cols = st.columns(6)
shown = [("Tokens", "tokens"), ("Requests", "requests"), ("MoE layers", "layers"), ("Experts", "experts"),
         ("Top-k", "top_k"), ("Bytes", "bytes")]
for col, (label, key) in zip(cols, shown, strict=True):
    col.metric(label, f"{o[key]:,}")
if not o["rows"]:
    st.info(f"{store_health.no_routes_message(run)} Tokens, requests and the pages that read routes stay "
            "empty until it has some.")
per_id = o["bytes"] / max(o["rows"] * o["top_k"], 1)
st.caption(f"{o['rows']:,} route rows; {per_id:.2f} bytes per expert id on disk (routes, rollups, requests)")
if o["repeated_rows"]:
    st.warning(f"{o['repeated_rows']:,} of {o['rows']:,} route rows name an expert twice in their top-{o['top_k']} "
               f"({o['all_zero_rows']:,} of them all zeros): a router picks {o['top_k']} distinct experts, so these "
               "are broken captures, such as token slots the capture never wrote. Heat and placements count them "
               "as routes; `r3trace ingest --drop-repeated` leaves them out.")
if o["unplaced_rows"]:
    st.warning(f"{o['unplaced_rows']:,} of {o['placed_rows']:,} route rows have physical_ids whose slots do not hold "
               "their topk_ids under the placement in force at their forward: a rebalance the trace did not record, "
               "or slots read through another map. Heat by expert is unaffected; per-GPU load from these slots is "
               "wrong.")
imb = sc.imbalance(path, run_id)
if imb.is_empty():
    if o["rows"]:  # without route rows the line above already said why
        st.info(store_health.no_rollups_message(run))
    st.stop()
st.plotly_chart(figures.bars(imb["layer_id"].to_list(), {"max/mean": imb["max_over_mean"].to_numpy()},
                             "Expert load imbalance per layer (max/mean, whole run)", "layer", "max / mean"),
                key="overview_imbalance")
st.dataframe(imb, hide_index=True)
