"""Exact mode's cost: forward time with EngineConfig.deterministic=True over the default, same model and batch.

Run (CPU): .venv/bin/python -m bench.exact_cost --out exact_cost.json
Smoke:     .venv/bin/python -m bench.exact_cost --smoke   (batch 1, 4 tokens, one timed rep, nothing written)

samples/model in fp32 (5 layers, D = 256, 32 experts, top-4, V = 4096). Prefill: B prefix-free requests of
P tokens, logits at each request's last row (what a step without input logprobs computes), and at every row
(input logprobs from position 0: the exact lm_head, 4096 x 256 products a row, dominates). Decode: one token
for each of B requests with P tokens already cached. The fastest of --reps timed forwards after one warm-up
(the minimum: the machine may be shared, and other load only adds time), each mode its own model and KV
buffer, both modes interleaved.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from r3trace.capture.recorder import ListRecorder
from r3trace.engine.engine_config import EngineConfig
from r3trace.engine.forward_batch import ForwardBatch
from r3trace.engine.model import DeepseekForCausalLM, build_model
from r3trace.engine.model_config import ModelConfig
from r3trace.engine.parallel import ParallelInfo
from r3trace.engine.weights import load_weights

MODEL = Path(__file__).resolve().parent.parent / "samples" / "model"


def _model(deterministic: bool) -> DeepseekForCausalLM:
    model = build_model(ModelConfig.from_hf(MODEL), EngineConfig(deterministic=deterministic), ParallelInfo(),
                        ListRecorder())  # fmt: skip
    load_weights(model, MODEL)
    return model.eval()


def _batches(cfg: ModelConfig, b: int, p: int) -> dict[str, ForwardBatch]:
    """{prefill of b x p tokens (logits at each last row, or at every row), decode of b tokens at position p};
    request r's slots r * (p + 1) ...."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(2, cfg.vocab_size, (b, p + 1), generator=gen)
    r2t = torch.arange(b * (p + 1), dtype=torch.int32).view(b, p + 1)
    prefill = {
        name: ForwardBatch.build(
            forward_id=0, input_ids=ids[:, :p].reshape(-1).tolist(), prefix_lens=[0] * b, extend_lens=[p] * b,
            req_pool_indices=list(range(b)), out_cache_loc=r2t[:, :p].reshape(-1), req_to_token=r2t,
            logits_rows=rows, device="cpu",
        )
        for name, rows in (("prefill", [(r + 1) * p - 1 for r in range(b)]), ("prefill_all_logits", list(range(b * p))))
    }
    decode = ForwardBatch.build(
        forward_id=1, input_ids=ids[:, p].tolist(), prefix_lens=[p] * b, extend_lens=[1] * b,
        req_pool_indices=list(range(b)), out_cache_loc=r2t[:, p], req_to_token=r2t, logits_rows=list(range(b)),
        device="cpu",
    )
    return {**prefill, "decode": decode}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)  # the CI machine's cores
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="batch 1 of 4 tokens, one rep (make test)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.batch, args.prompt, args.reps = 1, 4, 1
    torch.set_num_threads(args.threads)
    models = {mode: _model(mode == "exact") for mode in ("default", "exact")}
    cfg = models["default"].config
    batches = _batches(cfg, args.batch, args.prompt)
    slots = args.batch * (args.prompt + 1)
    kv = {mode: torch.zeros(cfg.num_hidden_layers, slots, cfg.kv_cache_dim) for mode in models}
    times: dict[str, dict[str, list[float]]] = {mode: {phase: [] for phase in batches} for mode in models}
    for rep in range(args.reps + 1):
        for mode, model in models.items():
            for phase, fb in batches.items():
                start = time.perf_counter()
                model(fb, kv[mode])
                if rep:  # rep 0 warms up
                    times[mode][phase].append(time.perf_counter() - start)
    result: dict[str, Any] = {"batch": args.batch, "prompt": args.prompt, "threads": args.threads,
                              "torch": torch.__version__}  # fmt: skip
    for phase in batches:
        best = {mode: min(times[mode][phase]) for mode in models}
        result[phase] = {"default_ms": round(1e3 * best["default"], 2), "exact_ms": round(1e3 * best["exact"], 2),
                         "ratio": round(best["exact"] / best["default"], 1)}  # fmt: skip
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
