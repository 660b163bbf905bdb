"""append_tokens' batches merged into one file (tokens.merge_tokens) write what append's rows write: the same routes
table, row for row, and the same rollups, with weights and physical ids.

    .venv/bin/pytest -q tests/trace/test_token_batches.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from r3trace.trace import TraceWriter, open_dataset

MOE = [0, 2, 3]  # L = 3 MoE layers of 4
E, P, K = 12, 16, 3
PHASES = ["prefill", "decode", "decode"]
SOURCES = ["computed", "prefix_cache", "computed"]


def batches(seed: int) -> list[dict[str, Any]]:
    """Three batches of 5, 1 and 4 tokens from different requests, phases, sources and times: [T] columns and
    ids, weights, physical ids [T, L, K] (slot p holds expert p % E)."""
    rng = np.random.default_rng(seed)
    out = []
    for i, t in enumerate((5, 1, 4)):
        phys = np.stack([rng.permutation(P)[:K] for _ in range(t * len(MOE))]).reshape(t, len(MOE), K)
        out.append({"request_id": [f"r{i}-{j % 2}" for j in range(t)], "token_pos": rng.integers(0, 99, t),
                    "phase": PHASES[i], "source": SOURCES[i], "forward_id": i + 7,
                    "ts": 10**9 * i + rng.integers(0, 10**9, t), "dp_rank": i % 2,
                    "topk_ids": (phys % E).astype(np.int32), "topk_weights": rng.random((t, len(MOE), K)),
                    "physical_ids": phys.astype(np.int64)})
    return out


def writer(root: Path) -> TraceWriter:
    return TraceWriter(root, model_name="t", num_hidden_layers=4, moe_layer_ids=MOE, num_experts=E, top_k=K,
                       run_id="a", flush_interval_s=None, with_weights=True, with_physical_ids=True)


def per_row(t: int) -> Any:
    """A token column (or a scalar) of t tokens -> its [T * L] rows."""
    return lambda v: np.repeat(np.broadcast_to(np.asarray(v), (t,)), len(MOE))


def test_token_batches_write_what_rows_write(tmp_path: Path) -> None:
    bs = batches(11)
    with writer(tmp_path / "tokens") as w:
        for b in bs:
            w.append_tokens(b["request_id"], b["token_pos"], b["phase"], b["source"], b["forward_id"], b["ts"],
                            b["dp_rank"], b["topk_ids"], b["topk_weights"], b["physical_ids"])
    with writer(tmp_path / "rows") as w:  # the same tokens as rows, token-major, layers in manifest order
        for b in bs:
            t = len(b["topk_ids"])
            rep = per_row(t)
            w.append(list(rep(b["request_id"])), rep(b["token_pos"]), b["phase"], b["source"], rep(b["forward_id"]),
                     rep(b["ts"]), rep(b["dp_rank"]), np.tile(MOE, t), b["topk_ids"].reshape(-1, K),
                     b["topk_weights"].reshape(-1, K), b["physical_ids"].reshape(-1, K))
    got, want = (open_dataset(tmp_path / d)[0] for d in ("tokens", "rows"))
    assert len(got.route_files) == 1  # the three batches went into one file: the merged path
    a, b = (pq.read_table(r.route_files).to_pylist() for r in (got, want))
    assert len(a) == 10 * len(MOE) and a == b
    ra, rb = (pq.read_table(r.rollup_files).sort_by([("window_start", "ascending"), ("phase", "ascending"),
                                                     ("layer_id", "ascending"), ("expert_id", "ascending")])
              for r in (got, want))
    assert ra.to_pylist() == rb.to_pylist() and sum(ra.column("count").to_pylist()) == 10 * len(MOE) * K
