"""Speculation under real CUDA graphs (GPU only): the chain, verify and extend graphs replayed against the eager
path, which stays the reference (cuda_graph_batch_sizes=()).

Run (GPU): python -m pytest -q -m gpu tests/spec/test_spec_graphs_gpu.py

- exact mode (deterministic=True, fp32): a row's bits do not depend on its batch, so graphs (padded batches, the
  longest context's key window) give eager speculation's tokens, logprobs and routes bit for bit;
- default bf16 mode on the sample model (samples/model, its MTP layer) with the triton backends: the same greedy
  tokens (bf16 GEMMs of a padded graph batch may round differently from the eager batch's, so routes are compared
  by bench/spec_decode.py against plain decoding with near ties excluded, not here);
- the draft graphs never touch the target's capture: its buffers are byte-identical around every draft replay.
The CPU runs the same paths through an eager stand-in (tests/spec/test_spec_graphs.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from r3trace.engine import Engine
from r3trace.engine.cuda_graph import CudaGraphCapture
from r3trace.engine.spec.graphs import SpecGraphs
from tests.engine.conftest import EngineFactory
from tests.spec.conftest import VOCAB
from tests.spec.test_spec_greedy import ASK, assert_mixed_acceptance, assert_same

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = Path(__file__).resolve().parents[2]
TRITON: dict[str, Any] = dict(attention_backend="triton", moe_backend="triton", topk_backend="triton",
                              norm_backend="triton", rope_backend="triton", device="cuda")
SIZES = (1, 2, 4, 8)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, VOCAB, size=int(rng.integers(4, 30))).tolist() for _ in range(n)]


def spec_graphs(engine: Engine) -> SpecGraphs:
    graphs = engine.runner.spec_graphs
    assert isinstance(graphs, SpecGraphs) and graphs.batch_sizes == SIZES
    return graphs


def test_exact_mode_graphs_are_eager_bit_for_bit(make_spec_engine: EngineFactory, mtp_ckpt: Path) -> None:
    """fp32 exact mode, d = 3, 5 then 3 requests (graphs of 8 and 4: padded), greedy with different lengths and one
    seeded sampled request: tokens, logprobs and routes of the graph engine equal the eager engine's."""
    opts = dict(deterministic=True, device="cuda", speculative_algorithm="NEXTN", speculative_num_steps=3,
                max_context_len=64, chunked_prefill_size=48)
    graphs_engine = make_spec_engine(model=mtp_ckpt, cuda_graph_batch_sizes=SIZES, **opts)
    eager = make_spec_engine(model=mtp_ckpt, cuda_graph_batch_sizes=(), **opts)
    graphs = spec_graphs(graphs_engine)
    assert eager.runner.spec_graphs is None
    first = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (9, 16, 16, 12, 16)]
    second = [{"temperature": 0, "max_new_tokens": 14, "ignore_eos": True},
              {"temperature": 1.0, "top_p": 0.9, "sampling_seed": 5, "max_new_tokens": 14, "ignore_eos": True},
              {"temperature": 0, "max_new_tokens": 14, "ignore_eos": True}]
    got, want = [], []
    for ids, sp in ((prompts(5, 1), first), (prompts(3, 2), second)):
        got += graphs_engine.generate(input_ids=ids, sampling_params=sp, **ASK)
        want += eager.generate(input_ids=ids, sampling_params=sp, **ASK)
    assert_same(got, want)
    assert_mixed_acceptance(got)
    assert graphs.replays > 0
    assert graphs_engine.flush_cache() and graphs_engine.kv_pool.num_free_pages == graphs_engine.kv_pool.num_pages


def test_bf16_sample_model_graphs_give_eager_greedy_tokens() -> None:
    """samples/model in bf16 with the triton backends, d = 3, 8 held-out prompts cut to 200 tokens, 48 greedy tokens
    each: the same tokens with graphs as eager. 8 requests on the graph of 8, so the verify's GEMMs see eager's shapes
    (a padded graph's bigger M may pick other tiles and round differently); the chain's attention split count comes
    from the longest context in the graph, which moves draft logits by rounding only. One prefill step for all 8
    (chunked_prefill_size 2048 >= 8 x 200): with 512, requests 0 and 1 verify beside the others' prefill chunks, which
    eager runs as one forward (the extend kernel, M = chunk + verify rows) and the graph engine as two (the verify's
    short-extend kernel, M = 8), and request 0 left plain greedy at a near tie by token 11. A token could then differ
    only at a near tie of bf16 logits."""
    from r3trace.engine.tokenizer import load_tokenizer

    model = ROOT / "samples" / "model"
    tok = load_tokenizer(model, 4096)
    rows = [json.loads(line) for line in (ROOT / "samples" / "prompts.jsonl").read_text().splitlines() if line]
    ids = [tok.encode(r["text"])[:200] for r in rows[::5][:8]]
    opts = dict(dtype="bfloat16", page_size=64, speculative_algorithm="NEXTN", speculative_num_steps=3,
                max_running_requests=8, chunked_prefill_size=2048, **TRITON)
    sp = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
    with Engine(model, cuda_graph_batch_sizes=SIZES, **opts) as graphs_engine:
        got = graphs_engine.generate(input_ids=ids, sampling_params=sp)
        assert spec_graphs(graphs_engine).replays > 0
    with Engine(model, cuda_graph_batch_sizes=(), **opts) as eager:
        want = eager.generate(input_ids=ids, sampling_params=sp)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a["output_ids"] == b["output_ids"], f"request {i}"


def test_draft_graph_replays_leave_the_target_capture_byte_identical(make_spec_engine: EngineFactory,
                                                                      mtp_ckpt: Path, tmp_path: Path) -> None:
    """triton backends (the fused top-k writes capture's device buffer itself), a trace recording every row, sampled
    requests (the chain / verify / extend graphs; greedy steps replay one graph: the test below): around every chain
    and extend replay the capturer's device and host buffers are byte-identical (synchronised reads)."""
    engine = make_spec_engine(model=mtp_ckpt, capture_weights=True, speculative_algorithm="NEXTN",
                              speculative_num_steps=3, cuda_graph_batch_sizes=SIZES, **TRITON)
    graphs = spec_graphs(engine)
    assert isinstance(graphs._verify[1][0].__self__, torch.cuda.CUDAGraph)  # real graphs, not a stand-in
    cap = engine.capturer
    changed, replays = [], [0]

    def state() -> list[np.ndarray]:
        torch.cuda.synchronize()
        b = cap.buffers
        dev = [t.contiguous().view(torch.uint8).cpu().numpy() for t in (b.dev_ids, b.dev_weights) if t is not None]
        return dev + [b.host_ids.copy(), b.kv_forward.copy(), b.rows_forward.copy()]

    for name in ("chain_forward", "extend_forward"):
        real = getattr(graphs, name)

        def spied(*args: Any, _real: Any = real) -> Any:
            before = state()
            out = _real(*args)
            after = state()
            replays[0] += 1
            changed.extend(i for i, (a, b) in enumerate(zip(before, after, strict=True)) if not np.array_equal(a, b))
            return out

        setattr(graphs, name, spied)
    engine.start_trace(tmp_path / "trace", run_id="spy")
    outs = engine.generate(input_ids=prompts(5, 3), sampling_params={"temperature": 1.0, "sampling_seed": 2,
                                                                     "max_new_tokens": 16, "ignore_eos": True},
                           return_routed_experts=[True, False, True, False, True])
    engine.stop_trace()
    assert all("error" not in o for o in outs)
    assert replays[0] >= 3 and changed == [], f"{replays[0]} draft replays changed capture buffers {changed}"


def test_greedy_graph_writes_only_the_verify_routes(make_spec_engine: EngineFactory, mtp_ckpt: Path) -> None:
    """The one-replay greedy graph (chain drafts, verify, acceptance, extend: spec/greedy_step.py) cannot be split
    around its draft forwards, so it is compared whole: on the same static batch, the capturer's device buffers
    (filled with a sentinel first) after one greedy-graph replay equal those after a replay of the verify graph alone:
    the draft forwards inside it write no route row of a request. One step a launch: a chained launch replays the
    S-step graph instead (its draft forwards are checked by the CPU spy, tests/spec/test_spec_graphs.py, and its routes
    against plain decoding bitwise by tests/spec/test_batch_invariant_gpu.py)."""
    engine = make_spec_engine(model=mtp_ckpt, capture_weights=True, speculative_algorithm="NEXTN",
                              speculative_num_steps=3, speculative_launch_steps=1, cuda_graph_batch_sizes=SIZES,
                              **TRITON)
    graphs = spec_graphs(engine)
    sizes: list[int] = []
    greedy_step = graphs.greedy_step

    def spied(fb: Any) -> Any:
        sizes.append(fb.batch_size)
        return greedy_step(fb)

    graphs.greedy_step = spied  # type: ignore[method-assign]
    engine.generate(input_ids=prompts(5, 3), sampling_params={"temperature": 0, "max_new_tokens": 16,
                                                              "ignore_eos": True}, return_routed_experts=True)
    assert graphs.graph_steps > 0 and graphs.replays == graphs.graph_steps, "greedy steps replay one graph each"

    def replay_both() -> list[list[torch.Tensor]]:
        # The static batch holds the last greedy step's requests, and past that step's graph size the rows of an
        # older, larger step (the last steps run fewer requests: 3 of 5 on a CPU run of this scenario). Those stale
        # rows read KV slots that the last step's rows write in the same replay, so they race between replays:
        # padding them leaves only the last step's requests, whose reads no other row of the replay writes.
        graphs.verify_batch.pad(sizes[-1], 8)
        b = engine.capturer.buffers
        bufs = [t for t in (b.dev_ids, b.dev_weights) if t is not None]
        states = []
        for replay in (graphs._step[8][0], graphs._verify[8][0]):
            for t in bufs:
                t.fill_(-7)
            replay()
            torch.cuda.synchronize()
            states.append([t.clone() for t in bufs])
        return states

    step, verify = engine.core.loop.call(replay_both)
    # rows of the static batch whose KV slot is a request's: padding requests all write the pool's padding slot and
    # their extend attention reads it back, so their rows race between replays (they are never copied out)
    real = graphs.verify_batch.out_cache_loc[: 8 * graphs.tokens] != engine.kv_pool.pad_slot  # [8 n]
    assert real.any()
    rows = real.numel()  # buffers are [L, rows, K]: the static batch writes rows [0, 8 n)
    assert (step[0][:, :rows][:, real] != -7).all(), "the verify inside the greedy graph wrote every request row"
    assert all(torch.equal(a[:, :rows][:, real], b[:, :rows][:, real]) for a, b in zip(step, verify, strict=True))


def test_capture_is_one_pool_of_real_graphs() -> None:
    """CudaGraphCapture: a callable recorded once; replay recomputes from the static input in place."""
    x = torch.zeros(4, device="cuda")
    capture = CudaGraphCapture()
    replay, (y,) = capture(lambda: (x * 2 + 1,))
    x.copy_(torch.arange(4.0, device="cuda"))
    replay()
    torch.cuda.synchronize()
    assert y.tolist() == [1.0, 3.0, 5.0, 7.0] and len(capture.graphs) == 1
