"""POST /update_expert_placement and GET /expert_placement in front of an engine built with redundant expert slots
(one process, exact mode).

    TRITON_INTERPRET=1 .venv/bin/pytest -q tests/server/test_placement_http.py
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import torch

from r3trace.engine import Engine
from r3trace.engine.placement_control import running_map
from r3trace.eplb.placement import Cluster, from_phy2log, sglang_map
from r3trace.eplb.previous import read_previous
from r3trace.server import ServerConfig, create_app
from tests.server.live_server import LiveServer

MODEL = Path(__file__).resolve().parents[2] / "samples" / "model"


def test_update_expert_placement_over_http(tmp_path: Path) -> None:
    root = tmp_path / "placements"
    root.mkdir()
    g = torch.Generator().manual_seed(11)
    phy = torch.stack([torch.cat([torch.randperm(32, generator=g), torch.randint(0, 32, (8,), generator=g)])
                       for _ in range(5)])  # [num_hidden_layers, P = 40]: SGLang's layout
    (root / "good.json").write_text(json.dumps({"physical_to_logical_map": phy.tolist()}))
    (root / "short.json").write_text(json.dumps({"physical_to_logical_map": phy[:, :36].tolist()}))
    (tmp_path / "outside.json").write_text("{}")
    body = {"input_ids": [3, 14, 15, 92, 65], "sampling_params": {"max_new_tokens": 6, "temperature": 0.0},
            "return_logprob": True}
    with Engine(MODEL, deterministic=True, ep_num_redundant_experts=8) as engine, \
            LiveServer(create_app(engine, ServerConfig(placement_root=root))) as live, \
            httpx.Client(base_url=live.url, timeout=60) as http:
        before = http.post("/generate", json=body).json()
        r = http.post("/update_expert_placement", json={"path": "good.json", "chunk_layers": 2})
        assert r.status_code == 200, r.text
        assert r.json()["chunks"] == 2 and r.json()["slots_copied"][0] > 0
        assert engine.expert_slots()[0]["held"][0] == phy[1].tolist()
        after = http.post("/generate", json=body).json()
        assert after["output_ids"] == before["output_ids"]
        assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
        for path, says in (("../outside.json", "outside the placement root"), ("missing.json", "is not a file"),
                           ("short.json", "P=36 slots")):
            r = http.post("/update_expert_placement", json={"path": path})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "path" and err["message"].startswith("path: ") and says in err["message"]
        assert engine.expert_slots()[0]["held"][0] == phy[1].tolist()  # a refused file changed nothing
        # GET /expert_placement: what runs, as SGLang's file (MoE rows as loaded, the dense row trivial), which
        # `r3trace eplb --previous` reads back as the same placement
        r = http.get("/expert_placement")
        assert r.status_code == 200, r.text
        running = torch.tensor(r.json()["physical_to_logical_map"])
        moe = list(engine.model_config.moe_layer_ids)
        assert moe == [1, 2, 3, 4] and torch.equal(running[moe], phy[moe])
        assert torch.equal(running[0], torch.arange(40) % 32)
        saved = tmp_path / "running.json"
        saved.write_text(r.text)
        pl = read_previous(saved, Cluster(1, 1, 40, num_groups=engine.model_config.n_group), 5, tuple(moe), 32)
        assert torch.equal(torch.from_numpy(pl.phy2log), phy[moe])


def test_serve_flags_reach_the_engine_config() -> None:
    import argparse

    from r3trace.commands import serve
    from r3trace.engine.engine_config import EngineConfig

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args([str(MODEL), "--ep-num-redundant-experts", "8", "--init-expert-location", "p.json",
                              "--ep-dispatch-algorithm", "dynamic", "--expert-dispatch-seed", "3",
                              "--capture-physical-ids", "--placement-root", "plans"])
    cfg = EngineConfig(**serve.engine_options(args))  # type: ignore[arg-type]
    assert (cfg.ep_num_redundant_experts, cfg.init_expert_location, cfg.ep_dispatch_algorithm,
            cfg.expert_dispatch_seed, cfg.capture_physical_ids) == (8, "p.json", "dynamic", 3, True)
    assert args.placement_root == "plans"


def test_running_map_puts_ep_ranks_end_to_end_and_counts_tp_peers_once() -> None:
    """EngineCore.expert_map of 2 EP ranks x 2 attention-TP peers (rank order 0, 1, 2, 3 = ep 0, 0, 1, 1 here given
    out of order) -> EP rank 0's slots then rank 1's; as SGLang's map, dense layer 0 trivial."""
    held = {0: [[0, 1, 2], [3, 2, 1]], 1: [[3, 0, 3], [0, 0, 2]]}  # ep_rank -> per MoE layer its 3 slots
    ranks = [{"ep_rank": ep, "forward_id": 9, "layer_ids": [1, 2], "held": held[ep]} for ep in (1, 0, 1, 0)]
    forward_id, layer_ids, phy2log = running_map(ranks)
    assert (forward_id, layer_ids) == (9, (1, 2))
    assert phy2log.tolist() == [[0, 1, 2, 3, 0, 3], [3, 2, 1, 0, 0, 2]]
    assert sglang_map(from_phy2log(phy2log, 4), 3, layer_ids).tolist() == [
        [0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 3], [3, 2, 1, 0, 0, 2]]
