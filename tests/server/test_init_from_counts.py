"""`r3trace serve --init-expert-location DUMP.pt` where the file holds SGLang's `logical_count` (a stat dump, as
/dump_expert_distribution_record writes it): planned as SGLang's ExpertLocationMetadata.init_by_eplb plans it
(python/sglang/srt/eplb/expert_location.py at sgl-project/sglang commit 01fec5c2e61f9568c41a6e1d4fd5ac46c88504f1;
eplb_algorithms/__init__.py at 046f88cb789d7d0e268dce5b7bdbe4ad3252d5ba: weight = logical_count summed over dim 0,
`auto` = deepseek_hierarchical when num_groups % num_nodes == 0, else deepseek), then loaded by the engine: SGLang's
record -> dump -> restart loop, end to end.

    TRITON_INTERPRET=1 .venv/bin/pytest -q tests/server/test_init_from_counts.py
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from r3trace.commands import serve
from r3trace.engine import Engine
from r3trace.engine.model_config import ModelConfig
from r3trace.eplb import deepseek
from r3trace.eplb.placement import Cluster
from r3trace.errors import UsageError
from r3trace.server import ServerConfig, create_app
from tests.server.live_server import LiveServer

MODEL = Path(__file__).resolve().parents[2] / "samples" / "model"
MOE, E, P = [1, 2, 3, 4], 32, 40
LOG = logging.getLogger("test")


def args(*extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return p.parse_args([str(MODEL), "--ep-num-redundant-experts", "8", *extra])


def test_a_recorded_stat_dump_starts_the_next_engine_with_deepseeks_plan(tmp_path: Path) -> None:
    cfg = ServerConfig(trace_root=tmp_path / "traces", expert_distribution_dir=tmp_path / "dumps")
    with Engine(MODEL, deterministic=True) as engine, LiveServer(create_app(engine, cfg)) as live, \
            httpx.Client(base_url=live.url, timeout=60) as http:
        http.post("/start_expert_distribution_record")
        for ids in ([3, 14, 15, 92, 65], [2, 7, 18, 28, 18, 28, 45]):
            http.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 6}})
        assert http.post("/dump_expert_distribution_record").status_code == 200
    [dump] = list((tmp_path / "dumps").glob("*.pt"))
    counts = torch.load(dump, weights_only=True)["logical_count"].numpy().sum(0)  # [5, 32]: init_by_eplb's weight

    path = serve.init_location(args("--init-expert-location", str(dump)), MODEL, LOG, tmp_path)
    assert path is not None and path != str(dump)
    planned = np.array(json.loads(Path(path).read_text())["physical_to_logical_map"])  # [5, 40]
    groups = ModelConfig.from_hf(MODEL).n_group  # the sample model's router groups: they divide over one node
    want = deepseek.hierarchical(counts[MOE], Cluster(1, 1, P, num_groups=groups)).phy2log
    assert np.array_equal(planned[MOE], want) and np.array_equal(planned[0], np.arange(P) % E)
    with Engine(MODEL, deterministic=True, ep_num_redundant_experts=8, init_expert_location=path) as engine:
        held = engine.expert_slots()[0]["held"]
        assert [held[i] for i in range(len(MOE))] == want.tolist()

    flat = serve.init_location(args("--init-expert-location", str(dump), "--eplb-algorithm", "deepseek"), MODEL, LOG,
                                tmp_path)
    assert flat is not None
    glob = deepseek.global_policy(counts[MOE], Cluster(1, 1, P, num_groups=groups)).phy2log
    assert np.array_equal(np.array(json.loads(Path(flat).read_text())["physical_to_logical_map"])[MOE], glob)


def test_a_map_passes_through_and_bad_counts_are_one_line(tmp_path: Path) -> None:
    mapped = tmp_path / "map.json"
    mapped.write_text(json.dumps({"physical_to_logical_map": [[p % E for p in range(P)]] * 5}))
    assert serve.init_location(args("--init-expert-location", str(mapped)), MODEL, LOG, tmp_path) == str(mapped)
    bad = tmp_path / "bad.pt"
    torch.save({"logical_count": torch.zeros(3, 5, 16)}, bad)
    with pytest.raises(UsageError) as e:
        serve.init_location(args("--init-expert-location", str(bad)), MODEL, LOG, tmp_path)
    assert str(e.value) == (f"--init-expert-location {bad}: logical_count is [5, 16]; the model has 5 layers (4 MoE) "
                            "of 32 experts")


def test_the_cli_server_plans_a_dump_and_records_into_the_flagged_folder(tmp_path: Path) -> None:
    """`r3trace serve` as a subprocess with SGLang's flags: --init-expert-location a stat dump (planned before the
    engine loads: GET /expert_placement is DeepSeek's hierarchical plan of its counts) and
    --expert-distribution-recorder-dir (a dump lands there)."""
    import signal
    import subprocess
    import sys

    from bench.spawn import free_port
    from tests.health import stop, wait_healthy

    counts = torch.from_numpy(np.random.default_rng(4).integers(0, 50, (3, 5, E)))
    torch.save({"rank": 0, "logical_count": counts}, tmp_path / "dump.pt")
    port, log = free_port(), tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "r3trace.cli", "serve", str(MODEL), "--port", str(port),
                                 "--log-level", "warning", "--ep-num-redundant-experts", "8", "--init-expert-location",
                                 str(tmp_path / "dump.pt"), "--trace-root", str(tmp_path / "traces"),
                                 "--expert-distribution-recorder-dir", str(tmp_path / "dumps")],
                                stdout=out, stderr=subprocess.STDOUT, cwd=MODEL.parents[1])
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(f"{url}/health", proc, 120, lambda: log.read_text()[-3000:])
            running = np.array(httpx.get(f"{url}/expert_placement").json()["physical_to_logical_map"])
            groups = ModelConfig.from_hf(MODEL).n_group
            want = deepseek.hierarchical(counts.numpy().sum(0)[MOE], Cluster(1, 1, P, num_groups=groups)).phy2log
            assert np.array_equal(running[MOE], want)
            assert httpx.post(f"{url}/start_expert_distribution_record").status_code == 200
            httpx.post(f"{url}/generate", json={"input_ids": [3, 14, 15], "sampling_params": {"max_new_tokens": 2}},
                       timeout=60)
            assert httpx.post(f"{url}/dump_expert_distribution_record", timeout=60).status_code == 200
            assert len(list((tmp_path / "dumps").glob("expert_distribution_recorder_*.pt"))) == 1
        finally:
            stop(proc, signal.SIGINT, 30)
