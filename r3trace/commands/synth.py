"""r3trace synth OUT: a synthetic DeepSeek-V3-shaped trace written through TraceWriter."""

from __future__ import annotations

import argparse

from r3trace.commands.args import positive_int

HELP = "write a synthetic V3-shaped trace (Zipf popularity, group-limited routing, locality, domains)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", help="dataset folder to write the run into")
    p.add_argument("--tokens", type=positive_int, default=100_000,
                   help="about this many tokens: whole forwards, so a few more")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--zipf-s", type=float, default=0.6)
    p.add_argument("--locality", type=float, default=0.3)
    p.add_argument("--domains", type=positive_int, default=4)
    p.add_argument("--run-id", default=None)


def run(args: argparse.Namespace) -> int:
    from r3trace.analysis.synth import SynthConfig, write_synth
    from r3trace.commands.args import check_out_dir
    from r3trace.progress import progress_flag

    check_out_dir(args.out, "out")
    cfg = SynthConfig(zipf_s=args.zipf_s, locality=args.locality, num_domains=args.domains, seed=args.seed)
    w = write_synth(args.out, cfg, args.tokens, run_id=args.run_id, progress=progress_flag(args.progress))
    m = w.manifest
    print(f"run {m.run_id}: {m.rows} rows in {m.file_count} files under {w.run_dir}")
    return 0
