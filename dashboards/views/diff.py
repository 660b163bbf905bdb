"""Trace diff: agreement per layer between two runs of the same tokens, and the tokens that flipped."""

from __future__ import annotations

import streamlit as st

from r3trace.dashboards import figures, query_state, store_health
from r3trace.dashboards import store_cache as sc

path, run_a = st.session_state["store"], st.session_state["run_id"]
st.header("Trace diff")
others = [r for r in sc.runs(path)["run_id"].to_list() if r != run_a]
if not others:
    st.info(f"The store holds one run ({run_a}); a diff needs two runs of the same tokens.")
    st.stop()
store_health.require_routes(sc.run_row(path, run_a), "A diff compares the route rows of two runs.")
run_b = query_state.select(f"Compare {run_a} with", others, "b")
store_health.require_routes(sc.run_row(path, str(run_b)), "A diff compares the route rows of two runs.")
by_layer, summary, flipped = sc.diff(path, run_a, str(run_b), 500)
s = summary.row(0, named=True)
if not s["matched_rows"]:
    st.warning(f"{run_a} and {run_b} share no (request_id, token_pos, layer) rows.")
    st.stop()
cols = st.columns(4)
cols[0].metric("Matched tokens", f"{s['tokens']:,}")
cols[1].metric("Exact match (layer rows)", f"{s['exact_match_rate']:.4f}")
cols[2].metric("Tokens with any layer different", f"{s['tokens_any_layer_different']:.4f}")
cols[3].metric("Mean top-k overlap", f"{s['mean_overlap']:.4f}")
st.plotly_chart(figures.bars(by_layer["layer_id"].to_list(),
                             {"exact match": by_layer["exact_match"].to_numpy(),
                              "overlap": by_layer["overlap"].to_numpy()},
                             f"Agreement per layer: {run_a} vs {run_b}", "layer", "share"), key="diff_bars")
st.subheader(f"Flipped tokens ({flipped.height:,} shown, most layers first)")
st.dataframe(flipped, hide_index=True)
