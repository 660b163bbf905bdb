"""Ingest: responses JSON lines, malformed input, expert-distribution dumps, npz, native.
Run: .venv/bin/pytest tests/analysis/test_ingest.py -q"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pybase64
import pytest
import torch

from r3trace.analysis.ingest import (
    IngestError,
    ModelShape,
    ingest_native,
    ingest_responses,
)
from r3trace.analysis.ingest_dump import ingest_expert_distribution
from r3trace.analysis.ingest_numpy import ingest_numpy
from r3trace.analysis.store import TraceStore

SHAPE = ModelShape(num_hidden_layers=4, moe_layer_ids=(1, 2, 3), num_experts=16, top_k=2)


def b64(a: np.ndarray) -> str:
    return pybase64.b64encode(a.astype("<i4").tobytes()).decode()


def response(rng: np.random.Generator, rid: str, rows: int, dense_fill: int) -> tuple[dict, np.ndarray]:
    full = np.argsort(rng.random((rows, 4, 16)), axis=-1)[..., :2].astype(np.int32)  # K distinct experts a layer
    full[:, 0] = dense_fill  # layer 0 dense: SGLang writes 0, we write -1
    meta = {"id": rid, "routed_experts": b64(full), "prompt_tokens": 3, "completion_tokens": rows - 2,
            "finish_reason": {"type": "length"}}
    return {"text": "x", "meta_info": meta}, full[:, 1:]


def test_responses_roundtrip(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    a, ida = response(rng, "ra", 5, 0)
    b, idb = response(rng, "rb", 7, -1)
    src = tmp_path / "resp.jsonl"
    src.write_text(json.dumps(a) + "\n\n" + json.dumps({"id": "x", "choices": [b]}) + "\n")
    store = tmp_path / "store"
    m = ingest_responses(src, store, SHAPE, run_id="resp")
    assert m.rows == (5 + 7) * 3
    s = TraceStore(store)
    got = s.query("select request_id, token_pos, layer_id, topk_ids, phase from routes order by all")
    ra = got.filter(got["request_id"] == "ra")
    assert np.array_equal(np.stack(ra["topk_ids"].to_list()).reshape(5, 3, 2), ida)
    assert ra.filter(ra["token_pos"] < 3)["phase"].unique().to_list() == ["prefill"]
    assert s.query("select finish_reason from requests where request_id = 'rb'").item() == "length"


@pytest.mark.parametrize("bad,message", [
    ("not json", r"resp.jsonl:2: not JSON"),
    (json.dumps({"meta_info": {"routed_experts": "!!!"}}), r"resp.jsonl:2: field meta_info.routed_experts is not"),
    (json.dumps({"meta_info": {"routed_experts": b64(np.zeros(5))}}), r"resp.jsonl:2: .* 5 ids, not a multiple"),
    (json.dumps({"meta_info": {"routed_experts": b64(np.r_[0, 0, np.full(6, 16)])}}),
     r"resp.jsonl:2: .* holds id 16 .* 0..15"),
    (json.dumps({"meta_info": {"routed_experts": b64(np.full(8, 3))}}),
     r"resp.jsonl:2: field meta_info.routed_experts holds expert ids on layer 0, which the model layout"),
    (json.dumps({"meta_info": {}}), r"resp.jsonl:2: field meta_info.routed_experts missing"),
])
def test_malformed_line_names_line_and_field_and_leaves_nothing(tmp_path: Path, bad: str, message: str) -> None:
    rng = np.random.default_rng(2)
    good, _ = response(rng, "ok", 4, 0)
    src = tmp_path / "resp.jsonl"
    src.write_text(json.dumps(good) + "\n" + bad + "\n")
    store = tmp_path / "store"
    store.mkdir()
    with pytest.raises(IngestError, match=message):
        ingest_responses(src, store, SHAPE, run_id="r")
    assert list(store.iterdir()) == []  # no run folder, no staging folder


def test_expert_distribution_numpy_and_native(tmp_path: Path, tiny_trace: dict) -> None:
    rng = np.random.default_rng(3)
    counts = torch.from_numpy(rng.integers(0, 100, (2, 4, 16)))  # per-pass dump over all 4 layers
    torch.save({"logical_count": counts}, tmp_path / "dump.pt")
    store = tmp_path / "store"
    ingest_expert_distribution(tmp_path / "dump.pt", store, SHAPE, run_id="heat")
    s = TraceStore(store)
    got = s.query("select layer_id, expert_id, count from rollups order by all")
    want = counts.sum(0).numpy()[1:]
    for lid, e, c in got.iter_rows():
        assert c == want[lid - 1, e]
    assert got["count"].sum() == want.sum()
    ids = np.argsort(rng.random((9, 3, 16)), axis=-1)[..., :2]  # 2 distinct experts a layer
    np.savez(tmp_path / "a.npz", topk_ids=ids)
    assert ingest_numpy(tmp_path / "a.npz", store, SHAPE, run_id="np").rows == 27
    assert ingest_native(tiny_trace["root"], store) == ["a"]
    assert sorted(r.manifest.run_id for r in TraceStore(store).runs) == ["a", "heat", "np"]
    with pytest.raises(IngestError, match="already exists"):
        ingest_native(tiny_trace["root"], store)


def test_numpy_top_k_repeating_an_expert_is_refused_and_nothing_lands(tmp_path: Path) -> None:
    """A router picks K distinct experts: a token whose top-K repeats one is a broken export (here in the second
    16,384-token slice, so the token index counts from the file's start), refused whole (all-or-nothing)."""
    rng = np.random.default_rng(4)
    ids = np.argsort(rng.random((16_390, 3, 16)), axis=-1)[..., :2]  # [T, L, K] distinct per token and layer
    np.savez(tmp_path / "ok.npz", topk_ids=ids)
    store = tmp_path / "store"
    assert ingest_numpy(tmp_path / "ok.npz", store, SHAPE, run_id="ok").rows == ids.shape[0] * 3
    ids[16_388, 1, 1] = ids[16_388, 1, 0]
    np.savez(tmp_path / "bad.npz", topk_ids=ids)
    with pytest.raises(IngestError, match=rf"repeats expert {ids[16_388, 1, 0]} in token 16388's top-2 on MoE "
                                          r"layer 1 \(of 3; model layer 2\)"):
        ingest_numpy(tmp_path / "bad.npz", store, SHAPE, run_id="bad")
    assert [r.manifest.run_id for r in TraceStore(store).runs] == ["ok"]
