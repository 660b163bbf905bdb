"""Rows no router could have produced: a top-K that names one expert twice, or slots that do not hold its experts.

A router's top-k picks K distinct experts, so a routes row whose topk_ids repeat an id is a broken capture: the
all-zero rows ([0] * K) a capture buffer hands back for token slots it never wrote (SGLang's host buffer, indexed
by KV slot and zeroed at start), or an export with its layer and top-k axes swapped. Ingest refuses such tokens
(analysis/ingest.py); a trace written some other way (our writer's per-forward check leaves the sort out, and a
Parquet file written to the contract by hand) is counted here, by `r3trace stats`.

A run with physical_ids and a placements table (an r3trace engine's with capture_physical_ids, an SGLang per_token
dump's ingest) also says which slot served each expert: under the map in force at the row's forward (the layer's
placement row with the largest from_forward_id <= forward_id), slot physical_ids[k] must hold topk_ids[k]. A row
where it does not read a slot through the wrong map: a rebalance the trace did not record, or rows from another
replica's slots.
"""

from __future__ import annotations

from typing import NamedTuple

import duckdb

from r3trace.analysis.coactivation import top_k


class Repeated(NamedTuple):
    rows: int  # routes rows whose K ids repeat one
    all_zero: int  # of them, rows of K zeros
    total: int  # routes rows looked at


def repeated_rows(con: duckdb.DuckDBPyConnection, run_id: str | None = None) -> Repeated:
    """Counts over the routes of run_id (None: every run): one scan, ~25 ms for the sample's 39,100 rows. A row repeats
    an id where two of its K positions are equal (K (K - 1) / 2 comparisons of its ids, each read out of the list once
    into a column) or it holds fewer than K. On a 116M-row trace (2M tokens x 58 layers, top-8) on 2 cores: 7.3 s,
    where the same comparisons on list elements took 14.4 s and a per-row len(list_distinct(topk_ids)) 37.0 s
    (BENCHMARKS.md, "r3trace stats on a big trace")."""
    k = top_k(con, run_id)
    ids = ", ".join(f"topk_ids[{i}] AS a{i}" for i in range(1, k + 1))
    pairs = "".join(f" OR a{i} = a{j}" for i in range(1, k + 1) for j in range(i + 1, k + 1))
    found = con.execute(
        "SELECT count(*) FILTER (WHERE rep), count(*) FILTER (WHERE rep AND list_max(topk_ids) = 0), count(*) "
        f"FROM (SELECT topk_ids, n < $k{pairs} AS rep "
        f"      FROM (SELECT topk_ids, len(topk_ids) AS n, {ids} FROM routes WHERE run_id = coalesce($run, run_id)))",
        {"k": k, "run": run_id}).fetchone()
    assert found is not None  # an aggregate without GROUP BY returns one row
    rows, zeros, total = (int(v) for v in found)
    return Repeated(rows, zeros if k > 1 else 0, total)


class Unplaced(NamedTuple):
    rows: int  # rows with a map whose physical_ids do not hold their topk_ids under it
    unmapped: int  # rows of a forward before their layer's first placement row
    total: int  # routes rows looked at


def unplaced_rows(con: duckdb.DuckDBPyConnection, run_id: str) -> Unplaced:
    """Counts over run_id's routes, which must have physical_ids: each row's map is its layer's at its forward (an
    ASOF join); of two rows of one layer and forward the later written (larger ts) wins, as placements.placement_at.

    The ASOF join runs over the run's distinct (layer, forward) pairs, and the routes reach their map through two
    hash joins (pair -> map number -> map); each slot is read and compared position by position. A 17M-row trace (58
    layers, top-8, two maps of 288 slots, 64 tokens a forward) on 2 cores: 4.5 s, where the ASOF join of every row and
    a list_transform of its slots took 11.3 s."""
    k = top_k(con, run_id)
    wrong = " OR ".join(f"p.phy2log[r.physical_ids[{i}] + 1] IS DISTINCT FROM r.topk_ids[{i}]" for i in range(1, k + 1))
    found = con.execute(
        "WITH p AS (SELECT row_number() OVER () AS map, layer_id, from_forward_id, phy2log FROM placements"
        "  WHERE run_id = $run"
        "  QUALIFY row_number() OVER (PARTITION BY layer_id, from_forward_id ORDER BY ts DESC) = 1),"
        " f AS (SELECT DISTINCT layer_id, forward_id FROM routes WHERE run_id = $run),"
        " fm AS (SELECT f.layer_id, f.forward_id, p.map FROM f"
        "  ASOF LEFT JOIN p ON f.layer_id = p.layer_id AND f.forward_id >= p.from_forward_id),"
        " r AS (SELECT layer_id, forward_id, topk_ids, physical_ids FROM routes WHERE run_id = $run)"
        f" SELECT count(*) FILTER (WHERE p.phy2log IS NOT NULL AND ({wrong})),"
        " count(*) FILTER (WHERE p.phy2log IS NULL), count(*)"
        " FROM r LEFT JOIN fm ON r.layer_id = fm.layer_id AND r.forward_id = fm.forward_id"
        " LEFT JOIN p ON fm.map = p.map",
        {"run": run_id}).fetchone()
    assert found is not None  # an aggregate without GROUP BY returns one row
    return Unplaced(*(int(v) for v in found))
