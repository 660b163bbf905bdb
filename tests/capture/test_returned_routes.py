"""Returned routes equal a direct forward's, exactly, under every scheduling path.

Run: .venv/bin/pytest -q tests/capture/test_returned_routes.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from r3trace.capture.capturer import CaptureConfig, CaptureConfigError
from tests.capture.helpers import assert_routes_exact, direct_routes, returned_routes
from tests.engine.conftest import EngineFactory, greedy, random_prompts


def test_one_request_and_mixed_batches(tiny_ckpt: Path, make_engine: EngineFactory) -> None:
    engine = make_engine(chunked_prefill_size=64)
    prompts = random_prompts(6, 3, 30, seed=1)
    alone = [engine.generate(input_ids=p, sampling_params=greedy(7), return_routed_experts=True) for p in prompts]
    together = engine.generate(input_ids=prompts, sampling_params=greedy(7), return_routed_experts=True)
    for p, a, b in zip(prompts, alone, together, strict=False):
        assert_routes_exact(tiny_ckpt, p, a)
        assert_routes_exact(tiny_ckpt, p, b)
        meta = b["meta_info"]
        assert meta["routed_experts_shape"] == [len(p) + 6, 3, 3] and meta["moe_layer_ids"] == [1, 2]
        assert meta["routed_experts_dtype"] == "int32"


def test_dense_layers_are_minus_one_never_zero(tiny_ckpt: Path, make_engine: EngineFactory) -> None:
    out = make_engine().generate(input_ids=[5, 6, 7, 8], sampling_params=greedy(3), return_routed_experts=True)
    routes = returned_routes(out)
    assert (routes[:, 0] == -1).all()  # layer 0 is dense (first_k_dense_replace = 1)
    assert (routes[:, 1:] >= 0).all()


def test_tiny_chunks(tiny_ckpt: Path, make_engine: EngineFactory) -> None:
    engine = make_engine(chunked_prefill_size=3)
    for p in random_prompts(3, 10, 25, seed=2):
        assert_routes_exact(tiny_ckpt, p, engine.generate(input_ids=p, sampling_params=greedy(5),
                                                          return_routed_experts=True))


def test_prefix_cache_hit_with_partial_page(tiny_ckpt: Path, make_engine: EngineFactory) -> None:
    engine = make_engine(page_size=4)
    shared = random_prompts(1, 10, 10, seed=3)[0]  # 10 tokens: 2 whole pages + a partly filled one
    first = shared + [11, 12, 13]
    second = shared + [21, 22]
    assert_routes_exact(tiny_ckpt, first, engine.generate(input_ids=first, sampling_params=greedy(4),
                                                          return_routed_experts=True))
    out = engine.generate(input_ids=second, sampling_params=greedy(4), return_routed_experts=True)
    assert out["meta_info"]["cached_tokens"] == 8  # whole pages only; the partial page is recomputed
    assert_routes_exact(tiny_ckpt, second, out)
    assert out["meta_info"]["routed_experts_provenance"][0] == [0, 8, "prefill", "prefix_cache"]


def test_preemption_and_reprefill(tiny_ckpt: Path, make_engine: EngineFactory) -> None:
    engine = make_engine(kv_pool_tokens=64, chunked_prefill_size=16)
    prompts = random_prompts(5, 8, 14, seed=4)
    outs = engine.generate(input_ids=prompts, sampling_params=greedy(12), return_routed_experts=True)
    assert engine.scheduler.num_retractions > 0, "the pool must be small enough to force retraction"
    for p, o in zip(prompts, outs, strict=False):
        assert_routes_exact(tiny_ckpt, p, o)
    assert engine.recompute_mismatches == 0  # deterministic fp32: re-prefill routes the same way


def test_flagged_and_unflagged_in_one_batch_copy_only_asked_rows(tiny_ckpt: Path, make_engine: EngineFactory) -> None:
    engine = make_engine()
    prompts = random_prompts(4, 6, 6, seed=5)
    capturer = engine.capturer
    assert capturer is not None
    per_row = 2 * 3 * 2 + 8  # M=2 MoE layers x K=3 ids x int16 + an int64 KV slot
    outs = engine.generate(input_ids=prompts, sampling_params=greedy(1),
                           return_routed_experts=[True, False, False, False])
    # The single forward held 4 x 6 prompt rows; only request 0's 6 rows crossed to the host.
    assert capturer.bytes_last_step == 6 * per_row
    assert "routed_experts" in outs[0]["meta_info"] and "routed_experts" not in outs[1]["meta_info"]
    assert_routes_exact(tiny_ckpt, prompts[0], outs[0])
    before = capturer.bytes_total
    engine.generate(input_ids=prompts, sampling_params=greedy(3))
    assert capturer.bytes_total == before  # nobody asked: nothing copied
    assert capturer.bytes_last_step == 0


def test_start_len_and_prefill_only(tiny_ckpt: Path, make_engine: EngineFactory) -> None:
    engine = make_engine()
    p = random_prompts(1, 12, 12, seed=6)[0]
    out = engine.generate(input_ids=p, sampling_params=greedy(4), return_routed_experts=True,
                          routed_experts_start_len=5)
    assert_routes_exact(tiny_ckpt, p, out, start_len=5)
    prefill_only = engine.generate(input_ids=p, sampling_params=greedy(0), return_routed_experts=True)
    routes = returned_routes(prefill_only)
    assert routes.shape[0] == len(p)  # every prompt position, the last one included (SGLang drops it)
    np.testing.assert_array_equal(routes, direct_routes(tiny_ckpt, p))


@pytest.mark.parametrize("start", [-1, 13, "3", True])
def test_bad_start_len_fails_that_request_only(make_engine: EngineFactory, start: object) -> None:
    engine = make_engine()
    prompts = random_prompts(2, 12, 12, seed=7)
    outs = engine.generate(input_ids=prompts, sampling_params=greedy(2), return_routed_experts=True,
                           routed_experts_start_len=[start, 0])
    assert "routed_experts_start_len" in outs[0]["error"]
    assert "routed_experts" in outs[1]["meta_info"]


def test_streaming_chunks_concatenate(tiny_ckpt: Path, make_engine: EngineFactory) -> None:
    engine = make_engine(chunked_prefill_size=4)
    p = random_prompts(1, 11, 11, seed=8)[0]
    whole = engine.generate(input_ids=p, sampling_params=greedy(6), return_routed_experts=True)
    chunks = list(engine.generate(input_ids=p, sampling_params=greedy(6), return_routed_experts=True, stream=True))
    offset, parts = 0, []
    for chunk in chunks:
        meta = chunk["meta_info"]
        if "routed_experts" in meta:
            assert meta["routed_experts_offset"] == offset
            part = returned_routes(chunk)
            parts.append(part)
            offset += len(part)
    assert len(parts) > 2, "rows must arrive incrementally, not in one blob at the end"
    np.testing.assert_array_equal(np.concatenate(parts), returned_routes(whole))


def test_abort_mid_generation_releases_rows(make_engine: EngineFactory) -> None:
    engine = make_engine()
    stream = engine.generate(input_ids=[3, 4, 5, 6], sampling_params=greedy(50), return_routed_experts=True,
                             stream=True)
    next(stream)
    next(stream)
    stream.close()  # the caller walks away: the engine aborts the request
    engine.generate(input_ids=[7, 8], sampling_params=greedy(1))  # a later step processes the abort
    assert engine.capturer is not None and engine.capturer.requests == {}
    assert engine.flush_cache()
    assert engine.kv_pool.num_free_pages == engine.kv_pool.num_pages


def test_overflowing_configuration_is_refused() -> None:
    with pytest.raises(CaptureConfigError, match=r"max_batch_tokens=256 could overflow.*512 tokens"):
        CaptureConfig(num_hidden_layers=4, moe_layer_ids=(1, 2, 3), top_k=8, num_experts=256, kv_slots=1024,
                      max_batch_tokens=256, chunked_prefill_size=256, max_running_requests=128, dp_size=2)
    with pytest.raises(CaptureConfigError, match="spec_verify_tokens 3"):
        CaptureConfig(num_hidden_layers=4, moe_layer_ids=(1, 2, 3), top_k=8, num_experts=256, kv_slots=1024,
                      max_batch_tokens=300, chunked_prefill_size=256, max_running_requests=100, spec_verify_tokens=3)


def test_routed_weights_are_the_gate_weights(tiny_ckpt: Path, make_engine: EngineFactory) -> None:
    import r3trace
    from bench.tiny_models import direct_forward, load_engine_model

    engine = make_engine(capture_weights=True)
    p = random_prompts(1, 9, 9, seed=9)[0]
    out = engine.generate(input_ids=p, sampling_params=greedy(3), return_routed_weights=True)
    weights = r3trace.decode_routed_weights(out["meta_info"])
    ids = returned_routes(out)
    assert weights.dtype == np.float16 and weights.shape == ids.shape
    model = load_engine_model(tiny_ckpt)
    direct_forward(model, (p + out["output_ids"])[:-1])
    for layer, (_, w) in model.recorder.routes.items():
        # float16 on the wire: 11 significant bits, so 1e-3 relative (weights are O(1) after scaling)
        np.testing.assert_allclose(weights[:, layer], w.numpy(), rtol=1e-3, atol=1e-3)
    assert (weights[:, 0] == 0).all()  # dense layer: no weights


def test_prefix_hit_on_kv_of_a_request_that_did_not_capture(tiny_ckpt: Path, make_engine: EngineFactory) -> None:
    """Only asked-for rows reach the host, so a cached prefix computed without capture has no host
    routes: the capturing request must recompute those positions rather than return stale rows."""
    engine = make_engine(page_size=2)
    shared = random_prompts(1, 10, 10, seed=15)[0]
    engine.generate(input_ids=shared + [40], sampling_params=greedy(2))  # no capture: rows never copied
    # Another uncaptured request reuses and then frees slots, so stale host rows would be wrong rows.
    engine.generate(input_ids=random_prompts(1, 30, 30, seed=16)[0], sampling_params=greedy(4))
    out = engine.generate(input_ids=shared + [41], sampling_params=greedy(3), return_routed_experts=True)
    assert_routes_exact(tiny_ckpt, shared + [41], out)
    assert out["meta_info"]["cached_tokens"] == 0  # recomputed: the cached copy had no host routes
    plain = engine.generate(input_ids=shared + [42], sampling_params=greedy(1))
    assert plain["meta_info"]["cached_tokens"] == 10  # requests without capture still reuse the prefix
    # The capturing request's copy of the prefix replaced the uncaptured one in the cache (adopt), so the
    # next capturing request reuses it, with the first one's routes as source=prefix_cache rows.
    again = engine.generate(input_ids=shared + [43], sampling_params=greedy(2), return_routed_experts=True)
    assert again["meta_info"]["cached_tokens"] == 10
    assert_routes_exact(tiny_ckpt, shared + [43], again)
    np.testing.assert_array_equal(returned_routes(again)[:10], returned_routes(out)[:10])
    engine.flush_cache()
    assert engine.kv_pool.num_free_pages == engine.kv_pool.num_pages  # adopt freed exactly the replaced pages


def test_capturing_copy_replaces_a_prefix_another_request_still_holds(
    tiny_ckpt: Path, make_engine: EngineFactory
) -> None:
    """The cached prefix without host routes is held by a long uncaptured decode when the capturing request
    that recomputed it finishes: its copy still replaces the cached one (so the next capturing request reuses
    it), while the old pages stay allocated until the long request is done. A third request, admitted when
    the capturing one leaves, allocates pages then: had the old pages gone back to the pool early it would
    overwrite the long request's prefix, and its tokens would differ from a run of its own."""
    engine = make_engine(page_size=2, max_running_requests=2)
    shared = random_prompts(1, 10, 10, seed=15)[0]
    other = random_prompts(1, 12, 12, seed=17)[0]
    engine.generate(input_ids=shared + [40], sampling_params=greedy(2))  # cached without host routes
    outs = engine.generate(input_ids=[shared + [50], shared + [41], other],
                           sampling_params=[greedy(24), greedy(2), greedy(8)],
                           return_routed_experts=[False, True, False])  # fmt: skip
    assert outs[0]["meta_info"]["cached_tokens"] == 10 and outs[1]["meta_info"]["cached_tokens"] == 0
    assert_routes_exact(tiny_ckpt, shared + [41], outs[1])
    again = engine.generate(input_ids=shared + [43], sampling_params=greedy(2), return_routed_experts=True)
    assert again["meta_info"]["cached_tokens"] == 10  # the capturing copy took the held node's place
    assert_routes_exact(tiny_ckpt, shared + [43], again)
    np.testing.assert_array_equal(returned_routes(again)[:10], returned_routes(outs[1])[:10])
    engine.flush_cache()
    assert engine.kv_pool.num_free_pages == engine.kv_pool.num_pages  # the retired pages came back, once
    alone = make_engine(page_size=2).generate(input_ids=shared + [50], sampling_params=greedy(24))
    assert outs[0]["output_ids"] == alone["output_ids"]


def _waiting_rids(engine: object) -> set[str]:
    """Test only: peek at the scheduler's waiting queue from another thread (copy, retry on a race)."""
    for _ in range(100):
        try:
            return {r.rid for r in list(engine.scheduler.waiting)}  # type: ignore[attr-defined]
        except RuntimeError:  # deque mutated during iteration
            continue
    return set()


def test_abort_before_admission_with_capture(make_engine: EngineFactory) -> None:
    """A capturing request aborted while it still waits (no KV, no rows) finishes cleanly; the engine
    keeps serving (this once killed the scheduler thread with a KeyError)."""
    import threading
    import time

    engine = make_engine(max_running_requests=1)
    stream = engine.generate(input_ids=[3, 4, 5], sampling_params=greedy(40), return_routed_experts=True,
                             stream=True)
    next(stream)  # the long request now holds the only running slot
    result: dict[str, object] = {}
    waiter = threading.Thread(target=lambda: result.update(engine.generate(
        input_ids=[6, 7, 8], sampling_params=greedy(5), return_routed_experts=True, rid="waiting")))
    waiter.start()
    deadline = time.monotonic() + 30
    while "waiting" not in _waiting_rids(engine):  # the abort must reach it after its submission
        assert time.monotonic() < deadline, "the request never reached the waiting queue"
        time.sleep(0.005)
    engine.abort("waiting")
    waiter.join(timeout=60)
    meta = result["meta_info"]
    assert isinstance(meta, dict) and meta["finish_reason"]["type"] == "abort"
    assert len(list(stream)) > 0  # the running request completes
    out = engine.generate(input_ids=[9, 10], sampling_params=greedy(2), return_routed_experts=True)
    assert returned_routes(out).shape == (3, 3, 3)
