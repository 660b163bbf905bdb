"""The dashboard's only door to data: cached calls into r3trace.analysis / r3trace.eplb.

The TraceStore (a DuckDB connection) is a `st.cache_resource`, one per store path; every query result is
a `st.cache_data` whose arguments are all of its inputs (store path first), so a widget change reruns
only the queries that depend on it. A cursor per call: Streamlit runs sessions on several threads.
The app calls `refresh` first on every rerun: when a run's manifest changed (a live writer committed or
compacted, a run was added or recovered) or its writer started or stopped, every cached store and result
is dropped, so the pages show the commits made since, and never read files a compaction deleted.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import streamlit as st

from r3trace.analysis import agreement, coactivation, heat
from r3trace.analysis.integrity import repeated_rows, unplaced_rows
from r3trace.analysis.limited_query import LimitedResult, run_limited
from r3trace.analysis.store import TraceStore, query_frame
from r3trace.trace.lifecycle import run_is_live
from r3trace.trace.schema import MANIFEST_NAME

STORE_ENV = "R3TRACE_STORE"
SQL_TIMEOUT_ENV = "R3TRACE_SQL_TIMEOUT_S"  # set by `r3trace dashboard --sql-timeout-s`
SQL_TIMEOUT_S = 30


def store_path() -> str | None:
    """$R3TRACE_STORE, else the argument after `--` of `streamlit run dashboards/app.py -- STORE`."""
    env = os.environ.get(STORE_ENV)
    if env:
        return env
    if len(sys.argv) > 1 and Path(sys.argv[0]).name == "app.py":
        return sys.argv[1]
    return None


def sql_timeout_s() -> int:
    """The SQL console's time limit: $R3TRACE_SQL_TIMEOUT_S, else 30 s. The page may lower it, not raise it."""
    raw = os.environ.get(SQL_TIMEOUT_ENV, "")
    return max(int(raw), 1) if raw.isdigit() else SQL_TIMEOUT_S


@st.cache_resource(show_spinner=False)
def open_store(path: str) -> TraceStore:
    return TraceStore(path)


@st.cache_resource(show_spinner=False)
def open_readonly_store(path: str) -> TraceStore:
    """For the SQL console: SELECT only, no file access outside the store, memory and threads capped."""
    return TraceStore(path, read_only=True)


Stamp = tuple[tuple[str, int, int, int, bool], ...]


def store_stamp(path: str) -> Stamp:
    """Per run folder: its name, its manifest's inode, size and mtime (an atomic rewrite changes the inode), and
    whether a writer holds it. Open's discovery (reader.open_dataset); a stat and a lock probe per run."""
    root = Path(path)
    dirs = [root] if (root / MANIFEST_NAME).exists() else sorted(root.glob("run_id=*"))
    out = []
    for d in dirs:
        try:
            s = (d / MANIFEST_NAME).stat()
        except FileNotFoundError:  # no manifest yet: not a run
            continue
        out.append((d.name, s.st_ino, s.st_size, s.st_mtime_ns, run_is_live(d)))
    return tuple(out)


@st.cache_resource(show_spinner=False)
def _stamps() -> tuple[threading.Lock, dict[str, Stamp]]:
    return threading.Lock(), {}


def refresh(path: str) -> bool:
    """Drops every cached store and query result if the store changed since the last rerun looked; True if so."""
    stamp = store_stamp(path)
    lock, seen = _stamps()
    with lock:
        changed = path in seen and seen[path] != stamp
        seen[path] = stamp
    if changed:
        st.cache_data.clear()
        open_store.clear()
        open_readonly_store.clear()
    return changed


def _q(path: str, sql: str, params: list[Any] | None = None) -> pl.DataFrame:
    return query_frame(open_store(path).con, sql, params)


@st.cache_data(show_spinner=False)
def runs(path: str) -> pl.DataFrame:
    """[runs] run_id, kind, model_name, num_hidden_layers, num_experts, top_k, rows, file_count, run_dir."""
    return _q(path, "SELECT run_id, kind, model_name, num_hidden_layers, moe_layer_ids, num_experts, top_k,"
                    " num_groups, rows, file_count, rollup_window_ns, start_time, end_time, run_dir"
                    " FROM runs ORDER BY run_id")


def run_row(path: str, run_id: str) -> dict[str, Any]:
    """The run's row of `runs` (manifest fields, file_count, run_dir)."""
    return dict(runs(path).filter(pl.col("run_id") == run_id).row(0, named=True))


@st.cache_data(show_spinner=False)
def overview(path: str, run_id: str) -> dict[str, Any]:
    """tokens, requests, layers, experts, top_k, rows, bytes on disk (of the files the manifest lists), and the
    route rows whose top-K repeats an expert (analysis/integrity.py), all zeros among them, and with physical_ids and
    placements the rows whose slots miss their experts under their forward's map, of the rows a map covers."""
    run = run_row(path, run_id)
    counts = _q(path, "SELECT count(DISTINCT (request_id, token_pos)) AS tokens,"
                      " count(DISTINCT request_id) AS requests FROM routes WHERE run_id = ?", [run_id]).row(0)
    files = open_store(path).run(run_id)
    size = sum(p.stat().st_size for p in files.listed_files)
    bad = repeated_rows(open_store(path).con, run_id)
    m = files.manifest
    off = unplaced_rows(open_store(path).con, run_id) if m.with_physical_ids and m.placements and m.rows else None
    return {"tokens": int(counts[0]), "requests": int(counts[1]), "layers": len(run["moe_layer_ids"]),
            "experts": int(run["num_experts"]), "top_k": int(run["top_k"]), "rows": int(run["rows"]),
            "bytes": int(size), "repeated_rows": bad.rows, "all_zero_rows": bad.all_zero,
            "unplaced_rows": off.rows if off else 0, "placed_rows": off.total - off.unmapped if off else 0}


@st.cache_data(show_spinner=False)
def heat_windows(path: str, run_id: str, window_s: float) -> pl.DataFrame:
    """[W*L*E] window_start, layer_id, expert_id, count, from the rollups (no scan of routes)."""
    return heat.heat_windows(open_store(path).con, window_s, run_id=run_id, source="rollups")


@st.cache_data(show_spinner=False)
def imbalance(path: str, run_id: str) -> pl.DataFrame:
    """[L] layer_id, selections, max_over_mean, cv, norm_entropy, gini (whole run, from rollups)."""
    return heat.imbalance(open_store(path).con, run_id=run_id, source="rollups")


@st.cache_data(show_spinner=False)
def coactivation_pairs(path: str, run_id: str, layer_id: int, min_count: int) -> pl.DataFrame:
    """[pairs] expert_a, expert_b, count, lift."""
    return coactivation.coactivation(open_store(path).con, layer_id, run_id=run_id, min_count=min_count)


@st.cache_data(show_spinner=False)
def request_list(path: str, run_id: str) -> pl.DataFrame:
    """[requests] request_id, tokens (route rows), tag, prompt_tokens, completion_tokens, finish_reason."""
    return _q(path, "SELECT t.request_id, t.tokens, r.tag, r.prompt_tokens, r.completion_tokens,"
                    " r.finish_reason"
                    " FROM (SELECT request_id, count(*) AS tokens FROM tokens WHERE run_id = ? GROUP BY 1) t"
                    " LEFT JOIN (SELECT * FROM requests WHERE run_id = ?) r USING (request_id)"
                    " ORDER BY t.request_id", [run_id, run_id])


@st.cache_data(show_spinner=False)
def request_routes(path: str, run_id: str, request_id: str) -> pl.DataFrame:
    """[T rows] token_pos, phase, source, forward_id, then one column per MoE layer ("L3") of expert ids."""
    long = _q(path, "SELECT token_pos, phase, source, forward_id, layer_id,"
                    " array_to_string(topk_ids, ' ') AS experts FROM routes"
                    " WHERE run_id = ? AND request_id = ? ORDER BY token_pos, layer_id", [run_id, request_id])
    if long.is_empty():
        return long
    wide = long.with_columns(("L" + pl.col("layer_id").cast(pl.Utf8)).alias("layer")).pivot(
        on="layer", index=["token_pos", "phase", "source", "forward_id"], values="experts")
    return wide.sort("token_pos")


@st.cache_data(show_spinner=False)
def diff(
    path: str, run_a: str, run_b: str, max_flipped: int
) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """(per-layer agreement [L], summary [1], flipped tokens [<= max_flipped]: request_id, token_pos,
    layers_differing, first layer that differs)."""
    con = open_store(path).con
    flipped = _q(path, """
        WITH a AS (SELECT request_id, token_pos, layer_id, topk_ids FROM routes WHERE run_id = ?),
        b AS (SELECT request_id, token_pos, layer_id, topk_ids FROM routes WHERE run_id = ?)
        SELECT request_id, token_pos, count(*) AS layers_differing, min(layer_id) AS first_layer
        FROM a JOIN b USING (request_id, token_pos, layer_id)
        WHERE len(list_intersect(a.topk_ids, b.topk_ids)) < len(a.topk_ids)
        GROUP BY ALL ORDER BY layers_differing DESC, request_id, token_pos LIMIT ?""",
        [run_a, run_b, max_flipped])
    return (agreement.agreement_by_layer(con, run_a, run_b), agreement.agreement_summary(con, run_a, run_b),
            flipped)


def sql(path: str, query: str, limit: int, timeout_s: float, on_wait: Callable[[float], None]) -> LimitedResult:
    """Untrusted SQL on the read-only store: SELECT only, run as written; its first `limit` rows.

    Not cached: it runs when asked, and is interrupted at `timeout_s` or when `on_wait` raises (the page
    passes a callback that draws the elapsed time, so Streamlit's Stop or leaving the page ends it).
    """
    store = open_readonly_store(path)
    store.check_statement(query)
    return run_limited(store.con, query, max_rows=limit, timeout_s=timeout_s, on_wait=on_wait)


def heat_matrix(frame: pl.DataFrame, layers: list[int], num_experts: int) -> np.ndarray:
    """(layer_id, expert_id, count) rows -> counts [L, E] in `layers` order (absent = 0)."""
    out = np.zeros((len(layers), num_experts), dtype=np.int64)
    if frame.height:
        index = {layer: i for i, layer in enumerate(layers)}
        li = np.array([index[x] for x in frame["layer_id"].to_list()], dtype=np.int64)
        np.add.at(out, (li, frame["expert_id"].to_numpy()), frame["count"].to_numpy())
    return out


@st.cache_data(show_spinner=False)
def imbalance_windows(path: str, run_id: str, window_s: float) -> tuple[list[str], list[int], np.ndarray]:
    """(window labels [W], MoE layers [L], max/mean expert load per window and layer [W, L]) from rollups."""
    run = run_row(path, run_id)
    frame = heat_windows(path, run_id, window_s)
    layers = list(run["moe_layer_ids"])
    windows = frame["window_start"].unique().sort().to_list()
    out = np.zeros((len(windows), len(layers)))
    for i, w in enumerate(windows):
        m = heat_matrix(frame.filter(pl.col("window_start") == w), layers, int(run["num_experts"]))
        mean = m.mean(axis=1)
        out[i] = np.where(mean > 0, m.max(axis=1) / np.where(mean > 0, mean, 1), np.nan)
    return [str(w) for w in windows], layers, out
