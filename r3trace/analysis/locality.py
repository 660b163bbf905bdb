"""Temporal locality, specialisation by request / tag / phase, and prefill vs decode."""

from __future__ import annotations

from typing import Literal

import duckdb
import polars as pl

from r3trace.analysis.coactivation import top_k
from r3trace.analysis.store import query_frame

GroupBy = Literal["tag", "request_id", "phase"]


def temporal_locality(
    con: duckdb.DuckDBPyConnection, run_id: str | None = None, layer_id: int | None = None
) -> pl.DataFrame:
    """Overlap |S_t n S_t-1| / K of a token's top-k set with the previous position's, same request and layer.

    Only pairs of consecutive positions (token_pos = previous + 1) count. Returns [L rows] columns
    layer_id, pairs, mean_overlap, baseline = sum_e pi_e^2 / K, the overlap two independent tokens would
    have given each expert's selection rate pi_e at that layer (so mean_overlap / baseline is the lift).
    """
    k = top_k(con, run_id)
    cur = ", ".join(f"topk_ids[{i}] AS a{i}" for i in range(1, k + 1))
    lags = ", ".join(f"lag(a{i}) OVER w AS b{i}" for i in range(1, k + 1))
    # |S_t n S_t-1|: per id of S_t whether S_t-1 holds it (as list_contains counts), over K integer columns, where
    # lagging whole lists and list_contains on them took 131 s on 116M rows of a top-8 trace on 2 cores (this: 74 s,
    # the same figures to 1e-16)
    inter = " + ".join("(" + " OR ".join(f"a{i} = b{j}" for j in range(1, k + 1)) + ")::INTEGER"
                       for i in range(1, k + 1))
    # each part scans routes itself: a CTE that several parts read is materialised whole (116M rows with their lists)
    rows = "FROM routes WHERE run_id = coalesce(?, run_id) AND layer_id = coalesce(?, layer_id)"
    sql = f"""
    WITH lagged AS (
        SELECT layer_id, token_pos, {", ".join(f"a{i}" for i in range(1, k + 1))},
               lag(token_pos) OVER w AS prev_pos, {lags}
        FROM (SELECT run_id, request_id, token_pos, layer_id, {cur} {rows})
        WINDOW w AS (PARTITION BY run_id, request_id, layer_id ORDER BY token_pos)),
    ov AS (SELECT layer_id, avg({inter})::DOUBLE / ? AS mean_overlap, count(*) AS pairs
           FROM lagged WHERE prev_pos = token_pos - 1 GROUP BY layer_id),
    h AS (SELECT layer_id, e, count(*)::DOUBLE AS c FROM (SELECT layer_id, unnest(topk_ids) AS e {rows})
          GROUP BY ALL),
    t AS (SELECT layer_id, count(*)::DOUBLE AS n {rows} GROUP BY layer_id),
    base AS (SELECT h.layer_id, sum((c / n) * (c / n)) / ? AS baseline FROM h JOIN t USING (layer_id)
             GROUP BY h.layer_id)
    SELECT layer_id, pairs, mean_overlap, baseline FROM ov JOIN base USING (layer_id) ORDER BY layer_id
    """
    scan = [run_id, layer_id]  # each {rows}'s parameters, in the order the parts appear
    return query_frame(con, sql, [*scan, k, *scan, *scan, k])


def specialisation(
    con: duckdb.DuckDBPyConnection,
    by: GroupBy = "tag",
    run_id: str | None = None,
    layer_id: int | None = None,
) -> pl.DataFrame:
    """How far each group's expert distribution is from the layer's overall one.

    Groups are request tags (domains, via the requests table), requests, or phases. Returns
    [groups x L rows] columns group, layer_id, tokens, kl_bits = KL(P_group || P_layer) in bits, and
    top_share = the share of the group's selections that land on its K most used experts. KL grows as
    ~ (E-1) / (2 ln2 * selections) from sampling noise alone, so compare groups of similar size.
    """
    k = top_k(con, run_id)
    key = {"tag": "coalesce(q.tag, '')", "request_id": "r.request_id", "phase": "r.phase"}[by]
    join = "LEFT JOIN requests q USING (run_id, request_id)" if by == "tag" else ""
    sql = f"""
    WITH r AS (SELECT run_id, request_id, phase, layer_id, topk_ids FROM routes
               WHERE run_id = coalesce(?, run_id) AND layer_id = coalesce(?, layer_id)),
    g AS (SELECT {key} AS grp, r.layer_id, r.topk_ids FROM r {join}),
    gh AS (SELECT grp, layer_id, e, count(*)::DOUBLE AS c
           FROM (SELECT grp, layer_id, unnest(topk_ids) AS e FROM g)
           GROUP BY ALL),
    gt AS (SELECT grp, layer_id, sum(c) AS s FROM gh GROUP BY ALL),
    lh AS (SELECT layer_id, e, sum(c) AS c FROM gh GROUP BY ALL),
    lt AS (SELECT layer_id, sum(c) AS s FROM lh GROUP BY ALL),
    ranked AS (SELECT gh.*, row_number() OVER (PARTITION BY grp, layer_id ORDER BY c DESC) AS rk FROM gh)
    SELECT ranked.grp AS "group", ranked.layer_id, (gt.s / ?)::BIGINT AS tokens,
           sum((ranked.c / gt.s) * log2((ranked.c / gt.s) / (lh.c / lt.s))) AS kl_bits,
           sum(CASE WHEN rk <= ? THEN ranked.c ELSE 0 END) / gt.s AS top_share
    FROM ranked JOIN gt USING (grp, layer_id) JOIN lh USING (layer_id, e) JOIN lt USING (layer_id)
    GROUP BY ranked.grp, ranked.layer_id, gt.s ORDER BY ranked.layer_id, "group"
    """
    return query_frame(con, sql, [run_id, layer_id, k, k])


def prefill_vs_decode(con: duckdb.DuckDBPyConnection, run_id: str | None = None) -> pl.DataFrame:
    """Per layer, how prefill and decode tokens differ in which experts they pick.

    Returns [L rows] columns layer_id, prefill_tokens, decode_tokens, tv_distance = 1/2 sum_e |p_e - d_e|
    between the two selection distributions (0 = same, 1 = disjoint), max_over_mean_prefill,
    max_over_mean_decode (over experts selected at least once in that phase).
    """
    k = top_k(con, run_id)
    sql = """
    WITH h AS (SELECT phase, layer_id, e, count(*)::DOUBLE AS c
               FROM (SELECT phase, layer_id, unnest(topk_ids) AS e FROM routes
                     WHERE run_id = coalesce(?, run_id) AND phase IN ('prefill', 'decode'))
               GROUP BY ALL),
    p AS (SELECT layer_id, e, c, c / sum(c) OVER l AS f, max(c) OVER l / avg(c) OVER l AS mom
          FROM h WHERE phase = 'prefill' WINDOW l AS (PARTITION BY layer_id)),
    d AS (SELECT layer_id, e, c, c / sum(c) OVER l AS f, max(c) OVER l / avg(c) OVER l AS mom
          FROM h WHERE phase = 'decode' WINDOW l AS (PARTITION BY layer_id))
    SELECT layer_id, (sum(coalesce(p.c, 0)) / ?)::BIGINT AS prefill_tokens,
           (sum(coalesce(d.c, 0)) / ?)::BIGINT AS decode_tokens,
           0.5 * sum(abs(coalesce(p.f, 0) - coalesce(d.f, 0))) AS tv_distance,
           max(p.mom) AS max_over_mean_prefill, max(d.mom) AS max_over_mean_decode
    FROM p FULL OUTER JOIN d USING (layer_id, e) GROUP BY layer_id ORDER BY layer_id
    """
    return query_frame(con, sql, [run_id, k, k])
