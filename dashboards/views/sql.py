"""Read-only SQL console over the store's views (routes, tokens, requests, runs, rollups).

The query runs as written; only its first `limit` rows are fetched. It is interrupted at the time limit
(`r3trace dashboard --sql-timeout-s`, lowered here if wanted) and when the user presses Stop or leaves the
page: the wait draws the elapsed time every 0.1 s, and each draw is where Streamlit raises its stop.
"""

from __future__ import annotations

import streamlit as st

from r3trace.analysis.limited_query import QueryTimeout
from r3trace.dashboards import query_state
from r3trace.dashboards import store_cache as sc

path = st.session_state["store"]
st.header("SQL console (read-only)")
st.caption("Views: routes, tokens, requests, runs, rollups. SELECT only; no file access outside the store.")
query = query_state.text("SQL", "q", "SELECT layer_id, count(*) AS rows FROM routes GROUP BY ALL ORDER BY 1",
                         area=True)
c = st.columns(2)
limit = query_state.number("Row limit", "qlim", 1000, 1, 100_000, where=c[0])
ceiling = sc.sql_timeout_s()
timeout_s = query_state.number("Time limit (s)", "qto", ceiling, 1, ceiling, where=c[1])
if query.strip():
    status = st.empty()

    def show_wait(elapsed_s: float) -> None:  # an st call: where Streamlit raises its Stop / rerun / leave
        status.caption(f"Running: {elapsed_s:.1f} s of {timeout_s} s")

    try:
        result = sc.sql(path, query, limit, timeout_s, show_wait)
    except QueryTimeout as exc:
        status.empty()
        st.error(f"{exc} (the Time limit box lowers it; `r3trace dashboard --sql-timeout-s` sets its ceiling).")
    except Exception as exc:  # DuckDB errors and StoreQueryError: shown, never raised into the page
        status.empty()
        st.error(f"{type(exc).__name__}: {exc}")
    else:
        status.empty()
        shown = (f"showing the first {limit:,} rows (the query returns more; the Row limit box changes it)"
                 if result.truncated else f"{result.frame.height:,} rows")
        st.caption(f"{shown}; {result.seconds:.2f} s")
        st.dataframe(result.frame, hide_index=True)
