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
    from r3trace.engine.replay_check import run as run_check  # the engine only when the command runs

    return run_check(args)
