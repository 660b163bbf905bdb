"""r3trace sql "SELECT ..." [--store DIR]: run SQL over a trace store (read-only unless --trusted)."""

from __future__ import annotations

import argparse

HELP = "run SQL over the views routes, tokens, requests, runs, rollups (read-only by default)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("query", help="SQL; SELECT only unless --trusted")
    p.add_argument("--store", default=".", help="dataset folder (many runs) or run folder")
    p.add_argument("--trusted", action="store_true", help="allow any statement and file access")
    p.add_argument("--format", choices=["table", "csv", "json"], default="table")
    p.add_argument("--max-rows", type=int, default=50, help="table rows shown; -1 shows all")


def run(args: argparse.Namespace) -> int:
    import polars as pl

    from r3trace.analysis.store import StoreQueryError, open_store
    from r3trace.errors import UsageError

    store = open_store(args.store, read_only=not args.trusted)
    try:
        df = store.query(args.query)
    except StoreQueryError as e:
        raise UsageError(f"{e}; rerun with --trusted to allow it (it may then write files)") from e
    nested = [name for name, dtype in df.schema.items() if dtype.is_nested()]
    if args.format == "csv" and nested:
        raise UsageError(f"--format csv: column(s) {', '.join(nested)} hold lists, which CSV cannot; use --format "
                         "json, or select elements (topk_ids[1]) or array_to_string(topk_ids, ' ')")
    if args.format == "csv":
        print(df.write_csv(), end="")
    elif args.format == "json":
        print(df.write_json())
    else:
        with pl.Config(tbl_rows=args.max_rows, tbl_cols=-1):
            print(df)
    return 0
