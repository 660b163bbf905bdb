"""Train the sample DeepSeek-V3-architecture model with the engine's own modules, save it, measure it.

Steps: corpus (bench/sample_corpus.py, built here if --corpus lacks it) -> token cache -> training
(next-token + 0.3 MTP loss + a small sequence-wise balance loss, expert biases updated every step from
the batch load) -> checkpoint in the Hugging Face layout (bf16) + tokenizer.json -> evidence through the
engine on held-out windows of each domain -> evidence JSON and held-out prompts.

Run (the sample in samples/ was made on one H200, samples/README.md):
  .venv/bin/python -m bench.train_sample --out samples/model --time-budget 300
Smoke (CPU): .venv/bin/python -m bench.train_sample --smoke   (a 2-documents-a-split corpus, the tiny preset, 1 step,
  everything in a temporary folder)
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.sample_corpus import DOMAINS, build_corpus, read_documents
from bench.sample_evidence import engine_routes, routing_evidence, unigram_loss
from bench.sample_lm import SampleLM, hf_config, save_checkpoint
from r3trace.engine.model_config import ModelConfig

# The sample: 1 dense + 4 MoE layers + MTP, 32 experts in 4 groups, top-4 of 2 groups, 1 shared expert.
PRESETS: dict[str, dict[str, Any]] = {
    "sample": dict(
        vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=5, first_k_dense_replace=1,
        num_attention_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, moe_intermediate_size=64, n_routed_experts=32, n_shared_experts=1,
        num_experts_per_tok=4, n_group=4, topk_group=2, topk_method="noaux_tc", scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.5, moe_layer_freq=1, rope_theta=10000.0, max_position_embeddings=1024,
        rms_norm_eps=1e-6, num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=0,
    ),
}
PRESETS["tiny"] = {**PRESETS["sample"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
                   "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
                   "v_head_dim": 8, "moe_intermediate_size": 16}
PROMPTS_PER_DOMAIN = 8
PROMPT_CHARS = 600


def tokenize(corpus: Path, docs_per_domain: int) -> dict[str, Any]:
    """-> {"ids": uint16 [N], "offsets": [D+1], "domain": [D], "split": [D] (1 = heldout), "sources": [D]},
    each document prefixed with EOT (id 0). Cached in <corpus>/tokens.npz for the full corpus."""
    cache = corpus / "tokens.npz"
    if docs_per_domain == 0 and cache.is_file():
        z = np.load(cache)
        return {k: z[k] for k in z.files}
    from tokenizers import Tokenizer

    docs = read_documents(corpus)
    if docs_per_domain:
        seen: dict[tuple[str, str], int] = {}
        keep = []
        for d in docs:
            seen[d.domain, d.split] = seen.get((d.domain, d.split), 0) + 1
            if seen[d.domain, d.split] <= docs_per_domain:
                keep.append(d)
        docs = keep
    enc = Tokenizer.from_file(str(corpus / "tokenizer.json")).encode_batch([d.text for d in docs])
    lengths = np.array([len(e.ids) + 1 for e in enc])
    out = {
        "ids": np.concatenate([np.array([0, *e.ids], dtype=np.uint16) for e in enc]),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]),
        "domain": np.array([DOMAINS.index(d.domain) for d in docs], dtype=np.int8),
        "split": np.array([d.split == "heldout" for d in docs], dtype=np.int8),
        "sources": np.array([d.source for d in docs]),
    }
    if docs_per_domain == 0:
        np.savez(cache, **out)  # type: ignore[arg-type]
    return out


def streams(tok: dict[str, Any], seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-> (train stream [N] int64 in a seeded document order, {domain: held-out stream in corpus order})."""
    ids, off = tok["ids"], tok["offsets"]
    docs = [i for i in range(len(off) - 1) if tok["split"][i] == 0]
    random.Random(seed).shuffle(docs)
    train = torch.from_numpy(np.concatenate([ids[off[i] : off[i + 1]] for i in docs]).astype(np.int64))
    held = {}
    for j, name in enumerate(DOMAINS):
        mine = [i for i in range(len(off) - 1) if tok["split"][i] and tok["domain"][i] == j]
        parts = [ids[off[i] : off[i + 1]] for i in mine]
        held[name] = torch.from_numpy(np.concatenate(parts).astype(np.int64))
    return train, held


def eval_windows(held: dict[str, torch.Tensor], length: int, per_domain: int) -> dict[str, torch.Tensor]:
    """[W, length] non-overlapping windows spread evenly over each domain's held-out stream (many documents,
    not the first few long ones)."""
    out = {}
    for name, s in held.items():
        slots = s[: len(s) // length * length].view(-1, length)
        pick = torch.linspace(0, len(slots) - 1, min(per_domain, len(slots))).round().long()
        out[name] = slots[pick]
    return out


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * frac)))


def train(
    lm: SampleLM, stream: torch.Tensor, args: argparse.Namespace, log: list[dict[str, Any]]
) -> dict[str, Any]:
    device = stream.device
    decay = [p for n, p in lm.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in lm.named_parameters() if p.dim() < 2 or "embed" in n]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda",
    )
    gen = torch.Generator(device=device).manual_seed(args.seed)
    span = torch.arange(args.seq_len + 2, device=device)
    total, start, t_cal = args.steps, time.perf_counter(), 0.0
    step = 0
    while step < (total or 10**9):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total or 10**9, args.lr, args.warmup)
        high = len(stream) - args.seq_len - 2
        starts = torch.randint(0, high, (args.batch, 1), generator=gen, device=device)
        loss, mtp_loss = lm(stream[starts + span])
        bal = lm.balance_loss(args.batch)
        opt.zero_grad(set_to_none=True)
        (loss + args.mtp_weight * mtp_loss + args.balance_alpha * bal).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
        opt.step()
        skew = lm.update_bias(args.bias_gamma)
        step += 1
        if total == 0 and step == 10:  # calibrate: fix the step count from the time of steps 10..30
            _sync(device)
            t_cal = time.perf_counter()
        if total == 0 and step == 30:
            _sync(device)
            per_step = (time.perf_counter() - t_cal) / 20
            total = 30 + int((args.time_budget - (time.perf_counter() - start)) / per_step * 0.97)
            print(f"calibrated: {per_step * 1e3:.1f} ms/step -> --steps {total}", flush=True)
        if step % args.log_every == 0 or step == total:
            elapsed = time.perf_counter() - start
            row = {"step": step, "loss": round(loss.item(), 4), "mtp_loss": round(mtp_loss.item(), 4),
                   "balance": round(bal.item(), 4), "grad_norm": round(grad_norm.item(), 3),
                   "max_over_mean": [round(x, 2) for x in skew.tolist()], "elapsed_s": round(elapsed, 1)}
            log.append(row)
            print(json.dumps(row), flush=True)
            if elapsed > args.time_budget * 1.15:  # slower than calibrated: stop here, still save
                print(f"time cap hit at step {step}/{total}", flush=True)
                break
    _sync(device)
    tokens = step * args.batch * args.seq_len
    seconds = round(time.perf_counter() - start, 1)
    return {"steps": step, "planned_steps": total, "tokens": tokens, "seconds": seconds}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def mtp_eval(lm: SampleLM, windows: dict[str, torch.Tensor], batch: int) -> dict[str, float]:
    """MTP cross-entropy per domain, from the training model (the engine has no MTP forward yet)."""
    out = {}
    for name, w in windows.items():
        losses = [lm(w[s : s + batch])[1].item() * len(w[s : s + batch]) for s in range(0, len(w), batch)]
        out[name] = round(sum(losses) / len(w), 4)
    return out


def write_prompts(corpus: Path, path: Path) -> None:
    docs = [d for d in read_documents(corpus) if d.split == "heldout"]
    rows: list[dict[str, str]] = []
    for name in DOMAINS:
        for d in [d for d in docs if d.domain == name][:PROMPTS_PER_DOMAIN]:
            text = d.text.strip()[:PROMPT_CHARS]
            text = text[: text.rfind("\n")] if "\n" in text[PROMPT_CHARS // 2 :] else text
            rows.append({"id": f"{name}-{len(rows):03d}", "domain": name, "source": d.source, "text": text})
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="checkpoint folder (config, weights, tokenizer); required but in --smoke")
    ap.add_argument("--corpus", type=Path, default=Path(".corpus"))
    ap.add_argument("--evidence", type=Path, help="evidence JSON (default: <out>/../evidence.json)")
    ap.add_argument("--prompts", type=Path, help="held-out prompts (default: <out>/../prompts.jsonl)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="sample")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=0, help="0: calibrate from --time-budget")
    ap.add_argument("--time-budget", type=float, default=300.0, help="seconds of training when --steps 0")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--balance-alpha", type=float, default=1e-4, help="DeepSeek-V3's alpha")
    ap.add_argument("--bias-gamma", type=float, default=1e-3, help="DeepSeek-V3's bias update speed")
    ap.add_argument("--eval-windows", type=int, default=64, help="held-out windows a domain")
    ap.add_argument("--docs-per-domain", type=int, default=0, help="smoke tests: first N docs a split")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="tiny corpus and preset, 1 step, a temporary folder (CPU)")
    args = ap.parse_args(argv)
    if args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            args.corpus, args.out = Path(tmp) / "corpus", Path(tmp) / "model"
            build_corpus(args.corpus, per_split=2)
            args.preset, args.device, args.steps, args.batch, args.seq_len = "tiny", "cpu", 1, 2, 32
            args.warmup, args.eval_windows, args.log_every = 1, 1, 1
            run_training(args)
        return
    if args.out is None:
        ap.error("--out is required")
    run_training(args)


def run_training(args: argparse.Namespace) -> None:
    evidence_path = args.evidence or args.out.parent / "evidence.json"
    prompts_path = args.prompts or args.out.parent / "prompts.jsonl"

    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 master weights, tf32 matmuls on the GPU
    torch.backends.cudnn.allow_tf32 = True
    if not (args.corpus / "documents.jsonl.gz").is_file():
        build_corpus(args.corpus)
    t0 = time.perf_counter()
    tok = tokenize(args.corpus, args.docs_per_domain)
    train_stream, held = streams(tok, args.seed)
    print(f"tokens: train {len(train_stream)}, held-out {({k: len(v) for k, v in held.items()})} "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)

    fields = dict(PRESETS[args.preset])
    cfg = ModelConfig.from_dict(hf_config(dict(fields)))
    device = torch.device(args.device)
    lm = SampleLM(cfg, args.seq_len, args.device)
    lm.init_weights(args.seed)
    log: list[dict[str, Any]] = []
    run = train(lm, train_stream.to(device), args, log)
    size = save_checkpoint(lm, hf_config(dict(fields)), args.out)
    shutil.copy(args.corpus / "tokenizer.json", args.out / "tokenizer.json")
    print(f"saved {args.out} ({size / 1e6:.1f} MB safetensors) after {json.dumps(run)}", flush=True)

    windows = eval_windows(held, args.seq_len + 2, args.eval_windows)
    lm.eval()
    mtp = mtp_eval(lm, {k: v.to(device) for k, v in windows.items()}, args.batch)
    del lm
    routes, val = {}, {}
    for name, w in windows.items():
        nll, routes[name] = engine_routes(args.out, w[:, : args.seq_len + 1], args.device, "bfloat16"
                                          if device.type == "cuda" else "float32")
        val[name] = {"model": round(nll.mean().item(), 4), "mtp": mtp[name],
                     "unigram": round(unigram_loss(train_stream, w[:, 1 : args.seq_len + 1], cfg.vocab_size),
                                      4),
                     "tokens": nll.numel(), "windows": len(w)}
    evidence = {
        "config": fields, "checkpoint_bytes": size, "run": {**run, "device": _device_name(device), **{
            k: getattr(args, k) for k in ("seed", "batch", "seq_len", "lr", "warmup", "mtp_weight",
                                          "balance_alpha", "bias_gamma")}},
        "corpus": {} if args.docs_per_domain else json.loads((args.corpus / "manifest.json").read_text()),
        "val_loss_nats": val,
        "layers": routing_evidence(routes, list(cfg.moe_layer_ids), cfg.n_routed_experts, args.seed),
        "train_log": log,
    }
    evidence_path.write_text(json.dumps(evidence, indent=1) + "\n")
    write_prompts(args.corpus, prompts_path)
    print_summary(evidence)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def print_summary(ev: dict[str, Any]) -> None:
    print(f"{'domain':18s} {'val loss':>9s} {'MTP':>7s} {'unigram':>8s} {'tokens':>7s}")
    for name, v in ev["val_loss_nats"].items():
        print(f"{name:18s} {v['model']:9.3f} {v['mtp']:7.3f} {v['unigram']:8.3f} {v['tokens']:7d}")
    print(f"{'layer':>5s} {'max/mean':>8s} {'H/lnE':>6s} {'JSD dom':>8s} {'JSD half':>8s} {'overlap':>7s} "
          f"{'shuffled':>8s} {'K/E':>5s}")
    for layer, v in ev["layers"].items():
        print(f"{layer:>5s} {v['max_over_mean']:8.2f} {v['entropy_norm']:6.3f} "
              f"{v['jsd_between_domains']:8.4f} {v['jsd_within_domain_halves']:8.4f} "
              f"{v['overlap_prev']:7.3f} "
              f"{v['overlap_chance_shuffled']:8.3f} {v['overlap_chance_uniform']:5.3f}")


if __name__ == "__main__":
    main()
