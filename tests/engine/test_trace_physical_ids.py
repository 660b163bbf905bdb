"""A trace of a one-process Engine with capture_physical_ids and redundant experts: the routes' physical_ids are what
meta_info["routed_experts_physical"] returned, row for row (computed and prefix-cache rows), and each names a slot
that holds the logical expert in topk_ids.

    TRITON_INTERPRET=1 .venv/bin/pytest -q tests/engine/test_trace_physical_ids.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import torch

from r3trace.analysis.store import TraceStore
from r3trace.capture.wire import decode_routed_experts
from r3trace.engine import Engine
from r3trace.engine.model_config import ModelConfig

MODEL = Path(__file__).resolve().parents[2] / "samples" / "model"
E, REDUNDANT = 32, 8  # the sample model's routed experts; P = 40 slots


def record(tmp_path: Path, pin: dict[str, int], **parallel: int) -> tuple[np.ndarray, Path, list[dict[str, Any]]]:
    """A trace of two requests, the second hitting the first's prefix, under a shuffled placement with REDUNDANT
    replicas and dynamic dispatch -> (phy2log [num_hidden_layers, P], the store, the two results). pin: generate's
    routed_dp_rank, so that under DP both requests meet the same prefix cache."""
    mc = ModelConfig.from_hf(MODEL)
    g = torch.Generator().manual_seed(11)  # [num_hidden_layers, P]: a shuffle of the E experts + seeded replicas
    phy2log = torch.stack([torch.cat([torch.randperm(E, generator=g), torch.randint(0, E, (REDUNDANT,), generator=g)])
                           for _ in range(mc.num_hidden_layers)]).numpy()
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps({"physical_to_logical_map": phy2log.tolist()}))
    rng = random.Random(3)
    shared = [rng.randrange(4096) for _ in range(12)]
    store = tmp_path / "store"
    with Engine(MODEL, ep_num_redundant_experts=REDUNDANT, init_expert_location=str(placement),
                ep_dispatch_algorithm="dynamic", capture_physical_ids=True, page_size=4, **parallel) as engine:
        engine.start_trace(store, run_id="phys")
        out = [engine.generate(input_ids=shared + tail, sampling_params={"max_new_tokens": 4, "temperature": 0.0},
                               return_routed_experts=True, rid=rid, **pin)
               for rid, tail in (("a", [7]), ("b", [8, 9]))]  # b hits a's prefix: prefix-cache rows
        manifest = engine.stop_trace()
    assert manifest is not None and manifest["with_physical_ids"]
    return phy2log, store, out  # type: ignore[return-value]


def check(phy2log: np.ndarray, store: Path, out: list[dict[str, Any]], dp_rank: int = 0) -> None:
    mc = ModelConfig.from_hf(MODEL)

    con = duckdb.connect()
    moe = list(mc.moe_layer_ids)
    physical_seen = []
    for result in out:
        rid = result["meta_info"]["id"]
        rows = con.execute(
            "SELECT token_pos, layer_id, topk_ids, physical_ids, source, dp_rank FROM read_parquet(?)"
            " WHERE request_id = ? ORDER BY token_pos, layer_id", [f"{store}/routes/**/*.parquet", rid]).fetchall()
        logical = decode_routed_experts(result["meta_info"])  # [rows, L, K]
        physical = decode_routed_experts(result["meta_info"], "routed_experts_physical")
        assert len(rows) == len(logical) * len(moe)
        pos = np.array([r[0] for r in rows])
        layer = np.array([r[1] for r in rows])
        topk = np.array([r[2] for r in rows])  # [rows * M, K]
        phys = np.array([r[3] for r in rows])
        assert np.array_equal(phys, physical[pos, layer])  # the wire's physical ids, row for row
        assert np.array_equal(topk, logical[pos, layer])
        assert np.array_equal(phy2log[layer[:, None], phys], topk)  # each slot holds the recorded expert
        assert {r[5] for r in rows} == {dp_rank}
        if rid == "b":
            assert "prefix_cache" in {r[4] for r in rows}
        physical_seen.append(phys)
    seen = np.concatenate(physical_seen)
    assert (seen >= E).any()  # some pairs went to a redundant replica
    routes = TraceStore(store).query("SELECT physical_ids FROM routes ORDER BY request_id, token_pos, layer_id")
    assert np.array_equal(np.array(routes["physical_ids"].to_list()), seen)  # the store's view has the column


def test_trace_physical_ids_match_the_wire_and_the_placement(tmp_path: Path) -> None:
    check(*record(tmp_path, {}))


def test_dp2_trace_physical_ids_through_the_rank_forwarder(tmp_path: Path) -> None:
    """Two processes (DP attention, one DP rank each): rows reach the front end's writer through
    lockstep.TraceForwarder, pickled, physical_ids a keyword argument."""
    check(*record(tmp_path, {"routed_dp_rank": 1}, tp_size=2, dp_size=2), dp_rank=1)
