"""Sample traces: the engine runs the sample model on the held-out prompts with the trace sink on.

Every prompt of samples/prompts.jsonl is one request, tagged with its domain, decoded greedily for
--max-new-tokens tokens; routes of prompt and generated tokens go through the engine's capture path
(RoutedExpertsCapturer -> TraceWriter) into one run under --out.

Run:   .venv/bin/python -m bench.make_sample_traces   (CPU, fp32, ~1 min)
Smoke: .venv/bin/python -m bench.make_sample_traces --smoke   (2 prompts, 2 tokens, a temporary store)
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from r3trace.engine.engine import Engine
from r3trace.trace.layout import TABLES, table_dir
from r3trace.trace.schema import SCHEMA_VERSION

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "samples" / "model")
    ap.add_argument("--prompts", type=Path, default=ROOT / "samples" / "prompts.jsonl")
    ap.add_argument("--out", type=Path, default=ROOT / "samples" / "traces")
    ap.add_argument("--run-id", default="sample")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--smoke", action="store_true", help="2 prompts, 2 new tokens, a temporary store")
    args = ap.parse_args(argv)
    if args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            args.out, args.max_new_tokens = Path(tmp), 2
            write_traces(args, prompts_limit=2)
        return
    write_traces(args)


def write_traces(args: argparse.Namespace, prompts_limit: int = 0) -> None:
    prompts = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    prompts = prompts[:prompts_limit] if prompts_limit else prompts
    run_dir = args.out / f"run_id={args.run_id}"  # the manifest's folder; each table's files in <out>/<table>/
    run_dirs = [run_dir] + [table_dir(run_dir, SCHEMA_VERSION, t) for t in TABLES]
    for d in run_dirs:
        if d.exists():
            shutil.rmtree(d)  # one run, rewritten whole: the sample is regenerated, never appended to
    engine = Engine(args.model, dtype="float32", device=args.device, seed=0)
    try:
        engine.start_trace(args.out, run_id=args.run_id)
        results = engine.generate(
            [p["text"] for p in prompts],
            sampling_params={"max_new_tokens": args.max_new_tokens, "temperature": 0.0, "ignore_eos": True},
            rid=[p["id"] for p in prompts], tag=[p["domain"] for p in prompts],
        )
        manifest = engine.stop_trace()
    finally:
        engine.shutdown()
    assert isinstance(results, list)
    errors = [r for r in results if "error" in r]
    if errors:
        raise SystemExit(f"{len(errors)} request(s) failed, e.g. {errors[0]}")
    size = sum(f.stat().st_size for d in run_dirs for f in d.rglob("*") if f.is_file())
    assert manifest is not None
    print(f"{len(results)} requests -> {run_dir} ({size / 1e6:.2f} MB, {len(manifest['files'])} route files)")


if __name__ == "__main__":
    main()
