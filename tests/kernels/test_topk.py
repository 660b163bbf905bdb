"""grouped_topk (Triton) against grouped_topk_ref (DeepSeek's gate in torch), and that reference (the
repository's only one: the engine's ref backend runs it too) against transformers' own gate modules.

Run: TRITON_INTERPRET=1 .venv/bin/pytest tests/kernels/test_topk.py -q   (CPU)
     python -m pytest tests/kernels/test_topk.py -q                                (GPU)
"""

from __future__ import annotations

import pytest
import torch

from bench.tiny_models import CONFIGS as TINY_CONFIGS
from bench.tiny_models import hf_config
from r3trace.kernels.contract import KernelInputError
from r3trace.kernels.router_logits import router_logits, router_logits_ref
from r3trace.kernels.topk import grouped_topk, grouped_topk_ref, sum_partials
from tests.kernels.conftest import DEVICE, gpu, requires_gpu, requires_triton

pytestmark = requires_triton

# (E, K, scoring, method, n_group, topk_group, norm, scale, bias)
CONFIGS = [
    (256, 8, "sigmoid", "noaux_tc", 8, 4, True, 2.5, True),  # DeepSeek-V3
    (160, 6, "softmax", "group_limited_greedy", 8, 3, False, 16.0, False),  # DeepSeek-V2
    (64, 6, "softmax", "greedy", 1, 1, False, 1.0, False),  # DeepSeek-V2-Lite
    (12, 3, "softmax", "group_limited_greedy", 3, 2, True, 1.0, False),  # odd: 3 groups of 4
    (12, 4, "sigmoid", "noaux_tc", 3, 2, True, 1.5, True),
    (20, 2, "sigmoid", "noaux_tc", 5, 1, False, 1.0, False),  # noaux_tc without a bias
    (7, 7, "softmax", "greedy", 1, 1, True, 1.0, False),  # K = E
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"E{c[0]}-K{c[1]}-{c[3]}-g{c[4]}")
@pytest.mark.parametrize("T", [1, 37])
def test_grouped_topk_matches_ref(cfg: tuple, T: int, poisoned_empty: None) -> None:
    E, K, scoring, method, n_group, topk_group, norm, scale, with_bias = cfg
    gen = torch.Generator().manual_seed(T * 1000 + E)
    logits = torch.randn(T, E, generator=gen).to(DEVICE) * 3  # spread: softmax far from uniform
    bias = (torch.randn(E, generator=gen) * 0.1).to(DEVICE) if with_bias else None
    args = (bias, K, scoring, method, n_group, topk_group, norm, scale)
    weights, ids = grouped_topk(logits, *args)
    ref_weights, ref_ids = grouped_topk_ref(logits, *args)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids), "expert ids (and their gate-rank order) must match exactly"
    # fp32 throughout; the kernel's softmax sums in another order: a few fp32 ulps of weights <= scale
    torch.testing.assert_close(weights, ref_weights, atol=1e-6 * scale, rtol=1e-5)


def test_grouped_topk_rejects_bad_arguments() -> None:
    logits = torch.randn(4, 12, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    bias = torch.zeros(12, device=DEVICE)
    with pytest.raises(KernelInputError, match="correction_bias"):
        grouped_topk(logits, bias, 2, "sigmoid", "greedy", 1, 1, False, 1.0)
    with pytest.raises(KernelInputError, match="exceeds"):
        grouped_topk(logits, None, 5, "softmax", "group_limited_greedy", 3, 1, False, 1.0)
    with pytest.raises(KernelInputError, match="divisible"):
        grouped_topk(logits, None, 2, "softmax", "group_limited_greedy", 5, 1, False, 1.0)
    with pytest.raises(KernelInputError, match="dtype"):
        grouped_topk(logits.half(), None, 2, "softmax", "greedy", 1, 1, False, 1.0)


@gpu
@requires_gpu
def test_grouped_topk_v3_many_tokens_gpu() -> None:
    """DeepSeek-V3 routing at prefill size: 4099 tokens crosses many programs and a ragged last one."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4099, 256, generator=gen).cuda()
    bias = (torch.randn(256, generator=gen) * 0.1).cuda()
    args = (bias, 8, "sigmoid", "noaux_tc", 8, 4, True, 2.5)
    weights, ids = grouped_topk(logits, *args)
    ref_weights, ref_ids = grouped_topk_ref(logits, *args)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=2.5e-6, rtol=1e-5)


def test_ids_out_is_written_in_place() -> None:
    """The route capturer hands the kernel a [T, K] view of its layer-major buffer: ids land there."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(13, 16, generator=gen).to(DEVICE)
    bias = (torch.randn(16, generator=gen) * 0.1).to(DEVICE)
    buf = torch.full((3, 20, 4), -7, dtype=torch.int32, device=DEVICE)  # [M, R, K], layer 1 rows [:13]
    args = (4, "sigmoid", "noaux_tc", 4, 2, True, 2.5)
    weights, ids = grouped_topk(logits, bias, *args, ids_out=buf[1, :13])
    assert ids.data_ptr() == buf[1, :13].data_ptr()
    ref_w, ref_ids = grouped_topk_ref(logits, bias, *args)
    assert torch.equal(buf[1, :13].long(), ref_ids.long())
    assert (buf[1, 13:] == -7).all() and (buf[0] == -7).all() and (buf[2] == -7).all()  # nothing else written
    torch.testing.assert_close(weights, ref_w)


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[2], CONFIGS[3]], ids=lambda c: f"E{c[0]}-K{c[1]}-{c[3]}")
@pytest.mark.parametrize("n_shared", [1, 2])
@pytest.mark.parametrize("capture", [False, True])
def test_shared_columns_appended(cfg: tuple, n_shared: int, capture: bool, poisoned_empty: None) -> None:
    """n_shared = S: [T, K + S] routes for the fused MoE (the ref's routes, then ids E..E+S-1 of weight 1.0);
    with a capture buffer, it gets the [T, K] routed ids alone and nothing else of it is written."""
    E, K, scoring, method, n_group, topk_group, norm, scale, with_bias = cfg
    T = 37
    gen = torch.Generator().manual_seed(E + n_shared)
    logits = torch.randn(T, E, generator=gen).to(DEVICE) * 3
    bias = (torch.randn(E, generator=gen) * 0.1).to(DEVICE) if with_bias else None
    args = (bias, K, scoring, method, n_group, topk_group, norm, scale)
    buf = torch.full((2, T + 3, K), -7, dtype=torch.int32, device=DEVICE)  # [M, R, K], layer 1 rows [:T]
    weights, ids = grouped_topk(logits, *args, ids_out=buf[1, :T] if capture else None, n_shared=n_shared)
    ref_w, ref_ids = grouped_topk_ref(logits, *args)
    assert ids.shape == weights.shape == (T, K + n_shared)
    shared_ids = torch.arange(E, E + n_shared, dtype=torch.int32, device=DEVICE).expand(T, -1)
    assert torch.equal(ids, torch.cat([ref_ids, shared_ids], dim=1))
    assert torch.equal(weights[:, K:], torch.ones(T, n_shared, device=DEVICE))
    torch.testing.assert_close(weights[:, :K], ref_w, atol=1e-6 * scale, rtol=1e-5)  # as in the test above
    if capture:
        assert torch.equal(buf[1, :T], ref_ids)
        assert (buf[1, T:] == -7).all() and (buf[0] == -7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,e,d", [(1, 64, 2048), (37, 12, 200), (64, 160, 384), (3, 24, 7168), (300, 20, 72)])
def test_router_logits_matches_ref(t: int, e: int, d: int, dtype: torch.dtype, poisoned_empty: None) -> None:
    """x [T, D] (a row-strided view) . W [E, D] fp32 in fp32, as partial sums over slices of D (two for
    D=200, the second 72 wide; 28 of 256 for V3's D=7168; T=300 is past the kernel's limit: torch, one part).
    Bound: each side is a sum of D fp32 products in some order, off the exact sum by at most D * 2^-24 * sum|x w|
    (recursive summation's worst case), so the two differ by at most twice that; a dropped 64-wide step or slice, or
    a wrong row, misses by ~1/32 of sum|x w| at D=2048, far outside it."""
    gen = torch.Generator().manual_seed(t + e + d)
    x = torch.randn(t, d + 5, generator=gen).to(dtype).to(DEVICE)[:, :d]
    w = (torch.randn(e, d, generator=gen) * 0.05).to(DEVICE)
    parts = router_logits(x, w)
    assert parts.dim() == 3 and parts.shape[1:] == (t, e) and parts.dtype == torch.float32
    # slices of whole 64-wide steps, >= 128 wide, at most 32 of them
    assert parts.shape[0] == {2048: 16, 384: 3, 200: 2, 7168: 28, 72: 1}[d]
    out, ref = sum_partials(parts), router_logits_ref(x, w)
    bound = 2 * d * 2.0**-24 * (x.float().abs() @ w.abs().T)
    assert bool(((out - ref).abs() <= bound).all()), f"max excess {((out - ref).abs() - bound).max().item():.3e}"


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[3]], ids=lambda c: f"E{c[0]}-K{c[1]}-{c[3]}")
def test_grouped_topk_adds_partial_logits(cfg: tuple, poisoned_empty: None) -> None:
    """[P, T, E] partial sums: the kernel adds them in the order sum_partials does, so the ids equal the ref's
    on the summed logits exactly and the weights as in test_grouped_topk_matches_ref."""
    E, K, scoring, method, n_group, topk_group, norm, scale, with_bias = cfg
    gen = torch.Generator().manual_seed(E)
    parts = torch.randn(5, 19, E, generator=gen).to(DEVICE)  # 5 parts of ~N(0, 1): summed logits spread ~2.2
    bias = (torch.randn(E, generator=gen) * 0.1).to(DEVICE) if with_bias else None
    args = (bias, K, scoring, method, n_group, topk_group, norm, scale)
    weights, ids = grouped_topk(parts, *args)
    ref_w, ref_ids = grouped_topk_ref(sum_partials(parts), *args)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-6 * scale, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_ref_matches_transformers_gate(name: str) -> None:
    """grouped_topk_ref on the router logits of transformers' DeepseekV3TopkRouter / DeepseekV2TopkRouter (the
    gate module alone, random weights and correction bias) gives their expert set and weights for every token.
    transformers picks with sorted=False, so both sides are compared per token in ascending id order."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = hf_config(name)
    v3 = TINY_CONFIGS[name][0] == "v3"
    gate = DeepseekV3TopkRouter(cfg) if v3 else DeepseekV2TopkRouter(cfg)
    e, t = cfg.n_routed_experts, 64
    gen = torch.Generator().manual_seed(sorted(TINY_CONFIGS).index(name))
    with torch.no_grad():
        gate.weight.copy_(torch.randn(e, cfg.hidden_size, generator=gen) * 0.3)  # logits spread ~2
        if v3:  # the same size as the spread of sigmoid scores: it decides some picks (checked below)
            gate.e_score_correction_bias.copy_(torch.randn(e, generator=gen) * 0.1)
        logits, hf_weights, hf_ids = gate(torch.randn(t, cfg.hidden_size, generator=gen))
    method = "noaux_tc" if v3 else cfg.topk_method
    grouped = method != "greedy"
    # transformers' V2 gate never renormalises (DeepSeek-V2's does when norm_topk_prob): the V2 configs have it off
    assert v3 or not cfg.norm_topk_prob
    args = (cfg.num_experts_per_tok, "sigmoid" if v3 else "softmax", method, cfg.n_group if grouped else 1,
            cfg.topk_group if grouped else 1, bool(v3 and cfg.norm_topk_prob), cfg.routed_scaling_factor)
    bias = gate.e_score_correction_bias if v3 else None
    weights, ids = grouped_topk_ref(logits, bias, *args)  # type: ignore[arg-type]

    def by_id(w: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = i.long().argsort(dim=-1)
        return w.gather(1, order), i.long().gather(1, order)

    (w_ours, i_ours), (w_hf, i_hf) = by_id(weights, ids), by_id(hf_weights, hf_ids)
    assert torch.equal(i_ours, i_hf), f"{(i_ours != i_hf).any(-1).sum()} of {t} tokens with another expert set"
    # the same fp32 operations; only the order of the K-term sum in the renormalisation may differ: 1-2 ulps
    torch.testing.assert_close(w_ours, w_hf, atol=1e-7 * cfg.routed_scaling_factor, rtol=1e-6)
    if v3:
        _, ids_unbiased = grouped_topk_ref(logits, None, *args)  # type: ignore[arg-type]
        flips = (by_id(weights, ids_unbiased)[1] != i_ours).any(-1).sum().item()
        assert flips >= t // 8, f"the bias decides only {flips} of {t} tokens here: the input cannot pin it"
