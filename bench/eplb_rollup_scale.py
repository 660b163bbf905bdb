"""A plan from rollups alone at the scale of a billion token-layer rows: how big the rollups are and how long
`r3trace eplb` takes on them.

Writes a heat-only run (kind "heat": rollup files and a manifest, no routes) whose rollups are what a DeepSeek-V3
trace of `--rows` token-layer rows rolls up to: 58 MoE layers x 256 experts x 2 phases per 1 s rollup window,
`--tokens-per-s` tokens a second (so rows / 58 / tokens_per_s windows), each (window, layer) a multinomial draw
of tokens x 8 selections over a Zipf(0.8) popularity that drifts window by window. Then times make_report (what
`r3trace eplb` runs) with --policy ours and with the default --policy auto: run facts, the heat query that groups
the rollups into history windows, the backtest and the plan. Writes bench/results/eplb_rollup_scale.json.

Run:   .venv/bin/python -m bench.eplb_rollup_scale [--rows 1e9] [--tokens-per-s 20000] [--out FILE]
Smoke: .venv/bin/python -m bench.eplb_rollup_scale --smoke   (16 windows of 100 tokens a second, nothing written)
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from r3trace.analysis.store import TraceStore
from r3trace.eplb.placement import Cluster
from r3trace.eplb.plan_request import PlanRequest
from r3trace.eplb.report import make_report
from r3trace.trace.commit import write_parquet_atomic
from r3trace.trace.layout import file_table, table_dir
from r3trace.trace.schema import ROLLUP_SCHEMA, FileEntry, Manifest, run_dir_name

V3_MOE = tuple(range(3, 61))  # DeepSeek-V3: 61 layers, the first 3 dense
E, K, NS = 256, 8, 10**9
WINDOWS_PER_FILE = 64  # one rollup file per 64 s, as a writer committing a routes file a minute would leave


def write_rollup_run(root: Path, rows: float, tokens_per_s: int, seed: int = 0) -> tuple[Manifest, int]:
    """The heat-only run and its rollup row count."""
    rng = np.random.default_rng(seed)
    n_layers = len(V3_MOE)
    windows = int(np.ceil(rows / n_layers / tokens_per_s))
    m = Manifest(run_id="billion", model_name="deepseek-v3-shaped", num_hidden_layers=61, moe_layer_ids=V3_MOE,
                 num_experts=E, top_k=K, num_groups=8, kind="heat",
                 engine={"represents_route_rows": rows, "tokens_per_s": tokens_per_s})
    run_dir = root / run_dir_name(m.run_id)
    run_dir.mkdir(parents=True)
    folder = table_dir(run_dir, m.schema_version, "rollups")
    folder.mkdir(parents=True)
    zipf = 1.0 / np.arange(1, E + 1) ** 0.8
    perm = np.stack([rng.permutation(E) for _ in range(n_layers)])  # [L, E] each layer's popularity order
    start = 1_767_225_600 * NS
    files: list[FileEntry] = []
    total = 0
    for f0 in range(0, windows, WINDOWS_PER_FILE):
        parts = []
        for w in range(f0, min(f0 + WINDOWS_PER_FILE, windows)):
            if w % 60 == 0:  # drift: once a minute two experts of every layer trade places
                a, b = rng.integers(0, E, 2)
                perm[:, [a, b]] = perm[:, [b, a]]
            p = zipf[np.argsort(perm, axis=1)]
            p /= p.sum(1, keepdims=True)
            for phase, share in (("prefill", 0.3), ("decode", 0.7)):
                c = rng.multinomial(int(tokens_per_s * share) * K, p)  # [L, E]
                li, ei = np.nonzero(c)
                parts.append(pa.table({
                    "window_start": pa.array(np.full(len(li), start + w * NS), pa.timestamp("ns")),
                    "layer_id": pa.array(np.asarray(V3_MOE, np.int16)[li]), "expert_id": pa.array(ei.astype(np.int32)),
                    "phase": pa.array([phase] * len(li), pa.string()), "count": pa.array(c[li, ei].astype(np.int64))}))
        table = pa.concat_tables(parts).cast(ROLLUP_SCHEMA.remove(0))
        name = f"rollup-{len(files):05d}.parquet"
        write_parquet_atomic(file_table(table, m), folder / name, staging=run_dir)
        files.append(FileEntry(name="", rows=0, rollup=name))
        total += table.num_rows
    m = Manifest(**{**m.__dict__, "files": tuple(files)})
    m.write(run_dir)
    return m, total


def timed(store: TraceStore, req: PlanRequest) -> dict[str, object]:
    t = time.perf_counter()
    rep = make_report(store, req)
    return {"policy": rep.policy, "forecast": rep.forecast, "seconds_total": time.perf_counter() - t,
            "seconds": rep.seconds, "history_windows": rep.history_windows,
            "held_out_balancedness_even": None if rep.held is None else rep.held.balancedness_even}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=float, default=1e9, help="token-layer rows the rollups stand for")
    ap.add_argument("--tokens-per-s", type=int, default=20_000)
    ap.add_argument("--out", default="bench/results/eplb_rollup_scale.json")
    ap.add_argument("--smoke", action="store_true", help="16 one-second windows of 100 tokens, nothing written")
    args = ap.parse_args(argv)
    if args.smoke:
        args.rows, args.tokens_per_s, args.out = len(V3_MOE) * 16 * 100, 100, ""
    root = Path(tempfile.mkdtemp(prefix="eplb-rollup-"))
    try:
        t = time.perf_counter()
        m, rollup_rows = write_rollup_run(root, args.rows, args.tokens_per_s)
        write_s = time.perf_counter() - t
        size = sum(p.stat().st_size for p in (root / "rollups").rglob("*.parquet"))
        store = TraceStore(root)
        cluster = Cluster(32, 4, 288, num_groups=8, node_limit=4)
        from r3trace.eplb.window import WindowSpec
        windows = -(-int(args.rows / len(V3_MOE)) // args.tokens_per_s)
        train = WindowSpec("time", None, float(windows - windows // 8))  # the last eighth held out
        runs = {name: timed(store, PlanRequest(cluster, policy, None, train, None, "billion"))  # type: ignore[arg-type]
                for name, policy in (("ours", "ours"), ("global", "global"), ("auto", "auto"))}
        doc = {"route_rows": args.rows, "tokens": int(args.rows / len(V3_MOE)), "tokens_per_s": args.tokens_per_s,
               "rollup_windows": windows, "rollup_rows": rollup_rows, "rollup_bytes": size,
               "write_seconds": write_s, "cluster": cluster.__dict__, "plans": runs,
               "routes_bytes_estimate": int(args.rows * K),  # ~1 byte per expert id under zstd (bench/analysis.py)
               "cpu": "2-core shared CI machine"}
        if args.out:
            Path(args.out).write_text(json.dumps(doc, indent=1))
        print(json.dumps(doc, indent=1))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
