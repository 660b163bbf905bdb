"""Temporal locality, specialisation by request / tag / phase, and prefill vs decode."""

from __future__ import annotations

from typing import Literal

import duckdb
import polars as pl

from r3trace.analysis.coactivation import top_k
from r3trace.analysis.heat import HeatSource, heat_sql
from r3trace.analysis.store import query_frame

GroupBy = Literal["tag", "request_id", "phase"]


# a (request, layer, position) packed into one BIGINT sort key while the product of their ranges stays below this
PACKED_KEY_LIMIT = 2**62


def temporal_locality(
    con: duckdb.DuckDBPyConnection, run_id: str | None = None, layer_id: int | None = None,
    source: HeatSource = "routes", packed_key: bool = True,
) -> pl.DataFrame:
    """Overlap |S_t n S_t-1| / K of a token's top-k set with the previous position's, same request and layer.

    Only pairs of consecutive positions (token_pos = previous + 1) count. Returns [L rows] columns
    layer_id, pairs, mean_overlap, baseline = sum_e pi_e^2 / K, the overlap two independent tokens would
    have given each expert's selection rate pi_e at that layer (so mean_overlap / baseline is the lift).
    source: where the baseline's heat comes from (heat.heat_sql; "rollups" where every routes file has its rollup,
    RunFiles.rollups_complete: the same counts without a second scan of the routes). packed_key=False: the previous
    position found by a window partitioned by request and layer (what a key too wide to pack falls back to).
    """
    k = top_k(con, run_id)
    scan = [run_id, layer_id]  # the routes filter's parameters
    rows = "FROM routes WHERE run_id = coalesce(?, run_id) AND layer_id = coalesce(?, layer_id)"
    ids = ", ".join(f"a{i}" for i in range(1, k + 1))
    cur = ", ".join(f"topk_ids[{i}] AS a{i}" for i in range(1, k + 1))
    lags = ", ".join(f"lag(a{i}) OVER w AS b{i}" for i in range(1, k + 1))
    # |S_t n S_t-1|: per id of S_t whether S_t-1 holds it (as list_contains counts), over K integer columns, where
    # lagging whole lists and list_contains on them took 131 s on 116M rows of a top-8 trace on 2 cores
    inter = " + ".join("(" + " OR ".join(f"a{i} = b{j}" for j in range(1, k + 1)) + ")::INTEGER"
                       for i in range(1, k + 1))
    sizes = con.execute(f"SELECT (SELECT count(*) FROM (SELECT DISTINCT run_id, request_id {rows})), max(layer_id), "
                        f"min(token_pos), max(token_pos) {rows}", [*scan, *scan]).fetchone()
    n_req, max_layer, min_pos, max_pos = sizes if sizes is not None else (0, None, None, None)
    packed = (packed_key and max_layer is not None and min_pos is not None and min_pos >= 0
              and n_req * (max_layer + 1) * (max_pos + 2) < PACKED_KEY_LIMIT)  # no rows or no positions: the window
    if packed:
        # one BIGINT key (request number, layer, position) sorted once: the previous row is the previous position of
        # the same request and layer iff its key is this key - 1 (position max_pos + 1, which a borrow from the layer
        # would give, holds no row). 116M rows of a top-8 trace on 2 cores: 28 s, where the window partitioned by
        # (run, request string, layer) took 53 s
        nl, npos = max_layer + 1, max_pos + 2
        lagged = f"""
        rq AS (SELECT run_id, request_id, row_number() OVER () AS q FROM (SELECT DISTINCT run_id, request_id {rows})),
        lagged AS (
            SELECT layer_id, {ids}, key, lag(key) OVER w AS prev, {lags}
            FROM (SELECT r.layer_id, (rq.q * {nl} + r.layer_id) * {npos} + r.token_pos AS key, {cur}
                  FROM routes r JOIN rq ON r.run_id = rq.run_id AND r.request_id IS NOT DISTINCT FROM rq.request_id
                  WHERE r.run_id = coalesce(?, r.run_id) AND r.layer_id = coalesce(?, r.layer_id))
            WINDOW w AS (ORDER BY key)),
        ov AS (SELECT layer_id, avg({inter})::DOUBLE / ? AS mean_overlap, count(*) AS pairs
               FROM lagged WHERE prev = key - 1 GROUP BY layer_id)"""
    else:
        lagged = f"""
        lagged AS (
            SELECT layer_id, token_pos, {ids}, lag(token_pos) OVER w AS prev_pos, {lags}
            FROM (SELECT run_id, request_id, token_pos, layer_id, {cur} {rows})
            WINDOW w AS (PARTITION BY run_id, request_id, layer_id ORDER BY token_pos)),
        ov AS (SELECT layer_id, avg({inter})::DOUBLE / ? AS mean_overlap, count(*) AS pairs
               FROM lagged WHERE prev_pos = token_pos - 1 GROUP BY layer_id)"""
    hsql, hparams = heat_sql(run_id, None, source)
    # pi_e = c_e / T with T = sum_e c_e / K (a row holds K ids): sum_e pi_e^2 / K = K sum_e c_e^2 / (sum_e c_e)^2
    sql = f"""
    WITH {lagged},
    h AS (SELECT layer_id, count::DOUBLE AS c FROM ({hsql}) WHERE layer_id = coalesce(?, layer_id)),
    base AS (SELECT layer_id, ? * sum(c * c) / (sum(c) * sum(c)) AS baseline FROM h GROUP BY layer_id)
    SELECT layer_id, pairs, mean_overlap, baseline FROM ov JOIN base USING (layer_id) ORDER BY layer_id
    """
    return query_frame(con, sql, [*scan, *(scan if packed else []), k, *hparams, layer_id, k])


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
