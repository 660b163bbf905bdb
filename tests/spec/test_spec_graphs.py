"""Speculation's CUDA-graph paths on the CPU: the static batch and its padding, when a step runs on graphs, and the
three replayed forwards giving eager speculation's tokens, logprobs and routes bit for bit in exact mode.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/spec/test_spec_graphs.py

The graphs here are tests/spec/graph_standin.py's stand-in (the capture runs fn once, a replay re-runs it on the static
inputs): everything the engine does around a graph is the GPU's code; tests/spec/test_spec_graphs_gpu.py replays real
CUDA graphs. Exact mode (deterministic=True) makes a row's bits independent of its batch, so padded graph batches must
give eager's bits: any difference is a graph bug (a row copied to the wrong place, padding reaching a real row or a
response, the extend reading another forward's hidden states, a route row of a padding request returned).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from r3trace.engine import Engine
from r3trace.engine.forward_batch import ForwardBatch
from r3trace.engine.graph_batch import GraphBatch
from tests.engine.conftest import EngineFactory
from tests.spec.capture_spy import CaptureSpy
from tests.spec.conftest import VOCAB
from tests.spec.graph_standin import install_decode_graphs, install_spec_graphs
from tests.spec.test_spec_greedy import ASK, assert_mixed_acceptance, assert_same

EXACT: dict[str, Any] = dict(deterministic=True, max_context_len=64, chunked_prefill_size=48)


def batch(rng: np.random.Generator, prefix: list[int], extend: list[int]) -> ForwardBatch:
    """A host-built batch of random ids and slots (requests of extend[b] rows after prefix[b] positions)."""
    t = sum(extend)
    return ForwardBatch.build(
        forward_id=7, input_ids=rng.integers(0, 50, t).tolist(), prefix_lens=prefix, extend_lens=extend,
        req_pool_indices=rng.integers(1, 9, len(extend)).tolist(), out_cache_loc=rng.integers(0, 90, t),
        req_to_token=torch.zeros(10, 64, dtype=torch.int32), logits_rows=list(range(t)), device="cpu",
    )


@pytest.mark.parametrize("n", [1, 4])
def test_graph_batch_copies_real_rows_and_pads_the_rest(n: int) -> None:
    """3 requests of n rows into a graph of 8: rows [0, 3n) and requests [0, 3) are the batch's; the padding requests
    decode n tokens of id 0 at positions 0..n-1 into the padding slot, prefix 0, req_to_token row 0; the host lengths
    of the captured batch are the longest context's."""
    rng = np.random.default_rng(n)
    gb = GraphBatch(max_bs=8, tokens=n, pad_slot=99, max_context_len=64, device="cpu")
    gb.input_ids.fill_(-5)  # stale values of an earlier replay
    fb = batch(rng, prefix=[5, 9, 30], extend=[n] * 3)
    assert gb.fits(fb) is None
    gb.load(fb, 4)
    t = 3 * n
    for name in ("input_ids", "positions", "out_cache_loc"):
        assert torch.equal(getattr(gb, name)[:t], getattr(fb, name)), name
    for name in ("req_pool_indices", "seq_lens", "prefix_lens"):
        assert torch.equal(getattr(gb, name)[:3], getattr(fb, name)), name
    assert gb.input_ids[t : 4 * n].tolist() == [0] * n and gb.input_ids[4 * n :].tolist() == [-5] * (4 * n)
    assert gb.positions[t : 4 * n].tolist() == list(range(n))
    assert gb.out_cache_loc[t : 4 * n].tolist() == [99] * n
    assert (gb.req_pool_indices[3], gb.seq_lens[3], gb.prefix_lens[3]) == (0, n, 0)
    static = gb.static(4, fb.req_to_token)
    assert static.mode == ("decode" if n == 1 else "extend") and static.num_tokens == 4 * n
    assert static.extend_start_loc.tolist() == [0, n, 2 * n, 3 * n] and static.logits_indices.tolist() == list(
        range(4 * n))
    assert (static.seq_lens_cpu, static.prefix_lens_cpu, static.extend_lens_cpu) == ([64] * 4, [64 - n] * 4, [n] * 4)


def test_graph_batch_says_why_a_batch_does_not_fit() -> None:
    rng = np.random.default_rng(0)
    gb = GraphBatch(max_bs=4, tokens=4, pad_slot=99, max_context_len=64, device="cpu")
    assert gb.fits(batch(rng, [3, 8], [4, 3])) == "extend lengths [3, 4], the graphs run 4 a request"
    assert gb.fits(batch(rng, [3] * 5, [4] * 5)) == "5 requests, the graphs hold 1..4"
    assert gb.fits(batch(rng, [3], [1])) == "mode decode, the graphs run extend"
    with pytest.raises(ValueError, match="tokens=0"):
        GraphBatch(max_bs=4, tokens=0, pad_slot=99, max_context_len=64, device="cpu")


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, VOCAB, size=int(rng.integers(4, 30))).tolist() for _ in range(n)]


@pytest.mark.parametrize("steps", [1, 3])
def test_graph_speculation_is_eager_speculation_bit_for_bit(make_spec_engine: EngineFactory, mtp_ckpt: Path,
                                                          steps: int) -> None:
    """Exact mode, ladder (1, 2, 4, 8): 5 requests (graph of 8: 3 padding requests), then 3 (graph of 4) with one
    sampling at temperature 1 with a seed; greedy requests of different lengths end on eager steps (fewer drafts).
    Tokens, logprobs and routes equal the eager engine's; some steps ran on graphs, padded, some eager; all-greedy
    steps on the one-replay greedy graph, the others on the chain / verify / extend graphs."""
    spec = dict(speculative_algorithm="NEXTN", speculative_num_steps=steps, **EXACT)
    graphs_engine, eager = make_spec_engine(model=mtp_ckpt, **spec), make_spec_engine(model=mtp_ckpt, **spec)
    graphs = install_spec_graphs(graphs_engine, (1, 2, 4, 8))
    seen: list[tuple[int, int]] = []  # (B, the graph size it ran on) of each graph step
    kinds: list[str] = []  # "greedy" (one replay: spec/greedy_step.py) or "sampled" (chain, verify, extend replays)
    for kind, name in (("sampled", "verify_forward"), ("greedy", "greedy_step")):
        real = getattr(graphs, name)

        def spied(fb: ForwardBatch, _real: Any = real, _kind: str = kind) -> Any:
            seen.append((fb.batch_size, next(s for s in graphs.batch_sizes if s >= fb.batch_size)))
            kinds.append(_kind)
            return _real(fb)

        setattr(graphs, name, spied)
    steps_run = [0]
    real_launch = graphs_engine.runner.launch

    def launch(items: Any) -> Any:
        steps_run[0] += 1
        return real_launch(items)

    graphs_engine.runner.launch = launch  # type: ignore[method-assign]
    forwards = [0]  # target forwards: a step mixing prefill chunks and greedy verifies runs two
    real_forward = graphs_engine.runner._launch

    def forward(items: Any) -> Any:
        forwards[0] += 1
        return real_forward(items)

    graphs_engine.runner._launch = forward  # type: ignore[method-assign]
    rounds: list[tuple[list[list[int]], list[dict[str, Any]]]] = [
        (prompts(5, seed=steps), [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (9, 16, 16,
                                                                                                    12, 16)]),
        (prompts(3, seed=10 + steps), [{"temperature": 0, "max_new_tokens": 14, "ignore_eos": True},
                                       {"temperature": 1.0, "top_p": 0.9, "sampling_seed": 5, "max_new_tokens": 14,
                                        "ignore_eos": True},
                                       {"temperature": 0, "max_new_tokens": 14, "ignore_eos": True}]),
    ]
    got, want = [], []
    for ids, sp in rounds:
        got += graphs_engine.generate(input_ids=ids, sampling_params=sp, **ASK)
        want += eager.generate(input_ids=ids, sampling_params=sp, **ASK)
    assert_same(got, want)
    assert_mixed_acceptance(got)
    spec_meta = ("spec_verify_ct", "spec_num_correct_drafts", "spec_num_proposed_drafts")
    assert [[r["meta_info"][k] for k in spec_meta] for r in got] == [[r["meta_info"][k] for k in spec_meta]
                                                                      for r in want], "drafts differ from eager's"
    assert any(b < bs for b, bs in seen), f"no padded graph batch: {seen}"
    assert {bs for _, bs in seen} >= {4, 8}, seen
    assert {"greedy", "sampled"} <= set(kinds), kinds
    # a sampled graph step is d - 1 chain, 1 verify and 1 extend replays, a greedy one a single replay; a step with
    # a prefill chunk runs eager but for its verifies' d - 1 chain replays
    chained = graphs.replays - kinds.count("greedy") - kinds.count("sampled") * (steps + 1)
    assert chained % max(steps - 1, 1) == 0 and (chained > 0) == (steps > 1), (graphs.replays, kinds)
    assert 0 < len(seen) < steps_run[0], "some steps must run eager (prefill chunks, fewer drafts near the end)"
    assert forwards[0] > steps_run[0], "some steps must split into a prefill forward and the greedy graph"
    assert graphs_engine.flush_cache() and graphs_engine.kv_pool.num_free_pages == graphs_engine.kv_pool.num_pages


def test_draft_graph_replays_leave_the_target_capture_byte_identical(make_spec_engine: EngineFactory,
                                                                      mtp_ckpt: Path, tmp_path: Path) -> None:
    """The spy of test_spec_capture around every draft forward a graph replays (the stand-in re-runs the captured
    code, so the Drafter's chain and extend forwards inside the chain / extend graphs and inside the one-replay greedy
    graph): the capturer's buffers are byte-identical before and after, no recorder hook runs inside one. A greedy
    round (the greedy graph) and a sampled one (chain / verify / extend graphs). A trace records every row."""
    engine = make_spec_engine(model=mtp_ckpt, capture_weights=True, speculative_algorithm="NEXTN",
                              speculative_num_steps=3, **EXACT)
    graphs = install_spec_graphs(engine, (1, 2, 4))
    spy = CaptureSpy(engine.capturer)
    for name in ("chain_forward", "extend_forward"):
        spy.wrap(engine.runner.drafter, name)
    engine.start_trace(tmp_path / "trace", run_id="spy")
    outs, graph_steps = [], []
    for sp in ({"temperature": 0}, {"temperature": 1.0, "sampling_seed": 3}):
        before = graphs.graph_steps
        outs += engine.generate(input_ids=prompts(3, seed=4), sampling_params={**sp, "max_new_tokens": 12,
                                                                                "ignore_eos": True},
                                return_routed_experts=[True, False, True])
        graph_steps.append(graphs.graph_steps - before)
    engine.stop_trace()
    assert all("error" not in o for o in outs)
    assert min(graph_steps) >= 3 and spy.forwards >= 3 * 3, f"graphs must have replayed: {graph_steps}"
    assert spy.calls == [] and spy.changed == [], \
        f"draft replays called {spy.calls} / changed capture buffers {spy.changed}"


def test_exact_decode_graphs_are_eager_decode_bit_for_bit(make_spec_engine: EngineFactory, mtp_ckpt: Path) -> None:
    """Exact mode's decode under graphs (now capturable: device-masked attention, sync-free experts): 3 requests on
    a graph of 4, tokens, logprobs and routes equal eager decoding's."""
    graphs_engine, eager = make_spec_engine(model=mtp_ckpt, **EXACT), make_spec_engine(model=mtp_ckpt, **EXACT)
    graphs = install_decode_graphs(graphs_engine, (1, 2, 4))
    runs = [0]
    real_run = graphs.run

    def run(fb: ForwardBatch) -> torch.Tensor:
        runs[0] += 1
        return real_run(fb)

    graphs.run = run  # type: ignore[method-assign]
    sp = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    got = graphs_engine.generate(input_ids=prompts(3, seed=8), sampling_params=sp, **ASK)
    want = eager.generate(input_ids=prompts(3, seed=8), sampling_params=sp, **ASK)
    assert_same(got, want)
    assert runs[0] >= 8


def test_graph_contract_is_checked(make_spec_engine: EngineFactory, mtp_ckpt: Path) -> None:
    """An extend replay without the verify of its batch just before it, and a verify batch that does not fit, raise
    instead of reading another forward's static inputs."""
    engine: Engine = make_spec_engine(model=mtp_ckpt, speculative_algorithm="NEXTN", speculative_num_steps=2, **EXACT)
    graphs = install_spec_graphs(engine, (1, 2))
    rng = np.random.default_rng(0)
    fb = batch(rng, [5], [3])
    with pytest.raises(RuntimeError, match="without the verify of the same batch"):
        graphs.extend_forward(fb, fb.input_ids, torch.zeros(3, 8))
    with pytest.raises(ValueError, match=r"speculation graph: extend lengths \[4\], the graphs run 3 a request"):
        graphs.verify_forward(batch(rng, [5], [4]))
