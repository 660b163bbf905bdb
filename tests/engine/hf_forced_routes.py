"""The routing-replay oracle: transformers' DeepSeek-V2/V3 with its gates routed to given expert ids.

Nobody here wrote this math. The patch replaces only the ids of the gate's final top-k call (the one over all
E experts that picks K); everything after it is transformers' own code, so the weights are its own gate scores
at the forced ids, normalised and scaled as it does:
  - DeepseekV3TopkRouter.forward (transformers 5.x, models/deepseek_v3/modeling_deepseek_v3.py): ids =
    torch.topk(scores_for_choice, k=top_k)[1], then weights = scores.gather(1, ids) (sigmoid scores, no
    bias), / sum + 1e-20 when norm_topk_prob, * routed_scaling_factor.
  - DeepseekV2TopkRouter.forward (greedy): weights, ids = torch.topk(scores, k=top_k) over the softmax scores,
    * routed_scaling_factor; the patched call returns scores.gather(1, forced ids) as its values. (Its
    group_limited_greedy top-k runs over scores with dropped groups zeroed, so forced ids there would get
    weight 0: not the gate's score, and not used here.)
That is Megatron-LM's RouterReplay (megatron/core/transformer/moe/router_replay.py, get_replay_topk:
probs = scores.gather(1, top_indices), then topk_routing_with_score_function's normalisation and scaling;
NVIDIA/Megatron-LM@d98e8a64ddf34856e74b24714e3bedb2f5a39553).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch


def moe_gates(hf: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """{layer_id: the transformers gate} of every MoE layer."""
    return {i: layer.mlp.gate for i, layer in enumerate(hf.model.layers)
            if hasattr(getattr(layer.mlp, "gate", None), "top_k")}


@contextmanager
def forced_gates(hf: torch.nn.Module, routes: np.ndarray, mask: np.ndarray) -> Iterator[None]:
    """While inside, one forward of a single sequence of N tokens routes token t of MoE layer l to
    routes[t, l] (ids [N, L, K]) where mask[t] ([N] bool), and as the gate picks elsewhere."""
    gates = moe_gates(hf)
    for gate in gates.values():
        if getattr(gate, "topk_method", "noaux_tc") not in ("greedy", "noaux_tc"):
            raise ValueError(f"topk_method {gate.topk_method}: the patched top-k would not see the gate's scores")
    topk = torch.topk
    state: dict[str, Any] = {"layer": None, "replaced": 0}

    def forced_topk(input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:  # noqa: A002 (torch's name)
        out = topk(input, *args, **kwargs)
        layer = state["layer"]
        k = kwargs.get("k", args[0] if args else None)
        if layer is None or input.shape[-1] != gates[layer].num_experts or k != gates[layer].top_k:
            return out  # not the gate's final top-k (V3's group top-k has n_group columns)
        state["replaced"] += 1
        forced = torch.from_numpy(routes[:, layer]).long()  # [N, K]
        ids = torch.where(torch.from_numpy(mask)[:, None], forced, out[1])
        return input.gather(-1, ids), ids

    def enter(layer: int) -> Any:
        def hook(_m: torch.nn.Module, _args: Any) -> None:
            state["layer"], state["replaced"] = layer, 0
        return hook

    def leave(_m: torch.nn.Module, _args: Any, _out: Any) -> None:
        assert state["replaced"] == 1, f"layer {state['layer']}: {state['replaced']} top-k calls replaced"
        state["layer"] = None

    handles = [h for i, g in gates.items() for h in (g.register_forward_pre_hook(enter(i)),
                                                     g.register_forward_hook(leave))]
    torch.topk = forced_topk  # the modeling files call torch.topk through the module, at call time
    try:
        yield
    finally:
        torch.topk = topk
        for h in handles:
            h.remove()


def hf_logprobs(hf: torch.nn.Module, tokens: list[int], routes: np.ndarray, mask: np.ndarray) -> torch.Tensor:
    """Log-softmax of transformers' logits [N, V] fp32 for one sequence, routed as forced_gates says."""
    with torch.no_grad(), forced_gates(hf, routes, mask):
        logits = hf(torch.tensor([tokens]), use_cache=False).logits[0]
    return logits.float().log_softmax(-1)
