"""r3trace dashboard: `r3trace dashboard STORE` (or `streamlit run dashboards/app.py -- STORE`).

The pages are thin: each reads widgets (state in the URL's query params), calls cached functions of
store_cache.py (which call r3trace.analysis / r3trace.eplb), and draws Plotly charts. What a store or a
run lacks (no runs, foreign files, a crashed run, no route rows) is said in one line, never a traceback.
"""

from __future__ import annotations

import logging
from pathlib import Path

import duckdb
import streamlit as st

# dashboards/ is the package r3trace.dashboards (pyproject's package-dir): importable wherever r3trace is
# installed, from a wheel or from this checkout, whatever folder `streamlit run` puts on sys.path
from r3trace.dashboards import query_state, store_cache, store_health
from r3trace.trace.schema import TraceSchemaError

_LOG = logging.getLogger("r3trace.dashboard")


def _first_line(exc: BaseException) -> str:
    """`Type: first line` (DuckDB appends the SQL it ran, which names nothing the user can fix)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


st.set_page_config(page_title="r3trace", layout="wide")

# not "pages/": streamlit would also auto-register that folder as a second, unwired set of pages
_PAGES = Path(__file__).parent / "views"
pages = [
    st.Page(_PAGES / "overview.py", title="Overview", url_path="overview"),
    st.Page(_PAGES / "heat.py", title="Heat map", url_path="heat"),
    st.Page(_PAGES / "imbalance.py", title="Imbalance over time", url_path="imbalance"),
    st.Page(_PAGES / "coactivation.py", title="Co-activation", url_path="coactivation"),
    st.Page(_PAGES / "requests.py", title="Request explorer", url_path="requests"),
    st.Page(_PAGES / "diff.py", title="Trace diff", url_path="diff"),
    st.Page(_PAGES / "eplb.py", title="EPLB planner", url_path="eplb"),
    st.Page(_PAGES / "sql.py", title="SQL console", url_path="sql"),
]


def _to_overview() -> None:
    st.switch_page(pages[0], query_params=st.query_params.to_dict())


# Streamlit serves the default page at "/" only, so a visible default page would make /overview "Page not
# found": the default is a hidden page that forwards to /overview, and every page keeps its own URL.
# Registered before anything can st.stop(), so a page's URL resolves even when the store is empty.
nav = st.navigation([st.Page(_to_overview, title="r3trace", url_path="home", default=True,
                             visibility="hidden"), *pages])
st.title("r3trace: MoE routing traces")

path = store_cache.store_path()
if path is None or not Path(path).is_dir():
    st.error(f"No trace store: got {path!r}. Launch with `r3trace dashboard STORE` (a folder of runs), "
             f"or set ${store_cache.STORE_ENV}.")
    st.stop()
assert path is not None
try:
    store_cache.refresh(path)  # a live writer's commits since the last rerun, a run recovered meanwhile
    runs = store_cache.runs(path)
except (TraceSchemaError, OSError, duckdb.Error) as exc:  # a corrupt manifest or listed file: named in the message
    st.error(f"Cannot open the store {path}: {_first_line(exc)}")
    st.stop()
if runs.is_empty():
    st.warning(store_health.no_runs_message(path))
    st.stop()
run_ids = runs["run_id"].to_list()
st.session_state["store"] = path
run_id = st.session_state["run_id"] = query_state.select("Run", run_ids, "run", where=st.sidebar)
st.sidebar.caption(f"store: {path}")
foreign = store_health.foreign_entries(path)
if foreign:
    st.sidebar.info(f"Not runs, not shown: {store_health.names(foreign)}")
try:
    state, problems = store_health.run_problems(path, run_id)
    if problems:  # one line each (a Markdown hard break between them)
        (st.warning if state == "crashed" else st.info)("  \n".join(problems))
    nav.run()
except Exception as exc:  # the last net: one line on the page, the traceback in the server log
    _LOG.exception("page %s failed on run %s", st.query_params.to_dict(), run_id)
    st.error(f"This page could not be drawn for run {run_id}: {_first_line(exc)}")
