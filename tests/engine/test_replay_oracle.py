"""Routing replay against an outside oracle: transformers with its gates routed to the same forced ids.

Semantics (docs/replay.md), as Megatron-LM's RouterReplay (megatron/core/transformer/moe/router_replay.py,
RouterReplay.get_replay_topk, at NVIDIA/Megatron-LM@d98e8a64ddf34856e74b24714e3bedb2f5a39553) and slime's R3
(slime/utils/routing_replay.py, get_routing_replay_compute_topk, at
THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515) use them: the forced ids on the forced rows, weights =
the gate's own scores at those ids, normalised and scaled as the model's routing does.
tests/engine/hf_forced_routes.py patches transformers' gate so that its own code computes those weights.

Every prompt and output logprob of every request is compared with transformers' over the final sequence,
greedy tokens must be transformers' argmax, and the returned routes must be the forced ids, with random valid
routes (seeded) on every prompt and decode row, through batches of different lengths, chunked prefill, pages
of several slots, a stream beside a batch, a prefix-cache hit on forced rows, preemption, and partial replay.
Configs: DeepSeek-V3 sigmoid/noaux_tc with groups (norm_topk_prob, routed_scaling_factor 2.5, q_lora),
DeepSeek-V2 softmax/greedy (no renormalisation, no q_lora), DeepSeek-V3 without renormalisation (scaling 1.7,
no q_lora), and behind the slow marker two dense layers with YaRN; both MLA paths (normal on prefix-free
prefill, absorbed elsewhere, by default; all absorbed with mla_path="absorb"; all normal behind slow).

Tolerance 1e-4 on logprobs, fp32 end to end: the engine and transformers differ only in summation order
(KV cache, paging, chunking, batching); the worst difference over these tests was 1.9e-6 (torch 2.13, CPU),
as test_hf_equivalence.py's direct forward (3.3e-6), so 1e-4 leaves 50x for other CPUs' BLAS. The forced
routes are visible far above it: every check also requires a logprob more than 0.1 away from transformers
with its gate's own routes (the smallest such gap here was 0.15).

Run: .venv/bin/pytest -q tests/engine/test_replay_oracle.py
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import r3trace
from bench.tiny_models import load_hf, make_checkpoint
from r3trace.engine import Engine
from r3trace.engine.model_config import ModelConfig
from tests.engine.conftest import greedy, random_prompts
from tests.engine.hf_forced_routes import hf_logprobs

ATOL = 1e-4
NATURAL_GAP = 0.1  # every check's forced routes move some logprob by more than this from natural routing
WORST: list[float] = []  # the largest difference each check saw (for the tolerance note above)
GAP: list[float] = []  # the largest difference from transformers' natural routing each check saw


class Oracle:
    def __init__(self, ckpt: Path) -> None:
        self.ckpt = ckpt
        self.hf = load_hf(ckpt)
        self.cfg = ModelConfig.from_hf(ckpt)

    def random_routes(self, rows: int, seed: int) -> np.ndarray:
        """[rows, L, K] int32: K distinct experts per row and MoE layer, -1 on dense layers."""
        rng = np.random.default_rng(seed)
        c = self.cfg
        out = np.full((rows, c.num_hidden_layers, c.num_experts_per_tok), -1, np.int32)
        for r in range(rows):
            for layer in c.moe_layer_ids:
                out[r, layer] = rng.choice(c.n_routed_experts, size=c.num_experts_per_tok, replace=False)
        return out

    def check(
        self, prompt: list[int], result: dict[str, Any], routes: np.ndarray, start: int = 0, logprob_start: int = 0
    ) -> float:
        """routes [n, L, K] forced on positions [start, start + n): logprobs (of prompt tokens from
        logprob_start on, and of every output token), tokens and routes against transformers over the final
        sequence; returns the worst logprob difference."""
        out_ids = result["output_ids"]
        seq = prompt + out_ids
        rows = len(seq) - 1
        full = np.full((rows, *routes.shape[1:]), -1, np.int32)
        mask = np.zeros(rows, bool)
        end = min(start + len(routes), rows)
        full[start:end], mask[start:end] = routes[: end - start], True
        lp = hf_logprobs(self.hf, seq[:rows], full, mask)  # [rows, V]: position p scores token p + 1
        meta = result["meta_info"]
        p = len(prompt)
        first = max(logprob_start, 1)  # token 0 has no logprob (SGLang reports None)
        entries = meta["input_token_logprobs"][first - logprob_start :]
        assert [x[1] for x in entries] == seq[first:p]
        got_in = torch.tensor([x[0] for x in entries])
        want_in = lp[torch.arange(first - 1, p - 1), torch.tensor(seq[first:p])]
        got_out = torch.tensor([x[0] for x in meta["output_token_logprobs"]])
        pos = torch.arange(p - 1, p - 1 + len(out_ids))  # the positions that score the output tokens
        want_out = lp[pos, torch.tensor(out_ids)]
        worst = max((got_in - want_in).abs().max().item() if p > first else 0.0,
                    (got_out - want_out).abs().max().item())
        nat = hf_logprobs(self.hf, seq[:rows], full, np.zeros(rows, bool))  # the gate's own routes everywhere
        gap = max((got_in - nat[torch.arange(first - 1, p - 1), torch.tensor(seq[first:p])]).abs().max().item()
                  if p > first else 0.0, (got_out - nat[pos, torch.tensor(out_ids)]).abs().max().item())
        WORST.append(worst)
        GAP.append(gap)
        assert worst < ATOL, f"worst logprob difference {worst:.2e}"
        assert gap > NATURAL_GAP, f"forced routes moved the logprobs by {gap:.2e} only: the check cannot see them"
        assert lp[pos].argmax(-1).tolist() == out_ids, "greedy tokens differ from transformers' argmax"
        returned = r3trace.decode_routed_experts(meta)
        assert returned.shape[0] == rows
        np.testing.assert_array_equal(returned[mask], full[mask])
        return worst


@pytest.fixture(scope="module", params=["v3_noaux_groups", "v2_softmax_greedy", "v3_qproj_nonorm",
                                        pytest.param("v3_dense2_yarn", marks=pytest.mark.slow)])
def oracle(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Oracle:
    return Oracle(make_checkpoint(tmp_path_factory.mktemp("oracle") / request.param, request.param, seed=5))


def kw(routes: Any, new: int, start: Any = None) -> dict[str, Any]:
    return dict(sampling_params=greedy(new), routed_experts=routes, routed_experts_replay_start_len=start,
                return_routed_experts=True, return_logprob=True, logprob_start_len=0)


@pytest.mark.parametrize("mla_path", ["auto", "absorb", pytest.param("normal", marks=pytest.mark.slow)])
def test_batch_stream_and_cache_hit_match_transformers(oracle: Oracle, mla_path: str) -> None:
    """Four requests of 5-17 tokens in 8-token chunks on 4-slot pages, a streamed one beside them, then a
    second turn whose first rows replay the first turn's routes and come from the prefix cache."""
    engine = Engine(oracle.ckpt, chunked_prefill_size=8, page_size=4, mla_path=mla_path)
    try:
        prompts = random_prompts(4, 5, 17, seed=40)
        new = 6
        routes = [oracle.random_routes(len(p) + new - 1, seed=41 + i) for i, p in enumerate(prompts)]
        batch: dict[str, Any] = {}
        runner = threading.Thread(target=lambda: batch.update(out=engine.generate(
            input_ids=prompts, **{**kw(routes, new), "routed_experts_replay_start_len": [None] * 4})))
        runner.start()
        sp = random_prompts(1, 11, 11, seed=45)[0]
        s_routes = oracle.random_routes(len(sp) + 7 - 1, seed=46)
        chunks = list(engine.generate(input_ids=sp, stream=True, **kw(s_routes, 7)))
        runner.join()
        for p, r, out in zip(prompts, routes, batch["out"], strict=True):
            oracle.check(p, out, r)
        oracle.check(sp, joined(chunks), s_routes)
        # turn 2 of the first conversation: its first rows force the first turn's routes (cached KV, flagged
        # forced, reused), the rest new random routes
        seq = prompts[0] + batch["out"][0]["output_ids"]
        p2 = seq + [7, 8, 9]
        r2 = np.concatenate([routes[0], oracle.random_routes(len(p2) + 4 - 1 - len(routes[0]), seed=47)])
        two = engine.generate(input_ids=p2, **{**kw(r2, 4), "logprob_start_len": len(p2) - 1})
        assert two["meta_info"]["cached_tokens"] == len(routes[0]) // 4 * 4
        oracle.check(p2, two, r2, logprob_start=len(p2) - 1)
    finally:
        engine.shutdown()


def joined(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A stream's chunks as one result: ids, output logprobs and routes concatenated (routes by offset)."""
    out_ids = [t for c in chunks for t in c["output_ids"]]
    inputs = max((c["meta_info"].get("input_token_logprobs", []) for c in chunks), key=len)
    outputs = [x for c in chunks for x in c["meta_info"]["output_token_logprobs"]]
    parts = []
    for c in chunks:
        if "routed_experts" in c["meta_info"]:
            assert c["meta_info"]["routed_experts_offset"] == sum(len(x) for x in parts)
            parts.append(r3trace.decode_routed_experts(c["meta_info"]))
    ids = np.concatenate(parts)
    from r3trace.capture.wire import encode_int32

    meta = {"input_token_logprobs": inputs, "output_token_logprobs": outputs, "routed_experts": encode_int32(ids),
            "routed_experts_shape": list(ids.shape), "routed_experts_dtype": "int32"}
    return {"output_ids": out_ids, "meta_info": meta}


def test_preempted_replays_match_transformers(oracle: Oracle) -> None:
    """A 64-slot pool cannot hold five requests of 8-14 + 12 tokens: the newest are retracted and re-prefilled
    (prompt + tokens so far) under their forced routes."""
    engine = Engine(oracle.ckpt, kv_pool_tokens=64, page_size=4, chunked_prefill_size=16)
    try:
        prompts = random_prompts(5, 8, 14, seed=50)
        routes = [oracle.random_routes(len(p) + 12 - 1, seed=51 + i) for i, p in enumerate(prompts)]
        outs = engine.generate(input_ids=prompts, **{**kw(routes, 12), "routed_experts_replay_start_len": [None] * 5})
        assert engine.scheduler.num_retractions > 0
        for p, r, out in zip(prompts, routes, outs, strict=True):
            oracle.check(p, out, r)
    finally:
        engine.shutdown()


def test_partial_replays_match_transformers(oracle: Oracle) -> None:
    """Forced rows only in [s, s + n), the gate's own routes elsewhere, on both sides: prompt rows only (decode
    rows free), a range across the prompt's end, decode rows only, and a middle range of the prompt."""
    engine = Engine(oracle.ckpt, chunked_prefill_size=8, page_size=2)
    try:
        prompts = random_prompts(4, 10, 15, seed=60)
        new = 6
        ranges = [(0, len(prompts[0])), (len(prompts[1]) - 2, 4), (len(prompts[2]) + 1, 3), (3, 5)]
        routes = [oracle.random_routes(n, seed=61 + i) for i, (_, n) in enumerate(ranges)]
        outs = engine.generate(input_ids=prompts, **kw(routes, new, start=[s for s, _ in ranges]))
        for p, r, (s, _), out in zip(prompts, routes, ranges, outs, strict=True):
            oracle.check(p, out, r, start=s)
    finally:
        engine.shutdown()
