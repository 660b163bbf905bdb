"""Sample traces: the engine runs the sample model on the held-out prompts with the trace sink on.

Every prompt of samples/prompts.jsonl is one request, tagged with its domain, decoded greedily for
--max-new-tokens tokens; routes of prompt and generated tokens go through the engine's capture path
(RoutedExpertsCapturer -> TraceWriter) into one run under --out.

Run: .venv/bin/python bench/make_sample_traces.py   (CPU, fp32, ~1 min)
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from r3trace.engine.engine import Engine

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "samples" / "model")
    ap.add_argument("--prompts", type=Path, default=ROOT / "samples" / "prompts.jsonl")
    ap.add_argument("--out", type=Path, default=ROOT / "samples" / "traces")
    ap.add_argument("--run-id", default="sample")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    prompts = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    run_dir = args.out / f"run_id={args.run_id}"
    if run_dir.exists():
        shutil.rmtree(run_dir)  # one run, rewritten whole: the sample is regenerated, never appended to
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
    size = sum(f.stat().st_size for f in run_dir.rglob("*") if f.is_file())
    assert manifest is not None
    print(f"{len(results)} requests -> {run_dir} ({size / 1e6:.2f} MB, {len(manifest['files'])} route files)")


if __name__ == "__main__":
    main()
