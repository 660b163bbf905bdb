"""`r3trace replay-check TRACE --model PATH`: recompute a trace's routes and say where they differ.

For every request of the trace (its token ids are in the requests table) one prefix-free forward of the
engine's model recomputes each MoE layer's top-k. Reported: per layer, the fraction of tokens whose
top-k *set* differs from the trace; the fraction of tokens with any layer different; and the near-tie
margin, the gap between the K-th and (K+1)-th biased gate score, over all rows and over flipped rows
(flips concentrate where the margin is tiny: that is what explains them).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import duckdb
import numpy as np
import torch

from r3trace.capture.recorder import ListRecorder
from r3trace.progress import progress_bar
from r3trace.trace.reader import open_dataset

from .engine_config import EngineConfig
from .model import build_model
from .model_config import ModelConfig
from .near_tie import forward_whole, gap_hooks
from .parallel import ParallelInfo
from .weights import load_weights


@dataclass(frozen=True)
class ReplayReport:
    requests: int
    tokens: int
    layer_ids: list[int]
    layer_flip_rate: list[float]  # per MoE layer: share of tokens whose top-k set differs
    token_any_flip_rate: float  # share of tokens with at least one layer different
    margin_quantiles: dict[str, float]  # near-tie margin over all (token, layer) rows
    flipped_margin_quantiles: dict[str, float]  # ... over the rows that flipped


def replay_check(trace: str | Path, model_path: str | Path, dtype: str = "float32", device: str = "cpu",
                 run_id: str | None = None, progress: bool | None = False) -> ReplayReport:
    """`progress`: a bar of the requests recomputed, on stderr (r3trace/progress.py)."""
    cfg = ModelConfig.from_hf(model_path)
    recorder = ListRecorder()
    model = build_model(cfg, EngineConfig(dtype=dtype, device=device), ParallelInfo(), recorder)  # type: ignore[arg-type]
    load_weights(model, model_path)
    margins: dict[int, torch.Tensor] = {}
    hooks = gap_hooks(model, margins, "set")  # the margin: K-th minus (K+1)-th score
    con = duckdb.connect()
    # Only the files the manifests list (reader.py): never a crashed commit's leftovers or a compaction's inputs.
    runs = [r for r in open_dataset(Path(trace)) if run_id is None or r.manifest.run_id == run_id]
    req_files = [str(p) for r in runs for p in r.request_files]
    route_files = [str(p) for r in runs for p in r.route_files]
    reqs: list = []
    if req_files and route_files:
        reqs = con.execute(f"SELECT request_id, token_ids FROM read_parquet({req_files}) "
                           "WHERE token_ids IS NOT NULL").fetchall()
        # one scan of the routes into memory, then a lookup per request (a scan per request: 86 s on the sample)
        con.execute(f"CREATE TEMP TABLE r AS SELECT request_id, token_pos, layer_id, topk_ids FROM "
                    f"read_parquet({route_files}) WHERE request_id IN "
                    f"(SELECT request_id FROM read_parquet({req_files}))")
    moe = list(cfg.moe_layer_ids)
    flips = np.zeros(len(moe))
    any_flip = tokens = 0
    all_m: list[np.ndarray] = []
    flip_m: list[np.ndarray] = []
    for rid, token_ids in progress_bar(progress, iterable=reqs, desc="replay-check", unit="req"):
        rows = con.execute("SELECT token_pos, layer_id, topk_ids FROM r WHERE request_id = ? "
                           "ORDER BY token_pos, layer_id", [rid]).fetchall()
        if not rows:
            continue
        n = max(r[0] for r in rows) + 1
        recorded = np.full((n, len(moe), cfg.num_experts_per_tok), -1, np.int64)
        for pos, layer, ids in rows:
            recorded[pos, moe.index(layer)] = ids
        forward_whole(model, list(token_ids[:n]), [n - 1])
        differ = np.zeros((n, len(moe)), bool)
        for j, layer in enumerate(moe):
            ours = np.sort(recorder.routes[layer][0].cpu().numpy(), axis=-1)
            differ[:, j] = (ours != np.sort(recorded[:, j], axis=-1)).any(-1)
            m = margins[layer].numpy()
            all_m.append(m)
            flip_m.append(m[differ[:, j]])
        flips += differ.sum(0)
        any_flip += int(differ.any(1).sum())
        tokens += n
    for h in hooks:
        h.remove()

    def quantiles(x: list[np.ndarray]) -> dict[str, float]:
        v = np.concatenate(x) if x else np.zeros(0)
        if v.size == 0:
            return {}
        return {f"p{q}": float(np.quantile(v, q / 100)) for q in (1, 10, 50, 90)} | {"count": float(v.size)}

    return ReplayReport(
        requests=len(reqs), tokens=tokens, layer_ids=moe,
        layer_flip_rate=[float(f / max(tokens, 1)) for f in flips],
        token_any_flip_rate=any_flip / max(tokens, 1),
        margin_quantiles=quantiles(all_m), flipped_margin_quantiles=quantiles(flip_m),
    )


def run(args: argparse.Namespace, progress: bool | None = False) -> int:
    report = replay_check(args.trace, args.model, args.dtype, args.device, args.run_id, progress)
    if args.json:
        print(json.dumps(asdict(report), indent=2))
        return 0
    print(f"requests {report.requests}  tokens {report.tokens}  tokens with any layer flipped "
          f"{100 * report.token_any_flip_rate:.2f}%")
    for layer, rate in zip(report.layer_ids, report.layer_flip_rate, strict=False):
        print(f"  layer {layer:3d}: {100 * rate:6.2f}% of tokens route to a different top-k set")
    print(f"near-tie margin (K-th minus (K+1)-th biased score), all rows: {report.margin_quantiles}")
    print(f"... rows that flipped: {report.flipped_margin_quantiles}")
    return 0
