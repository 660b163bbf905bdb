"""bench/collective_model.py's formula against the bytes real gloo ranks hand to torch.distributed.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/engine/test_collective_bytes.py

A tiny checkpoint, two rank processes, a prefill of 64 tokens and a decode step of 8 per DP rank; every collective
call of every layer and rank (op, group, sent / received / wire bytes, call order) must equal collective_bytes, the
normal-mode all-to-alls fed the routes the dispatcher really got.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.collective_bytes import compare, measure
from bench.collective_model import Layout, Shape, collective_bytes, reach_probability, worst_reach
from bench.tiny_models import make_checkpoint
from r3trace.engine.model_config import ModelConfig


@pytest.mark.parametrize(("tp", "dp", "ep", "options"), [(2, 2, 1, {}), (2, 1, 2, {"deepep_mode": "normal"})],
                         ids=["dp2", "ep2"])  # fmt: skip
def test_measured_equals_computed(tp: int, dp: int, ep: int, options: dict[str, str], tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "m", "v3_noaux_groups", seed=3)
    ranks = measure(tp, dp, ep, options, ckpt, tmp_path / "ranks")
    result = compare(ModelConfig.from_hf(ckpt), tp, dp, ep, options, ranks)
    assert result["match"], result["mismatches"]
    moe = result["steps"]["decode"]["moe"]
    assert moe and all(row["measured_mean"] is not None for row in moe)  # every computed call was seen


def test_formula_by_hand() -> None:
    """dp2 decode, D 48, fp32, 8 tokens a DP rank: the gather of [8, 48] rows, then the TP all-reduce of [16, 48]."""
    shape = Shape(hidden=48, vocab=320, experts=8, top_k=3, n_group=4, topk_group=2)
    moe = collective_bytes(shape, Layout(2, 2), 8, "max", 4).moe
    assert [(c.op, c.group, c.sent, c.received, c.wire) for c in moe] == [
        ("all_gather", "dp", 1536, 3072, 1536), ("all_reduce", "tp", 3072, 3072, 3072.0)]  # fmt: skip
    exact = collective_bytes(shape, Layout(2, 2), 8, "sum", 4, exact=True).moe  # every all-reduce an all-gather
    assert [(c.op, c.sent, c.received) for c in exact] == [("all_gather", 3072, 6144), ("all_gather", 3072, 6144)]
    # top-3 within 2 of 4 groups of 2 experts, ep 2 (4 experts a rank): P(reach a rank) = 1 - P(all 3 elsewhere);
    # the two groups on one rank (1 of 6 group pairs): the other rank unreached; else 1 - C(2, 3) / C(4, 3) = 1
    assert reach_probability(shape, 2) == pytest.approx(1 - 2 / 6 / 2)
    assert worst_reach(shape, 2) == 2
