"""SGLang's expert-distribution recorder endpoints on `r3trace serve` (r3trace/server/expert_distribution.py): the
calls and answers of python/sglang/srt/entrypoints/http_server.py at sgl-project/sglang commit
02295fe5ac5ccff3e8829800d50450351c56fb53 (GET or POST /start_expert_distribution_record,
/stop_expert_distribution_record, /dump_expert_distribution_record; 200 with a plain-text line), the files its
recorder writes (eplb/expert_distribution.py), counted against the routes the same requests return.

    TRITON_INTERPRET=1 .venv/bin/pytest -q tests/server/test_expert_distribution_http.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from r3trace.analysis.ingest import ModelShape
from r3trace.analysis.ingest_dump import ingest_expert_distribution
from r3trace.capture.wire import decode_routed_experts
from r3trace.engine import Engine
from r3trace.server import ServerConfig, create_app
from tests.server.live_server import LiveServer

MODEL = Path(__file__).resolve().parents[2] / "samples" / "model"
MOE = [1, 2, 3, 4]


def generate(http: httpx.Client, ids: list[int]) -> np.ndarray:
    """One request; its routes' counts per MoE layer [4, 32] (rows of every computed position)."""
    r = http.post("/generate", json={"input_ids": ids, "return_routed_experts": True,
                                     "sampling_params": {"max_new_tokens": 5, "temperature": 0.0}})
    assert r.status_code == 200, r.text
    routes = decode_routed_experts(r.json()["meta_info"])  # [rows, num_hidden_layers, K]
    return np.stack([np.bincount(routes[:, layer].ravel(), minlength=32) for layer in MOE])


def post(http: httpx.Client, what: str, method: str = "POST") -> httpx.Response:
    return http.request(method, f"/{what}_expert_distribution_record")


def counts(path: Path) -> np.ndarray:
    """A stat dump's logical_count summed over its passes, MoE layers [4, 32]."""
    body: dict[str, Any] = torch.load(path, weights_only=True)
    c = body["logical_count"]
    assert c.dtype == torch.int32 and c.shape[1:] == (5, 32) and not c[:, 0].any()
    return c.sum(0).numpy()[MOE]


def test_stat_record_counts_what_the_requests_routed(tmp_path: Path) -> None:
    """start, two requests, stop, dump: one file whose counts are the two responses' routes; a dump while recording
    writes what came since and records on; the refusals: a dump of nothing, a start while /start_trace records,
    /start_trace while the recorder records."""
    out = tmp_path / "dumps"
    cfg = ServerConfig(trace_root=tmp_path / "traces", expert_distribution_dir=out)
    with Engine(MODEL, deterministic=True, enable_prefix_cache=False) as engine, \
            LiveServer(create_app(engine, cfg)) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        r = post(http, "dump")
        assert r.status_code == 409 and "nothing recorded" in r.json()["error"]["message"]
        r = post(http, "start", "GET")
        assert (r.status_code, r.text) == (200, "Start recording the expert distribution.\n")
        want = generate(http, [3, 14, 15, 92, 65]) + generate(http, [2, 7, 18, 28, 18, 28, 45])
        assert http.post("/start_trace", json={"trace_dir": "mine"}).status_code == 409
        assert post(http, "stop").text == "Stop recording the expert distribution.\n"
        r = post(http, "dump")
        assert (r.status_code, r.text) == (200, "Dump expert distribution record.\n")
        [first] = sorted(out.glob("expert_distribution_recorder_*.pt"))
        assert np.array_equal(counts(first), want)
        assert not (tmp_path / "traces" / ".expert-distribution").exists()  # the recording is gone with the dump

        post(http, "start")
        generate(http, [9, 9, 8])
        r = post(http, "dump")  # while recording: what came since the start, then records on
        assert r.status_code == 200
        more = generate(http, [1, 2, 3, 4])
        post(http, "dump")
        third = sorted(set(out.glob("*.pt")) - {first})[-1]
        assert np.array_equal(counts(third), more)
        post(http, "stop")

        assert http.post("/start_trace", json={"trace_dir": "mine"}).status_code == 200
        r = post(http, "start")
        assert r.status_code == 409 and "POST /stop_trace first" in r.json()["error"]["message"]
        http.post("/stop_trace")


def test_per_pass_dump_reads_back_through_the_placement(tmp_path: Path) -> None:
    """An engine with 8 redundant slots and physical ids: the per_pass dump is one file for rank 0 whose slot counts,
    read through its map by `r3trace ingest`, are the requests' logical counts."""
    out = tmp_path / "dumps"
    cfg = ServerConfig(trace_root=tmp_path / "traces", expert_distribution_dir=out, expert_distribution_mode="per_pass")
    with Engine(MODEL, deterministic=True, ep_num_redundant_experts=8, capture_physical_ids=True) as engine, \
            LiveServer(create_app(engine, cfg)) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        post(http, "start")
        want = generate(http, [3, 14, 15, 92, 65])
        assert post(http, "dump").status_code == 200
    [path] = list(out.glob("expert_distribution_recorder_*_0.pt"))
    body = torch.load(path, weights_only=True)
    assert body["last_physical_to_logical_map"].shape == (5, 40) and body["records"]
    shape = ModelShape(num_hidden_layers=5, moe_layer_ids=tuple(MOE), num_experts=32, top_k=4)
    ingest_expert_distribution(path, tmp_path / "store", shape, run_id="back")
    import pyarrow.dataset as ds

    r = ds.dataset(tmp_path / "store" / "rollups" / "run_id=back").to_table().to_pandas()
    got = np.zeros((4, 32), dtype=np.int64)
    np.add.at(got, (r.layer_id.to_numpy() - 1, r.expert_id.to_numpy()), r["count"].to_numpy())
    assert np.array_equal(got, want)


def test_a_failed_dump_keeps_the_recording_and_per_pass_needs_slots(tmp_path: Path) -> None:
    """A dump into a folder it cannot make is a 500 naming the flag, and loses nothing: the next dump writes the
    same counts. per_pass on an engine with a placement but no physical ids is refused at the start."""
    out = tmp_path / "dumps"
    out.write_text("a file where the folder should be")
    cfg = ServerConfig(trace_root=tmp_path / "traces", expert_distribution_dir=out)
    with Engine(MODEL, deterministic=True, ep_num_redundant_experts=8) as engine:
        with LiveServer(create_app(engine, cfg)) as live, httpx.Client(base_url=live.url, timeout=60) as http:
            post(http, "start")
            want = generate(http, [3, 14, 15, 92, 65])
            r = post(http, "dump")
            assert r.status_code == 500 and "check --expert-distribution-recorder-dir" in r.json()["error"]["message"]
            out.unlink()
            assert post(http, "dump").status_code == 200
            [path] = list(out.glob("*.pt"))
            assert np.array_equal(counts(path), want)
        per_pass = ServerConfig(trace_root=tmp_path / "traces", expert_distribution_dir=out,
                                expert_distribution_mode="per_pass")
        with LiveServer(create_app(engine, per_pass)) as live, httpx.Client(base_url=live.url, timeout=60) as http:
            r = post(http, "start")
            assert r.status_code == 400 and "without --capture-physical-ids" in r.json()["error"]["message"]


def test_dp_ranks_each_dump_their_own_tokens(tmp_path: Path) -> None:
    """tp_size=2, dp_size=2, ep_size=2 (two processes; DP attention): per_pass writes one file a dp rank holding only
    that rank's tokens, counted once (not once per TP rank), which ingest reads back to the responses' routes."""
    out = tmp_path / "dumps"
    cfg = ServerConfig(trace_root=tmp_path / "traces", expert_distribution_dir=out, expert_distribution_mode="per_pass")
    with Engine(MODEL, deterministic=True, tp_size=2, dp_size=2, ep_size=2, ep_num_redundant_experts=8,
                capture_physical_ids=True) as engine, \
            LiveServer(create_app(engine, cfg)) as live, httpx.Client(base_url=live.url, timeout=120) as http:
        post(http, "start")
        want = {}
        for rank, ids in ((0, [3, 14, 15, 92, 65]), (1, [2, 7, 18, 28, 18, 28])):
            r = http.post("/generate", json={"input_ids": ids, "return_routed_experts": True, "routed_dp_rank": rank,
                                             "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}})
            assert r.status_code == 200, r.text
            routes = decode_routed_experts(r.json()["meta_info"])
            want[rank] = np.stack([np.bincount(routes[:, layer].ravel(), minlength=32) for layer in MOE])
        assert post(http, "dump").status_code == 200
    shape = ModelShape(num_hidden_layers=5, moe_layer_ids=tuple(MOE), num_experts=32, top_k=4)
    import pyarrow.dataset as ds

    for rank in (0, 1):
        [path] = list(out.glob(f"expert_distribution_recorder_*_{rank}.pt"))
        ingest_expert_distribution(path, tmp_path / "store", shape, run_id=f"r{rank}")
        r = ds.dataset(tmp_path / "store" / "rollups" / f"run_id=r{rank}").to_table().to_pandas()
        got = np.zeros((4, 32), dtype=np.int64)
        np.add.at(got, (r.layer_id.to_numpy() - 1, r.expert_id.to_numpy()), r["count"].to_numpy())
        assert np.array_equal(got, want[rank])


def test_an_earlier_servers_recording_is_kept_aside_not_deleted(tmp_path: Path) -> None:
    """A server stopped (or killed) while recording leaves its trace in .expert-distribution/; the next server moves
    it aside at start-up, where `r3trace export` writes its dump, and records anew without touching it."""
    from r3trace.cli import main
    from r3trace.trace.writer import TraceWriter

    folder = tmp_path / "traces" / ".expert-distribution"
    ids = np.tile(np.arange(4), (3, 4, 1))  # [3 tokens, 4 MoE layers, K = 4]
    with TraceWriter(folder, model_name="m", num_hidden_layers=5, moe_layer_ids=MOE, num_experts=32, top_k=4,
                     run_id="expert-distribution-1", flush_interval_s=None) as w:  # an engine's shutdown closes it
        w.append_tokens("r", np.arange(3), "decode", "computed", np.arange(3), 0, 0, ids)
    cfg = ServerConfig(trace_root=tmp_path / "traces", expert_distribution_dir=tmp_path / "dumps")
    with Engine(MODEL, deterministic=True) as engine, LiveServer(create_app(engine, cfg)) as live, \
            httpx.Client(base_url=live.url, timeout=60) as http:
        [kept] = list((tmp_path / "traces").glob("expert-distribution-left-*"))
        assert not folder.exists()
        post(http, "start")
        generate(http, [3, 14, 15])
        assert post(http, "dump").status_code == 200
    assert main(["export", str(kept), "--out", str(tmp_path / "old")]) == 0
    [path] = list((tmp_path / "old").glob("*.pt"))
    assert counts(path)[:, :4].sum() == 3 * 4 * 4 and (counts(path)[:, :4] == 3).all()
