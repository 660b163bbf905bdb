"""Engine(tp_size=2): two spawned rank processes behind the one-process API, against Engine() on the sample.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/engine/test_launch.py

Real processes (torch.multiprocessing spawn, gloo on CPU), fp32, the bundled sample model (samples/model: 5
layers, 4 of them MoE, 32 experts, top-4). Tensor parallelism sums o_proj's, the dense MLP's and the shared
experts' products in two halves (tests/engine/test_tensor_parallel.py: logits within ~2e-6), so a route may
flip only where two gate scores are within such a difference: those near-ties are counted, and every other
(row, layer) must hold the same expert ids in the same order. On the batch here (torch 2.13 CPU): no gap under
1e-5, the smallest 3.0e-5, so every route must match.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pytest
import torch

from bench.tiny_models import direct_forward, load_engine_model
from r3trace.capture.recorder import ListRecorder
from r3trace.capture.wire import decode_routed_experts
from r3trace.engine import Engine
from r3trace.engine.near_tie import gap_hooks

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "model"
OPTIONS: dict[str, Any] = dict(max_running_requests=8, kv_pool_tokens=2048, chunked_prefill_size=64)
LOGPROB_ATOL = 1e-4  # fp32 logits differ by ~1e-6 under TP (summation order); a missing reduction is off by ~1
NEAR_TIE = 1e-5  # gate-score gap below which a TP-order rounding difference may swap two experts
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 4000, int(rng.integers(5, 24))).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[Engine, Engine]]:
    ref = Engine(SAMPLE, **OPTIONS)
    try:
        tp2 = Engine(SAMPLE, tp_size=2, **OPTIONS)
        try:
            yield ref, tp2
        finally:
            tp2.shutdown()
    finally:
        ref.shutdown()


def _margins(seq: list[int]) -> dict[int, np.ndarray]:
    """Per MoE layer, [len(seq)] gap between the K-th and (K+1)-th gate score of a one-process forward."""
    model = load_engine_model(SAMPLE, ListRecorder())
    store: dict[int, torch.Tensor] = {}
    hooks = gap_hooks(model, store, "set")
    try:
        with torch.inference_mode():
            direct_forward(model, seq)
    finally:
        for h in hooks:
            h.remove()
    return {lid: m.numpy() for lid, m in store.items()}


def _compare_routes(prompt: list[int], ref: dict[str, Any], got: dict[str, Any]) -> tuple[int, int, float]:
    """Asserts equal routes away from near-ties; -> (near-tie (row, layer) entries, flips among them, the
    smallest gap seen)."""
    a, b = decode_routed_experts(ref["meta_info"]), decode_routed_experts(got["meta_info"])
    assert a.shape == b.shape, (a.shape, b.shape)
    seq = prompt + ref["output_ids"]
    margins = _margins(seq[: a.shape[0]])
    ties = flips = 0
    smallest = min(float(m.min()) for m in margins.values())
    for lid, m in margins.items():
        tie = m < NEAR_TIE
        differ = (a[:, lid] != b[:, lid]).any(axis=1)
        assert not (differ & ~tie).any(), f"layer {lid}: rows {np.flatnonzero(differ & ~tie)} differ, no near-tie"
        ties += int(tie.sum())
        flips += int((differ & tie).sum())
    return ties, flips, smallest


def test_tp2_batch_matches_one_process(engines: tuple[Engine, Engine]) -> None:
    ref, tp2 = engines
    prompts = _prompts(5, seed=1)
    kw: dict[str, Any] = dict(input_ids=prompts, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=2,
                              logprob_start_len=0, return_routed_experts=True)
    want, got = ref.generate(**kw), tp2.generate(**kw)
    assert isinstance(want, list) and isinstance(got, list)
    ties = flips = 0
    smallest = float("inf")
    for p, w, g in zip(prompts, want, got, strict=True):
        assert g["output_ids"] == w["output_ids"] and g["text"] == w["text"]
        assert sorted(g["meta_info"]) == sorted(w["meta_info"])
        for key in ("input_token_logprobs", "output_token_logprobs"):
            lw = np.array([x[0] for x in w["meta_info"][key]][1:], dtype=float)
            lg = np.array([x[0] for x in g["meta_info"][key]][1:], dtype=float)
            np.testing.assert_allclose(lg, lw, atol=LOGPROB_ATOL, rtol=0, err_msg=key)
        t, f, m = _compare_routes(p, w, g)
        ties, flips, smallest = ties + t, flips + f, min(smallest, m)
    print(f"near-ties (gap < {NEAR_TIE:g}): {ties} (row, layer) entries, {flips} flipped under tp2; "
          f"smallest gap {smallest:.1e}")


def test_tp2_single_and_stream_match(engines: tuple[Engine, Engine]) -> None:
    ref, tp2 = engines
    prompt = _prompts(1, seed=2)[0]
    kw: dict[str, Any] = dict(input_ids=prompt, sampling_params=GREEDY, return_routed_experts=True)
    want = ref.generate(**kw)
    single = tp2.generate(**kw)
    assert isinstance(want, dict) and isinstance(single, dict)
    assert single["output_ids"] == want["output_ids"]
    chunks = list(tp2.generate(**kw, stream=True))  # type: ignore[arg-type]
    assert [c["meta_info"]["finish_reason"] is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    assert sum((c["output_ids"] for c in chunks), []) == want["output_ids"]
    rows = np.concatenate([decode_routed_experts(c["meta_info"]) for c in chunks if "routed_experts" in c["meta_info"]])
    np.testing.assert_array_equal(rows, decode_routed_experts(single["meta_info"]))
    assert tp2.flush_cache() is True
    assert tp2.recompute_mismatches == 0


def test_tp2_trace_holds_each_row_once(engines: tuple[Engine, Engine], tmp_path: Path) -> None:
    _, tp2 = engines
    prompts = _prompts(4, seed=3)
    tp2.start_trace(tmp_path / "trace", run_id="tp2")
    assert tp2.trace_status()["tracing"] is True
    outs = tp2.generate(input_ids=prompts, sampling_params=GREEDY, return_routed_experts=True,
                        tag=["a", "b", "c", "d"])
    manifest = tp2.stop_trace()
    assert manifest is not None and manifest["parallel"] == {"tp_size": 2, "dp_size": 1, "ep_size": 1}
    con = duckdb.connect()
    glob = str(tmp_path / "trace" / "routes" / "**" / "part-*.parquet")
    dup = con.execute(f"SELECT count(*) FROM (SELECT request_id, token_pos, layer_id, count(*) c "
                      f"FROM read_parquet('{glob}') GROUP BY ALL HAVING c > 1)").fetchone()
    assert dup == (0,)
    assert con.execute(f"SELECT DISTINCT dp_rank FROM read_parquet('{glob}')").fetchall() == [(0,)]
    moe = list(manifest["moe_layer_ids"])
    assert isinstance(outs, list)
    for p, o in zip(prompts, outs, strict=True):
        rows = con.execute(f"SELECT topk_ids FROM read_parquet('{glob}') WHERE request_id = ? "
                           "ORDER BY token_pos, layer_id", [o["meta_info"]["id"]]).fetchall()
        n = len(p) + len(o["output_ids"]) - 1  # every computed position
        got = np.array([r[0] for r in rows]).reshape(n, len(moe), -1)
        np.testing.assert_array_equal(got, decode_routed_experts(o["meta_info"])[:, moe])
    tags = con.execute(f"SELECT tag FROM read_parquet('{tmp_path}/trace/**/requests-*.parquet') ORDER BY tag")
    assert tags.fetchall() == [("a",), ("b",), ("c",), ("d",)]


def test_tp2_abort_and_closed_stream_free_everything(engines: tuple[Engine, Engine]) -> None:
    _, tp2 = engines
    long = {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}
    stream = tp2.generate(input_ids=_prompts(1, seed=5)[0], sampling_params=long, stream=True)
    assert next(stream)["meta_info"]["finish_reason"] is None  # type: ignore[call-overload]
    stream.close()  # type: ignore[union-attr]  # the caller walks away: the ranks abort the request
    box: list[Any] = []
    t = threading.Thread(target=lambda: box.append(tp2.generate(input_ids=[3, 4, 5], sampling_params=long,
                                                                rid="to-abort")))
    t.start()
    time.sleep(0.5)
    tp2.abort("to-abort")
    t.join(30)
    assert box and box[0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(box[0]["output_ids"]) < 200
    deadline = time.monotonic() + 10
    while not tp2.flush_cache():  # True once no request is in flight on any rank
        assert time.monotonic() < deadline, "a request is still in flight after its abort"
        time.sleep(0.1)


@pytest.mark.parametrize("victim", [1, 0])
def test_killed_rank_fails_requests_and_shuts_down(victim: int) -> None:
    engine = Engine(SAMPLE, tp_size=2, **OPTIONS)
    procs = [m.process for m in engine._loop.members]
    try:
        stream = engine.generate(input_ids=_prompts(1, seed=4)[0], stream=True,
                                 sampling_params={"temperature": 0, "max_new_tokens": 400, "ignore_eos": True})
        first = next(stream)  # type: ignore[call-overload]
        assert first["meta_info"]["finish_reason"] is None
        os.kill(procs[victim].pid, signal.SIGKILL)
        t0 = time.monotonic()
        last = list(stream)[-1]
        assert time.monotonic() - t0 < 5
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert f"rank {victim} exited (killed by signal 9)" in last["error"], last
        with pytest.raises(RuntimeError, match="ranks have stopped"):
            engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})
        t0 = time.monotonic()
        engine.shutdown()
        assert time.monotonic() - t0 < 15 and not any(p.is_alive() for p in procs)
    finally:
        engine.shutdown()
        for p in procs:
            if p.is_alive():
                p.kill()
