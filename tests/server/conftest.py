"""One tiny random DeepSeek-V3 checkpoint, one Engine and one live server for the server tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from r3trace.engine import Engine
from r3trace.server import ServerConfig, create_app
from tests.server.live_server import LiveServer
from tests.tiny_models import make_checkpoint

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

