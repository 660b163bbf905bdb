"""Progress bars of the long commands: on stderr, counting real work (banks drawn, tokens written, files copied,
requests recomputed), forced with `--progress on`, silent by default when stderr is not a terminal.

Run: .venv/bin/pytest -q tests/analysis/test_cli_progress.py
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from r3trace.trace import open_dataset
from tests.analysis.cli_stores import SAMPLES, cli, sample_subset, small_store

EPLB = ("--gpus", "4", "--nodes", "2", "--slots", "16")


def final_bar(stderr: str, desc: str) -> str:
    """The last state tqdm drew for the bar labelled `desc` (tqdm redraws with \\r, closes with \\n)."""
    states = [s for s in re.split(r"[\r\n]", stderr) if s.startswith(f"{desc}:")]
    assert states, stderr
    return states[-1]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_store(tmp_path_factory.mktemp("store"))


def test_synth_counts_banks_and_the_tokens_it_writes(tmp_path: Path) -> None:
    proc = cli("synth", "out", "--tokens", "300", "--seed", "1", "--run-id", "s", "--progress", "on", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    m = open_dataset(tmp_path / "out")[0].manifest
    tokens = m.rows // m.num_moe_layers  # whole forwards: a few more than asked
    assert tokens >= 300
    assert "| 232/232 " in final_bar(proc.stderr, "synth bank")  # 4 domains x 58 MoE layers
    assert "100%" in final_bar(proc.stderr, "synth") and f"| {tokens}/{tokens} " in final_bar(proc.stderr, "synth")


def test_eplb_scan_progress_and_silence_off_a_terminal(store: Path) -> None:
    flags = (*EPLB, "--policy", "ours", "--window-s", "2", "--train", "time=..10")
    quiet = cli("eplb", str(store), *flags, cwd=store)  # auto: stderr is a pipe here: no bar
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    loud = cli("--progress", "on", "eplb", str(store), *flags, cwd=store)
    assert loud.returncode == 0, loud.stderr
    assert loud.stdout == quiet.stdout and "ours + ema forecast: P=16 on 4 GPUs / 2 nodes" in loud.stdout
    assert final_bar(loud.stderr, "heat").startswith("heat: 100%")  # the training window's
    assert final_bar(loud.stderr, "held-out heat").startswith("held-out heat: 100%")


def test_ingest_counts_files_and_tokens(store: Path, tmp_path: Path) -> None:
    [run] = open_dataset(store)
    files = len(run.route_files) + len(run.rollup_files) + len(run.request_files)
    proc = cli("ingest", str(store), "--store", str(tmp_path / "copy"), "--progress", "on", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    copied = [p for t in ("routes", "rollups", "requests") for p in (tmp_path / "copy" / t / "run_id=a").iterdir()]
    assert len(copied) == files > 9  # 9 routes files and their rollups
    assert f"| {files}/{files} " in final_bar(proc.stderr, "ingest native")

    ids = np.argsort(np.random.default_rng(0).random((50, 3, 16)), axis=-1)[..., :4].astype(np.int32)  # distinct
    np.savez(tmp_path / "r.npz", topk_ids=ids)
    proc = cli("ingest", "r.npz", "--store", "np", "--format", "numpy", "--num-hidden-layers", "4", "--first-k-dense",
               "1", "--num-experts", "16", "--top-k", "4", "--num-groups", "4", "--progress", "on", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "| 50/50 " in final_bar(proc.stderr, "ingest numpy") and "150 rows" in proc.stdout


@pytest.mark.skipif(not (SAMPLES / "model" / "config.json").exists(), reason="samples/model is not in this checkout")
def test_replay_check_counts_requests(tmp_path: Path) -> None:
    sub = sample_subset(tmp_path / "sub", n_requests=2)
    m = open_dataset(sub)[0].manifest
    proc = cli("replay-check", str(sub), "--model", str(SAMPLES / "model"), "--progress", "on", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "100%" in final_bar(proc.stderr, "replay-check") and "| 2/2 " in final_bar(proc.stderr, "replay-check")
    # the sample traces were recorded in fp32 by this model: recomputing them flips nothing
    assert f"requests 2  tokens {m.rows // m.num_moe_layers}  tokens with any layer flipped 0.00%" in proc.stdout
