"""Expert heat and per-layer imbalance, as SQL over the TraceStore views.

Every function takes an explicit connection with the store's views and `?` parameters; `run_id=None`
means every run, `phase=None` every phase. Heat counts selections: a token adds 1 to each of its K
experts, so per layer the counts sum to T*K.
"""

from __future__ import annotations

from typing import Literal

import duckdb
import polars as pl

from r3trace.analysis.store import query_frame
from r3trace.trace.schema import TraceSchemaError

HeatSource = Literal["routes", "rollups"]


def heat_sql(
    run_id: str | None, phase: str | None, source: HeatSource = "routes", window_ns: int | None = None
) -> tuple[str, list[object]]:
    """SQL and params for (window_start, layer_id, expert_id, count); window_start NULL when unwindowed."""
    win = "NULL::TIMESTAMP_NS" if window_ns is None else "make_timestamp_ns(epoch_ns({col}) // ? * ?)"
    wparams: list[object] = [] if window_ns is None else [window_ns, window_ns]
    if source == "rollups":
        sql = (
            f"SELECT {win.format(col='window_start')} AS window_start, layer_id, expert_id,"
            " sum(count)::BIGINT AS count FROM rollups"
            " WHERE run_id = coalesce(?, run_id) AND phase = coalesce(?, phase) GROUP BY ALL"
        )
    else:
        sql = (
            f"SELECT window_start, layer_id, expert_id, count(*) AS count FROM ("
            f" SELECT {win.format(col='ts')} AS window_start, layer_id, unnest(topk_ids) AS expert_id"
            " FROM routes WHERE run_id = coalesce(?, run_id) AND phase = coalesce(?, phase)) GROUP BY ALL"
        )
    return sql, [*wparams, run_id, phase]


def heat(
    con: duckdb.DuckDBPyConnection,
    run_id: str | None = None,
    phase: str | None = None,
    source: HeatSource = "routes",
    progress: bool | None = False,
) -> pl.DataFrame:
    """Selections per (layer, expert) over the whole trace.

    Returns [rows <= L*E] columns layer_id, expert_id, count; experts never selected are absent.
    `source="rollups"` reads the per-file rollup tables instead of scanning routes (same numbers).
    `progress`: a percent bar on stderr while DuckDB scans (r3trace/progress.py).
    """
    sql, params = heat_sql(run_id, phase, source)
    return query_frame(con, f"SELECT layer_id, expert_id, count FROM ({sql}) ORDER BY ALL", params, progress, "heat")


def heat_windows(
    con: duckdb.DuckDBPyConnection,
    window_s: float,
    run_id: str | None = None,
    phase: str | None = None,
    source: HeatSource = "routes",
    progress: bool | None = False,
) -> pl.DataFrame:
    """Selections per (time window of `window_s` seconds by forward timestamp, layer, expert).

    Returns [rows <= W*L*E] columns window_start (timestamp ns), layer_id, expert_id, count.
    From rollups, window_s must be a multiple of every selected run's rollup window. `progress` as heat's.
    """
    window_ns = int(round(window_s * 1e9))
    if window_ns <= 0:
        raise TraceSchemaError(f"window_s={window_s} must be > 0")
    if source == "rollups":
        sel = "SELECT run_id, rollup_window_ns FROM runs WHERE run_id = coalesce(?, run_id)"
        rows = query_frame(con, sel, [run_id])
        for rid, w in rows.iter_rows():
            if window_ns % w:
                msg = f"window_s={window_s} is not a multiple of run {rid}'s rollup window of {w} ns"
                raise TraceSchemaError(msg)
    sql, params = heat_sql(run_id, phase, source, window_ns)
    return query_frame(con, f"{sql} ORDER BY window_start, layer_id, expert_id", params, progress, "heat windows")


def num_experts(con: duckdb.DuckDBPyConnection, run_id: str | None) -> int:
    """E of the selected runs; they must agree."""
    sel = "SELECT DISTINCT num_experts FROM runs WHERE run_id = coalesce(?, run_id)"
    es = query_frame(con, sel, [run_id])
    if es.height != 1:
        got = es.to_series().to_list()
        raise TraceSchemaError(f"runs selected by run_id={run_id!r} have num_experts {got}, need one value")
    return int(es.item())


def imbalance(
    con: duckdb.DuckDBPyConnection,
    run_id: str | None = None,
    phase: str | None = None,
    source: HeatSource = "routes",
) -> pl.DataFrame:
    """Per-layer imbalance of expert heat, over all E experts (unselected experts count as 0).

    Returns [L rows] columns layer_id, selections (T*K), max_over_mean, cv (std/mean, population),
    norm_entropy (entropy / ln E: 1 = uniform), gini (0 = uniform, -> 1 = one expert takes all).
    """
    e = num_experts(con, run_id)
    hsql, params = heat_sql(run_id, phase, source)
    sql = f"""
    WITH h AS (SELECT layer_id, expert_id, count FROM ({hsql})),
    full_heat AS (
        SELECT l.layer_id, x.range::INTEGER AS expert_id, coalesce(h.count, 0)::DOUBLE AS c
        FROM (SELECT DISTINCT layer_id FROM h) l CROSS JOIN range(?) x
        LEFT JOIN h ON h.layer_id = l.layer_id AND h.expert_id = x.range),
    ranked AS (
        SELECT layer_id, c, row_number() OVER (PARTITION BY layer_id ORDER BY c) AS i,
               sum(c) OVER (PARTITION BY layer_id) AS s
        FROM full_heat)
    SELECT layer_id, sum(c)::BIGINT AS selections, max(c) / avg(c) AS max_over_mean,
           stddev_pop(c) / avg(c) AS cv,
           -sum(CASE WHEN c > 0 THEN c / s * ln(c / s) ELSE 0 END) / ln(?) AS norm_entropy,
           sum((2 * i - ? - 1) * c) / (? * max(s)) AS gini
    FROM ranked GROUP BY layer_id ORDER BY layer_id
    """
    return query_frame(con, sql, [*params, e, e, e, e])
