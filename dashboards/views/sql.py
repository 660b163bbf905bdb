"""Read-only SQL console over the store's views (routes, tokens, requests, runs, rollups)."""

from __future__ import annotations

import streamlit as st

from dashboards import query_state
from dashboards import store_cache as sc

path = st.session_state["store"]
st.header("SQL console (read-only)")
st.caption("Views: routes, tokens, requests, runs, rollups. SELECT only; no file access outside the store.")
query = query_state.text("SQL", "q", "SELECT layer_id, count(*) AS rows FROM routes GROUP BY ALL ORDER BY 1",
                         area=True)
limit = query_state.number("Row limit", "qlim", 1000, 1, 100_000)
if query.strip():
    try:
        result = sc.sql(path, query, limit)
    except Exception as exc:  # DuckDB errors and StoreQueryError: shown, never raised into the page
        st.error(f"{type(exc).__name__}: {exc}")
    else:
        st.caption(f"{result.height:,} rows")
        st.dataframe(result, hide_index=True)
