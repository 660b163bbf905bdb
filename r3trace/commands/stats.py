"""r3trace stats TRACE: per-run summary: rows, tokens, imbalance, locality, prefill vs decode."""

from __future__ import annotations

import argparse

HELP = "summarise a trace: rows, tokens, per-layer imbalance, temporal locality"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="dataset folder or run folder")
    p.add_argument("--run-id", default=None, help="only this run (default: every run)")
    p.add_argument("--layers", action="store_true", help="print the per-layer tables too")


def run(args: argparse.Namespace) -> int:
    import polars as pl

    from r3trace.analysis.heat import HeatSource, imbalance
    from r3trace.analysis.integrity import repeated_rows, unplaced_rows
    from r3trace.analysis.locality import temporal_locality
    from r3trace.analysis.store import open_store
    from r3trace.commands.args import select_run
    from r3trace.trace.placements import history_line, switches

    store = open_store(args.trace)
    if args.run_id is not None:
        select_run([r.manifest.run_id for r in store.runs], args.run_id, args.trace)
    for r in store.runs:
        m = r.manifest
        if args.run_id not in (None, m.run_id):
            continue
        print(f"run {m.run_id}: {m.kind}, model {m.model_name}, L={m.num_moe_layers} E={m.num_experts} "
              f"K={m.top_k}, {m.rows} rows in {m.file_count} files, {m.rows // m.num_moe_layers} tokens")
        if m.rows == 0 and m.kind == "routes":
            print("  no rows yet (a run that recorded nothing, or one whose writer stopped before its first file)")
            continue
        # the rollups where they count every routes row: imbalance 0.2 s against a 10 s scan of 116M routes rows
        source: HeatSource = "rollups" if m.kind == "heat" or r.rollups_complete else "routes"
        imb = imbalance(store.con, m.run_id, source=source)
        print(imb.select(pl.exclude("layer_id", "selections").mean()).with_columns(pl.lit("mean over layers")
              .alias("")))
        if m.kind == "routes":
            bad = repeated_rows(store.con, m.run_id)
            print(f"rows repeating an expert in their top-{m.top_k}: {bad.rows:,} of {bad.total:,}"
                  + (f" ({bad.all_zero:,} all zeros: token slots the capture never wrote?)" if bad.rows else ""))
            if m.placements:
                print(history_line(switches(r)))
            if m.with_physical_ids and m.placements:
                off = unplaced_rows(store.con, m.run_id)
                print(f"rows whose physical_ids miss their experts under their forward's placement: {off.rows:,} of "
                      f"{off.total - off.unmapped:,}" + (f" ({off.unmapped:,} rows before the first map)"
                                                          if off.unmapped else ""))
            elif m.with_physical_ids:
                print("physical_ids without a placements table: slots cannot be checked against experts")
            loc = temporal_locality(store.con, m.run_id, source=source)
            ov, base = loc["mean_overlap"].to_numpy().mean(), loc["baseline"].to_numpy().mean()
            print(f"temporal locality: mean overlap {ov:.3f} (independent tokens: {base:.3f})")
            if args.layers:
                print(loc)
        if args.layers:
            with pl.Config(tbl_rows=-1):
                print(imb)
    return 0

