"""r3trace dashboard: `r3trace dashboard STORE` (or `streamlit run dashboards/app.py -- STORE`).

The pages are thin: each reads widgets (state in the URL's query params), calls cached functions of
store_cache.py (which call r3trace.analysis / r3trace.eplb), and draws Plotly charts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import streamlit as st

# `streamlit run` puts this folder on sys.path, not the repo root: add it so `dashboards.*` imports work.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from dashboards import query_state, store_cache  # noqa: E402

st.set_page_config(page_title="r3trace", layout="wide")
st.title("r3trace: MoE routing traces")

path = store_cache.store_path()
if path is None or not Path(path).is_dir():
    st.error(f"No trace store: got {path!r}. Launch with `r3trace dashboard STORE` (a folder of runs), "
             f"or set ${store_cache.STORE_ENV}.")
    st.stop()
assert path is not None
runs = store_cache.runs(path)
if runs.is_empty():
    st.warning(f"The store {path} holds no runs yet (no manifest.json under run_id=* folders).")
    st.stop()
run_ids = runs["run_id"].to_list()
st.session_state["store"] = path
st.session_state["run_id"] = query_state.select("Run", run_ids, "run", where=st.sidebar)
st.sidebar.caption(f"store: {path}")

# not "pages/": streamlit would also auto-register that folder as a second, unwired set of pages
_PAGES = Path(__file__).parent / "views"
nav = st.navigation([
    st.Page(_PAGES / "overview.py", title="Overview", url_path="overview", default=True),
    st.Page(_PAGES / "heat.py", title="Heat map", url_path="heat"),
    st.Page(_PAGES / "imbalance.py", title="Imbalance over time", url_path="imbalance"),
    st.Page(_PAGES / "coactivation.py", title="Co-activation", url_path="coactivation"),
    st.Page(_PAGES / "requests.py", title="Request explorer", url_path="requests"),
    st.Page(_PAGES / "diff.py", title="Trace diff", url_path="diff"),
    st.Page(_PAGES / "eplb.py", title="EPLB planner", url_path="eplb"),
    st.Page(_PAGES / "sql.py", title="SQL console", url_path="sql"),
])
nav.run()
