"""Stores the CLI tests run against, written by the real TraceWriter: small, seeded, and broken on purpose."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from r3trace.trace import TraceWriter, open_dataset, read_token_routes
from r3trace.trace.schema import PHASES
from tests.analysis.conftest import random_routes, write_run

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "samples"


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`r3trace ARGS` as a real process; stdout and stderr captured (stderr is not a terminal)."""
    return subprocess.run([sys.executable, "-m", "r3trace.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def small_store(root: Path, seed: int = 0) -> Path:
    """Run "a": 3 requests x 20 tokens over MoE layers (1, 2, 4), E=16, K=4, 20 rows a file (9 files)."""
    rng = np.random.default_rng(seed)
    req = np.repeat(["q0", "q1", "q2"], 20)
    pos = np.tile(np.arange(20), 3)
    order = np.lexsort((req, pos))  # forward f holds position f of every request
    req, pos = req[order], pos[order]
    phase = np.where(pos < 5, "prefill", "decode")
    write_run(root, "a", random_routes(rng, len(req)), req, pos, phase, pos.astype(np.int64), rows_per_file=20)
    return root


def broken_store(src: Path, dst: Path, how: str) -> Path:
    """A copy of `src` (one run "a") broken one way: corrupt_manifest, wrong_schema, corrupt_parquet."""
    shutil.copytree(src, dst)
    run = dst / "run_id=a"
    if how == "corrupt_manifest":
        (run / "manifest.json").write_text('{"run_id": "a", ')  # a writer killed mid-write without the rename
    elif how == "wrong_schema":
        d = json.loads((run / "manifest.json").read_text())
        d["layers"] = d.pop("moe_layer_ids")  # another tool's manifest
        (run / "manifest.json").write_text(json.dumps(d))
    elif how == "corrupt_parquet":
        part = sorted((dst / "routes" / "run_id=a").glob("part-*.parquet"))[0]
        part.write_bytes(part.read_bytes()[:100])  # a torn copy
    else:
        raise ValueError(how)
    return dst


def sample_subset(dst: Path, n_requests: int = 2) -> Path:
    """The `n_requests` shortest requests of samples/traces (routes and token ids) as run "sub" under dst."""
    [run] = open_dataset(SAMPLES / "traces")
    m = run.manifest
    reqs = [r for p in run.request_files for r in pq.read_table(p).to_pylist()]
    keep = sorted(reqs, key=lambda r: len(r["token_ids"]))[:n_requests]
    tr = read_token_routes(run)
    w = TraceWriter(dst, model_name=m.model_name, num_hidden_layers=m.num_hidden_layers,
                    moe_layer_ids=m.moe_layer_ids, num_experts=m.num_experts, top_k=m.top_k, run_id="sub",
                    num_groups=m.num_groups)
    for r in keep:
        sel = tr.request_id == r["request_id"]
        w.append_tokens(r["request_id"], tr.token_pos[sel], np.asarray(PHASES)[tr.phase[sel]], "computed",
                        tr.forward_id[sel], 0, 0, tr.topk_ids[sel])
        w.add_request(r["request_id"], prompt_tokens=r["prompt_tokens"], completion_tokens=r["completion_tokens"],
                      token_ids=r["token_ids"])
    w.close()
    return dst
