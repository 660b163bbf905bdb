"""r3trace export TRACE --out DIR [--mode stat|per_pass]: a run as SGLang expert-distribution dumps."""

from __future__ import annotations

import argparse

from r3trace.commands.args import check_out_dir

HELP = "write a run as SGLang expert-distribution dumps (what its /dump_expert_distribution_record writes)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="dataset folder or run folder")
    p.add_argument("--out", required=True, help="folder the .pt files go into (created when missing)")
    p.add_argument("--run-id", default=None, help="the run (default: the only one)")
    p.add_argument("--mode", choices=["stat", "per_pass"], default="stat",
                   help="SGLang's --expert-distribution-recorder-mode: stat, logical counts per forward (its "
                        "--init-expert-location plans from it); per_pass, each rank's slot counts per forward and "
                        "the map they ran under (one dump per map)")


def run(args: argparse.Namespace) -> int:
    from r3trace.analysis.export_dump import export_expert_distribution
    from r3trace.analysis.store import open_store
    from r3trace.commands.args import select_run
    from r3trace.errors import UsageError
    from r3trace.trace.schema import TraceSchemaError

    check_out_dir(args.out, "--out")
    store = open_store(args.trace)
    run_id = select_run([r.manifest.run_id for r in store.runs], args.run_id, args.trace)
    try:
        paths = export_expert_distribution(store, run_id, args.out, args.mode)
    except TraceSchemaError as e:
        raise UsageError(f"--mode {args.mode}: {e}") from e
    for p in paths:
        print(p)
    return 0
