"""Fused gate scoring + grouped top-k: one launch from router logits to (topk_weights, topk_ids).

Shape legend: T tokens, E routed experts, K experts per token (top_k), G expert groups (n_group).

Semantics are DeepSeek's reference gate (DeepSeek-V2/V3 `inference/model.py`):
    scores = softmax(logits) | sigmoid(logits)             # [T, E] float32
    choice = scores + bias    (noaux_tc with a bias only)   # [T, E]
    group score = max(choice in group)       (group_limited_greedy)
                | sum(top-2 choice in group) (noaux_tc)     # [T, G]
    keep the topk_group best groups; other groups' choice -> -inf
    topk_ids = top-K of choice, by descending choice, ties to the lower expert id
    topk_weights = scores[topk_ids] (no bias), / (sum + 1e-20) if norm_topk_prob, * routed_scaling_factor
`greedy` ignores groups. The kernel picks by repeated arg-max over a row held in one warp's registers: K <= 8 and
G <= 8 rounds of warp shuffles over E <= 256 values.
With S fused shared experts (n_shared) it also appends their S pairs, ids E..E+S-1 and weight 1.0, giving the
fused MoE its [T, K + S] routes directly: two torch.cat kernels less per MoE layer (1.5 us each at batch 64
on an H200), while the route capturer's [T, K] buffer (ids_out) still receives the routed ids alone.
"""

from __future__ import annotations

from typing import Literal

import torch
import triton
import triton.language as tl

from r3trace.kernels.contract import require, require_tensor

ScoringFunc = Literal["softmax", "sigmoid"]
TopkMethod = Literal["greedy", "group_limited_greedy", "noaux_tc"]
MaskValue = Literal["-inf", "zero"]

NORM_EPS = 1e-20  # DeepSeek's reference adds this to the weight sum before dividing
# One token per program, one warp: every reduction over a row (the group maxima, the top-k rounds: ~60 of them at E =
# 256, 8 groups) stays inside the warp. [16, 256] rows over 4 warps went through shared memory and a barrier for each:
# 28-33 us a call at T = 1 .. 1024 (E = 256) on the H200 against 5-10 us (BENCHMARKS.md#router-kernels). Fixed for
# every T: the weights' normalising sum is a reduction whose order follows the layout (4 or 8 warps a token gave other
# bits there), so a row's bits must not depend on T. Triton's interpreter (CPU) runs 16 tokens a program: it pays per
# program (the suite's engine tests took minutes more one token a program), and its numpy reductions give a row the
# same bits in a [16, E] block as alone.
_BLOCK_T, _WARPS = 1, 1
_INTERPRETED_BLOCK_T = 16


@triton.jit
def _grouped_topk_kernel(
    # pointers
    logits_ptr, bias_ptr, weights_ptr, routes_ptr, ids_ptr,
    # sizes
    T, E, routed_scaling_factor,
    # strides
    stride_lp, stride_lt, stride_wt, stride_rt, stride_it,
    # constexpr
    N_PART: tl.constexpr, TOP_K: tl.constexpr, N_SHARED: tl.constexpr, SPLIT_IDS: tl.constexpr,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_MODE: tl.constexpr, NORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # GROUP_MODE: 0 = greedy (no groups), 1 = group max, 2 = group top-2 sum. Outputs: weights and routes
    # [T, K + N_SHARED]; with SPLIT_IDS the routed ids also go to ids [T, K] (the capturer's buffer).
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, BLOCK_E)
    t_mask = offs_t < T
    e_mask = offs_e < E
    mask = t_mask[:, None] & e_mask[None, :]
    neg_inf = float("-inf")

    # rows past T load zeros (not -inf) so their softmax stays finite; their results are never stored.
    # N_PART > 1: the logits arrive as partial sums over slices of D (router_logits), added here in order.
    tile = logits_ptr + offs_t[:, None] * stride_lt + offs_e[None, :]
    logits = tl.load(tile, mask=mask, other=0.0).to(tl.float32)
    for part in tl.static_range(1, N_PART):
        logits += tl.load(tile + part * stride_lp, mask=mask, other=0.0).to(tl.float32)
    logits = tl.where(e_mask[None, :], logits, neg_inf)
    if SIGMOID:
        scores = tl.sigmoid(logits)
    else:
        row_max = tl.max(logits, axis=1)
        ex = tl.exp(logits - row_max[:, None])
        ex = tl.where(e_mask[None, :], ex, 0.0)
        scores = ex / tl.sum(ex, axis=1)[:, None]
    scores = tl.where(e_mask[None, :], scores, 0.0)
    choice = scores
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_e, mask=e_mask, other=0.0).to(tl.float32)
        choice = choice + bias[None, :]
    choice = tl.where(e_mask[None, :], choice, neg_inf)  # padding lanes never win

    e_idx = tl.broadcast_to(offs_e[None, :], (BLOCK_T, BLOCK_E))
    if GROUP_MODE > 0:
        group_of = e_idx // GROUP_SIZE
        offs_g = tl.arange(0, BLOCK_G)
        g_idx = tl.broadcast_to(offs_g[None, :], (BLOCK_T, BLOCK_G))
        group_score = tl.full((BLOCK_T, BLOCK_G), neg_inf, tl.float32)
        for g in tl.static_range(N_GROUP):
            in_g = group_of == g
            vals = tl.where(in_g, choice, neg_inf)
            best = tl.max(vals, axis=1)
            if GROUP_MODE == 2:
                # second best: drop only the first (lowest-id) maximum, so equal top-2 values count twice
                first = tl.min(tl.where(vals == best[:, None], e_idx, BLOCK_E), axis=1)
                second = tl.max(tl.where(e_idx == first[:, None], neg_inf, vals), axis=1)
                best = best + second
            group_score = tl.where(g_idx == g, best[:, None], group_score)
        keep = tl.zeros((BLOCK_T, BLOCK_G), tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            gbest = tl.max(group_score, axis=1)
            gsel = tl.min(tl.where(group_score == gbest[:, None], g_idx, BLOCK_G), axis=1)
            keep = tl.where(g_idx == gsel[:, None], 1, keep)
            group_score = tl.where(g_idx == gsel[:, None], neg_inf, group_score)
        # expand the kept-group mask [T, G] to experts [T, E]
        keep_e = tl.zeros((BLOCK_T, BLOCK_E), tl.int32)
        for g in tl.static_range(N_GROUP):
            kept_g = tl.max(tl.where(g_idx == g, keep, 0), axis=1)
            keep_e = tl.where(group_of == g, kept_g[:, None], keep_e)
        choice = tl.where(keep_e > 0, choice, neg_inf)

    offs_k = tl.arange(0, BLOCK_K)
    k_idx = tl.broadcast_to(offs_k[None, :], (BLOCK_T, BLOCK_K))
    out_ids = tl.zeros((BLOCK_T, BLOCK_K), tl.int32)
    out_w = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
    for k in tl.static_range(TOP_K):
        best = tl.max(choice, axis=1)
        sel = tl.min(tl.where(choice == best[:, None], e_idx, BLOCK_E), axis=1)
        hit = e_idx == sel[:, None]
        w = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        out_ids = tl.where(k_idx == k, sel[:, None], out_ids)
        out_w = tl.where(k_idx == k, w[:, None], out_w)
        choice = tl.where(hit, neg_inf, choice)
    if NORMALIZE:
        out_w = out_w / (tl.sum(out_w, axis=1)[:, None] + 1e-20)
    out_w = out_w * routed_scaling_factor

    routed_mask = t_mask[:, None] & (offs_k[None, :] < TOP_K)
    if SPLIT_IDS:
        tl.store(ids_ptr + offs_t[:, None] * stride_it + offs_k[None, :], out_ids, mask=routed_mask)
    if N_SHARED > 0:
        shared = k_idx >= TOP_K  # columns K..K+S-1: shared expert E + (k - K), weight 1 for every token
        out_ids = tl.where(shared, E + k_idx - TOP_K, out_ids)
        out_w = tl.where(shared, 1.0, out_w)
    out_mask = t_mask[:, None] & (offs_k[None, :] < TOP_K + N_SHARED)
    tl.store(routes_ptr + offs_t[:, None] * stride_rt + offs_k[None, :], out_ids, mask=out_mask)
    tl.store(weights_ptr + offs_t[:, None] * stride_wt + offs_k[None, :], out_w, mask=out_mask)


def _check_routing_args(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    scoring_func: str,
    topk_method: str,
    n_group: int,
    topk_group: int,
) -> None:
    require(router_logits.dim() in (2, 3),
            f"router_logits must be [T, E] or [P, T, E], got shape {tuple(router_logits.shape)}")
    require_tensor("router_logits", router_logits, router_logits.dim(), (torch.float32,), router_logits.device)
    E = router_logits.shape[-1]
    require(scoring_func in ("softmax", "sigmoid"), f"scoring_func {scoring_func!r} not softmax|sigmoid")
    require(
        topk_method in ("greedy", "group_limited_greedy", "noaux_tc"),
        f"topk_method {topk_method!r} not greedy|group_limited_greedy|noaux_tc",
    )
    require(1 <= top_k <= E, f"top_k {top_k} must be in 1..E={E}")
    if correction_bias is not None:
        require(topk_method == "noaux_tc", f"correction_bias is only used by noaux_tc, not {topk_method}")
        require_tensor("correction_bias", correction_bias, 1, (torch.float32,), router_logits.device)
        require(correction_bias.shape[0] == E, f"correction_bias has {correction_bias.shape[0]} != E={E}")
    if topk_method != "greedy":
        require(n_group >= 1 and E % n_group == 0, f"E={E} is not divisible by n_group={n_group}")
        require(1 <= topk_group <= n_group, f"topk_group {topk_group} must be in 1..n_group={n_group}")
        require(
            top_k <= topk_group * (E // n_group),
            f"top_k {top_k} exceeds the {topk_group * (E // n_group)} experts in {topk_group} kept groups",
        )
        if topk_method == "noaux_tc":
            require(E // n_group >= 2, f"noaux_tc needs >= 2 experts per group, got {E // n_group}")


def grouped_topk(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    scoring_func: ScoringFunc,
    topk_method: TopkMethod,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    ids_out: torch.Tensor | None = None,
    n_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E] fp32, or [P, T, E] partial sums (router_logits over P slices of D, summed here in
    order p = 0..P-1) -> (topk_weights [T, K] fp32, topk_ids [T, K] int32), one launch.

    ids_out: where to write topk_ids (int32 [T, K], rows contiguous; e.g. the route capturer's buffer),
    returned as topk_ids; None allocates. n_shared = S > 0: the results are [T, K + S] instead, their last
    S columns the fused shared experts (ids E..E+S-1, weight 1.0); ids_out then gets the [T, K] routed ids too."""
    _check_routing_args(router_logits, correction_bias, top_k, scoring_func, topk_method, n_group, topk_group)
    parts = router_logits if router_logits.dim() == 3 else router_logits.unsqueeze(0)  # [P, T, E]
    _, T, E = parts.shape
    require(E <= 1024 and top_k + n_shared <= 16,
            f"E={E} > 1024 or top_k + n_shared = {top_k + n_shared} > 16: one row no longer fits")
    require(n_shared >= 0, f"n_shared={n_shared}: must be >= 0")
    grouped = topk_method != "greedy" and n_group > 1
    mode = 0 if not grouped else (1 if topk_method == "group_limited_greedy" else 2)
    width = top_k + n_shared
    weights = torch.empty((T, width), dtype=torch.float32, device=router_logits.device)
    if ids_out is not None:
        require(tuple(ids_out.shape) == (T, top_k) and ids_out.dtype == torch.int32, (
            f"ids_out: shape {tuple(ids_out.shape)} {ids_out.dtype}, expected ({T}, {top_k}) int32"))
        require(ids_out.stride(1) == 1 and ids_out.device == router_logits.device,
                f"ids_out: strides {ids_out.stride()} on {ids_out.device}; rows must be contiguous, on the "
                "logits' device")
    # routes: the [T, K + S] ids returned; without shared experts, ids_out itself (one store, no copy)
    split = ids_out is not None and n_shared > 0
    if ids_out is not None and not split:
        routes = ids_out
    else:
        routes = torch.empty((T, width), dtype=torch.int32, device=router_logits.device)
    ids = ids_out if ids_out is not None and split else routes  # the routed [T, K] store, read only when split
    if T == 0:
        return weights, routes
    bias = correction_bias if correction_bias is not None else parts  # unread when HAS_BIAS=0
    n_g = n_group if grouped else 1
    block_t = _BLOCK_T if router_logits.is_cuda else _INTERPRETED_BLOCK_T
    grid = (triton.cdiv(T, block_t),)
    _grouped_topk_kernel[grid](
        parts, bias, weights, routes, ids,
        T, E, float(routed_scaling_factor),
        parts.stride(0), parts.stride(1), weights.stride(0), routes.stride(0), ids.stride(0),
        N_PART=parts.shape[0], TOP_K=top_k, N_SHARED=n_shared, SPLIT_IDS=split,
        N_GROUP=n_g, TOPK_GROUP=topk_group if grouped else 1, GROUP_SIZE=E // n_g,
        SIGMOID=scoring_func == "sigmoid", HAS_BIAS=correction_bias is not None, GROUP_MODE=mode,
        NORMALIZE=norm_topk_prob,
        BLOCK_T=block_t, BLOCK_E=max(16, triton.next_power_of_2(E)),
        BLOCK_G=max(2, triton.next_power_of_2(n_g)), BLOCK_K=max(2, triton.next_power_of_2(width)),
        num_warps=_WARPS,
    )  # fmt: skip
    return weights, routes


def grouped_topk_ref(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    scoring_func: ScoringFunc,
    topk_method: TopkMethod,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    mask_value: MaskValue = "-inf",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, line for line DeepSeek's reference gate. Same contract as grouped_topk.

    The repository's one grouped top-k reference: the kernel's tests compare against it, the engine's ref
    backend, routing replay and replay-check call it (through engine/layers/router.py), and
    tests/kernels/test_topk.py checks it against transformers' own gates. mask_value="zero" masks dropped
    groups with 0.0 as some ports do (the tests use it to show where that differs); the engine never does."""
    _check_routing_args(router_logits, correction_bias, top_k, scoring_func, topk_method, n_group, topk_group)
    scores = gate_scores(sum_partials(router_logits), scoring_func)  # [T, E]
    choice = group_masked_choice(scores, correction_bias, topk_method, n_group, topk_group, mask_value)  # [T, E]
    ids = choice.topk(top_k, dim=-1, sorted=True).indices  # [T, K]
    return weights_for_ids(scores, ids, norm_topk_prob, routed_scaling_factor), ids.to(torch.int32)


def gate_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """logits [T, E] -> scores [T, E] fp32: softmax or sigmoid."""
    return logits.float().softmax(dim=-1) if scoring_func == "softmax" else logits.float().sigmoid()


def group_masked_choice(
    scores: torch.Tensor, bias: torch.Tensor | None, topk_method: str, n_group: int, topk_group: int,
    mask_value: MaskValue = "-inf",
) -> torch.Tensor:
    """scores [T, E] -> choice [T, E]: scores + bias (when given), experts outside the topk_group best groups
    masked (group score: max for group_limited_greedy, top-2 sum for noaux_tc; greedy has no groups)."""
    choice = scores if bias is None else scores + bias  # [T, E]
    if topk_method == "greedy" or n_group == 1:
        return choice
    T, E = choice.shape
    grouped = choice.view(T, n_group, E // n_group)  # [T, G, E/G]
    if topk_method == "group_limited_greedy":
        group_scores = grouped.amax(dim=-1)  # [T, G]
    else:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    keep_groups = group_scores.topk(topk_group, dim=-1).indices  # [T, topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep_groups, True)  # [T, G]
    fill = float("-inf") if mask_value == "-inf" else 0.0
    return grouped.masked_fill(~keep.unsqueeze(-1), fill).view(T, E)


def weights_for_ids(
    scores: torch.Tensor, topk_ids: torch.Tensor, norm_topk_prob: bool, routed_scaling_factor: float
) -> torch.Tensor:
    """The weights of given ids (also routing replay's): scores [T, E] (no bias), topk_ids [T, K] -> [T, K] fp32,
    divided by (their sum + 1e-20) if norm_topk_prob, times routed_scaling_factor."""
    weights = scores.gather(1, topk_ids.long())  # [T, K]
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + NORM_EPS)
    return weights * routed_scaling_factor


def sum_partials(router_logits: torch.Tensor) -> torch.Tensor:
    """[T, E] -> itself; [P, T, E] partial sums -> [T, E], added in order p = 0..P-1 as the top-k kernel does."""
    if router_logits.dim() == 2:
        return router_logits
    total = router_logits[0]
    for part in router_logits[1:]:
        total = total + part
    return total
