"""r3trace replay-check TRACE --model PATH: recompute a trace's routes with the engine and report flips."""

from __future__ import annotations

import argparse

HELP = "recompute a trace's routes with a model: per-layer flip rates and near-tie margins"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="trace folder (a dataset of runs)")
    p.add_argument("--model", required=True, help="checkpoint folder (HF layout)")
    p.add_argument("--run-id", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    from r3trace.analysis.store import open_store
    from r3trace.commands.args import check_model_dir, select_run
    from r3trace.errors import StoreError
    from r3trace.progress import progress_flag

    # the store and the model folder are checked before the engine (and torch) is imported
    store = open_store(args.trace)
    if args.run_id is not None:
        select_run([r.manifest.run_id for r in store.runs], args.run_id, args.trace)
    sql = "SELECT count(*) FROM requests WHERE token_ids IS NOT NULL AND run_id = coalesce(?, run_id)"
    if store.query(sql, [args.run_id]).item() == 0:
        raise StoreError(f"{args.trace}: no request keeps its token ids (requests.token_ids), so there is nothing "
                         "to recompute; traces the engine or `r3trace serve` wrote keep them, synthetic and "
                         "ingested ones do not")
    check_model_dir(args.model, "--model")
    from r3trace.engine.replay_check import run as run_check  # the engine only when the command runs

    return run_check(args, progress=progress_flag(args.progress))
