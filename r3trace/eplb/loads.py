"""What a plan reads from a trace: per-window expert heat (from the rollups or the routes) and a bounded sample
of token routes (to replay through node-limited dispatch and for co-activation).

Heat from the rollups reads no route row: a trace of 1e9 token-layer rows (V3: 17M tokens) rolls up to at most
windows x L x E x phases rows, and the plan groups those by history window in one DuckDB query
(bench/eplb_rollup_scale.py measures it). Both sources give the same counts for windows on rollup-window
bounds, so the same plan (tests/analysis/test_eplb_windows.py). Shape legend: W history windows, L MoE
layers (manifest order), E experts, T tokens, K top-k.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from r3trace.analysis.store import query_frame
from r3trace.eplb.window import RunFacts, Span
from r3trace.trace.reader import RunFiles
from r3trace.trace.schema import Manifest, TraceSchemaError

HeatSource = Literal["rollups", "routes"]


class TokenSample(NamedTuple):
    """A bounded sample of a window's tokens, in file order: their routes and the DP rank that served each."""

    ids: np.ndarray  # [T, L, K] topk_ids
    dp_rank: np.ndarray  # [T] int64
    dp_size: int | None  # the capture's DP size where its manifest says (the engine's `parallel`), else None


def run_facts(con: duckdb.DuckDBPyConnection, runs: Sequence[RunFiles]) -> dict[str, RunFacts]:
    """RunFacts of every run: time bounds from its rollups (one grouped scan), forward bounds from its manifest
    (each file's min/max forward id; the routes when a file lacks them)."""
    bounds = query_frame(con, "SELECT run_id, epoch_ns(min(window_start)), epoch_ns(max(window_start))"
                              " FROM rollups GROUP BY run_id")
    span = {r: (lo, hi) for r, lo, hi in bounds.iter_rows()}
    out = {}
    for run in runs:
        m = run.manifest
        lo, hi = span.get(m.run_id, (0, 0))
        has_routes = m.kind == "routes" and any(f.name for f in m.files)
        fwd = [(f.min_forward_id, f.max_forward_id) for f in m.files if f.name]
        if has_routes and any(a < 0 and b < 0 for a, b in fwd):  # files written before forward ids were listed
            row = query_frame(con, "SELECT min(forward_id), max(forward_id) FROM tokens WHERE run_id = ?",
                              [m.run_id]).row(0)
            fwd = [(int(row[0]), int(row[1]))]
        f_lo = min((a for a, _ in fwd), default=0)
        f_hi = max((b for _, b in fwd), default=-1) + 1
        out[m.run_id] = RunFacts(m.run_id, int(lo), int(hi) + m.rollup_window_ns, m.rollup_window_ns, f_lo,
                                 max(f_hi, f_lo), has_routes)
    return out


def span_heat(con: duckdb.DuckDBPyConnection, spans: Sequence[Span], m: Manifest,
              source: HeatSource = "rollups", progress: bool | None = False, desc: str = "heat") -> np.ndarray:
    """Selections per (span, layer, expert): [W, L, E] float64, spans in the order given.

    rollups: a rollup row counts in the span holding its window start; routes: a row in the span holding its
    ts or forward_id. Forward spans need the routes. `progress`: a percent bar `desc` while DuckDB scans."""
    if any(s.field == "forward_id" for s in spans) and source == "rollups":
        raise TraceSchemaError("forward windows read the routes: rollups keep no forward id")
    if source == "rollups":
        x, table, ids = "window_start", "rollups", "expert_id, count"
    else:
        x = "forward_id" if spans and spans[0].field == "forward_id" else "ts"
        table, ids = "routes", "unnest(topk_ids) AS expert_id, 1 AS count"
    cast = "make_timestamp_ns({})" if x != "forward_id" else "{}"
    lo, hi = cast.format("?::BIGINT"), cast.format("?::BIGINT")
    # a CASE over the spans, not a range join: one pass over the rows (25.6M V3 rollup rows: 3.7 s vs 10 s)
    case = " ".join(f"WHEN run_id = ? AND {x} >= {lo} AND {x} < {hi} THEN {i}" for i in range(len(spans)))
    runs = sorted({sp.run_id for sp in spans})
    sql = (f"SELECT b, layer_id, expert_id, sum(count)::BIGINT AS count FROM ("
           f" SELECT CASE {case} END AS b, layer_id, {ids} FROM {table}"
           f" WHERE run_id IN ({', '.join('?' for _ in runs)}) AND {x} >= {lo} AND {x} < {hi})"
           " WHERE b IS NOT NULL GROUP BY ALL")
    params: list[object] = [v for sp in spans for v in (sp.run_id, sp.lo, sp.hi)]
    params += [*runs, min(sp.lo for sp in spans), max(sp.hi for sp in spans)]
    frame = query_frame(con, sql, params, progress, desc)
    index = np.full(max(m.moe_layer_ids) + 1, -1, dtype=np.int64)
    index[list(m.moe_layer_ids)] = np.arange(m.num_moe_layers)
    out = np.zeros((len(spans), m.num_moe_layers, m.num_experts))
    if frame.height:
        b, lid, e, c = (frame[col].to_numpy() for col in frame.columns)
        np.add.at(out, (b.astype(np.int64), index[lid.astype(np.int64)], e.astype(np.int64)), c)
    return out


def span_sample(runs: dict[str, RunFiles], spans: Sequence[Span], max_tokens: int,
                newest: bool = False) -> TokenSample | None:
    """The tokens in `spans` (T <= max_tokens: the first ones in file order, or the last ones with `newest`), their
    routes and DP ranks; None when the runs hold no routes (heat-only runs)."""
    if max_tokens <= 0 or not spans:
        return None
    m = runs[spans[0].run_id].manifest
    n_layers = m.num_moe_layers
    need = max_tokens * n_layers
    parts: list[pa.Table] = []
    rows = 0
    order = [r for r in dict.fromkeys(s.run_id for s in spans)]
    for run_id in reversed(order) if newest else order:
        run = runs[run_id]
        if run.manifest.kind != "routes":
            continue
        mine = [s for s in spans if s.run_id == run_id]
        files = run.route_files
        for path in reversed(files) if newest else files:
            t = pq.read_table(path, columns=["layer_id", "dp_rank", "topk_ids"], filters=_filter(mine))
            if not t.num_rows:
                continue
            parts.append(t)
            rows += t.num_rows
            if rows >= need:
                break
        if rows >= need:
            break
    if not parts:
        return None
    table = pa.concat_tables(parts[::-1] if newest else parts)
    table = table.slice(max(table.num_rows - need, 0)) if newest else table.slice(0, need)
    if table.num_rows % n_layers:
        raise TraceSchemaError(f"run {m.run_id}: {table.num_rows} rows in the window, not a multiple of L={n_layers}")
    t_count = table.num_rows // n_layers
    layer = table.column("layer_id").to_numpy().reshape(t_count, n_layers)
    if not (layer == np.asarray(m.moe_layer_ids, dtype=layer.dtype)).all():
        raise TraceSchemaError(f"run {m.run_id}: rows not token-major over moe_layer_ids {m.moe_layer_ids}")
    ids = table.column("topk_ids").combine_chunks().flatten().to_numpy()
    rank = table.column("dp_rank").to_numpy().reshape(t_count, n_layers)[:, 0].astype(np.int64)
    dp_size = m.parallel.get("dp_size")
    return TokenSample(ids.reshape(t_count, n_layers, m.top_k), rank, int(dp_size) if dp_size else None)


def window_routes(runs: dict[str, RunFiles], spans: Sequence[Span], max_tokens: int) -> list[np.ndarray] | None:
    """Each span's first <= max_tokens tokens' routes [T, L, K] (token_mix.planning_loads' windows); None when a
    span holds no routes (heat-only runs)."""
    out = []
    for s in spans:
        sample = span_sample(runs, [s], max_tokens)
        if sample is None or not len(sample.ids):
            return None
        out.append(sample.ids)
    return out


def _filter(spans: Sequence[Span]) -> pc.Expression:
    """Rows inside any of `spans` (one run's), as a pyarrow filter (row groups outside are skipped)."""
    expr = None
    for s in spans:
        col = pc.field(s.field)
        lo: object = pa.scalar(s.lo, pa.timestamp("ns")) if s.field == "ts" else s.lo
        hi: object = pa.scalar(s.hi, pa.timestamp("ns")) if s.field == "ts" else s.hi
        one = (col >= lo) & (col < hi)
        expr = one if expr is None else expr | one
    assert expr is not None
    return expr
