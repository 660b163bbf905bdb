"""CLI commands end to end and the trace-replay simulator.
Run: .venv/bin/python -m pytest tests/analysis/test_cli_replay.py -q"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from r3trace.analysis.synth import SynthConfig, write_synth
from r3trace.cli import COMMANDS, build_parser, main
from r3trace.eplb import Cluster, global_policy, plan
from r3trace.eplb.replay import ReplayConfig, replay
from r3trace.eplb.score import heat_of
from r3trace.trace import open_dataset, read_token_routes

SMALL = SynthConfig(num_hidden_layers=6, first_k_dense=1, num_experts=32, top_k=4, num_groups=8, topk_group=2,
                    bank_size=256, prompt_len=(8, 16), completion_len=(4, 8), max_running=8)


def test_cli_synth_stats_sql_eplb_diff(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert {n for n, _ in COMMANDS} >= {"sql", "stats", "eplb", "diff", "synth", "ingest"}
    build_parser()
    out = tmp_path / "t"
    assert main(["synth", str(out), "--tokens", "500", "--run-id", "s", "--seed", "1"]) == 0
    rows = open_dataset(out)[0].manifest.rows
    assert main(["sql", "select count(*) as n from routes", "--store", str(out), "--format", "csv"]) == 0
    assert capsys.readouterr().out.strip().endswith(str(rows))
    assert main(["sql", f"copy (select 1) to '{out}/x.csv'", "--store", str(out)]) == 2  # read-only: refused
    assert "statement type COPY refused" in capsys.readouterr().err and not (out / "x.csv").exists()
    assert main(["stats", str(out)]) == 0
    assert main(["eplb", str(out), "--gpus", "32", "--nodes", "4", "--slots", "288",
                 "--sglang", str(tmp_path / "p.json")]) == 0
    p2l = np.asarray(json.loads((tmp_path / "p.json").read_text())["physical_to_logical_map"])
    assert p2l.shape == (58, 288) and len(np.unique(p2l[0])) == 256
    assert main(["diff", str(out / "run_id=s"), str(out / "run_id=s")]) == 0
    assert "1.0" in capsys.readouterr().out


def test_synth_is_deterministic_by_seed(tmp_path: Path) -> None:
    a = read_token_routes(open_dataset(write_synth(tmp_path / "a", SMALL, 300, progress=False).run_dir)[0])
    b = read_token_routes(open_dataset(write_synth(tmp_path / "b", SMALL, 300, progress=False).run_dir)[0])
    assert np.array_equal(a.topk_ids, b.topk_ids) and np.array_equal(a.forward_id, b.forward_id)
    per_group = a.topk_ids // (32 // 8)  # group-limited routing: <= topk_group groups per token-layer
    assert max(len(set(row)) for row in per_group.reshape(-1, 4).tolist()) <= 2


def test_replay_fixed_and_replanning(tmp_path: Path) -> None:
    w = write_synth(tmp_path, SMALL, 2000, progress=False)
    r = read_token_routes(open_dataset(w.run_dir)[0])
    cl = Cluster(8, 4, 40, num_groups=8, node_limit=2)
    fixed = replay(r, cl, 32, placement=global_policy(heat_of(r.topk_ids, 32), cl))
    assert fixed["tokens"].sum() == len(r.forward_id) and fixed["migration_bytes"].sum() == 0
    assert ((fixed["balancedness"] > 0) & (fixed["balancedness"] <= 1)).all()
    cfg = ReplayConfig(window_steps=20, chunk_layers=2, expert_bytes=1)
    planned = replay(r, cl, 32, policy=lambda h, prev, tok: plan(h, cl, prev), cfg=cfg)
    assert planned.height == fixed.height
    assert int(planned["max_nodes"].to_numpy().max()) <= 2  # homes on nodes: 2 groups per token -> at most 2 nodes
    assert planned["migration_bytes"].sum() >= 0
