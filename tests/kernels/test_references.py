"""One reference per op: the engine's `ref` backends run the very functions the kernels' tests compare against
(kernels/moe/reference.py, kernels/mla_decode/reference.py, kernels/topk.py), and each reference is checked here
against a plain per-element loop in float64 written from the op's definition, not from the reference's code.

Run: .venv/bin/pytest tests/kernels/test_references.py -q
"""

from __future__ import annotations

import math

import torch

from r3trace.engine.layers.attention_backend import RefAttention
from r3trace.engine.layers.moe import make_experts_fn
from r3trace.kernels.mla_decode import latent_attention_ref, mla_decode_ref
from r3trace.kernels.moe import fused_moe_ref
from tests.kernels.conftest import paged_req_to_token
from tests.kernels.moe_cases import moe_case


def _dense_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
               weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """out[t] = sum over k with ids[t, k] >= 0 of weights[t, k] * w2[e] (silu(gate) * up), one (token, k) at a time."""
    T, K = ids.shape
    I = w13.shape[1] // 2
    out = torch.zeros(T, hidden.shape[1], dtype=torch.float64)
    for t in range(T):
        x = hidden[t].double()
        for k in range(K):
            e = int(ids[t, k])
            if e < 0:
                continue
            gate, up = w13[e, :I].double() @ x, w13[e, I:].double() @ x
            act = gate / (1 + torch.exp(-gate)) * up
            out[t] += float(weights[t, k]) * (w2[e].double() @ act)
    return out


def test_fused_moe_ref_is_the_moe_definition() -> None:
    """fp32 inputs with ids of -1 and an expert nobody routes to: within fp32 rounding of the float64 loop."""
    hidden, w13, w2, ids, weights = moe_case(9, 24, 6, 10, 3, torch.float32, "cpu", seed=4)
    assert (ids < 0).any()
    out = fused_moe_ref(hidden, w13, w2, ids, weights)
    torch.testing.assert_close(out.double(), _dense_moe(hidden, w13, w2, ids, weights), rtol=1e-5, atol=1e-5)


def _dense_attention(q: torch.Tensor, kv: torch.Tensor, kv_lora: int, scale: float) -> torch.Tensor:
    """q [n, H, C], kv [N, C]: query i sees keys 0..N-n+i; the softmax(q . k * scale)-weighted sum of
    kv[:, :kv_lora] rows."""
    n, H, _ = q.shape
    N = kv.shape[0]
    out = torch.zeros(n, H, kv_lora, dtype=torch.float64)
    for i in range(n):
        for h in range(H):
            logits = [float(q[i, h].double() @ kv[j].double()) * scale for j in range(N - n + i + 1)]
            top = max(logits)
            w = [math.exp(x - top) for x in logits]
            total = sum(w)
            for j, wj in enumerate(w):
                out[i, h] += (wj / total) * kv[j, :kv_lora].double()
    return out


def test_latent_attention_ref_is_causal_softmax_attention() -> None:
    gen = torch.Generator().manual_seed(2)
    q, kv = torch.randn(3, 2, 12, generator=gen), torch.randn(7, 12, generator=gen)
    out = latent_attention_ref(q, kv, 8, 0.3)
    torch.testing.assert_close(out.double(), _dense_attention(q, kv, 8, 0.3), rtol=1e-5, atol=1e-6)


def test_mla_decode_ref_gathers_through_the_page_table() -> None:
    """Paged, shuffled slots of 3: each request's one query sees all its keys, through req_to_token."""
    gen = torch.Generator().manual_seed(3)
    lens = [1, 5, 9]
    r2t, rows, S = paged_req_to_token(lens, 3, gen)
    q, kv = torch.randn(3, 2, 12, generator=gen), torch.randn(S, 12, generator=gen)
    out = mla_decode_ref(q, kv, r2t, rows, torch.tensor(lens), 8, 0.3)
    for b, n in enumerate(lens):
        keys = kv[r2t[rows[b], :n].long()]
        torch.testing.assert_close(out[b].double(), _dense_attention(q[b : b + 1], keys, 8, 0.3)[0],
                                   rtol=1e-5, atol=1e-6)  # fmt: skip


def test_engine_ref_backends_run_the_kernel_references() -> None:
    """The engine's ref MoE is fused_moe_ref itself; its ref attention gives latent_attention_ref's bits."""
    assert make_experts_fn("ref") is fused_moe_ref
    gen = torch.Generator().manual_seed(5)
    q, kv = torch.randn(4, 3, 20, generator=gen), torch.randn(11, 20, generator=gen)
    prefix = torch.tensor(kv.shape[0] - q.shape[0])  # the queries are the last 4 of the 11 keys
    assert torch.equal(RefAttention()._latent(q, kv, 16, 0.25, prefix), latent_attention_ref(q, kv, 16, 0.25))
