"""Which experts fire together: within a layer (C(K,2) pairs per token) and across adjacent MoE layers."""

from __future__ import annotations

import duckdb
import polars as pl

from r3trace.analysis.store import query_frame
from r3trace.trace.schema import TraceSchemaError


def top_k(con: duckdb.DuckDBPyConnection, run_id: str | None) -> int:
    ks = query_frame(con, "SELECT DISTINCT top_k FROM runs WHERE run_id = coalesce(?, run_id)", [run_id])
    if ks.height != 1:
        raise TraceSchemaError(f"runs selected by run_id={run_id!r} have top_k {ks.to_series().to_list()}")
    return int(ks.item())


def coactivation(
    con: duckdb.DuckDBPyConnection,
    layer_id: int,
    run_id: str | None = None,
    min_count: int = 1,
) -> pl.DataFrame:
    """Expert pairs selected by the same token at `layer_id`, over all C(K,2) pairs of each token.

    Returns [pairs] columns expert_a < expert_b, count (tokens with both), lift = P(a, b) / (P(a) P(b))
    with P(x) = tokens selecting x / T: 1 means independent, > 1 together more often than chance.
    Sorted by count descending; pairs below `min_count` dropped.
    """
    k = top_k(con, run_id)
    sql = """
    WITH r AS (SELECT topk_ids FROM routes WHERE layer_id = ? AND run_id = coalesce(?, run_id)),
    n AS (SELECT count(*)::DOUBLE AS t FROM r),
    single AS (SELECT e, count(*)::DOUBLE AS c FROM (SELECT unnest(topk_ids) AS e FROM r) GROUP BY e),
    pairs AS (
        SELECT least(topk_ids[i], topk_ids[j]) AS expert_a, greatest(topk_ids[i], topk_ids[j]) AS expert_b,
               count(*) AS count
        FROM r, range(1, ? + 1) a(i), range(1, ? + 1) b(j) WHERE i < j GROUP BY ALL HAVING count(*) >= ?)
    SELECT p.expert_a, p.expert_b, p.count, p.count * n.t / (sa.c * sb.c) AS lift
    FROM pairs p CROSS JOIN n JOIN single sa ON sa.e = p.expert_a JOIN single sb ON sb.e = p.expert_b
    ORDER BY p.count DESC, p.expert_a, p.expert_b
    """
    return query_frame(con, sql, [layer_id, run_id, k, k, min_count])


def next_moe_layer(con: duckdb.DuckDBPyConnection, layer_id: int, run_id: str | None) -> int:
    ids = query_frame(con, "SELECT DISTINCT unnest(moe_layer_ids) AS l FROM runs"
                      " WHERE run_id = coalesce(?, run_id) ORDER BY l", [run_id]).to_series().to_list()
    later = [x for x in ids if x > layer_id]
    if layer_id not in ids or not later:
        raise TraceSchemaError(f"layer_id={layer_id} has no next MoE layer; MoE layers are {ids}")
    return int(later[0])


def cross_layer_affinity(
    con: duckdb.DuckDBPyConnection,
    layer_id: int,
    run_id: str | None = None,
    min_count: int = 1,
) -> pl.DataFrame:
    """P(expert j selected at the next MoE layer | expert i selected at `layer_id`), same token.

    Returns [pairs] columns expert_i, expert_j, count (tokens with i at layer_id and j next),
    p_j_given_i = count / tokens with i at layer_id. For each i the p sum to K. Sorted by count descending.
    """
    nxt = next_moe_layer(con, layer_id, run_id)
    sql = """
    WITH a AS (SELECT run_id, request_id, token_pos, forward_id, topk_ids FROM routes
               WHERE layer_id = ? AND run_id = coalesce(?, run_id)),
    b AS (SELECT run_id, request_id, token_pos, forward_id, topk_ids FROM routes
          WHERE layer_id = ? AND run_id = coalesce(?, run_id)),
    single AS (SELECT e, count(*)::DOUBLE AS c FROM (SELECT unnest(topk_ids) AS e FROM a) GROUP BY e),
    joined AS (SELECT a.topk_ids AS ia, b.topk_ids AS ib FROM a
               JOIN b USING (run_id, request_id, token_pos, forward_id)),
    pairs AS (SELECT i AS expert_i, j AS expert_j, count(*) AS count
              FROM (SELECT unnest(ia) AS i, ib FROM joined), unnest(ib) AS u(j)
              GROUP BY ALL HAVING count(*) >= ?)
    SELECT expert_i, expert_j, count, count / s.c AS p_j_given_i
    FROM pairs JOIN single s ON s.e = pairs.expert_i ORDER BY count DESC, expert_i, expert_j
    """
    return query_frame(con, sql, [layer_id, run_id, nxt, run_id, min_count])
