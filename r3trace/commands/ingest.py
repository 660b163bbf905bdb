"""r3trace ingest SRC --store DIR --format ...: bring routes from elsewhere into a store, all-or-nothing."""

from __future__ import annotations

import argparse

HELP = "ingest native runs, SGLang/vLLM response JSON lines, SGLang expert-distribution dumps or .npz"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src")
    p.add_argument("--store", required=True)
    p.add_argument("--format", choices=["native", "responses", "expert-dist", "numpy"], default="native")
    p.add_argument("--run-id", default=None)
    p.add_argument("--manifest", default=None, help="a manifest.json giving the model shape")
    p.add_argument("--num-hidden-layers", type=int, default=61)
    p.add_argument("--first-k-dense", type=int, default=3, help="MoE layers are first_k_dense..layers-1")
    p.add_argument("--num-experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--num-groups", type=int, default=8)
    p.add_argument("--model-name", default="unknown")


def run(args: argparse.Namespace) -> int:
    from r3trace.analysis import ingest as ing
    from r3trace.trace.schema import Manifest

    if args.format == "native":
        print("ingested runs:", ", ".join(ing.ingest_native(args.src, args.store)))
        return 0
    if args.manifest:
        import json

        with open(args.manifest) as f:
            m = Manifest.from_dict(json.load(f))
        shape = ing.ModelShape(m.num_hidden_layers, m.moe_layer_ids, m.num_experts, m.top_k, m.model_name,
                               m.num_groups)
    else:
        shape = ing.ModelShape(args.num_hidden_layers, tuple(range(args.first_k_dense, args.num_hidden_layers)),
                               args.num_experts, args.top_k, args.model_name, args.num_groups)
    fn = {"responses": ing.ingest_responses, "expert-dist": ing.ingest_expert_distribution,
          "numpy": ing.ingest_numpy}[args.format]
    out = fn(args.src, args.store, shape, run_id=args.run_id)
    print(f"run {out.run_id}: {out.kind}, {out.rows} rows")
    return 0
