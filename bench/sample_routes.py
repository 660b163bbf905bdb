"""The sample model's routes on held-out text, by domain: the pool bench/eplb_traces.py's "sample-mix" family draws
serving windows from (a trained router, a fixed checkpoint, the traffic's mix of domains moving under it).

Each domain's held-out documents (bench/sample_corpus.py's split, encoded with the model's own tokenizer, EOT before
each) are one stream; up to PER_DOMAIN windows of 513 tokens spread evenly over it (train_sample.eval_windows, as the
evidence in samples/README.md) run through the engine (fp32, CPU: sample_evidence.engine_routes) as prefix-free
requests of 512 tokens. Written: samples/heldout_routes.npz with ids uint8 [N, 512, L_moe, K] and domain int8 [N]
(bench/sample_corpus.DOMAINS order), num_experts, num_groups.

Run:   .venv/bin/python -m bench.sample_routes --corpus .corpus   (build it first: python -m bench.sample_corpus)
Smoke: .venv/bin/python -m bench.sample_routes --smoke   (2 documents a domain, one window each, a temporary file)
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from bench.sample_corpus import DOMAINS, build_corpus, read_documents
from bench.sample_evidence import engine_routes
from bench.train_sample import eval_windows

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "samples" / "model"
OUT = ROOT / "samples" / "heldout_routes.npz"
PER_DOMAIN = 64  # windows a domain (python_docstring's held-out text has 49): 16-33k tokens a domain
SEQ = 512  # tokens a window routes (one request)


def heldout_windows(corpus: Path, model: Path, per_domain: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (token ids [N, SEQ + 1] int64, domain [N] int8): each domain's held-out stream cut as eval_windows does."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    docs = [d for d in read_documents(corpus) if d.split == "heldout"]
    streams = {}
    for name in DOMAINS:
        enc = tok.encode_batch([d.text for d in docs if d.domain == name])
        streams[name] = torch.tensor([i for e in enc for i in (0, *e.ids)], dtype=torch.int64)
    wins = eval_windows(streams, SEQ + 1, per_domain)
    ids = torch.cat([wins[name] for name in DOMAINS]).numpy()
    domain = np.concatenate([np.full(len(wins[name]), j, dtype=np.int8) for j, name in enumerate(DOMAINS)])
    return ids, domain


def write_routes(corpus: Path, model: Path, out: Path, per_domain: int = PER_DOMAIN) -> dict[str, object]:
    """Route the held-out windows through the engine and save them (module doc); -> a summary."""
    ids, domain = heldout_windows(corpus, model, per_domain)
    _, routes = engine_routes(model, torch.from_numpy(ids), "cpu", "float32")  # [N, SEQ, L_moe, K]
    cfg = json.loads((model / "config.json").read_text())
    np.savez_compressed(out, ids=routes.numpy().astype(np.uint8), domain=domain,
                        num_experts=cfg["n_routed_experts"], num_groups=cfg["n_group"])
    return {"windows": {name: int((domain == j).sum()) for j, name in enumerate(DOMAINS)},
            "tokens_a_window": SEQ, "bytes": out.stat().st_size}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=Path(".corpus"))
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--smoke", action="store_true", help="2 documents a domain, one window each, a temporary file")
    args = ap.parse_args(argv)
    if args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            build_corpus(Path(tmp), per_split=2)
            print(json.dumps(write_routes(Path(tmp), args.model, Path(tmp) / "routes.npz", per_domain=1)))
        return
    print(json.dumps(write_routes(args.corpus, args.model, args.out)))


if __name__ == "__main__":
    main()
