"""A small store for the dashboard tests: a synthetic V3-shaped run ("base") and a copy of it ("flip")
in which a known set of tokens has one expert changed at one layer, so every number is known. For the
browser tests, one headless chromium and one `r3trace dashboard` process on that store serve the session."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

from r3trace.analysis.synth import SynthConfig, write_synth
from r3trace.trace import TraceWriter, open_dataset, read_token_routes
from tests.dashboard.browser import CHROMIUM, Browser
from tests.dashboard.server import Dashboard

CFG = SynthConfig(num_hidden_layers=5, first_k_dense=1, num_experts=16, top_k=4, num_groups=4, topk_group=2,
                  bank_size=128, prompt_len=(4, 12), completion_len=(4, 12), max_running=8, forward_ms=40.0,
                  seed=3)
TOKENS = 1200
FLIP_EVERY = 7  # every 7th token gets one expert replaced at its first MoE layer


class Store(NamedTuple):
    path: Path
    tokens: int
    flipped: int  # tokens that differ between the two runs


@pytest.fixture(scope="session")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    root = tmp_path_factory.mktemp("store")
    write_synth(root, CFG, TOKENS, run_id="base", progress=False)
    [run] = open_dataset(root)
    tr = read_token_routes(run)
    ids = tr.topk_ids.copy()
    flip = np.arange(0, len(ids), FLIP_EVERY)
    for t in flip:  # swap in the first expert not already chosen: the set changes, K stays distinct
        free = np.setdiff1d(np.arange(CFG.num_experts), ids[t, 0])
        ids[t, 0, -1] = free[0]
    m = run.manifest
    with TraceWriter(root, model_name=m.model_name, num_hidden_layers=m.num_hidden_layers,
                     moe_layer_ids=m.moe_layer_ids, num_experts=m.num_experts, top_k=m.top_k, run_id="flip",
                     num_groups=m.num_groups) as w:
        phases = np.array(["prefill", "decode", "verify"])[tr.phase]
        t0 = np.datetime64("2026-01-01T00:00:00", "ns").astype(np.int64)  # synth's clock: same windows
        ts = t0 + tr.forward_id * int(CFG.forward_ms * 1e6)
        w.append_tokens(tr.request_id, tr.token_pos, phases, "computed", tr.forward_id, ts, 0, ids)
    return Store(root, len(ids), len(flip))


ENSURE = Path(__file__).with_name("ensure_chromium.sh")


@pytest.fixture(scope="session")
def chromium() -> Path:
    """Debian's chromium, installed by ensure_chromium.sh when missing; the test skips, saying why, if it can't."""
    if not CHROMIUM.exists():
        subprocess.run(["bash", str(ENSURE)], check=False, timeout=600)
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} missing and {ENSURE.name} could not install it (needs root and apt-get)")
    return CHROMIUM


SQL_TIMEOUT_S = 45  # the `dashboard` fixture's --sql-timeout-s


@pytest.fixture(scope="session")
def browser(chromium: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    b = Browser(tmp_path_factory.mktemp("profile"))
    b.call("Page.enable")
    try:
        yield b
    finally:
        b.close()


@pytest.fixture(scope="session")
def dashboard(store: Store, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dashboard]:
    """`r3trace dashboard STORE --sql-timeout-s 45` on the synthetic store."""
    d = Dashboard(store.path, tmp_path_factory.mktemp("dashboard") / "dashboard.log",
                  "--sql-timeout-s", str(SQL_TIMEOUT_S))
    try:
        d.wait_healthy()
        yield d
    finally:
        d.stop()
