"""Exact mode (EngineConfig.deterministic): batch invariance through Engine (tiny random checkpoints and
samples/model), the exact reduction tree and its shard split, and tp2 (tp4: slow) in real gloo processes
bitwise equal to the one-process exact model.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/engine/test_exact_mode.py  (-m slow: tp4)

Every comparison is bitwise (== on logprobs, torch.equal on tensors): exact mode promises equal bits, so no
tolerance is given. fp32 on CPU. With deterministic=False the batch-invariance tests fail (other bits).
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import r3trace
from bench.spawn import spawn_ranks
from bench.tiny_models import direct_forward, load_engine_model, make_checkpoint
from r3trace.engine.distributed import init_parallel
from r3trace.engine.engine_config import EngineConfig, EngineConfigError
from r3trace.engine.layers.exact import (
    ExactModeError,
    exact_linear,
    exact_sigmoid,
    exact_silu,
    exact_tree_reduce,
    tree_sum,
)
from r3trace.engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from r3trace.engine.parallel import ParallelInfo
from tests.engine.conftest import EngineFactory, greedy, random_prompts

# ---------------------------------------------------------------- (a) batch invariance through the Engine API

TARGET = random_prompts(1, 21, 21, seed=11)[0]
OTHERS = random_prompts(3, 5, 40, seed=12)  # different lengths: 5..40 tokens
ASK: dict[str, Any] = dict(return_logprob=True, logprob_start_len=0, return_routed_experts=True)


def _view(out: dict[str, Any]) -> tuple[Any, ...]:
    """What must not move: greedy tokens, input and output logprobs (exact floats), routes."""
    meta = out["meta_info"]
    return out["output_ids"], meta["input_token_logprobs"], meta["output_token_logprobs"], meta["routed_experts"]


def test_a_request_is_bitwise_the_same_in_any_batch_chunking_or_cache_state(make_engine: EngineFactory) -> None:
    params = greedy(8)
    alone = make_engine(deterministic=True, enable_prefix_cache=False)
    want = _view(alone.generate(input_ids=TARGET, sampling_params=params, **ASK))
    assert len(want[1]) == len(TARGET) and len(want[0]) == 8 and want[3]

    # beside 3 others of different lengths: prefill rows and decode batches of 4, 3, 2 ... rows
    batch = alone.generate(input_ids=[OTHERS[0], TARGET, *OTHERS[1:]], sampling_params=params, **ASK)
    assert _view(batch[1]) == want

    # chunk boundaries inside the target's prompt, and mixed extend + decode steps
    for chunk in (4, 7):
        chunked = make_engine(deterministic=True, enable_prefix_cache=False, chunked_prefill_size=chunk)
        outs = chunked.generate(input_ids=[*OTHERS[:2], TARGET], sampling_params=params, **ASK)
        assert _view(outs[2]) == want, f"chunked_prefill_size={chunk}"

    # a prefix-cache hit: the first 13 tokens' latents and routes come from another request's forward (which asks
    # for routes, so they are on the host to reuse). Input logprobs of cached tokens would need their logits, so
    # the match stops before logprob_start_len - 1.
    cached = make_engine(deterministic=True)
    cached.generate(input_ids=TARGET[:13] + OTHERS[0], sampling_params=greedy(2), return_routed_experts=True)
    hit = cached.generate(input_ids=TARGET, sampling_params=params, **{**ASK, "logprob_start_len": 14})
    assert hit["meta_info"]["cached_tokens"] == 13
    ids, in_lp, out_lp, routes = _view(hit)
    assert (ids, in_lp, out_lp, routes) == (want[0], want[1][14:], want[2], want[3])


def test_the_sample_model_is_batch_invariant_too() -> None:
    """samples/model (D = 256, 32 experts, top-4, V = 4096, trained weights): alone, in a batch of 4 at the end,
    and in 9-token chunks. With deterministic=False the batch comparison fails here (MKL's GEMMs)."""
    from r3trace.engine import Engine

    model = Path(__file__).resolve().parents[2] / "samples" / "model"
    prompts = random_prompts(4, 11, 47, seed=14)
    params = greedy(8)
    with Engine(model, deterministic=True, enable_prefix_cache=False) as e:
        want = _view(e.generate(input_ids=prompts[0], sampling_params=params, **ASK))
        assert _view(e.generate(input_ids=prompts[1:] + prompts[:1], sampling_params=params, **ASK)[3]) == want
    with Engine(model, deterministic=True, enable_prefix_cache=False, chunked_prefill_size=9) as e:
        assert _view(e.generate(input_ids=prompts[1:3] + prompts[:1], sampling_params=params, **ASK)[2]) == want


def test_replayed_routes_are_batch_invariant(make_engine: EngineFactory) -> None:
    """Forced routes (R3 replay) weigh their ids with the gate's scores: those too come out the same bits alone,
    beside other requests and in other chunks."""
    new = 16
    cfg = make_engine(deterministic=True).model_config
    rng = np.random.default_rng(13)
    routes = np.full((len(TARGET) + new - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok), -1, np.int32)
    for row in routes:
        for layer in cfg.moe_layer_ids:
            row[layer] = rng.choice(cfg.n_routed_experts, size=cfg.num_experts_per_tok, replace=False)
    replay = dict(ASK, routed_experts=routes)
    alone = make_engine(deterministic=True, enable_prefix_cache=False)
    first = alone.generate(input_ids=TARGET, sampling_params=greedy(new), **replay)
    np.testing.assert_array_equal(r3trace.decode_routed_experts(first["meta_info"]), routes)  # the forced ones
    want = _view(first)
    # Decode steps of 4 rows x 8 experts fill AVX-512 vectors where a lone row runs torch's scalar tail, so a
    # position-dependent op would see the target in both paths (an ulp in one weight can still round away).
    chunked = make_engine(deterministic=True, enable_prefix_cache=False, chunked_prefill_size=6)
    outs = chunked.generate(input_ids=[OTHERS[2], TARGET, *OTHERS[:2]], sampling_params=greedy(new),
                            **{**ASK, "routed_experts": [None, routes, None, None]})  # fmt: skip
    assert _view(outs[1]) == want


def test_deterministic_options_are_checked(tiny_ckpt: Path) -> None:
    from r3trace.engine import Engine

    for bad, field in [
        (dict(attention_backend="triton"), "attention_backend"),
        (dict(moe_backend="triton"), "moe_backend"),
        (dict(topk_backend="triton"), "topk_backend"),
        (dict(norm_backend="triton"), "norm_backend"),
        (dict(rope_backend="triton"), "rope_backend"),
    ]:
        with pytest.raises(EngineConfigError, match=f"^{field}="):
            EngineConfig(deterministic=True, **bad)
    # exact mode runs the shared experts separately unless told "fused" (every layout can run separate ones)
    assert not EngineConfig(deterministic=True).fuse_shared_experts
    assert EngineConfig(deterministic=True, shared_experts="fused").fuse_shared_experts
    with pytest.raises(EngineConfigError, match="^deterministic="):
        EngineConfig(deterministic="yes")  # type: ignore[arg-type]
    with pytest.raises(EngineConfigError, match="^attention_backend="):
        Engine(tiny_ckpt, deterministic=True, attention_backend="triton")
    cfg = EngineConfig(deterministic=True)
    resolved = (cfg.mla_impl, cfg.attention_impl, cfg.moe_impl, cfg.norm_impl, cfg.topk_impl)
    assert resolved == ("absorb", "exact", "exact", "exact", "exact")
    assert not cfg.fuse_shared_experts and cfg.graph_batch_sizes == ()
    assert (EngineConfig().mla_impl, EngineConfig().attention_impl) == ("auto", "ref")


# ---------------------------------------------------------------- (b) the reduction tree and its shard split


def test_tree_sum_is_the_adjacent_pair_tree_and_ignores_zero_padding() -> None:
    x = torch.tensor([1e8, 1.0, -1e8, 1.0, 3.0], dtype=torch.float32)
    # ((x0 + x1) + (x2 + x3)) + ((x4 + 0) + 0): 1e8 + 1 rounds to 1e8 and -1e8 + 1 to -1e8 in fp32
    assert tree_sum(x, 0).item() == 3.0
    left_to_right = torch.zeros((), dtype=torch.float32)
    for v in x:
        left_to_right = left_to_right + v
    assert left_to_right.item() == 4.0  # another order, other bits: the tree is the definition
    gen = torch.Generator().manual_seed(3)
    y = torch.randn(5, 37, 3, generator=gen)
    s = tree_sum(y, 1)  # [5, 3]
    assert torch.allclose(s.double(), y.double().sum(1), atol=1e-5)
    for extra in (27, 91):  # to 64 and to 128: the same bits
        padded = torch.cat([y, torch.zeros(5, extra, 3)], dim=1)
        assert torch.equal(tree_sum(padded, 1), s)


def test_exact_linear_sums_in_its_documented_tree() -> None:
    """In = 32: 8 blocks of 4. Block 0 holds [1e8, 1, -1e8, 1]: its tree is (1e8 + 1) + (-1e8 + 1) = 0 in fp32,
    where a left-to-right sum gives 1; the other blocks hold 2.0, 0.5, ... so the block tree adds exact values."""
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([1e8, 1.0, -1e8, 1.0])
    x[0, 4:] = torch.tensor([2.0, 0.5, 0.25, 0.125]).repeat(7)
    w = torch.ones(3, 32)
    assert exact_linear(x, w).tolist() == [[7 * 2.875] * 3]


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_row_parallel_shards_reduce_to_the_unsplit_exact_linear(ranks: int) -> None:
    gen = torch.Generator().manual_seed(ranks)
    t, in_f, out_f = 7, 96, 13  # odd T and Out; In / 8 = 12 (not a power of two: each block is padded)
    x, w = torch.randn(t, in_f, generator=gen), torch.randn(out_f, in_f, generator=gen)
    full = exact_linear(x, w)
    assert torch.allclose(full.double(), x.double() @ w.double().T, atol=1e-4)
    n = in_f // ranks
    parts = []
    for r in range(ranks):
        layer = RowParallelLinear(in_f, out_f, r, ranks, torch.float32, "cpu", matmul="exact")
        layer.weight.data.copy_(w[:, r * n : (r + 1) * n])
        parts.append(layer(x[:, r * n : (r + 1) * n]))
    assert torch.equal(exact_tree_reduce(parts), full)


def test_column_split_rows_and_chunking_do_not_change_bits() -> None:
    gen = torch.Generator().manual_seed(9)
    x, w = torch.randn(9, 40, generator=gen), torch.randn(11, 40, generator=gen)
    full = exact_linear(x, w)
    pieces = [exact_linear(x, w[a:b]) for a, b in [(0, 3), (3, 4), (4, 11)]]  # uneven output slices
    assert torch.equal(torch.cat(pieces, dim=1), full)
    rows = torch.cat([exact_linear(x[i : i + 1], w) for i in range(9)])  # one row at a time
    assert torch.equal(rows, full)
    with pytest.raises(ExactModeError, match="in_features=12 is not a multiple of the 8"):
        ColumnParallelLinear(12, 5, 0, 1, torch.float32, "cpu", matmul="exact")
    with pytest.raises(ExactModeError, match="in_features=10 is not a multiple of the 4"):
        RowParallelLinear(20, 5, 0, 2, torch.float32, "cpu", matmul="exact")  # a shard of 10 in 8 / 2 blocks
    with pytest.raises(ExactModeError, match="power-of-two"):
        exact_tree_reduce([full] * 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sync_free_experts_are_the_exact_experts_bit_for_bit(dtype: torch.dtype) -> None:
    """exact_experts_gathered (what an exact engine that captures CUDA graphs runs: no host sync) against
    exact_experts: 13 tokens, K = 3 with ids of -1, D = 1000 and I = 504 (blocks of 125 and 63: the block split
    shows in the bits) so that exact_pair_linear's chunks (4 pairs of w13) cut through an expert's pairs; and a row
    of exact_pair_linear is exact_linear's."""
    from r3trace.engine.layers.exact import exact_pair_linear
    from r3trace.engine.layers.moe import exact_experts, exact_experts_gathered, make_experts_fn

    gen = torch.Generator().manual_seed(3)
    t, k, e, i, d = 13, 3, 5, 504, 1000
    x = torch.randn(t, d, generator=gen).to(dtype)
    w13, w2 = torch.randn(e, 2 * i, d, generator=gen).to(dtype), torch.randn(e, d, i, generator=gen).to(dtype)
    ids = torch.randint(-1, e, (t, k), generator=gen, dtype=torch.int32)
    weights = torch.rand(t, k, generator=gen)
    assert (ids < 0).any()
    want = exact_experts(x, w13, w2, ids, weights)
    assert torch.equal(exact_experts_gathered(x, w13, w2, ids, weights).view(torch.int16 if dtype == torch.bfloat16
                                                                                else torch.int32),
                       want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    idx = torch.tensor([4, 0, 4, 2], dtype=torch.int64)
    xs = x[:4, :i].contiguous()  # [4, I]: rows into w2's [D, I]
    rows = torch.cat([exact_linear(xs[r : r + 1], w2[j]) for r, j in enumerate(idx.tolist())])
    assert torch.equal(exact_pair_linear(xs, w2, idx), rows)
    assert (make_experts_fn("exact"), make_experts_fn("exact", graphs=True)) == (exact_experts, exact_experts_gathered)


def test_exact_attention_over_a_longer_key_window_keeps_its_bits() -> None:
    """A CUDA graph's exact attention reads the longest context's keys, masked by the request's prefix length on the
    device: 5 queries after 11 cached keys over the 16 real keys, or over a 64-key window whose keys past them hold
    stale values (inf, NaN here), give the same bits, -0.0 included (value channel 0 is -0.0 on every real key)."""
    from r3trace.engine.layers.exact import exact_attention

    gen = torch.Generator().manual_seed(4)
    q = torch.randn(5, 2, 8, generator=gen)
    k, v = torch.randn(64, 2, 8, generator=gen), torch.randn(64, 2, 6, generator=gen)
    v[:, :, 0] = -0.0
    v[20], v[30], k[40] = float("inf"), float("nan"), float("nan")

    def bits(x: torch.Tensor) -> torch.Tensor:
        return x.view(torch.int32)

    want = exact_attention(q, k[:16], v[:16], 0.3)
    assert torch.equal(bits(exact_attention(q, k, v, 0.3, torch.tensor(11))), bits(want))
    assert torch.equal(bits(exact_attention(q, k[:16], v[:16], 0.3, torch.tensor(11))), bits(want))
    assert not torch.equal(exact_attention(q, k[:16], v[:16], 0.3, torch.tensor(10)), want)  # one key fewer seen


def test_elementwise_ops_are_position_free() -> None:
    """A value's bits must not depend on where it sits in the tensor: torch's CPU sigmoid/silu take a scalar
    path on a chunk's tail elements; exp, and exact_sigmoid / exact_silu built on it, do not."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(4)) * 8
    for f in (torch.exp, exact_sigmoid, exact_silu):
        full = f(x)
        for n in (1, 3, 17, 33, 100):
            for s in range(0, 600, n):
                assert torch.equal(f(x[s : s + n]), full[s : s + n]), (f, n, s)
    assert torch.allclose(exact_silu(x), F.silu(x), rtol=1e-6, atol=1e-7)
    assert torch.allclose(exact_sigmoid(x), torch.sigmoid(x), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- (c) tp2 (and tp4) in gloo processes

# (checkpoint config, mla_path): absorbed (exact mode's default) and forced normal, q_b_proj and q_proj heads,
# a V2 softmax stack with no dense layer
CASES = [
    ("v3_noaux_groups", "auto"),
    ("v3_noaux_groups", "normal"),
    ("v3_qproj_nonorm", "auto"),
    ("v2_group_limited", "auto"),
]
TOKENS = torch.randint(2, 320, (23,), generator=torch.Generator().manual_seed(5)).tolist()


def _run(ckpts: dict[str, Path], parallel: ParallelInfo | None) -> list[dict[str, Any]]:
    out = []
    for name, mla_path in CASES:
        model = load_engine_model(ckpts[name], parallel=parallel, deterministic=True, mla_path=mla_path)
        logits, routes = direct_forward(model, TOKENS)
        out.append({"logits": logits, "routes": {k: v.clone() for k, v in routes.items()}})
    return out


def _worker(rank: int, tp: int, store: str, ckpts: dict[str, Path], out_dir: Path) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    timeout = timedelta(seconds=60)  # a failed rank must not leave the other in gloo's 30-minute default
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=tp, timeout=timeout)
    try:
        torch.save(_run(ckpts, init_parallel(tp, timeout=timeout)), out_dir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


# tp4: one head, a quarter of o_proj's and the dense MLP's inputs (2 of the 8 reduction blocks) per rank
@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tp_exact_is_bitwise_the_one_process_exact_model(tmp_path: Path, tp: int) -> None:
    ckpts = {name: make_checkpoint(tmp_path / name, name, seed=7) for name in {c[0] for c in CASES}}
    spawn_ranks(_worker, (tp, str(tmp_path / "store"), ckpts, tmp_path), tp)
    ref = _run(ckpts, None)
    for rank in range(tp):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for case, r, g in zip(CASES, ref, got, strict=True):
            diff = (g["logits"] - r["logits"]).abs().max().item()
            assert torch.equal(g["logits"], r["logits"]), f"rank {rank} {case}: logits differ by up to {diff:.2e}"
            assert sorted(g["routes"]) == sorted(r["routes"]), case
            for layer_id, ids in r["routes"].items():
                assert torch.equal(g["routes"][layer_id], ids), f"rank {rank} {case} layer {layer_id}: routes differ"


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    raise SystemExit(pytest.main([__file__, "-q"]))
