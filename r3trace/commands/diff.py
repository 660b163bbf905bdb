"""r3trace diff A B: agreement between two traces of the same tokens."""

from __future__ import annotations

import argparse

HELP = "compare two traces of the same tokens: per-layer overlap, Jaccard, exact match, tokens differing"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="run folder, or dataset folder with one run (or use --run-a)")
    p.add_argument("b", help="run folder, or dataset folder with one run (or use --run-b)")
    p.add_argument("--run-a", default=None)
    p.add_argument("--run-b", default=None)
    p.add_argument("--layers", action="store_true", help="print the per-layer table")


def _one(store: object, path: str, run_id: str | None) -> str:
    from r3trace.trace.reader import open_dataset

    ids = [r.manifest.run_id for r in open_dataset(path)]
    if run_id is not None:
        return run_id
    if len(ids) != 1:
        raise SystemExit(f"{path} holds runs {ids}; pick one with --run-a/--run-b")
    return ids[0]


def run(args: argparse.Namespace) -> int:
    import polars as pl

    from r3trace.analysis.agreement import agreement_by_layer, agreement_summary
    from r3trace.analysis.store import TraceStore

    paths = [args.a] if args.a == args.b else [args.a, args.b]
    store = TraceStore(paths)
    ra, rb = _one(store, args.a, args.run_a), _one(store, args.b, args.run_b)
    with pl.Config(tbl_rows=-1, tbl_cols=-1):
        print(agreement_summary(store.con, ra, rb))
        if args.layers:
            print(agreement_by_layer(store.con, ra, rb))
    return 0
