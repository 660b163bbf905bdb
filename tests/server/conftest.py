"""One tiny random DeepSeek-V3 checkpoint, one Engine and one live server for the server tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.tiny_models import make_checkpoint
from r3trace.engine import Engine
from r3trace.server import ServerConfig, create_app
from tests.server.live_server import LiveServer

MAX_BODY = 64 * 1024  # small, so the oversized-body case stays cheap


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny_v3"), "v3_noaux_groups", seed=0)


@pytest.fixture(scope="session")
def engine(tiny_model: Path) -> Iterator[Engine]:
    eng = Engine(tiny_model, max_running_requests=64, chunked_prefill_size=256, kv_pool_tokens=8192)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def trace_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("traces")


@pytest.fixture(scope="session")
def server(engine: Engine, trace_root: Path) -> Iterator[LiveServer]:
    cfg = ServerConfig(model_name="tiny-v3", max_body_bytes=MAX_BODY, trace_root=trace_root)
    with LiveServer(create_app(engine, cfg)) as live:
        yield live


@pytest.fixture()
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client



SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "model"


@pytest.fixture(scope="session")
def sample_engine() -> Iterator[Engine]:
    """The bundled sample model (trained weights, a byte-level BPE tokenizer.json): token texts and logprobs that
    mean something, unlike the tiny random checkpoint's byte tokenizer."""
    if not (SAMPLE / "config.json").exists():
        pytest.skip("samples/model is not in this checkout")
    eng = Engine(SAMPLE, max_running_requests=64)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def sample_server(sample_engine: Engine) -> Iterator[LiveServer]:
    with LiveServer(create_app(sample_engine, ServerConfig(model_name="sample"))) as live:
        yield live


@pytest.fixture()
def sample_http(sample_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sample_server.url, timeout=120) as client:
        yield client
