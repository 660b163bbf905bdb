"""Speculative decoding fixtures: tiny random checkpoints with an MTP layer (one per session) and an Engine factory.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q -m "not gpu and not slow" tests/spec
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from r3trace.engine import Engine
from tests.engine.conftest import EngineFactory
from tests.spec.mtp_checkpoint import make_mtp_checkpoint

VOCAB = 64
EOS = 1  # bench/tiny_models.py _BASE eos_token_id


@pytest.fixture(scope="session")
def mtp_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """v3 noaux_tc groups, 2 layers (dense, MoE: 8 experts, top-3), vocab 64, an MTP layer at model.layers.2 whose
    drafts the target accepts about half the time (tests/spec/mtp_checkpoint.py)."""
    return make_mtp_checkpoint(tmp_path_factory.mktemp("mtp") / "v3", seed=3, vocab_size=VOCAB, noise=0.5)


@pytest.fixture
def make_spec_engine(mtp_ckpt: Path) -> Iterator[EngineFactory]:
    """Engine(mtp_ckpt, **options); every engine built is shut down after the test."""
    engines: list[Engine] = []

    def factory(**options: Any) -> Engine:
        engines.append(Engine(options.pop("model", mtp_ckpt), **options))
        return engines[-1]

    yield factory
    for e in engines:
        e.shutdown()
