"""r3trace.client.capture over real HTTP: into a trace that the readers load back row for row.

Two servers: r3trace's own (shape and layer ids in the response), and a stand-in for plain SGLang,
which is not installable here: a FastAPI app that answers /generate with SGLang's flat payload (every
layer, dense ones as 0, no shape) holding the routes of a direct forward; the client then needs a manifest.

Run: .venv/bin/pytest -q tests/server/test_client.py
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
from fastapi import FastAPI

from bench.tiny_models import direct_forward, load_engine_model
from r3trace.capture.wire import encode_int32
from r3trace.client import capture
from r3trace.engine import Engine
from r3trace.trace import Manifest, open_dataset, read_token_routes
from tests.server.live_server import LiveServer

PROMPTS: list[Any] = [[5, 6, 7, 8], [9, 10, 11], {"input_ids": [12, 13, 14, 15, 16], "tag": "code"}]
SP = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}


def sglang_standin(engine: Engine, tiny_model: Path, sent: dict[str, np.ndarray]) -> FastAPI:
    """sent: request id -> the [rows, num_hidden_layers, K] routes it answered with."""
    model = load_engine_model(tiny_model)
    mc = engine.model_config
    app = FastAPI()
    lock = threading.Lock()  # one model and its recorder, shared by FastAPI's worker threads

    @app.post("/generate")
    def generate(body: dict[str, Any]) -> dict[str, Any]:
        out = engine.generate(input_ids=body["input_ids"], sampling_params=body["sampling_params"])
        assert isinstance(out, dict)
        tokens = body["input_ids"] + out["output_ids"]
        with lock, torch.inference_mode():
            _, direct = direct_forward(model, tokens[:-1])
        k = mc.num_experts_per_tok
        routes = np.zeros((len(tokens) - 1, mc.num_hidden_layers, k), np.int32)  # SGLang: dense layers 0
        for layer, ids in direct.items():
            routes[:, layer] = ids.cpu().numpy()
        start = body["routed_experts_start_len"]
        out["meta_info"]["routed_experts"] = encode_int32(routes[start:])
        sent[out["meta_info"]["id"]] = routes[start:]
        return out

    return app


def test_capture_from_plain_sglang_with_manifest(engine: Engine, tiny_model: Path, tmp_path: Path) -> None:
    mc = engine.model_config
    manifest = Manifest(run_id="shape", model_name="tiny", num_hidden_layers=mc.num_hidden_layers,
                        moe_layer_ids=mc.moe_layer_ids, num_experts=mc.n_routed_experts,
                        top_k=mc.num_experts_per_tok)
    sent: dict[str, np.ndarray] = {}
    with LiveServer(sglang_standin(engine, tiny_model, sent)) as s:
        res = capture(s.url, PROMPTS, out=tmp_path, sampling_params=SP, manifest=manifest, run_id="sgl",
                      concurrency=2, progress=False)
    assert res.requests == 3 and res.tokens == (4 + 3 - 1) + (3 + 3 - 1) + (5 + 3 - 1) and res.skipped == 0
    [run] = open_dataset(tmp_path)
    assert run.manifest.moe_layer_ids == mc.moe_layer_ids
    assert run.manifest.rows == res.tokens * len(mc.moe_layer_ids)
    tr = read_token_routes(run)
    assert sorted(np.unique(tr.request_id)) == sorted(sent)
    prompt_lens = {}
    for rid, routes in sent.items():
        sel = tr.request_id == rid
        np.testing.assert_array_equal(tr.topk_ids[sel], routes[:, list(mc.moe_layer_ids)])
        np.testing.assert_array_equal(tr.token_pos[sel], np.arange(len(routes)))
        prompt_lens[rid] = len(routes) + 1 - SP["max_new_tokens"]
        np.testing.assert_array_equal(tr.phase[sel], (np.arange(len(routes)) >= prompt_lens[rid]).astype(int))
    reqs = pq.read_table(run.request_files[0]).to_pylist()
    assert {r["request_id"]: r["prompt_tokens"] for r in reqs} == prompt_lens
    assert sorted(r["tag"] or "" for r in reqs) == ["", "", "code"]


def test_capture_from_r3trace_server(server: LiveServer, engine: Engine, tmp_path: Path) -> None:
    assert engine.flush_cache()  # start from an empty cache so the counts below are this test's alone
    res = capture(server.url, PROMPTS, out=tmp_path, sampling_params=SP, run_id="own", progress=False)
    [run] = open_dataset(tmp_path)
    assert run.manifest.num_experts == engine.model_config.n_routed_experts
    assert read_token_routes(run).topk_ids.shape[0] == res.tokens and res.skipped == 0
