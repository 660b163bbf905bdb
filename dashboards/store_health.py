"""What a store or a run lacks, said in a line a page can show instead of failing on it.

- foreign entries: files and folders beside the runs that are not runs (open_dataset skips them);
- a run not closed cleanly (a crash, or a writer still running): complete routes files its manifest does
  not list, `.tmp` files, requests with routes but no row in the requests table, requests marked
  `finish_reason='unfinished'`;
- a run without route rows (0-row runs, heat-only runs): pages that read routes stop with `require_routes`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import streamlit as st

from dashboards import store_cache as sc
from r3trace.trace.schema import MANIFEST_NAME

_SHOWN = 5  # names listed in a message before "and N more"


def names(items: list[str]) -> str:
    more = f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more


def foreign_entries(path: str) -> list[str]:
    """Entries of a dataset folder that are not runs ("x.csv", "notes/", "run_id=a/ (no manifest.json)")."""
    root = Path(path)
    if (root / MANIFEST_NAME).exists():  # a run folder opened directly
        return []
    out = []
    for p in sorted(root.iterdir()):
        if p.name.startswith("."):
            continue
        if p.is_dir() and p.name.startswith("run_id="):
            if not (p / MANIFEST_NAME).exists():
                out.append(f"{p.name}/ (no {MANIFEST_NAME})")
        else:
            out.append(p.name + ("/" if p.is_dir() else ""))
    return out


def no_runs_message(path: str) -> str:
    foreign = foreign_entries(path)
    holds = f" It holds {len(foreign)} other entries: {names(foreign)}." if foreign else " The folder is empty."
    return (f"The store {path} holds no r3trace runs: no run_id=*/{MANIFEST_NAME} under it.{holds} "
            "Record one (`r3trace serve --trace-dir`, `engine.start_trace`) or point `r3trace dashboard` "
            "at a folder of runs.")


@st.cache_data(show_spinner=False)
def run_problems(path: str, run_id: str) -> list[str]:
    """Signs that `run_id` was not closed cleanly, one phrase each; [] for a cleanly closed run."""
    run = sc.open_store(path).run(run_id)
    listed = {f.name for f in run.manifest.files}
    unlisted = [p.name for p in sorted(run.run_dir.glob("part-*.parquet")) if p.name not in listed]
    tmp = [p.name for p in sorted(run.run_dir.glob("*.tmp"))]
    out = []
    if unlisted:
        out.append(f"{len(unlisted)} complete routes file(s) its manifest does not list ({names(unlisted)}), "
                   f"not shown here: `r3trace.trace.recover_run('{run.run_dir}')` adds them")
    if tmp:
        out.append(f"{len(tmp)} unfinished file(s) ({names(tmp)}), never read")
    if run.request_files:  # a writer that records requests: routes of a request without its row = unfinished
        c = sc.request_counts(path, run_id)
        if c["without_row"]:
            out.append(f"{c['without_row']:,} of {c['with_routes']:,} requests with routes have no row in the "
                       "requests table (they had not finished)")
        if c["unfinished"]:
            out.append(f"{c['unfinished']:,} request(s) marked finish_reason='unfinished'")
    return out


def no_routes_message(run: dict[str, Any]) -> str:
    kind = " (a heat-only run: rollups, no routes)" if run["kind"] == "heat" else ""
    return (f"Run {run['run_id']} has no route rows{kind}: its manifest lists {run['file_count']} file(s) and "
            f"{run['rows']:,} rows.")


def require_routes(run: dict[str, Any], needs: str) -> None:
    """Stops the page with an info line when the run has no route rows; `needs` says what the page needs."""
    if not run["rows"]:
        st.info(f"{no_routes_message(run)} {needs}")
        st.stop()


def no_rollups_message(run: dict[str, Any]) -> str:
    return (f"Run {run['run_id']} has no rollup rows (its manifest lists {run['file_count']} file(s), "
            f"{run['rows']:,} route rows): no expert load to show yet.")
