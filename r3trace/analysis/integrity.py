"""Rows no router could have produced: a top-K that names one expert twice.

A router's top-k picks K distinct experts, so a routes row whose topk_ids repeat an id is a broken capture: the
all-zero rows ([0] * K) a capture buffer hands back for token slots it never wrote (SGLang's host buffer, indexed
by KV slot and zeroed at start), or an export with its layer and top-k axes swapped. Ingest refuses such tokens
(analysis/ingest.py); a trace written some other way (our writer's per-forward check leaves the sort out, and a
Parquet file written to the contract by hand) is counted here, by `r3trace stats`.
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
    """Counts over the routes of run_id (None: every run): one scan, ~25 ms for the sample's 39,100 rows."""
    k = top_k(con, run_id)
    found = con.execute(
        "SELECT count(*) FILTER (WHERE len(list_distinct(topk_ids::INTEGER[])) < ?), "
        "count(*) FILTER (WHERE list_max(topk_ids::INTEGER[]) = 0), count(*) "
        "FROM routes WHERE run_id = coalesce(?, run_id)", [k, run_id]).fetchone()
    assert found is not None  # an aggregate without GROUP BY returns one row
    rows, zeros, total = (int(v) for v in found)
    return Repeated(rows, zeros if k > 1 else 0, total)
