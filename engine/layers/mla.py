"""Multi-head Latent Attention with both paths, always both available.

Shape legend: T new tokens, H heads, D hidden, C = kv_lora_rank + rope (one latent cache row).
- normal:  decompress latents through kv_b_proj into per-head K/V, then MHA. Picked for prefill with no
           cached prefix, where it costs less than attending in the 512+64-wide latent space.
- absorb:  w_kc folded into the query and w_vc applied after attention; attention runs over the latent
           cache directly. Picked for decode and for extend on top of a cached prefix.
The cache row of a token is [kv_a_layernorm(c_kv), rope(k_pe)], written before attention runs.

Tensor parallelism (attention-TP size R > 1): the heads are split, H = num_attention_heads / R per rank.
q_proj / q_b_proj and kv_b_proj are column-parallel (their rows are per-head blocks), o_proj row-parallel:
forward returns this rank's partial sum [T, D], all-reduced by LayerCommunicator.prepare_mlp. The latent
path (q_a_proj, kv_a_proj_with_mqa, the norms, the cache row) is replicated: every rank holds the whole
latent cache, which all its heads read.

matmul (matmul.py, chosen at construction): every linear and the two per-head absorbed products run torch, the
batch-invariant GEMM or exact.py's fixed-tree sums; in the last two modes EngineConfig.mla_impl pins one path
(absorbed) for every forward.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Literal

import torch
from torch import nn

from r3trace.kernels.latent_write import latent_write

from ..forward_batch import ForwardBatch
from ..model_config import ModelConfig
from .attention_backend import AttentionBackend
from .linear import ColumnParallelLinear, RowParallelLinear, replicated_linear
from .matmul import HeadMatmul, MatmulImpl, make_head_matmul, make_matmul
from .norm import RMSNorm
from .rope import RotaryEmbedding

AttnPath = Literal["normal", "absorb"]


def select_attn_path(fb: ForwardBatch, forced: str) -> AttnPath:
    """The one dispatch: normal for prefix-free prefill, absorbed for decode and prefix extends."""
    if forced in ("normal", "absorb"):
        return forced  # type: ignore[return-value]
    return "normal" if fb.mode == "extend" and not fb.has_prefix else "absorb"


class MLAAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        rope: RotaryEmbedding,
        backend: AttentionBackend,
        mla_path: str,
        dtype: torch.dtype,
        device: torch.device | str,
        norm_backend: str = "ref",
        tp_rank: int = 0,
        tp_size: int = 1,
        matmul: MatmulImpl = "torch",
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        if cfg.num_attention_heads % tp_size:
            raise ValueError(f"num_attention_heads={cfg.num_attention_heads} not divisible by attention TP {tp_size}")
        self.h = cfg.num_attention_heads // tp_size  # this rank's heads
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora = cfg.kv_lora_rank
        self.scale = cfg.softmax_scale
        self.rope = rope
        self.backend = backend
        self.mla_path = mla_path
        d, qk = cfg.hidden_size, cfg.qk_head_dim
        heads = cfg.num_attention_heads
        self.q_proj: ColumnParallelLinear | None = None
        self.q_a_proj: ColumnParallelLinear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: ColumnParallelLinear | None = None
        if cfg.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(d, heads * qk, tp_rank, tp_size, dtype, device, matmul)
        else:
            self.q_a_proj = replicated_linear(d, cfg.q_lora_rank, dtype, device, matmul)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype, device, norm_backend)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, heads * qk, tp_rank, tp_size, dtype, device, matmul)
        self.kv_a_proj_with_mqa = replicated_linear(d, self.kv_lora + self.rope_dim, dtype, device, matmul)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, cfg.rms_norm_eps, dtype, device, norm_backend)
        kv_b_out = heads * (self.nope + self.v_dim)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora, kv_b_out, tp_rank, tp_size, dtype, device, matmul)
        self.o_proj = RowParallelLinear(heads * self.v_dim, d, tp_rank, tp_size, dtype, device, matmul)
        self._matmul = make_matmul(matmul, d)  # the stacked q_a / kv_a projection below
        self._head_matmul: HeadMatmul = make_head_matmul(matmul)  # the absorbed w_kc and w_vc products
        # The latent write as one kernel (r3trace.kernels.latent_write) with the triton norm and rope backends;
        # its twin is the norm, the rope, a cat and an index store (4 kernels: 8.8 us a layer at batch 64).
        self.fused_latent = norm_backend == "triton" and rope.backend == "triton"
        # q_a_proj and kv_a_proj_with_mqa read the same x: one GEMM of their stacked weights (post_load) is one
        # launch instead of two (two 5.7 us nvjet calls a layer at batch 64 on the H200, D = 2048, N = 768 and
        # 576). Its columns are the two projections' dot products over the same D; only cuBLAS's kernel choice
        # for the wider N may differ.
        self.fuse_qkv_a = self.q_a_proj is not None
        self.qkv_a_weight: torch.Tensor | None = None
        # Filled by post_load() from kv_b_proj: w_kc [H, nope, kv_lora], w_vc [H, v, kv_lora].
        self.register_buffer("w_kc", torch.empty(0, dtype=dtype, device=device), persistent=False)
        self.register_buffer("w_vc", torch.empty(0, dtype=dtype, device=device), persistent=False)

    def post_load(self) -> None:
        w = self.kv_b_proj.weight.view(self.h, self.nope + self.v_dim, self.kv_lora)
        self.w_kc = w[:, : self.nope].contiguous()
        self.w_vc = w[:, self.nope :].contiguous()
        if self.fuse_qkv_a:
            assert self.q_a_proj is not None
            kv_a = self.kv_a_proj_with_mqa
            stacked = torch.cat([self.q_a_proj.weight.data, kv_a.weight.data])  # [q_lora + C, D]
            r = self.q_a_proj.weight.shape[0]
            self.q_a_proj.weight.data, kv_a.weight.data = stacked[:r], stacked[r:]  # views: no second copy
            self.qkv_a_weight = stacked

    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D] -> (q [T, H, qk], kv_a [T, C])."""
        if self.q_proj is not None:
            q, kv_a = self.q_proj(x), self.kv_a_proj_with_mqa(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            if self.qkv_a_weight is not None:
                q_lora = self.qkv_a_weight.shape[0] - self.kv_lora - self.rope_dim
                q_a, kv_a = self._matmul(x, self.qkv_a_weight).split([q_lora, self.kv_lora + self.rope_dim], dim=-1)
            else:
                q_a, kv_a = self.q_a_proj(x), self.kv_a_proj_with_mqa(x)
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        return q.view(x.shape[0], self.h, self.nope + self.rope_dim), kv_a

    def forward(self, x: torch.Tensor, fb: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """x: [T, D]; kv_cache: [S, C] of this layer -> [T, D] (partial over the attention-TP ranks)."""
        t = x.shape[0]
        q, kv_a = self._projections(x)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        if self.mla_path == "split":
            out = self._split(q_nope, q_pe, kv_a, kv_cache, fb)
            return self.o_proj(out.reshape(t, self.h * self.v_dim))
        normal = select_attn_path(fb, self.mla_path) == "normal"
        latent = self._write_latent(kv_a, fb, kv_cache, normal and not fb.has_prefix)
        if normal:
            out = self._normal(torch.cat([q_nope, self.rope(fb.positions, q_pe)], dim=-1), latent, kv_cache, fb)
        else:
            out = self._absorbed(q_nope, q_pe, kv_cache, fb)
        return self.o_proj(out.reshape(t, self.h * self.v_dim))

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                  fb: ForwardBatch) -> torch.Tensor:  # fmt: skip
        """[T, H, nope], [T, H, rope] -> [T, H, v] through the latent cache.

        The absorbed query [T, H, kv_lora + rope] is built in place: the bmm and the rope store into its two column
        ranges through strided views, and the value projection stores [T, H, v] rows o_proj reads as they are. einsum
        + cat cost a cat a layer (4.6 us at batch 64 on the H200, in the decode step's kernel profile,
        bench/step_profile.py), and the reshape of einsum's permuted output a copy."""
        t = q_nope.shape[0]
        q_lat = q_nope.new_empty(t, self.h, self.kv_lora + self.rope_dim)
        self._head_matmul(q_nope, self.w_kc, q_lat[:, :, : self.kv_lora])
        self.rope(fb.positions, q_pe, out=q_lat[:, :, self.kv_lora :])
        o_lat = self.backend.absorbed(q_lat, kv_cache, fb, self.kv_lora, self.scale)  # [T, H, kv_lora]
        out = o_lat.new_empty(t, self.h, self.v_dim)
        self._head_matmul(o_lat, self.w_vc.transpose(1, 2), out)  # [T, H, v]
        return out

    def _split(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_a: torch.Tensor, kv_cache: torch.Tensor,
               fb: ForwardBatch) -> torch.Tensor:  # fmt: skip
        """The row-invariant mode (EngineConfig.row_invariant): the step's leading decode and verify requests (the
        scheduler puts them first) on the absorbed path, whose fixed-split attention gives a row the same bits in
        any batch; its prompt requests on the normal path over every key of the request, whose MHA rows follow their
        own keys only (kernels/mha_prefill.py), so a prompt row is the same in any chunk or batch. The keys are the
        cache's values either way: read back from it on a cached prefix, else the latent the write returns.
        [T, H, nope], [T, H, rope], kv_a [T, C] -> [T, H, v]."""
        n_req, n = fb.lead_requests, fb.lead_rows
        if n == q_nope.shape[0]:
            self._write_latent(kv_a, fb, kv_cache, False)
            return self._absorbed(q_nope, q_pe, kv_cache, fb)
        prompts = fb.requests(n_req, fb.batch_size)
        latent = self._write_latent(kv_a, fb, kv_cache, not prompts.has_prefix)
        q = torch.cat([q_nope[n:], self.rope(prompts.positions, q_pe[n:])], dim=-1)
        tail = self._normal(q, None if latent is None else latent[n:], kv_cache, prompts)
        if n == 0:
            return tail
        return torch.cat([self._absorbed(q_nope[:n], q_pe[:n], kv_cache, fb.requests(0, n_req)), tail])

    def _write_latent(
        self, kv_a: torch.Tensor, fb: ForwardBatch, kv_cache: torch.Tensor, want_latent: bool
    ) -> torch.Tensor | None:
        """kv_a: [T, C] -> cache rows [rmsnorm(c_kv), rope(k_pe)] at fb.out_cache_loc; returns them [T, C] in
        the cache dtype when want_latent (the prefix-free normal path reads the new keys from there)."""
        norm = self.kv_a_layernorm
        if self.fused_latent:
            return latent_write(kv_a, norm.weight, norm.eps, fb.positions, self.rope.cos, self.rope.sin,
                                fb.out_cache_loc, kv_cache, return_latent=want_latent)  # fmt: skip
        c_kv, k_pe = kv_a.split([self.kv_lora, self.rope_dim], dim=-1)
        latent = torch.cat([norm(c_kv), self.rope(fb.positions, k_pe)], dim=-1).to(kv_cache.dtype)  # [T, C]
        kv_cache[fb.out_cache_loc] = latent
        return latent

    def _normal(
        self, q: torch.Tensor, latent: torch.Tensor | None, kv_cache: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        if fb.has_prefix:
            # On top of a cached prefix: decompress every key of each request from the cache, gathered
            # on the device (no per-request indexing: a 0-d device index syncs the host each request and layer)
            k_lens = list(fb.seq_lens_cpu)
            nk = sum(k_lens)
            starts = torch.cumsum(fb.seq_lens, 0) - fb.seq_lens  # [B]
            owner = torch.repeat_interleave(fb.req_pool_indices, fb.seq_lens, output_size=nk)  # [Nk]
            pos = torch.arange(nk, device=kv_cache.device) - torch.repeat_interleave(starts, fb.seq_lens,
                                                                                      output_size=nk)  # fmt: skip
            keys = kv_cache[fb.req_to_token[owner, pos].long()]  # [Nk, C]
        else:
            assert latent is not None  # _write_latent returns it on this path
            keys, k_lens = latent, list(fb.extend_lens_cpu)
        # each request's first key: one pass (summed request by request it took 0.53 ms of host a layer at 256 requests)
        k_starts = list(accumulate(k_lens[:-1], initial=0)) if k_lens else []
        kv = self.kv_b_proj(keys[:, : self.kv_lora]).view(-1, self.h, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_pe = keys[:, self.kv_lora :].unsqueeze(1).expand(-1, self.h, -1)
        k = torch.cat([k_nope, k_pe], dim=-1)  # [Nk, H, qk]
        return self.backend.mha(q, k, v, fb, k_starts, k_lens, self.scale)  # [T, H, v]
