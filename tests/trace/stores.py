"""Stores for the layout tests: two runs written by the real TraceWriter, and the same runs in layout 1.

`write_store` returns what was written, as sorted (run_id, request_id, token_pos, layer_id, topk_ids) rows,
so each reader's result is compared with the input, not with another reader.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from r3trace.trace import TraceWriter, open_dataset
from r3trace.trace.schema import Manifest

MOE = (1, 2, 4)  # 5 hidden layers, layers 0 and 3 dense
E, K = 16, 4
SHAPE = dict(model_name="tiny", num_hidden_layers=5, moe_layer_ids=MOE, num_experts=E, top_k=K)
Row = tuple[str, str, int, int, tuple[int, ...]]


def write_store(root: Path, seed: int) -> list[Row]:
    """Runs "alpha" (3 requests) and "beta" (2), several commits each so each table holds several files."""
    rng = np.random.default_rng(seed)
    rows: list[Row] = []
    for run_id, n_req in (("alpha", 3), ("beta", 2)):
        w = TraceWriter(root, run_id=run_id, flush_interval_s=None, rows_per_file=60, compact_fanin=64,
                        **SHAPE)  # type: ignore[arg-type]
        for r in range(n_req):
            rid, n_tok = f"{run_id}-q{r}", int(rng.integers(5, 30))
            ids = np.stack([np.stack([rng.permutation(E)[:K] for _ in MOE]) for _ in range(n_tok)])  # [T, L, K]
            pos = np.arange(n_tok)
            w.append_tokens(rid, pos, np.where(pos < 4, "prefill", "decode"), "computed", pos, pos * 1000, 0, ids)
            w.add_request(rid, tag=f"tag{r}", prompt_tokens=4, completion_tokens=n_tok - 4, finish_reason="stop")
            w.flush()
            rows += [(run_id, rid, int(t), MOE[li], tuple(int(x) for x in ids[t, li]))
                     for t in range(n_tok) for li in range(len(MOE))]
        w.close()
    return sorted(rows)


def heat_of(rows: list[Row]) -> dict[tuple[str, int, int], int]:
    """(run_id, layer_id, expert_id) -> selections, from the rows as written."""
    out: dict[tuple[str, int, int], int] = {}
    for run_id, _, _, layer, ids in rows:
        for e in ids:
            out[run_id, layer, e] = out.get((run_id, layer, e), 0) + 1
    return out


def to_layout_1(root: Path) -> None:
    """Rewrites a store as the previous layout wrote it: every file beside its manifest, run_id a dictionary
    column in each file, schema_version 1; the table folders removed."""
    for run in open_dataset(root):
        m = run.manifest
        for src in [*run.route_files, *run.rollup_files, *run.request_files]:
            t = pq.read_table(src)
            col = pa.array([m.run_id] * t.num_rows, pa.string())
            col = col.dictionary_encode() if src in run.route_files else col
            pq.write_table(t.add_column(0, "run_id", col).replace_schema_metadata(None), run.run_dir / src.name)
        replace(m, schema_version=1).write(run.run_dir)
    for table in ("routes", "rollups", "requests"):
        shutil.rmtree(root / table)
    assert json.loads((root / "run_id=alpha" / "manifest.json").read_text())["schema_version"] == 1
    assert Manifest.read(root / "run_id=beta").schema_version == 1
