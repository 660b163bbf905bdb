"""`r3trace serve` as a real subprocess on the bundled sample model, and `capture()` against it.

Run: .venv/bin/pytest -q tests/server/test_cli.py
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from bench.spawn import free_port
from r3trace.client import capture
from r3trace.trace import open_dataset, read_token_routes
from tests.health import stop, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "samples" / "model"


@pytest.mark.skipif(not (SAMPLE / "config.json").exists(), reason="samples/model is not in this checkout")
def test_serve_subprocess_and_capture(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "r3trace.cli", "serve", str(SAMPLE), "--port", str(port),
                                 "--trace-root", str(tmp_path / "traces"), "--log-level", "warning",
                                 "--served-model-name", "sample"],
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(f"{url}/health", proc, 120, lambda: log.read_text()[-3000:])
            prompts = [json.loads(line) for line in (ROOT / "samples" / "prompts.jsonl").read_text().splitlines()]
            bodies = [{"text": p["text"][:200], "tag": p["domain"]} for p in prompts[:4]]
            res = capture(url, bodies, out=tmp_path / "store", sampling_params={"max_new_tokens": 8,
                          "temperature": 0}, run_id="cli", concurrency=4, progress=False)
            [run] = open_dataset(tmp_path / "store")
            tr = read_token_routes(run)
            assert tr.topk_ids.shape[0] == res.tokens > 4 * 8 and res.skipped == 0
            assert (tr.topk_ids >= 0).all() and (tr.topk_ids < run.manifest.num_experts).all()
            info = httpx.get(f"{url}/get_model_info").json()
            assert info["moe_layer_ids"] == list(run.manifest.moe_layer_ids)
            metrics = httpx.get(f"{url}/metrics").text
            assert 'endpoint="/generate",status="200"} 4' in metrics
            # --served-model-name, and the checkpoint's path and folder name, are the names OpenAI requests may use
            assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["sample"]
            for model, status in (("sample", 200), (str(SAMPLE), 200), ("model", 200), ("samples/model", 404)):
                r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "a", "max_tokens": 1})
                assert r.status_code == status, (model, r.text)
            assert r.json()["error"]["code"] == "model_not_found"
        finally:
            stop(proc, signal.SIGINT, 30)


def test_serve_engine_flags_reach_engine_config() -> None:
    """`r3trace serve`'s engine flags map onto EngineConfig fields; --cuda-graphs takes auto, off or a list."""
    from r3trace.cli import Parser
    from r3trace.commands import serve
    from r3trace.engine.engine_config import EngineConfig
    from r3trace.errors import UsageError

    p = Parser(prog="r3trace serve")
    serve.add_arguments(p)
    opts = serve.engine_options(p.parse_args(["m", "--backend", "triton", "--device", "cuda", "--dtype", "bfloat16",
                                              "--page-size", "64", "--cuda-graphs", "1,2,4", "--no-overlap"]))
    cfg = EngineConfig(**opts)  # type: ignore[arg-type]
    assert (cfg.attention_backend, cfg.moe_backend, cfg.topk_backend, cfg.norm_backend, cfg.rope_backend) == \
        ("triton",) * 5
    assert (cfg.page_size, cfg.cuda_graph_batch_sizes, cfg.overlap_schedule, cfg.enable_prefix_cache) == \
        (64, (1, 2, 4), False, True)
    defaults = EngineConfig(**serve.engine_options(p.parse_args(["m"])))  # type: ignore[arg-type]
    assert defaults.cuda_graph_batch_sizes is None and defaults.overlap_schedule and defaults.page_size == 1
    assert serve.engine_options(p.parse_args(["m", "--cuda-graphs", "off"]))["cuda_graph_batch_sizes"] == ()
    assert defaults.deterministic is False
    exact_args = p.parse_args(["m", "--enable-deterministic-inference"])
    exact = EngineConfig(**serve.engine_options(exact_args))  # type: ignore[arg-type]
    assert exact.deterministic is True and exact.dispatcher_mode == "low_latency"
    with pytest.raises(UsageError, match="argument --cuda-graphs: 'x2': expected auto, off or a list"):
        p.parse_args(["m", "--cuda-graphs", "x2"])


def test_serve_on_cuda_picks_the_fast_paths_by_itself() -> None:
    """--device cuda alone: the triton backends (hence the CUDA-graph ladder) and 64-slot pages; CPU, exact mode and
    explicit flags keep what they ask for. EngineConfig checks the combination as it would."""
    from r3trace.cli import Parser
    from r3trace.commands import serve
    from r3trace.engine.engine_config import EngineConfig

    p = Parser(prog="r3trace serve")
    serve.add_arguments(p)

    def cfg(*argv: str) -> EngineConfig:
        return EngineConfig(**serve.engine_options(p.parse_args(["m", *argv])))  # type: ignore[arg-type]

    def picked(c: EngineConfig) -> tuple[object, ...]:
        return (c.attention_backend, c.moe_backend, c.topk_backend, c.norm_backend, c.rope_backend, c.page_size)

    cuda = cfg("--device", "cuda")
    assert picked(cuda) == ("triton",) * 5 + (64,) and cuda.cuda_graph_batch_sizes is None and cuda.all_triton
    assert picked(cfg("--device", "cuda:1")) == ("triton",) * 5 + (64,)
    assert picked(cfg()) == ("ref",) * 5 + (1,)  # CPU
    assert picked(cfg("--device", "cuda", "--enable-deterministic-inference")) == ("ref",) * 5 + (1,)
    assert picked(cfg("--device", "cuda", "--backend", "ref")) == ("ref",) * 5 + (1,)
    assert picked(cfg("--device", "cuda", "--page-size", "16")) == ("triton",) * 5 + (16,)
    assert picked(cfg("--backend", "triton", "--page-size", "1")) == ("triton",) * 5 + (1,)


@pytest.mark.skipif(not (SAMPLE / "config.json").exists(), reason="samples/model is not in this checkout")
def test_serve_rejects_a_bad_engine_flag_by_name() -> None:
    """A bad flag stops the server before it binds, naming the field and its limit (no traceback)."""
    proc = subprocess.run([sys.executable, "-m", "r3trace.cli", "serve", str(SAMPLE), "--page-size", "64",
                           "--kv-pool-tokens", "100"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode != 0
    assert "kv_pool_tokens=100 is not a multiple of page_size=64" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
