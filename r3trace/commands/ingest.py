"""r3trace ingest SRC --store DIR --format ...: bring routes from elsewhere into a store, all-or-nothing."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from r3trace.analysis.peer_formats import WIRE_DTYPES
from r3trace.commands.args import check_out_dir, positive_int

if TYPE_CHECKING:
    from r3trace.analysis.ingest import ModelShape

HELP = "ingest native runs, SGLang/vLLM/OpenAI response JSON lines, SGLang expert-distribution dumps or .npz"
# responses: each line's format detected from its keys (r3trace/analysis/peer_formats.py); the three after it
# force one format
FORMATS = ("native", "responses", "sglang", "openai", "vllm", "expert-dist", "numpy")
SHAPE_FLAGS = ("num_hidden_layers", "first_k_dense", "moe_layer_ids", "num_experts", "top_k", "num_groups")
DEEPSEEK_V3 = {"num_hidden_layers": 61, "first_k_dense": 3, "num_experts": 256, "top_k": 8, "num_groups": 8}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="native: a store (or run folder); else the file to read")
    p.add_argument("--store", required=True, help="dataset folder the runs go into (created when missing)")
    p.add_argument("--format", choices=FORMATS, default="native",
                   help="responses: detect each line (SGLang /generate or sglext, r3trace sgl_ext, vLLM .npy)")
    p.add_argument("--run-id", default=None)
    p.add_argument("--manifest", default=None, help="a manifest.json giving the model shape")
    p.add_argument("--num-hidden-layers", type=positive_int, default=None, help="default 61 (DeepSeek-V3)")
    p.add_argument("--first-k-dense", type=int, default=None,
                   help="MoE layers are first_k_dense..layers-1 (default 3)")
    p.add_argument("--moe-layer-ids", type=layer_ids, default=None,
                   help="MoE layers as a comma list (1,3,5), for layouts --first-k-dense cannot say")
    p.add_argument("--num-experts", type=positive_int, default=None, help="default 256")
    p.add_argument("--top-k", type=positive_int, default=None, help="default 8")
    p.add_argument("--num-groups", type=positive_int, default=None, help="default 8")
    p.add_argument("--model-name", default="unknown")
    p.add_argument("--wire-dtype", choices=WIRE_DTYPES, default="int32",
                   help="SGLang payload dtype for bodies that do not name it in routed_experts_dtype")
    p.add_argument("--ts", default=None, help="numpy: a .npy of timestamps, one per token or one per forward "
                   "(integers: ns since the epoch; floats: seconds; datetime64); replaces the npz's ts")
    p.add_argument("--drop-repeated", action="store_true",
                   help="response bodies and numpy: leave out the tokens whose top-K repeats an expert on some MoE "
                        "layer (all-zero rows from KV slots SGLang never captured), instead of refusing the file; "
                        "the run's manifest counts them (engine.dropped_repeated_tokens)")
    p.add_argument("--window-ids", default=None, help="numpy: a .npy of integer window ids, one per token or per "
                   "forward (window w starts at w seconds, one rollup window); replaces the npz's window_id")


def layer_ids(text: str) -> tuple[int, ...]:
    """'1,3,5' -> (1, 3, 5): ascending, distinct, >= 0."""
    try:
        ids = tuple(int(v) for v in text.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of layer ids") from e
    if not ids or min(ids) < 0 or list(ids) != sorted(set(ids)):
        raise argparse.ArgumentTypeError(f"{text!r}: layer ids must be >= 0, ascending and distinct")
    return ids


def _shape(args: argparse.Namespace) -> ModelShape:
    """The model shape bodies and dumps are read with, first found of: --manifest; the shape flags (DeepSeek-V3's
    values for those not given); the runs already in --store, when they agree; DeepSeek-V3."""
    from pathlib import Path

    from r3trace.analysis import ingest as ing
    from r3trace.errors import StoreError, UsageError
    from r3trace.trace.reader import open_dataset
    from r3trace.trace.schema import Manifest

    def of(m: Manifest) -> ModelShape:
        return ing.ModelShape(m.num_hidden_layers, m.moe_layer_ids, m.num_experts, m.top_k, m.model_name,
                              m.num_groups)

    if args.manifest:
        path = Path(args.manifest)
        run_dir = path.parent if path.name == "manifest.json" else path
        try:
            return of(Manifest.read(run_dir))
        except ValueError as e:  # TraceSchemaError names the file when it cannot be read
            raise StoreError(f"--manifest {path}: {e}") from e
    given = {k: getattr(args, k) for k in SHAPE_FLAGS if getattr(args, k) is not None}
    store = Path(args.store)
    if not given and store.is_dir() and any(store.glob("run_id=*/manifest.json")):
        found = [of(r.manifest) for r in open_dataset(store)]
        shapes = {(f.num_hidden_layers, f.moe_layer_ids, f.num_experts, f.top_k, f.num_groups) for f in found}
        if len(shapes) == 1:
            return found[0]
        raise UsageError(f"--store {store} holds runs of {len(shapes)} model shapes; give --manifest or the "
                         "shape flags")
    v = {**DEEPSEEK_V3, **given}
    layers = v["num_hidden_layers"]
    if "moe_layer_ids" in v:
        if v["moe_layer_ids"][-1] >= layers:
            raise UsageError(f"--moe-layer-ids holds {v['moe_layer_ids'][-1]}, outside 0..--num-hidden-layers - 1 "
                             f"= {layers - 1}")
        moe = v["moe_layer_ids"]
    elif not 0 <= v["first_k_dense"] < layers:
        raise UsageError(f"--first-k-dense {v['first_k_dense']} must be in 0..--num-hidden-layers - 1 "
                         f"= {layers - 1}")
    else:
        moe = tuple(range(v["first_k_dense"], layers))
    return ing.ModelShape(layers, moe, v["num_experts"], v["top_k"], args.model_name, v["num_groups"])


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from r3trace.analysis import ingest as ing
    from r3trace.analysis.ingest_dump import ingest_expert_distribution
    from r3trace.analysis.store import open_store
    from r3trace.errors import StoreError, UsageError
    from r3trace.progress import progress_flag

    progress = progress_flag(args.progress)
    check_out_dir(args.store, "--store")
    for flag, value in (("--ts", args.ts), ("--window-ids", args.window_ids)):
        if value is not None and args.format != "numpy":
            raise UsageError(f"{flag} {value}: only with --format numpy (native runs keep their ts; a response "
                             "body's rows take its `created`)")
    if args.drop_repeated and args.format in ("native", "expert-dist"):
        raise UsageError(f"--drop-repeated: only for response bodies and numpy (--format {args.format} holds "
                         + ("runs r3trace already checked)" if args.format == "native" else
                            "SGLang's recorder, whose every token is checked: a dump with a repeat is refused)"))
    if args.ts is not None and args.window_ids is not None:
        raise UsageError(f"--ts {args.ts} --window-ids {args.window_ids}: give one of them")
    if args.format == "native":
        open_store(args.src)  # a missing path, a bad manifest or no runs: one error naming the path
        print("ingested runs:", ", ".join(ing.ingest_native(args.src, args.store, progress=progress)))
        return 0
    src = Path(args.src)
    if not src.is_file() and not (args.format == "expert-dist" and src.is_dir()):
        what = "does not exist" if not src.exists() else "is a folder, not a file"
        raise StoreError(f"src {src} {what} (--format {args.format} reads one file; expert-dist a file or a folder)")
    shape = _shape(args)
    if args.format == "expert-dist":  # one torch.load and one small write: nothing to count
        out = ingest_expert_distribution(src, args.store, shape, run_id=args.run_id)
        when = "the time in the dump's file name, else its modification time"
    elif args.format == "numpy":
        from r3trace.analysis.ingest_numpy import ingest_numpy

        ts, windows = (_npy(v, flag) if v is not None else None
                       for v, flag in ((args.ts, "--ts"), (args.window_ids, "--window-ids")))
        out = ingest_numpy(src, args.store, shape, run_id=args.run_id, progress=progress, ts=ts,
                           window_id=windows, drop_repeated=args.drop_repeated)
        when = str(out.engine.get("ts_from"))
    else:  # response bodies; "responses" detects each line's format
        fmt = None if args.format == "responses" else args.format
        out = ing.ingest_responses(src, args.store, shape, run_id=args.run_id, progress=progress, fmt=fmt,
                                   wire_dtype=args.wire_dtype, drop_repeated=args.drop_repeated)
        when = "each body's `created` (else the ingest time); forward_id = the body's line number"
    dropped = out.engine.get("dropped_repeated_tokens")
    left_out = f"; left out {dropped} tokens repeating an expert (--drop-repeated)" if dropped else ""
    print(f"run {out.run_id}: {out.kind}, {out.rows} rows; time from {when}{left_out}")
    return 0


def _npy(path: str, flag: str) -> Any:
    """A .npy array for --ts / --window-ids; one line naming the flag when it cannot be read."""
    import numpy as np

    from r3trace.errors import StoreError

    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise StoreError(f"{flag} {path}: not a .npy array ({e})") from e
