"""`r3trace replay-check`: recomputed routes of a trace, per-layer flip rates and near-tie margins.

Run: .venv/bin/pytest -q tests/capture/test_replay_check.py
"""

from __future__ import annotations

from pathlib import Path

from bench.tiny_models import make_checkpoint
from r3trace.engine import Engine
from r3trace.engine.replay_check import replay_check
from tests.engine.conftest import greedy, random_prompts


def test_replay_check_same_model_zero_flips_other_model_flips(tiny_ckpt: Path, tmp_path: Path) -> None:
    with Engine(tiny_ckpt, trace_dir=str(tmp_path / "trace")) as engine:
        engine.generate(input_ids=random_prompts(4, 5, 20, seed=20), sampling_params=greedy(6))
        engine.stop_trace()
    same = replay_check(tmp_path / "trace", tiny_ckpt)
    assert same.requests == 4 and same.tokens > 0
    assert same.layer_flip_rate == [0.0, 0.0] and same.token_any_flip_rate == 0.0
    assert same.margin_quantiles["p1"] >= 0 and not same.flipped_margin_quantiles

    other = make_checkpoint(tmp_path / "other", "v3_noaux_groups", seed=99)
    diff = replay_check(tmp_path / "trace", other)
    assert diff.token_any_flip_rate > 0.5  # another model's router disagrees almost everywhere
    assert all(0 < r <= 1 for r in diff.layer_flip_rate)
    assert diff.flipped_margin_quantiles["count"] > 0
