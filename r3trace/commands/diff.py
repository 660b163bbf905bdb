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


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import polars as pl

    from r3trace.analysis.agreement import agreement_by_layer, agreement_summary
    from r3trace.analysis.store import TraceStore, open_store
    from r3trace.commands.args import select_run

    a, b = Path(args.a).resolve(), Path(args.b).resolve()
    # each path on its own first: a missing path, a bad manifest or no runs is an error naming that path
    ids = {p: [r.manifest.run_id for r in open_store(p).runs] for p in (a, b)}
    ra = select_run(ids[a], args.run_a, args.a, "--run-a")
    rb = select_run(ids[b], args.run_b, args.b, "--run-b")
    store = TraceStore([a] if a == b else [a, b])
    with pl.Config(tbl_rows=-1, tbl_cols=-1):
        print(agreement_summary(store.con, ra, rb))
        if args.layers:
            print(agreement_by_layer(store.con, ra, rb))
    return 0
