"""Request explorer: one request's tokens with their experts per MoE layer, phase and provenance."""

from __future__ import annotations

import polars as pl
import streamlit as st

from r3trace.dashboards import query_state, store_health
from r3trace.dashboards import store_cache as sc

path, run_id = st.session_state["store"], st.session_state["run_id"]
st.header("Request explorer")
store_health.require_routes(sc.run_row(path, run_id), "The explorer lists the requests that have route rows.")
reqs = sc.request_list(path, run_id)
# A run whose writer records requests: a request had not finished when its row says 'unfinished' (close() writes
# those for requests still running, and a crashed run's in-flight requests read as such, reader.py) or when it has
# no row yet (in flight at a live writer's last commit).
recorded = reqs["finish_reason"].is_not_null().any()
marked = reqs.filter(pl.col("finish_reason") == "unfinished").height
no_row = reqs.filter(pl.col("finish_reason").is_null()).height
if recorded and (marked or no_row):
    kinds = [f"{marked:,} with finish_reason 'unfinished'"] if marked else []
    kinds += [f"{no_row:,} with no row in the requests table"] if no_row else []
    st.caption(f"{marked + no_row:,} of {reqs.height:,} requests had not finished when the trace was written "
               f"({', '.join(kinds)}: empty tag and lengths)")
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
