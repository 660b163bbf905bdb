"""The bundled sample (samples/): model spec, MTP tensors, transformers == engine greedy text, traces.

Run: .venv/bin/pytest -q tests/samples/test_sample_model.py
(SAMPLE_MODEL_DIR=<folder> points it at another checkpoint made by bench/train_sample.py.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from bench.tiny_models import direct_forward, load_engine_model, load_hf
from r3trace.engine.tokenizer import HFTokenizer

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = Path(os.environ.get("SAMPLE_MODEL_DIR", ROOT / "samples" / "model"))
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((MODEL_DIR / "config.json").read_text())


def test_config_meets_the_spec(config: dict) -> None:
    assert config["model_type"] == "deepseek_v3"
    assert config["q_lora_rank"] is not None  # MLA with a compressed query
    assert (config["topk_method"], config["scoring_func"]) == ("noaux_tc", "sigmoid")
    assert config["n_routed_experts"] >= 32 and config["num_experts_per_tok"] >= 4
    assert config["n_group"] >= 2 and config["topk_group"] < config["n_group"]
    assert config["n_shared_experts"] == 1
    assert 1 <= config["first_k_dense_replace"] <= 2 < config["num_hidden_layers"]
    assert config["num_nextn_predict_layers"] == 1
    assert (MODEL_DIR / "model.safetensors").stat().st_size <= 32 * 2**20
    assert (MODEL_DIR / "tokenizer.json").is_file()


def test_mtp_layer_is_stored_as_deepseek_stores_it(config: dict) -> None:
    mtp = f"model.layers.{config['num_hidden_layers']}."
    with safe_open(str(MODEL_DIR / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        dtypes = {f.get_slice(n).get_dtype() for n in names if not n.endswith("e_score_correction_bias")}
        eh_shape = f.get_slice(mtp + "eh_proj.weight").get_shape()
    d = config["hidden_size"]
    for part in ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                 "shared_head.head.weight", "self_attn.q_a_proj.weight", "mlp.gate.weight",
                 "mlp.gate.e_score_correction_bias", "mlp.shared_experts.down_proj.weight",
                 f"mlp.experts.{config['n_routed_experts'] - 1}.down_proj.weight"):
        assert mtp + part in names, f"{mtp + part} missing"
    assert eh_shape == [d, 2 * d]
    assert dtypes == {"BF16"}


def test_transformers_and_engine_continue_a_prompt_identically() -> None:
    tok = HFTokenizer(MODEL_DIR / "tokenizer.json")
    prompt = tok.encode("def read_config(path):\n    with open(path) as f:\n")
    hf = load_hf(MODEL_DIR)  # fp32
    hf_ids = list(prompt)
    with torch.no_grad():  # greedy by hand: generate() would stop at or suppress the EOS id
        for _ in range(NEW_TOKENS):
            hf_ids.append(int(hf(torch.tensor([hf_ids])).logits[0, -1].argmax()))

    model = load_engine_model(MODEL_DIR)  # fp32, ref backends
    ids = list(prompt)
    for _ in range(NEW_TOKENS):
        logits, _ = direct_forward(model, ids)
        ids.append(int(logits[-1].argmax()))
    n = len(prompt)
    assert ids == hf_ids, f"engine {tok.decode(ids[n:])!r} != transformers {tok.decode(hf_ids[n:])!r}"


def test_sample_traces_tag_every_prompt_with_its_domain() -> None:
    import pyarrow.parquet as pq

    from r3trace.trace.reader import open_dataset

    [run] = open_dataset(ROOT / "samples" / "traces")
    manifest = run.manifest
    prompts = [json.loads(line) for line in (ROOT / "samples" / "prompts.jsonl").read_text().splitlines()]
    [requests_file] = run.request_files
    requests = pq.read_table(requests_file).to_pylist()
    assert {r["request_id"]: r["tag"] for r in requests} == {p["id"]: p["domain"] for p in prompts}
    assert manifest.num_experts == 32 and manifest.top_k == 4
    files = [run.run_dir / "manifest.json", *run.route_files, *run.rollup_files, *run.request_files]
    assert sum(f.stat().st_size for f in files) <= 10 * 2**20
