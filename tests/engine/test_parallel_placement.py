"""Expert placement through the Engine: redundant experts, static and dynamic dispatch, a rebalance while requests
run, and the physical ids returned, each against a one-process exact Engine (identical greedy tokens, bitwise
logprobs, 0 mismatched route entries).

    TRITON_INTERPRET=1 .venv/bin/pytest -q tests/engine/test_parallel_placement.py
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

# shuffled_placement: the samples/model shape, 5 layers, 32 experts, 8 spares
from bench.multigpu.placement import rebalance_during_stream, shuffled_placement
from r3trace.capture.wire import decode_routed_experts
from r3trace.engine import Engine
from r3trace.engine.expert_placement import read_location
from r3trace.engine.layers.expert_location import ExpertLocation, ExpertLocationError
from r3trace.engine.model_config import ModelConfig
from r3trace.eplb.placement import Cluster, Placement, to_json

MODEL = Path(__file__).resolve().parents[2] / "samples" / "model"
E, REDUNDANT = 32, 8  # the sample model's routed experts; P = 40 slots
GREEDY = {"temperature": 0.0}
NEW = 24  # tokens each request of the rebalance case generates: the update's 4 chunks land well inside them


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4096) for _ in range(rng.randrange(3, 24))] for _ in range(n)]


def run(engine: Engine, ids: list[list[int]], new: int) -> list[dict[str, Any]]:
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": new, **GREEDY}, return_logprob=True,
                          return_routed_experts=True)
    assert isinstance(out, list)
    return out


def assert_exact(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    for g, w in zip(got, want, strict=True):
        assert "error" not in g, g.get("error")
        assert g["output_ids"] == w["output_ids"]
        assert g["meta_info"]["output_token_logprobs"] == w["meta_info"]["output_token_logprobs"]  # bitwise
        gr, wr = decode_routed_experts(g["meta_info"]), decode_routed_experts(w["meta_info"])
        assert gr.shape == wr.shape
        assert int((gr != wr).sum()) == 0, "route entries differ"


@pytest.fixture(scope="module")
def reference() -> Iterator[Engine]:
    with Engine(MODEL, deterministic=True) as engine:
        yield engine


@pytest.fixture(scope="module")
def ep2_static() -> Iterator[Engine]:
    with Engine(MODEL, deterministic=True, tp_size=2, ep_size=2, ep_num_redundant_experts=REDUNDANT,
                capture_physical_ids=True) as engine:
        yield engine


def test_ep2_static_with_redundant_experts_is_exact(reference: Engine, ep2_static: Engine) -> None:
    ids = prompts(6, seed=1)
    assert_exact(run(ep2_static, ids, 12), run(reference, ids, 12))
    held = [s["held"] for s in ep2_static.expert_slots()]
    assert [len(h[0]) for h in held] == [20, 20]  # P / G slots a rank
    assert held[1][0][12:] == list(range(8))  # trivial: slot p holds p % E, slots 32..39 the replicas of 0..7


def test_ep2_dynamic_is_exact(reference: Engine) -> None:
    ids = prompts(6, seed=2)
    with Engine(MODEL, deterministic=True, tp_size=2, ep_size=2, ep_num_redundant_experts=REDUNDANT,
                ep_dispatch_algorithm="dynamic", expert_dispatch_seed=3) as engine:
        assert_exact(run(engine, ids, 12), run(reference, ids, 12))


def test_physical_ids_name_slots_holding_the_recorded_expert(reference: Engine, ep2_static: Engine) -> None:
    ids = prompts(4, seed=3)
    out = run(ep2_static, ids, 8)
    assert_exact(out, run(reference, ids, 8))
    slots = ep2_static.expert_slots()
    phy2log = np.array([sum((s["held"][m] for s in slots), []) for m in range(4)])  # [M, P]
    moe = list(ModelConfig.from_hf(MODEL).moe_layer_ids)
    for result in out:
        logical = decode_routed_experts(result["meta_info"])  # [rows, L, K]
        physical = decode_routed_experts(result["meta_info"], "routed_experts_physical")
        assert physical.shape == logical.shape
        assert (physical[:, 0] == -1).all()  # the dense layer
        for m, layer in enumerate(moe):
            assert (phy2log[m][physical[:, layer]] == logical[:, layer]).all()
    # rank 1's static choice sends experts 0..7 to its own replicas (slots 32..39), so some rows name them
    assert any((decode_routed_experts(r["meta_info"], "routed_experts_physical") >= E).any() for r in out)


def test_rebalance_while_requests_run_keeps_them_exact(
    reference: Engine, ep2_static: Engine, tmp_path: Path
) -> None:
    ids = prompts(4, seed=4)
    want = run(reference, ids, NEW)
    base = reference.expert_slots()[0]  # one process: slot e is expert e
    before = ep2_static.expert_slots()
    path = tmp_path / "placement.json"
    path.write_text(json.dumps({"physical_to_logical_map": shuffled_placement(5).tolist()}))

    rb = rebalance_during_stream(ep2_static, ids, path, sampling_params={"max_new_tokens": NEW, **GREEDY},
                                 return_logprob=True, return_routed_experts=True)
    chunks, done, after_update = rb.chunks, rb.update, rb.chunks_after_update
    assert done["chunks"] == 4 and sum(done["slots_copied"]) > 0
    assert after_update > 0, "the requests finished before the rebalance did"
    assert_exact(rb.results, want[:3])
    tokens = [t for c in chunks for t in c["output_ids"]]
    logprobs = [lp for c in chunks for lp in c["meta_info"]["output_token_logprobs"]]
    assert tokens == want[3]["output_ids"] and logprobs == want[3]["meta_info"]["output_token_logprobs"]

    after = ep2_static.expert_slots()
    moved = [(r, m, j) for r in range(2) for m in range(4) for j in range(20)
             if after[r]["held"][m][j] != before[r]["held"][m][j]]
    assert moved
    for r, m, j in moved:  # the slot's weights are now those of the expert the map says it holds
        assert after[r]["w13_sum"][m][j] == base["w13_sum"][m][after[r]["held"][m][j]]
        assert after[r]["w2_sum"][m][j] == base["w2_sum"][m][after[r]["held"][m][j]]
    # and the engine goes on exactly under the new placement
    assert_exact(run(ep2_static, ids[:2], 6), run(reference, ids[:2], 6))


@pytest.mark.slow
def test_ep4_static_with_redundant_experts_is_exact(reference: Engine) -> None:
    ids = prompts(6, seed=6)
    with Engine(MODEL, deterministic=True, tp_size=4, ep_size=4, ep_num_redundant_experts=REDUNDANT) as engine:
        assert_exact(run(engine, ids, 12), run(reference, ids, 12))


@pytest.mark.parametrize("ep", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_dp2_dynamic_physical_ids_follow_the_dp_rows(reference: Engine, ep: int) -> None:
    """DP attention: with ep 1 the MoE runs over both DP ranks' gathered rows and each DP rank keeps only its own
    (batch.route_rows, which starts past the other rank's rows on DP rank 1); with ep 2 over its own rows."""
    ids = prompts(6, seed=8)
    with Engine(MODEL, deterministic=True, tp_size=2, dp_size=2, ep_size=ep, ep_num_redundant_experts=REDUNDANT,
                ep_dispatch_algorithm="dynamic", capture_physical_ids=True) as engine:
        out = run(engine, ids, 8)
        assert_exact(out, run(reference, ids, 8))
        slots = engine.expert_slots()
    phy2log = np.array([sum((s["held"][m] for s in slots), []) for m in range(4)])  # [M, P]
    moe = list(ModelConfig.from_hf(MODEL).moe_layer_ids)
    for result in out:
        logical = decode_routed_experts(result["meta_info"])
        physical = decode_routed_experts(result["meta_info"], "routed_experts_physical")
        for m, layer in enumerate(moe):
            assert (phy2log[m][physical[:, layer]] == logical[:, layer]).all()


def test_placement_sources_and_their_errors(tmp_path: Path) -> None:
    mc = ModelConfig.from_hf(MODEL)
    phy = shuffled_placement(7)
    sglang = tmp_path / "sglang.json"
    sglang.write_text(json.dumps({"physical_to_logical_map": phy.tolist()}))
    loc = read_location(str(sglang), mc, 2)
    assert loc.num_physical == E + REDUNDANT and torch.equal(loc.physical_to_logical, torch.as_tensor(phy[1:]))
    pt = tmp_path / "sglang.pt"
    torch.save({"physical_to_logical_map": torch.as_tensor(phy)}, pt)
    assert read_location(str(pt), mc, 2).same_as(loc)
    not_even = r"^source='.*sglang.json': .*P=40 slots, not a multiple of ep_size=3"
    with pytest.raises(ExpertLocationError, match=not_even):
        read_location(str(sglang), mc, 3)
    eplb = tmp_path / "eplb.json"  # what `r3trace eplb --out` writes: rows over the MoE layers, G in the cluster
    eplb.write_text(to_json(Placement(loc.physical_to_logical.numpy(), loc.logical_to_physical.numpy(),
                                      loc.logical_count.numpy()), Cluster(2, 1, E + REDUNDANT, num_groups=4)))
    assert read_location(str(eplb), mc, 2).same_as(loc)
    with pytest.raises(ExpertLocationError, match=r"^source: placement for ep_size=2.*engine runs ep_size=4"):
        read_location(str(eplb), mc, 4)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ExpertLocationError, match=r"^init_expert_location='.*bad.json': unreadable"):
        read_location(str(bad), mc, 2, "init_expert_location")
    assert isinstance(read_location(loc, mc, 2), ExpertLocation)


def test_placement_options_are_checked() -> None:
    from r3trace.engine.engine_config import EngineConfig, EngineConfigError

    with pytest.raises(EngineConfigError, match=r"^ep_num_redundant_experts=-1: must be an integer >= 0$"):
        EngineConfig(ep_num_redundant_experts=-1)
    with pytest.raises(EngineConfigError, match=r"^ep_dispatch_algorithm='random'"):
        EngineConfig(ep_dispatch_algorithm="random")  # type: ignore[arg-type]
    with pytest.raises(EngineConfigError, match="P = 32 \\+ 3 = 35 physical slots is not a multiple of ep_size=2"):
        EngineConfig(ep_num_redundant_experts=3).check_expert_slots(32, 2)
    with pytest.raises(EngineConfigError, match="^ep_num_redundant_experts=3: P = 32 \\+ 3 = 35"):
        Engine(MODEL, tp_size=2, ep_size=2, ep_num_redundant_experts=3)  # refused before any rank starts
    with pytest.raises(ExpertLocationError, match="^init_expert_location='missing.json': unreadable"):
        Engine(MODEL, tp_size=2, ep_size=2, init_expert_location="missing.json")


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    raise SystemExit(pytest.main([__file__, "-q"]))
