"""Chained speculative launches (EngineConfig.speculative_launch_steps): S greedy steps as one graph, the batch moved on
the device between them, the host handed the S results one step at a time (engine/spec/launch_steps.py).

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/spec/test_spec_launch_steps.py

In exact mode a row's bits do not depend on its batch, so a chained launch must give what one step a launch gives,
bit for bit: tokens, finish reasons, routes, the trace's rows (each position once, none of a rejected draft), the
stream's route deltas and the prefix cache's KV. Any difference is a chaining bug: a position or KV slot the device
moved to that the host did not, a route row read from another step's part of the capture buffer, a rejected row
claimed after a later step rewrote its slot, a request that stopped at step s still reaching a response or trace.
The graphs are tests/spec/graph_standin.py's stand-in; tests/spec/test_spec_graphs_gpu.py replays real ones.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pytest

import r3trace
from r3trace.engine import Engine
from r3trace.engine.engine_config import EngineConfig, EngineConfigError
from r3trace.engine.engine_core import capture_config
from r3trace.engine.model_config import ModelConfig
from r3trace.engine.parallel import ParallelInfo
from r3trace.engine.step import ScheduledReq
from tests.engine.conftest import EngineFactory
from tests.spec.conftest import VOCAB
from tests.spec.graph_standin import install_spec_graphs

SPEC: dict[str, Any] = dict(speculative_algorithm="NEXTN", speculative_num_steps=3, deterministic=True,
                            max_context_len=96, chunked_prefill_size=48)
LAUNCH = 3


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, VOCAB, size=int(rng.integers(4, 30))).tolist() for _ in range(n)]


def trace_rows(con: duckdb.DuckDBPyConnection, folder: Path, rid: str) -> list[tuple[Any, ...]]:
    glob = str(folder / "**" / "part-*.parquet")
    return con.execute(f"SELECT token_pos, layer_id, topk_ids, phase FROM read_parquet('{glob}') "
                       "WHERE request_id = ? ORDER BY token_pos, layer_id", [rid]).fetchall()


class StepLog:
    """What the chained engine's scheduler processed: per processed step, whether it was a chained launch's step
    before its last, and which of its requests that step finished."""

    def __init__(self, engine: Engine) -> None:
        self.steps: list[tuple[bool, int]] = []  # (more steps follow, requests finished by this step)
        sched = engine.core.scheduler
        real = sched.process

        def process(items: list[ScheduledReq], outputs: Any) -> None:
            live = [it.req for it in items if not it.req.finished]
            real(items, outputs)
            more = any(it.more_steps for it in items)
            self.steps.append((more, sum(r.finished for r in live)))

        sched.process = process  # type: ignore[method-assign]


def test_chained_launches_are_single_steps_bit_for_bit(make_spec_engine: EngineFactory, mtp_ckpt: Path,
                                                       tmp_path: Path) -> None:
    """5 greedy requests of different lengths on a graph of 8 (3 padding requests), 3 steps a launch, against the
    same requests one eager step at a time: tokens, finish reasons, routes (logical and physical: both capture
    buffers take a launch's rows past each other) and draft counts equal; the trace holds
    each position once with the returned routes, verify rows marked; some requests stop inside a launch. A second
    round of the first round's prompts + outputs reads them from the prefix cache (KV the launches wrote), with one
    request sampling at temperature 1 (seeded: no chained launch while it runs). Every page is free afterwards."""
    chained = make_spec_engine(model=mtp_ckpt, speculative_launch_steps=LAUNCH, capture_physical_ids=True, **SPEC)
    eager = make_spec_engine(model=mtp_ckpt, capture_physical_ids=True, **SPEC)
    graphs = install_spec_graphs(chained, (1, 2, 4, 8))
    launches = [0]
    real = graphs.greedy_steps

    def greedy_steps(fb: Any) -> Any:
        launches[0] += 1
        return real(fb)

    graphs.greedy_steps = greedy_steps  # type: ignore[method-assign]
    log = StepLog(chained)
    first = prompts(5, seed=1)
    sp = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (9, 16, 5, 12, 16)]
    outs: dict[str, list[dict[str, Any]]] = {}
    for name, engine in (("chained", chained), ("eager", eager)):
        engine.start_trace(tmp_path / name, run_id=name)
        outs[name] = engine.generate(input_ids=first, sampling_params=sp, return_routed_experts=True)
        engine.stop_trace()
    got, want = outs["chained"], outs["eager"]
    meta = ("finish_reason", "routed_experts", "routed_experts_physical", "spec_verify_ct", "spec_num_correct_drafts",
            "spec_num_proposed_drafts")
    assert [(g["output_ids"], [g["meta_info"][k] for k in meta]) for g in got] == \
        [(w["output_ids"], [w["meta_info"][k] for k in meta]) for w in want]
    assert launches[0] >= 2, f"{launches[0]} chained launches"
    assert any(more and done for more, done in log.steps), "no request stopped inside a chained launch"

    con = duckdb.connect()
    for p, g in zip(first, got, strict=True):
        rows = trace_rows(con, tmp_path / "chained", g["meta_info"]["id"])
        n = len(p) + len(g["output_ids"]) - 1
        assert [r[0] for r in rows] == list(range(n)), "a position is missing, repeated or past the last token"
        np.testing.assert_array_equal(np.array([r[2] for r in rows]).reshape(n, -1, 3)[:, 0],
                                      r3trace.decode_routed_experts(g["meta_info"])[:, 1])
        assert {r[3] for r in rows if r[0] >= len(p)} == {"verify"}

    second = [p + g["output_ids"] for p, g in zip(first[:3], got[:3], strict=True)]
    sp2 = [{"temperature": 0, "max_new_tokens": 10, "ignore_eos": True},
           {"temperature": 1.0, "sampling_seed": 7, "max_new_tokens": 6, "ignore_eos": True},
           {"temperature": 0, "max_new_tokens": 14, "ignore_eos": True}]
    before = launches[0]
    got2 = chained.generate(input_ids=second, sampling_params=sp2, return_routed_experts=True)
    want2 = eager.generate(input_ids=second, sampling_params=sp2, return_routed_experts=True)
    assert [(g["output_ids"], g["meta_info"]["routed_experts"]) for g in got2] == \
        [(w["output_ids"], w["meta_info"]["routed_experts"]) for w in want2]
    assert all(g["meta_info"]["cached_tokens"] > 0 for g in got2), "the second round must hit the prefix cache"
    assert launches[0] > before, "the greedy requests left alone must chain again"
    assert chained.flush_cache() and chained.kv_pool.num_free_pages == chained.kv_pool.num_pages


def test_chained_stream_deltas_are_contiguous(make_spec_engine: EngineFactory, mtp_ckpt: Path) -> None:
    """A streamed request under chained launches: one chunk a launch at most (not one a step), deltas contiguous,
    adding up to the non-streamed request's tokens and routes."""
    engine = make_spec_engine(model=mtp_ckpt, speculative_launch_steps=LAUNCH, **SPEC)
    install_spec_graphs(engine, (1, 2))
    p = prompts(1, seed=5)[0]
    sp = {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}
    whole = engine.generate(input_ids=p, sampling_params=sp, return_routed_experts=True)
    chunks = list(engine.generate(input_ids=p, sampling_params=sp, return_routed_experts=True, stream=True))
    assert sum((c["output_ids"] for c in chunks), []) == whole["output_ids"]
    assert all(c["output_ids"] for c in chunks), "an empty chunk: one request reported twice for one launch"
    offsets = [c["meta_info"]["routed_experts_offset"] for c in chunks]
    pieces = [r3trace.decode_routed_experts(c["meta_info"]) for c in chunks]
    assert offsets == list(np.cumsum([0] + [len(x) for x in pieces[:-1]]))
    np.testing.assert_array_equal(np.concatenate(pieces), r3trace.decode_routed_experts(whole["meta_info"]))


def test_launch_steps_are_checked_and_sized(mtp_ckpt: Path) -> None:
    """1..8; the capture buffer holds every step's verify rows of a launch (none without speculation)."""
    for bad in (0, 9, True, 2.0):
        with pytest.raises(EngineConfigError, match="speculative_launch_steps="):
            EngineConfig(speculative_launch_steps=bad, speculative_algorithm="NEXTN")  # type: ignore[arg-type]
    mc = ModelConfig.from_hf(mtp_ckpt)
    triton = dict.fromkeys(("attention_backend", "moe_backend", "topk_backend", "norm_backend", "rope_backend"),
                           "triton")
    cfg = EngineConfig(max_running_requests=40, chunked_prefill_size=160, speculative_launch_steps=4,
                       speculative_algorithm="NEXTN", speculative_num_steps=3, device="cuda",
                       cuda_graph_batch_sizes=(1, 8), **triton)
    cc = capture_config(mc, cfg, ParallelInfo())
    assert (cc.max_batch_tokens, cc.verify_launch_steps) == (40 * 4 * 4, 4)
    with pytest.raises(r3trace.capture.CaptureConfigError, match="verify_launch_steps 4"):
        dataclasses.replace(cc, max_batch_tokens=40 * 4)
    # no graphs (eager, or the CPU): one step a launch, and no room kept for more
    for eager in (dataclasses.replace(cfg, cuda_graph_batch_sizes=()),
                  dataclasses.replace(cfg, device="cpu", cuda_graph_batch_sizes=None)):
        assert eager.launch_steps == 1
        assert capture_config(mc, eager, ParallelInfo()).max_batch_tokens == 40 * 4
