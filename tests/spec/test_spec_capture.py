"""Route capture under speculative decoding: draft forwards never touch the target's capture (a spy around every one),
rows of rejected positions reach no response, stream chunk or trace, verify rows say so, the capture buffer holds the
largest verify batch, and the draft's routing ops are checked at construction (fail closed).

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/spec/test_spec_capture.py

Peer behaviour this guards against (SGLang, python/sglang/srt/state_capturer/routed_experts.py and its
disable_routed_experts_capture_for_draft, read at sgl-project/sglang 0114f9c; vLLM #48622): a draft MoE layer writing
the target's capture buffer, verify rows overflowing it, rows of rejected drafts returned.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pytest

import r3trace
from r3trace.capture.config import CaptureConfigError
from r3trace.capture.recorder import ListRecorder
from r3trace.engine.engine_config import EngineConfig
from r3trace.engine.engine_core import capture_config
from r3trace.engine.layers.moe import MoE
from r3trace.engine.model_config import ModelConfig
from r3trace.engine.parallel import ParallelInfo
from r3trace.engine.spec.nextn import DraftCaptureError, check_draft_capture
from tests.engine.conftest import EngineFactory
from tests.spec.capture_spy import CaptureSpy
from tests.spec.conftest import VOCAB

SPEC: dict[str, Any] = dict(speculative_algorithm="NEXTN", speculative_num_steps=3)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, VOCAB, size=int(rng.integers(4, 30))).tolist() for _ in range(n)]


def greedy(n: int) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


def test_draft_forwards_leave_the_target_capture_byte_identical(make_spec_engine: EngineFactory, mtp_ckpt: Path,
                                                               tmp_path: Path) -> None:
    """A spy around every draft forward (chain and extend): the capturer's buffers are byte-identical before and after,
    and no recorder hook runs inside one. Capture on for some requests and a trace recording every row, so the
    capturer copies every forward's rows."""
    engine = make_spec_engine(model=mtp_ckpt, capture_weights=True, **SPEC)
    spy = CaptureSpy(engine.capturer)
    spy.wrap(engine.runner.drafter, "run")
    engine.start_trace(tmp_path / "trace", run_id="spy")
    outs = engine.generate(input_ids=prompts(5, seed=1), sampling_params=greedy(12),
                           return_routed_experts=[True, False, True, False, True])
    engine.stop_trace()
    assert all("error" not in o for o in outs)
    assert spy.forwards >= 3 * 4, "chain and extend forwards must have run"
    assert spy.calls == [] and spy.changed == [], \
        f"draft forwards called {spy.calls} / changed capture buffers {spy.changed}"


def test_rejected_rows_reach_no_response_stream_or_trace(make_spec_engine: EngineFactory, mtp_ckpt: Path,
                                                         tmp_path: Path) -> None:
    """Trace rows: exactly positions 0 .. len - 2 of each request, once each, equal to the returned routes (rows of
    rejected drafts, computed at positions later rows reuse, would show up as rows that differ), phase "verify" for
    every generated position; the stream's route deltas are contiguous and add up to the same rows."""
    engine = make_spec_engine(model=mtp_ckpt, **SPEC)
    engine.start_trace(tmp_path / "trace", run_id="rej")
    batch = prompts(4, seed=2)
    outs = engine.generate(input_ids=batch, sampling_params=greedy(14), return_routed_experts=True)
    stream_prompt = prompts(1, seed=3)[0]
    chunks = list(engine.generate(input_ids=stream_prompt, sampling_params=greedy(14), return_routed_experts=True,
                                  stream=True))
    engine.stop_trace()
    proposed = sum(o["meta_info"]["spec_num_proposed_drafts"] for o in outs)
    assert 0 < sum(o["meta_info"]["spec_num_correct_drafts"] for o in outs) < proposed, "no draft was rejected"

    con = duckdb.connect()
    glob = str(tmp_path / "trace" / "**" / "part-*.parquet")
    for p, o in zip(batch, outs, strict=True):
        rows = con.execute(f"SELECT token_pos, layer_id, topk_ids, phase FROM read_parquet('{glob}') "
                           "WHERE request_id = ? ORDER BY token_pos, layer_id", [o["meta_info"]["id"]]).fetchall()
        n = len(p) + len(o["output_ids"]) - 1
        assert [r[0] for r in rows] == list(range(n)), "a position is missing, repeated or past the last token"
        got = np.array([r[2] for r in rows]).reshape(n, 3)
        np.testing.assert_array_equal(got, r3trace.decode_routed_experts(o["meta_info"])[:, 1])
        assert {r[3] for r in rows if r[0] >= len(p)} == {"verify"}
        assert o["meta_info"]["routed_experts_provenance"] == [[0, len(p), "prefill", "computed"],
                                                               [len(p), n, "verify", "computed"]]

    offsets, pieces = [], []
    for c in chunks:
        if "routed_experts" in c["meta_info"]:
            offsets.append(c["meta_info"]["routed_experts_offset"])
            pieces.append(r3trace.decode_routed_experts(c["meta_info"]))
    ids = sum((c["output_ids"] for c in chunks), [])
    assert offsets == list(np.cumsum([0] + [len(x) for x in pieces[:-1]])), "stream deltas not contiguous"
    streamed = np.concatenate(pieces)
    assert len(streamed) == len(stream_prompt) + len(ids) - 1
    rid = chunks[0]["meta_info"]["id"]
    rows = con.execute(f"SELECT topk_ids FROM read_parquet('{glob}') WHERE request_id = ? ORDER BY token_pos",
                       [rid]).fetchall()
    np.testing.assert_array_equal(np.array([r[0] for r in rows]), streamed[:, 1])


def test_capture_buffer_holds_the_largest_verify_batch(mtp_ckpt: Path) -> None:
    """Sized for max_running_requests verifies of 1 + d rows; SGLang's sizing without the verify term is refused."""
    mc = ModelConfig.from_hf(mtp_ckpt)
    cfg = EngineConfig(max_running_requests=40, chunked_prefill_size=64, **SPEC)
    cc = capture_config(mc, cfg, ParallelInfo())
    assert (cc.max_batch_tokens, cc.spec_verify_tokens) == (40 * 4, 3)
    with pytest.raises(CaptureConfigError, match=r"could overflow.* x \(1 \+ spec_verify_tokens 3\)"):
        dataclasses.replace(cc, max_batch_tokens=max(64, 40))


def test_draft_routing_ops_are_checked_at_construction(make_spec_engine: EngineFactory, mtp_ckpt: Path) -> None:
    """The built draft passes; a draft router recording anywhere but its own NullRecorder, a routing module of the
    target, a route gather or a physical-id recorder in the draft each raise, naming the module."""
    engine = make_spec_engine(model=mtp_ckpt, **SPEC)
    draft, target = engine.runner.drafter.draft, engine.model
    check_draft_capture(draft, target)
    moe = draft.layer.mlp
    assert isinstance(moe, MoE)
    for field, value, needle in [
        ("recorder", target.recorder, "records into RoutedExpertsCapturer"),
        ("recorder", ListRecorder(), "records into ListRecorder"),
        ("route_gather", lambda ids, w: (ids, w), "gathers its routes"),
    ]:
        saved = getattr(moe.gate, field)
        setattr(moe.gate, field, value)
        with pytest.raises(DraftCaptureError, match=f"draft module layer.mlp.gate {needle}"):
            check_draft_capture(draft, target)
        setattr(moe.gate, field, saved)
    moe.physical_recorder = ListRecorder()
    with pytest.raises(DraftCaptureError, match="layer.mlp records physical ids"):
        check_draft_capture(draft, target)
    del moe.physical_recorder
    target_moe = target.model.layers[1].mlp
    draft.layer.mlp = target_moe
    with pytest.raises(DraftCaptureError, match="layer.mlp is a routing module of the target"):
        check_draft_capture(draft, target)
    draft.layer.mlp = moe
    check_draft_capture(draft, target)
