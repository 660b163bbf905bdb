"""Near-ties of the routing op: the (token, layer) entries where another summation order may change a route.

A route is the top-K of a row's masked choice scores (layers/router.py: gate scores, plus the correction bias,
outside the selected groups masked). Another summation order (tensor-parallel partials, DeepEP's per-rank combine,
another GEMM blocking) moves those scores by rounding, ~1e-6 in fp32. A route changes only where that is enough
to cross a gap between two neighbours among the row's top-(K+1) scores:

    set gap    the K-th minus the (K+1)-th score: crossed, the top-K *set* changes (replay-check's margin)
    order gap  the smallest neighbour gap among the top-(K+1): crossed, the set or the order of the K changes
               (what comparing returned routes, which are in score order, needs)

`count_flips` compares two runs' routes with a reference forward's gaps: an entry whose gap is under the threshold
is a near-tie (counted, and the flips among them counted); every other entry must hold the same ids in the same
order, so `FlipCount.far` is the number of real mismatches.

Shape legend: T tokens, L layers, K top-k, E experts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import torch
from torch.utils.hooks import RemovableHandle

from .forward_batch import ForwardBatch
from .layers.moe import MoE
from .layers.router import Router, gate_scores, group_masked_choice
from .model import DeepseekForCausalLM

GapKind = Literal["set", "order"]


def neighbour_gaps(router: Router, x: torch.Tensor) -> torch.Tensor:
    """[T, K] differences between neighbours of each row's top-(K+1) masked choice scores (column K-1: the set
    gap), for the router's input x [T, D]."""
    p = router.params
    choice = group_masked_choice(gate_scores(router.logits(x), p.scoring_func), router.e_score_correction_bias, p)
    top = choice.topk(p.top_k + 1, dim=-1).values  # [T, K + 1]
    return top[:, :-1] - top[:, 1:]


def gap_hooks(model: DeepseekForCausalLM, store: dict[int, torch.Tensor], kind: GapKind) -> list[RemovableHandle]:
    """Hook every router: after each forward store[layer_id] is that forward's [T] gaps of `kind`, fp32 on the
    host. Remove the handles to stop."""
    hooks = []
    for layer in model.decoder_layers():
        if not isinstance(layer.mlp, MoE):
            continue

        def hook(router: Router, inp: tuple[torch.Tensor, ...], _out: object, lid: int = layer.layer_id) -> None:
            gaps = neighbour_gaps(router, inp[0])
            gap = gaps[:, router.params.top_k - 1] if kind == "set" else gaps.min(dim=-1).values
            store[lid] = gap.float().cpu()

        hooks.append(layer.mlp.gate.register_forward_hook(hook))
    return hooks


def forward_whole(model: DeepseekForCausalLM, token_ids: list[int], logits_rows: list[int]) -> torch.Tensor:
    """One prefix-free forward of a whole sequence into a fresh latent cache; logits [len(logits_rows), V]."""
    cfg, ecfg = model.config, model.engine_config
    n = len(token_ids)
    kv = torch.zeros(cfg.num_hidden_layers, n, cfg.kv_cache_dim, dtype=ecfg.torch_dtype, device=ecfg.device)
    r2t = torch.arange(n, dtype=torch.int32, device=ecfg.device).unsqueeze(0)
    fb = ForwardBatch.build(forward_id=0, input_ids=list(token_ids), prefix_lens=[0], extend_lens=[n],
                            req_pool_indices=[0], out_cache_loc=r2t[0], req_to_token=r2t, logits_rows=logits_rows,
                            device=ecfg.device)  # fmt: skip
    return model(fb, kv)


def sequence_gaps(model: DeepseekForCausalLM, token_ids: list[int], kind: GapKind = "order") -> np.ndarray:
    """[T, L] each (row, layer)'s gap of `kind` in one prefix-free forward of token_ids (inf on dense layers)."""
    store: dict[int, torch.Tensor] = {}
    hooks = gap_hooks(model, store, kind)
    try:
        with torch.inference_mode():
            forward_whole(model, token_ids, [len(token_ids) - 1])
    finally:
        for h in hooks:
            h.remove()
    out = np.full((len(token_ids), model.config.num_hidden_layers), np.inf)
    for lid, gap in store.items():
        out[:, lid] = gap.numpy()
    return out


@dataclass(frozen=True)
class FlipCount:
    """Routes of two runs compared: entries = routed (token, MoE layer) entries; near_ties = those with a gap under
    the threshold; flips = near-ties whose ids differ; far = entries that differ away from any near-tie (0 when
    the runs agree up to rounding); smallest_gap over every entry compared."""

    entries: int = 0
    near_ties: int = 0
    flips: int = 0
    far: int = 0
    smallest_gap: float = float("inf")

    def __add__(self, other: FlipCount) -> FlipCount:
        return FlipCount(self.entries + other.entries, self.near_ties + other.near_ties, self.flips + other.flips,
                         self.far + other.far, min(self.smallest_gap, other.smallest_gap))  # fmt: skip

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def count_flips(want: np.ndarray, got: np.ndarray, gaps: np.ndarray, threshold: float) -> FlipCount:
    """want, got: [T, L, K] routes (-1 on dense layers); gaps: [T, L] (sequence_gaps, inf on dense layers). An entry
    differs when any of its K ids differs (order included)."""
    if want.shape != got.shape or gaps.shape != want.shape[:2]:
        raise ValueError(f"routes {want.shape} and {got.shape} with gaps {gaps.shape}: expected [T, L, K] twice and "
                         "[T, L]")
    routed = want[..., 0] >= 0  # [T, L]: MoE layers
    tie = (gaps < threshold) & routed
    differ = (want != got).any(axis=-1) & routed
    smallest = float(gaps[routed].min()) if routed.any() else float("inf")
    return FlipCount(int(routed.sum()), int(tie.sum()), int((differ & tie).sum()), int((differ & ~tie).sum()),
                     smallest)  # fmt: skip
