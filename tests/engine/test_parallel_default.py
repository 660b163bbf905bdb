"""Default mode (not exact) under tp2 and dp2+ep2 against plain one-process Engine: logprobs within 1e-4, routes
equal away from near-ties, near-tie flips counted.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/engine/test_parallel_default.py -s  (-s: the counts)

fp32 on CPU, samples/model. Outside exact mode the layouts sum in other orders (tp2: o_proj, the dense MLP and the
shared experts in two halves, then an all-reduce; dp2+ep2: DeepEP normal mode's per-rank partial combine), so
logits move by ~1e-6 and a route may change only where two gate scores are that close. A (token, layer) is a
near-tie when two neighbours among its top-(K+1) masked choice scores of a one-process forward differ by less than
NEAR_TIE (a set flip needs the K-th / (K+1)-th gap crossed, an order flip the gap between two chosen ones); every
other entry must hold the same ids in the same order. The counts are in the assertion message and printed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.tiny_models import load_engine_model
from r3trace.capture.recorder import ListRecorder
from r3trace.capture.wire import decode_routed_experts
from r3trace.engine import Engine
from r3trace.engine.model import DeepseekForCausalLM
from r3trace.engine.near_tie import FlipCount, count_flips, sequence_gaps

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "model"
OPTIONS: dict[str, Any] = dict(max_running_requests=8, kv_pool_tokens=2048, chunked_prefill_size=16)
LOGPROB_ATOL = 1e-4  # summation order moves fp32 logprobs by ~1e-6; a missing or doubled reduction by ~1
NEAR_TIE = 1e-5  # gate-score gap below which another summation order may swap two experts
PROMPTS = [np.random.default_rng(9).integers(2, 4000, n).tolist() for n in (5, 30, 11, 19, 8, 24)]
KW: dict[str, Any] = dict(input_ids=PROMPTS, sampling_params={"temperature": 0, "max_new_tokens": 8,
                          "ignore_eos": True}, return_logprob=True, logprob_start_len=0, return_routed_experts=True)


@pytest.fixture(scope="module")
def reference() -> list[dict[str, Any]]:
    with Engine(SAMPLE, **OPTIONS) as ref:
        out = ref.generate(**KW)
    assert isinstance(out, list)
    return out


@pytest.fixture(scope="module")
def model() -> DeepseekForCausalLM:
    """The one-process model whose forwards give each (row, layer)'s order gap (engine/near_tie.py)."""
    return load_engine_model(SAMPLE, ListRecorder())


@pytest.mark.parametrize(("tp", "dp", "ep"), [pytest.param(2, 1, 1, id="tp2"), pytest.param(2, 2, 2, id="dp2_ep2")])
def test_default_mode_matches_one_process_away_from_near_ties(
    reference: list[dict[str, Any]], model: DeepseekForCausalLM, tp: int, dp: int, ep: int
) -> None:
    with Engine(SAMPLE, tp_size=tp, dp_size=dp, ep_size=ep, **OPTIONS) as engine:
        got = engine.generate(**KW)
    assert isinstance(got, list)
    count, worst = FlipCount(), 0.0
    for p, w, g in zip(PROMPTS, reference, got, strict=True):
        assert g["output_ids"] == w["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            lw = np.array([x[0] for x in w["meta_info"][key]][1:], dtype=float)  # input: the first is None
            lg = np.array([x[0] for x in g["meta_info"][key]][1:], dtype=float)
            np.testing.assert_allclose(lg, lw, atol=LOGPROB_ATOL, rtol=0, err_msg=key)
            worst = max(worst, float(np.abs(lg - lw).max()))
        a, b = decode_routed_experts(w["meta_info"]), decode_routed_experts(g["meta_info"])
        assert a.shape == b.shape == (len(p) + 7, 5, 4)
        count += count_flips(a, b, sequence_gaps(model, (p + w["output_ids"])[: a.shape[0]]), NEAR_TIE)
    report = (f"tp{tp} dp{dp} ep{ep}: of {count.entries} (token, MoE layer) entries, {count.near_ties} near-ties "
              f"(gap < {NEAR_TIE:g}), {count.flips} of them flipped; {count.far} differ away from near-ties "
              f"(smallest gap {count.smallest_gap:.1e}; logprobs within {worst:.1e})")
    print(report)
    assert count.entries == sum(len(p) + 7 for p in PROMPTS) * 4, report  # every row of the 4 MoE layers compared
    assert count.far == 0, report
