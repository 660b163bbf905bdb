"""Request explorer: one request's tokens with their experts per MoE layer, phase and provenance."""

from __future__ import annotations

import polars as pl
import streamlit as st

from dashboards import query_state, store_health
from dashboards import store_cache as sc

path, run_id = st.session_state["store"], st.session_state["run_id"]
st.header("Request explorer")
store_health.require_routes(sc.run_row(path, run_id), "The explorer lists the requests that have route rows.")
reqs = sc.request_list(path, run_id)
# a run whose writer records requests: a request with routes but no row (null) had not finished either
recorded = reqs["finish_reason"].is_not_null().any()
unfinished = reqs.filter(pl.col("finish_reason").is_null() | (pl.col("finish_reason") == "unfinished")).height
if recorded and unfinished:
    st.caption(f"{unfinished:,} of {reqs.height:,} requests had not finished when the trace was written "
               "(finish_reason 'unfinished' or no row in the requests table: empty tag and lengths)")
rid = query_state.select("Request", reqs["request_id"].to_list(), "req")
info = reqs.filter(pl.col("request_id") == rid).row(0, named=True)
routes = sc.request_routes(path, run_id, str(rid))
cols = st.columns(5)
cols[0].metric("Tokens with routes", f"{info['tokens']:,}")
cols[1].metric("Prefill", f"{routes.filter(pl.col('phase') == 'prefill').height:,}")
cols[2].metric("Decode", f"{routes.filter(pl.col('phase') == 'decode').height:,}")
cols[3].metric("From prefix cache", f"{routes.filter(pl.col('source') == 'prefix_cache').height:,}")
cols[4].metric("Tag", str(info["tag"] or "-"))
st.caption("Each layer column lists the token's top-k experts in gate-rank order; `source` and `forward_id` "
           "say how the row came to be (computed in that forward, or reused from the prefix cache).")
st.dataframe(routes, hide_index=True)
