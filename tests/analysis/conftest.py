"""Shared fixtures: small random traces written by the real TraceWriter into tmp_path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from r3trace.trace import TraceWriter

MOE = (1, 2, 4)  # 5 hidden layers, layers 0 and 3 dense
E, K = 16, 4


def random_routes(rng: np.random.Generator, t: int, n_layers: int = len(MOE), e: int = E, k: int = K) -> np.ndarray:
    """[T, L, K] distinct ids per (token, layer), skewed so heat is uneven."""
    p = rng.dirichlet(np.full(e, 0.7), size=n_layers)
    out = np.empty((t, n_layers, k), dtype=np.int32)
    for li in range(n_layers):
        g = -np.log(-np.log(rng.random((t, e))))
        out[:, li] = np.argsort(-(np.log(p[li]) + g), axis=1)[:, :k]
    return out


def write_run(root: Path, run_id: str, ids: np.ndarray, requests: np.ndarray, pos: np.ndarray,
              phase: np.ndarray, fwd: np.ndarray, tags: dict[str, str] | None = None, **kw: object) -> None:
    w = TraceWriter(root, model_name="tiny", num_hidden_layers=5, moe_layer_ids=MOE, num_experts=E, top_k=K,
                    run_id=run_id, **kw)  # type: ignore[arg-type]
    for f in np.unique(fwd):
        m = fwd == f
        w.append_tokens(requests[m], pos[m], phase[m], "computed", fwd[m], 1_000_000_000 * f, 0, ids[m])
    for r, tag in (tags or {}).items():
        w.add_request(r, tag=tag)
    w.close()


@pytest.fixture
def tiny_trace(tmp_path: Path) -> dict[str, object]:
    """One run 'a': 6 requests x 40 tokens, 2 tags; forwards of 1 token per request (prefill = pos < 10)."""
    rng = np.random.default_rng(16)
    n_req, n_pos = 6, 40
    req = np.repeat([f"q{i}" for i in range(n_req)], n_pos)
    pos = np.tile(np.arange(n_pos), n_req)
    order = np.lexsort((req, pos))  # forward f holds position f of every request
    req, pos = req[order], pos[order]
    fwd = pos.astype(np.int64)
    phase = np.where(pos < 10, "prefill", "decode")
    ids = random_routes(rng, len(req))
    tags = {f"q{i}": ("math" if i % 2 else "code") for i in range(n_req)}
    write_run(tmp_path, "a", ids, req, pos, phase, fwd, tags, rows_per_file=200, rollup_window_s=1.0)
    return {"root": tmp_path, "ids": ids, "req": req, "pos": pos, "phase": phase, "fwd": fwd, "tags": tags}
