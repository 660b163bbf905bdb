"""Default mode (not exact) under tp2 and dp2+ep2 against plain one-process Engine: logprobs within 1e-4, routes
equal away from near-ties, near-tie flips counted.

Run: TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/engine/test_parallel_default.py -s  (-s: the counts)

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
import torch

from r3trace.capture.recorder import ListRecorder
from r3trace.capture.wire import decode_routed_experts
from r3trace.engine import Engine
from r3trace.engine.model import DeepseekForCausalLM
from tests.engine.dp_workload import _margin_hooks
from tests.tiny_models import direct_forward, load_engine_model

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
def gaps() -> tuple[DeepseekForCausalLM, dict[int, torch.Tensor]]:
    """A one-process model whose routers leave, per MoE layer, each row's smallest top-(K+1) neighbour gap."""
    model = load_engine_model(SAMPLE, ListRecorder())
    store: dict[int, torch.Tensor] = {}
    _margin_hooks(model, store)
    return model, store


def _gaps(gaps: tuple[DeepseekForCausalLM, dict[int, torch.Tensor]], seq: list[int]) -> np.ndarray:
    """[len(seq), L] each (row, layer)'s smallest top-(K+1) neighbour gap (inf on dense layers)."""
    model, store = gaps
    with torch.inference_mode():
        direct_forward(model, seq)
    out = np.full((len(seq), model.config.num_hidden_layers), np.inf)
    for lid, gap in store.items():
        out[:, lid] = gap.numpy()
    return out


@pytest.mark.parametrize(("tp", "dp", "ep"), [pytest.param(2, 1, 1, id="tp2"), pytest.param(2, 2, 2, id="dp2_ep2")])
def test_default_mode_matches_one_process_away_from_near_ties(
    reference: list[dict[str, Any]], gaps: tuple[DeepseekForCausalLM, dict[int, torch.Tensor]], tp: int, dp: int,
    ep: int,
) -> None:
    with Engine(SAMPLE, tp_size=tp, dp_size=dp, ep_size=ep, **OPTIONS) as engine:
        got = engine.generate(**KW)
    assert isinstance(got, list)
    entries = ties = flips = far = 0
    smallest, worst = float("inf"), 0.0
    for p, w, g in zip(PROMPTS, reference, got, strict=True):
        assert g["output_ids"] == w["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            lw = np.array([x[0] for x in w["meta_info"][key]][1:], dtype=float)  # input: the first is None
            lg = np.array([x[0] for x in g["meta_info"][key]][1:], dtype=float)
            np.testing.assert_allclose(lg, lw, atol=LOGPROB_ATOL, rtol=0, err_msg=key)
            worst = max(worst, float(np.abs(lg - lw).max()))
        a, b = decode_routed_experts(w["meta_info"]), decode_routed_experts(g["meta_info"])
        assert a.shape == b.shape == (len(p) + 7, 5, 4)
        gap = _gaps(gaps, (p + w["output_ids"])[: a.shape[0]])
        smallest, tie = min(smallest, float(gap.min())), gap < NEAR_TIE
        differ = (a != b).any(axis=-1)  # [rows, L]
        entries += int((a[..., 0] >= 0).sum())
        ties, flips, far = ties + int(tie.sum()), flips + int((differ & tie).sum()), far + int((differ & ~tie).sum())
    report = (f"tp{tp} dp{dp} ep{ep}: of {entries} (token, MoE layer) entries, {ties} near-ties (gap < {NEAR_TIE:g}), "
              f"{flips} of them flipped; {far} differ away from near-ties (smallest gap {smallest:.1e}; logprobs "
              f"within {worst:.1e})")
    print(report)
    assert far == 0, report
