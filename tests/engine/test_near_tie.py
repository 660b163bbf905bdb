"""engine/near_tie.py: the gaps that say where another summation order may flip a route, and the flip counts.

Run: .venv/bin/pytest -q tests/engine/test_near_tie.py

A router with hand-set scores gives known gaps (group masking included); on the sample model, lowering the K-th
chosen expert's correction bias by just over its set gap flips the top-K set and by just under it does not (the gap
is the exact distance to a flip); count_flips on arrays with known differences.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from bench.tiny_models import load_engine_model
from r3trace.capture.recorder import ListRecorder
from r3trace.engine.layers.router import Router, make_routing_ops
from r3trace.engine.model_config import ModelConfig
from r3trace.engine.near_tie import FlipCount, count_flips, forward_whole, neighbour_gaps, sequence_gaps

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "model"


def test_neighbour_gaps_of_hand_set_scores() -> None:
    """samples/model's routing: 32 experts in 4 groups of 8, the 2 best groups (top-2 sums) kept, K = 4, sigmoid.
    Logits 0 (score 0.5) plus a bias per expert: choice = 0.5 + bias."""
    cfg = ModelConfig.from_hf(SAMPLE)
    router = Router(cfg, 1, ListRecorder(), make_routing_ops("ref"), "cpu")
    router.weight.zero_()
    bias = torch.zeros(32)
    # groups 0 (3, 5, 6) and 2 (17, 20) win (top-2 sums 1.65, 1.52 against 1.21 for group 3, 1.0 for group 1);
    # expert 30 (0.71) would be 5th without the group mask
    for expert, b in {3: 0.40, 17: 0.30, 5: 0.25, 20: 0.22, 6: 0.10, 30: 0.21}.items():
        bias[expert] = b
    assert router.e_score_correction_bias is not None
    router.e_score_correction_bias.copy_(bias)
    gaps = neighbour_gaps(router, torch.zeros(2, cfg.hidden_size))  # [T, K]: choice 0.9, 0.8, 0.75, 0.72, 0.6
    np.testing.assert_allclose(gaps.numpy(), [[0.10, 0.05, 0.03, 0.12]] * 2, atol=1e-6)


@pytest.mark.parametrize("share", [1.01, 0.99])
def test_the_set_gap_is_the_distance_to_a_flip(share: float) -> None:
    """Lowering the bias of row r's K-th expert at one layer by `share` x its set gap flips its top-K set exactly
    when share > 1 (the row's input to that layer does not change: only later layers see the change)."""
    recorder = ListRecorder()
    model = load_engine_model(SAMPLE, recorder)
    seq = np.random.default_rng(5).integers(2, 4000, 24).tolist()
    layer, k = 2, model.config.num_experts_per_tok
    gaps = sequence_gaps(model, seq, "set")[:, layer]  # [T]
    with torch.inference_mode():
        forward_whole(model, seq, [len(seq) - 1])
    before = recorder.routes[layer][0].numpy().copy()  # [T, K]
    row = int(np.argsort(gaps)[len(gaps) // 2])  # a middling gap: far above fp32 rounding of the choice
    assert gaps[row] > 1e-4
    router = model.decoder_layers()[layer].mlp.gate
    router.e_score_correction_bias[before[row, k - 1]] -= share * float(gaps[row])
    with torch.inference_mode():
        forward_whole(model, seq, [len(seq) - 1])
    after = recorder.routes[layer][0].numpy()
    flipped = set(after[row].tolist()) != set(before[row].tolist())
    assert flipped == (share > 1), (gaps[row], before[row], after[row])


def test_count_flips_counts_ties_flips_and_far_entries() -> None:
    want = np.full((3, 3, 2), -1)  # [T, L, K]: layer 0 dense
    want[:, 1:] = [[1, 2], [3, 4]]
    got = want.copy()
    gaps = np.full((3, 3), 0.5)
    gaps[:, 0] = np.inf
    gaps[0, 1] = gaps[1, 2] = 1e-7  # near-ties
    got[0, 1] = [2, 1]  # order flip at a near-tie
    got[2, 2] = [3, 5]  # a set change away from any near-tie
    got[:, 0] = 7  # a dense layer's entries are never compared
    count = count_flips(want, got, gaps, 1e-5)
    assert count == FlipCount(entries=6, near_ties=2, flips=1, far=1, smallest_gap=1e-7)
    assert count + count == FlipCount(12, 4, 2, 2, 1e-7)
    with pytest.raises(ValueError, match=r"expected \[T, L, K\] twice and \[T, L\]"):
        count_flips(want, got[:2], gaps, 1e-5)
