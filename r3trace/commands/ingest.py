"""r3trace ingest SRC --store DIR --format ...: bring routes from elsewhere into a store, all-or-nothing."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from r3trace.commands.args import positive_int

if TYPE_CHECKING:
    from r3trace.analysis.ingest import ModelShape

HELP = "ingest native runs, SGLang/vLLM response JSON lines, SGLang expert-distribution dumps or .npz"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="native: a store (or run folder); else the file to read")
    p.add_argument("--store", required=True, help="dataset folder the runs go into (created when missing)")
    p.add_argument("--format", choices=["native", "responses", "expert-dist", "numpy"], default="native")
    p.add_argument("--run-id", default=None)
    p.add_argument("--manifest", default=None, help="a manifest.json giving the model shape")
    p.add_argument("--num-hidden-layers", type=positive_int, default=61)
    p.add_argument("--first-k-dense", type=int, default=3, help="MoE layers are first_k_dense..layers-1")
    p.add_argument("--num-experts", type=positive_int, default=256)
    p.add_argument("--top-k", type=positive_int, default=8)
    p.add_argument("--num-groups", type=positive_int, default=8)
    p.add_argument("--model-name", default="unknown")


def _shape(args: argparse.Namespace) -> ModelShape:
    """The model shape responses and dumps are read with: from --manifest, else from the shape flags."""
    from pathlib import Path

    from r3trace.analysis import ingest as ing
    from r3trace.errors import StoreError, UsageError
    from r3trace.trace.schema import Manifest

    if args.manifest:
        path = Path(args.manifest)
        run_dir = path.parent if path.name == "manifest.json" else path
        try:
            m = Manifest.read(run_dir)
        except ValueError as e:  # TraceSchemaError names the file when it cannot be read
            raise StoreError(f"--manifest {path}: {e}") from e
        return ing.ModelShape(m.num_hidden_layers, m.moe_layer_ids, m.num_experts, m.top_k, m.model_name,
                              m.num_groups)
    if not 0 <= args.first_k_dense < args.num_hidden_layers:
        raise UsageError(f"--first-k-dense {args.first_k_dense} must be in 0..--num-hidden-layers - 1 "
                         f"= {args.num_hidden_layers - 1}")
    return ing.ModelShape(args.num_hidden_layers, tuple(range(args.first_k_dense, args.num_hidden_layers)),
                          args.num_experts, args.top_k, args.model_name, args.num_groups)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from r3trace.analysis import ingest as ing
    from r3trace.analysis.store import open_store
    from r3trace.errors import StoreError
    from r3trace.progress import progress_flag

    progress = progress_flag(args.progress)
    if args.format == "native":
        open_store(args.src)  # a missing path, a bad manifest or no runs: one error naming the path
        print("ingested runs:", ", ".join(ing.ingest_native(args.src, args.store, progress=progress)))
        return 0
    src = Path(args.src)
    if not src.is_file():
        what = "does not exist" if not src.exists() else "is a folder, not a file"
        raise StoreError(f"src {src} {what} (--format {args.format} reads one file)")
    shape = _shape(args)
    if args.format == "expert-dist":  # one torch.load and one small write: nothing to count
        out = ing.ingest_expert_distribution(src, args.store, shape, run_id=args.run_id)
    elif args.format == "responses":
        out = ing.ingest_responses(src, args.store, shape, run_id=args.run_id, progress=progress)
    else:
        out = ing.ingest_numpy(src, args.store, shape, run_id=args.run_id, progress=progress)
    print(f"run {out.run_id}: {out.kind}, {out.rows} rows")
    return 0
