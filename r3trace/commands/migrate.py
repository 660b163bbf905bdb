"""r3trace migrate STORE: rewrite the runs of the previous layout (files beside manifest.json) in today's layout.

Today's layout (r3trace/trace/layout.py) keeps each table in its own folder, hive-partitioned by run id, so
plain readers (pyarrow, polars, DuckDB, Spark) open `<store>/routes`. r3trace reads both layouts; this is for
those readers. Each run is committed by its manifest's rewrite, so a stop midway leaves every run readable.
"""

from __future__ import annotations

import argparse

HELP = "rewrite runs of the previous layout so plain Parquet readers open <store>/routes"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", help="dataset folder (or one run folder)")


def run(args: argparse.Namespace) -> int:
    from r3trace.analysis.store import open_store
    from r3trace.trace.layout import FIRST_TABLE_LAYOUT, migrate_run

    runs = open_store(args.store).runs
    old = [r for r in runs if r.manifest.schema_version < FIRST_TABLE_LAYOUT]
    for r in old:
        m = migrate_run(r.run_dir)
        print(f"run {m.run_id}: {m.file_count} files moved to {r.run_dir.parent}/{{routes,rollups,requests}}")
    print(f"{len(old)} of {len(runs)} runs migrated; the others were already in today's layout")
    return 0
