"""What a store or a run lacks, said in a line a page can show instead of failing on it.

- foreign entries: files and folders beside the runs that are not runs (open_dataset skips them);
- a run that is not closed (reader.RunFiles.state): "crashed", its writer died before closing it (the
  requests then in flight read as finish_reason 'unfinished'; files its manifest does not list were never
  committed and are not shown), or "recording", a live writer still commits to it;
- a run without route rows (0-row runs, heat-only runs): pages that read routes stop with `require_routes`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import streamlit as st

from r3trace.dashboards import store_cache as sc
from r3trace.trace.layout import TABLES
from r3trace.trace.reader import RunFiles
from r3trace.trace.schema import MANIFEST_NAME, Manifest

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
        if p.name.startswith(".") or (p.is_dir() and p.name in TABLES):  # hidden, or a table's folder of runs
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


def uncommitted_files(run: RunFiles) -> list[str]:
    """Files in the run's folders that its manifest does not list: what `recover_run` deletes (`.tmp` files, and
    .parquet files renamed before a kill could write the manifest, or a compaction's inputs or output)."""
    return [p.name for p in run.unlisted_files()]


def _interval(m: Manifest) -> str:
    if m.flush_interval_s is None:
        return "on size, flush() and close only: its flush_interval_s is None"
    return f"within its flush_interval_s of {m.flush_interval_s:g} s"


@st.cache_data(show_spinner=False)
def run_problems(path: str, run_id: str) -> tuple[str, list[str]]:
    """(state, one line each) for a run that is not closed: its RunFiles.state, "crashed" or "recording", and
    what that means for what the pages show; ("closed", []) for a closed run."""
    run = sc.open_store(path).run(run_id)
    m = run.manifest
    if run.state == "closed":
        return run.state, []
    recover = f"`r3trace.trace.recover_run('{run.run_dir}')`"
    if run.state == "recording":
        out = [f"Run {run_id} is recording: a live writer still records it; rows appear as they are committed "
               f"({_interval(m)}), when the page reruns."]
        if m.open_requests:
            out.append(f"{len(m.open_requests):,} request(s) in flight at its last commit "
                       f"({names(list(m.open_requests))}) have routes and no requests-table row yet.")
        return run.state, out
    out = [f"Run {run_id} was not closed: its writer stopped without closing it (killed or crashed); the pages "
           "show what its last commit wrote."]
    if m.open_requests:
        out.append(f"{len(m.open_requests):,} request(s) in flight at the last commit "
                   f"({names(list(m.open_requests))}) are shown as finish_reason 'unfinished'.")
    stale = uncommitted_files(run)
    if stale:
        out.append(f"{len(stale):,} uncommitted file(s) its manifest does not list ({names(stale)}) are not "
                   f"shown; {recover} deletes them and closes the run.")
    else:
        out.append(f"{recover} {'writes their rows and ' if m.open_requests else ''}closes the run.")
    return run.state, out


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
