"""Shared engine-test fixtures: one tiny random DeepSeek-V3 checkpoint per session, and Engine factories.

The checkpoint is written once by transformers' save_pretrained (bench/tiny_models.py); engines are
cheap to build from it (about 0.1 s), so each test builds the configuration it needs.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.tiny_models import make_checkpoint
from r3trace.engine import Engine

VOCAB = 320  # bench/tiny_models.py _BASE vocab_size
EOS = 1  # bench/tiny_models.py _BASE eos_token_id

EngineFactory = Callable[..., Engine]


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """v3 with noaux_tc groups: the DeepSeek-V3 routing path, 3 layers, 8 experts, vocab 320."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "v3", "v3_noaux_groups", seed=3)


@pytest.fixture
def make_engine(tiny_ckpt: Path) -> Iterator[EngineFactory]:
    """Engine(tiny_ckpt, **options); every engine built is shut down after the test."""
    engines: list[Engine] = []

    def factory(**options: Any) -> Engine:
        engines.append(Engine(tiny_ckpt, **options))
        return engines[-1]

    yield factory
    for e in engines:
        e.shutdown()


def random_prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """n prompts of lo..hi token ids, avoiding EOS so that prompts never contain a stop token."""
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def greedy(max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True, **extra}


def assert_pool_whole(engine: Engine) -> None:
    """Every KV page and request row is free again once the prefix cache is flushed."""
    assert engine.flush_cache()
    assert engine.kv_pool.num_free_pages == engine.kv_pool.num_pages
    assert engine.scheduler.req_pool.num_free_rows == engine.config.max_running_requests
    if engine.cache is not None:
        assert engine.cache.evictable_tokens == 0 and engine.cache.locked_tokens == 0
