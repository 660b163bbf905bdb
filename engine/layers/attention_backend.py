"""Attention backends over the paged latent cache, chosen once at engine construction.

Shape legend: T new tokens, H heads, C = kv_lora_rank + qk_rope_head_dim, S cache slots.
- absorbed(q [T, H, C], kv_cache [S, C]) -> [T, H, kv_lora]: attention in latent space; every key
  (prefix and the new tokens, already written) is read from the cache through req_to_token.
- mha(q [T, H, Dqk], k [Nk, H, Dqk], v [Nk, H, Dv], k_starts, k_lens) -> [T, H, Dv]: per-head attention
  on decompressed keys; request b's queries are the last extend_lens[b] of its k_lens[b] keys (causal).

| backend | what runs                                                                     |
| ------- | ----------------------------------------------------------------------------- |
| ref     | torch einsum + softmax per request, fp32: the definition the kernels match     |
| triton  | r3trace.kernels' decode / extend / prefill kernels                             |
| exact   | exact.py's exact_attention per request: q.k, softmax's sum and p.v are tree    |
|         | sums over fixed orders (exact mode: a row's bits do not depend on its batch)   |
| invariant | batch_invariant: every query row (decode, a verify's d + 1, a prefill chunk) |
|         | as a decode row with its own key count, fixed 256-key splits merged in order   |
|         | (kernels/mla_decode/fixed_split.py); absorbed path only                        |
| row_invariant | row_invariant (the CUDA default): absorbed rows (decodes, verifies) as     |
|         | invariant; prompt rows through triton's MHA kernel over every key, prefix too  |
"""

from __future__ import annotations

from typing import Protocol

import torch

from r3trace.kernels.mla_decode.reference import latent_attention_ref
from r3trace.kernels.mla_decode.registry import DecodeShape

from ..forward_batch import ForwardBatch
from .exact import exact_attention


class AttentionBackend(Protocol):
    def absorbed(
        self, q: torch.Tensor, kv_cache: torch.Tensor, fb: ForwardBatch, kv_lora_rank: int, scale: float
    ) -> torch.Tensor: ...

    def mha(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        fb: ForwardBatch,
        k_starts: list[int],
        k_lens: list[int],
        scale: float,
    ) -> torch.Tensor: ...


def _causal_softmax(scores: torch.Tensor, q_len: int, k_len: int) -> torch.Tensor:
    """scores: [H, q_len, k_len] fp32; query i sits at key position k_len - q_len + i."""
    q_pos = torch.arange(k_len - q_len, k_len, device=scores.device).unsqueeze(1)
    k_pos = torch.arange(k_len, device=scores.device).unsqueeze(0)
    return scores.masked_fill(k_pos > q_pos, float("-inf")).softmax(dim=-1)


def _starts(fb: ForwardBatch) -> list[int]:
    """First row of each request in T, from host lists (no device sync)."""
    starts, acc = [], 0
    for n in fb.extend_lens_cpu:
        starts.append(acc)
        acc += n
    return starts


class _PerRequest:
    """One request at a time over the batch: the loop RefAttention and ExactAttention share; each supplies the
    attention of one request's n queries over its keys (absorbed: the latent rows [N, C]; mha: [N, H, D])."""

    def absorbed(
        self, q: torch.Tensor, kv_cache: torch.Tensor, fb: ForwardBatch, kv_lora_rank: int, scale: float
    ) -> torch.Tensor:
        out = q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)
        table = fb.req_to_token.index_select(0, fb.req_pool_indices)  # [B, max_context] (a gather: no host sync)
        for b, (start, n, seq_len) in enumerate(zip(_starts(fb), fb.extend_lens_cpu, fb.seq_lens_cpu, strict=False)):
            kv = kv_cache.index_select(0, table[b, :seq_len].long())  # [seq_len, C]
            o = self._latent(q[start : start + n], kv, kv_lora_rank, scale, fb.prefix_lens[b])  # [n, H, kv_lora]
            out[start : start + n] = o.to(q.dtype)
        return out

    def mha(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        fb: ForwardBatch,
        k_starts: list[int],
        k_lens: list[int],
        scale: float,
    ) -> torch.Tensor:
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
        for start, n, ks, kl in zip(_starts(fb), fb.extend_lens_cpu, k_starts, k_lens, strict=False):
            o = self._heads(q[start : start + n], k[ks : ks + kl], v[ks : ks + kl], scale)  # [n, H, Dv] fp32
            out[start : start + n] = o.to(q.dtype)
        return out

    def _latent(
        self, q: torch.Tensor, kv: torch.Tensor, kv_lora_rank: int, scale: float, q_start: torch.Tensor
    ) -> torch.Tensor:
        """q [n, H, C], kv [N, C] -> [n, H, kv_lora] fp32. The queries are the last n of the N keys; q_start (0-d, on
        the device: the request's prefix length) says so again for a backend that reads a longer key window."""
        raise NotImplementedError

    def _heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [n, H, Dqk], k [N, H, Dqk], v [N, H, Dv] -> [n, H, Dv] fp32."""
        raise NotImplementedError


class RefAttention(_PerRequest):
    """Plain torch, one request at a time, fp32 softmax: the definition the kernels are checked against."""

    def _latent(
        self, q: torch.Tensor, kv: torch.Tensor, kv_lora_rank: int, scale: float, q_start: torch.Tensor
    ) -> torch.Tensor:
        return latent_attention_ref(q, kv, kv_lora_rank, scale)  # the kernels' own reference (kernels/mla_decode)

    def _heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        probs = _causal_softmax(torch.einsum("nhd,khd->hnk", q.float(), k.float()) * scale, q.shape[0], k.shape[0])
        return torch.einsum("hnk,khd->nhd", probs, v.float())


class ExactAttention(_PerRequest):
    """RefAttention's loop with exact_attention inside: batch-invariant, for exact mode. Queries sit at the request's
    prefix length read on the device, so a CUDA graph (whose host lengths are the longest context: graph_batch.py)
    reads a longer key window with the keys past the request masked, and gets the eager bits."""

    def _latent(
        self, q: torch.Tensor, kv: torch.Tensor, kv_lora_rank: int, scale: float, q_start: torch.Tensor
    ) -> torch.Tensor:
        kv = kv.unsqueeze(1).expand(-1, q.shape[1], -1)  # [N, H, C]: one latent row for all heads
        return exact_attention(q, kv, kv[..., :kv_lora_rank], scale, q_start)

    def _heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return exact_attention(q, k, v, scale)


# An extend whose requests have at most this many rows each (a speculative verify's d + 1 <= 4, a short chunk) runs
# token_block.py's stage 1 instead of the extend kernel: a program holds up to 64 / H of a request's rows and reads
# each key tile once for them, where the extend kernel re-reads every tile per query tile (kernels/mla_decode/
# short_extend.py: splits cut per block on the device).
SHORT_EXTEND_ROWS = 8
SHORT_EXTEND_SPLITS = 16  # the most key splits of a short extend: its fp32 partials are T x H x splits x kv_lora
SHORT_EXTEND_MIN_SPLIT = 64  # the fewest keys a split gets: one bf16 tile (the cost model picks the count)


class TritonAttention:
    """Triton flash-decoding / extend kernels (r3trace.kernels). Split counts and max lengths come from
    the batch's host lists, so no kernel launch needs a device sync (and decode is graph-capturable)."""

    def __init__(
        self, device: str, decode_kernel: str, page_size: int, shape: DecodeShape, dtype: torch.dtype
    ) -> None:
        from r3trace.kernels import mha_prefill, mla_extend
        from r3trace.kernels.mla_decode import resolve_decoder

        # The decode kernel, resolved once for this rank's heads, the dtype, the KV pool's page size and the
        # device (kernels/mla_decode: the Gluon stage 1s on Hopper unless decode_kernel pins the Triton one);
        # the model builds one backend and every layer calls it.
        self.decoder = resolve_decoder(shape, dtype, page_size, device, use_gluon=decode_kernel == "auto")
        self._extend = mla_extend.mla_extend
        self._prefill = mha_prefill.mha_prefill
        from r3trace.kernels.mla_decode.short_extend import ShortExtendDecoder
        from r3trace.kernels.mla_decode.token_block import token_block_tile

        self.short = ShortExtendDecoder(token_block_tile(shape.num_heads, dtype), SHORT_EXTEND_MIN_SPLIT,
                                        SHORT_EXTEND_SPLITS, self.decoder.sm_count)  # fmt: skip
        # H >= 64: a token-block program holds one row of 64 heads, so a request's rows share no key tile there and
        # each row runs as a decode of its own keys (the decode kernel, Gluon on Hopper)
        self._short_extend = self._token_blocks if self.short.tile.tokens > 1 else self._rows_as_decodes

    def absorbed(
        self, q: torch.Tensor, kv_cache: torch.Tensor, fb: ForwardBatch, kv_lora_rank: int, scale: float
    ) -> torch.Tensor:
        if fb.mode == "decode":
            splits = self.decoder.num_kv_splits(fb.batch_size, max(fb.seq_lens_cpu))  # host lengths: no sync
            return self.decoder(q, kv_cache, fb.req_to_token, fb.req_pool_indices, fb.seq_lens, scale, splits)
        if max(fb.extend_lens_cpu) <= SHORT_EXTEND_ROWS:
            return self._short_extend(q, kv_cache, fb, kv_lora_rank, scale)
        return self._extend(
            q, kv_cache, fb.req_to_token, fb.req_pool_indices, fb.prefix_lens, fb.extend_lens,
            fb.extend_start_loc, kv_lora_rank, scale, max_extend_len=max(fb.extend_lens_cpu),
        )

    def _rows_as_decodes(
        self, q: torch.Tensor, kv_cache: torch.Tensor, fb: ForwardBatch, kv_lora_rank: int, scale: float
    ) -> torch.Tensor:
        """Row t decodes against its request's positions 0 .. its own: the request found on the device by its start
        row (a request of no rows shares its start with the next one, which the right-side search picks)."""
        rows = torch.arange(q.shape[0], device=q.device)
        request = torch.searchsorted(fb.extend_start_loc, rows, right=True) - 1
        splits = self.decoder.num_kv_splits(q.shape[0], max(fb.seq_lens_cpu))  # host lengths: no sync
        return self.decoder(q, kv_cache, fb.req_to_token, fb.req_pool_indices[request], fb.positions + 1, scale,
                            splits)  # fmt: skip

    def _token_blocks(
        self, q: torch.Tensor, kv_cache: torch.Tensor, fb: ForwardBatch, kv_lora_rank: int, scale: float
    ) -> torch.Tensor:
        """Each row attends to its request's positions 0 .. its own; the split count from the host's bounds (a
        graph's: the longest context it holds), each block's split size from its own rows on the device."""
        max_rows = max(fb.extend_lens_cpu)
        splits = self.short.num_splits(fb.batch_size, q.shape[1], max_rows, max(fb.seq_lens_cpu), q.shape[0])
        return self.short(q, kv_cache, fb.req_to_token, fb.req_pool_indices, fb.extend_start_loc, fb.extend_lens,
                          fb.positions + 1, kv_lora_rank, scale, splits, max_rows)  # fmt: skip

    def mha(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        fb: ForwardBatch,
        k_starts: list[int],
        k_lens: list[int],
        scale: float,
    ) -> torch.Tensor:
        if k_lens == fb.extend_lens_cpu:  # a prefix-free prefill: the keys are the queries' own rows
            return self._prefill(q, k, v, fb.extend_start_loc, fb.extend_lens, scale, max_extend_len=max(k_lens))
        # queries on a cached prefix (the MLA's normal path there): every key of each request, the batch's seq_lens,
        # already on the device, laid end to end
        if k_lens != fb.seq_lens_cpu:
            raise ValueError("triton mha takes a prefix-free prefill's keys or every key of each request (seq_lens)")
        starts = torch.cumsum(fb.seq_lens, 0) - fb.seq_lens
        return self._prefill(q, k, v, fb.extend_start_loc, fb.extend_lens, scale,
                             max_extend_len=max(fb.extend_lens_cpu), k_start_loc=starts, k_lens=fb.seq_lens)


# The invariant decoder keeps an fp32 partial per (row, head, 256-key split): rows x H x cdiv(max_len, 256) x kv_lora
# x 4 bytes, 4.3 GB for an 8 x 2048-token prefill at H = 16 and 43 GB for a 256-row verify graph at H = 128 and a
# 163,840-token context (a graph's max_len is the longest context). Launches hold at most this many bytes each.
PARTIAL_BYTES = 1 << 30


class InvariantAttention:
    """batch_invariant's attention: row i of the batch attends to positions 0..positions[i] of its request through
    the fixed-split kernel, whose tile shape is the same for every row, so a query's bits depend on its keys only: a
    token's row is the same in a plain decode step, in a verify of d + 1 rows, in a prefill chunk of any size and at
    any batch. A program holds up to 64 / H rows of one request (token_block.py): a prompt's rows share each key
    tile they read, as a flash prefill's query tile does."""

    def __init__(self, shape: DecodeShape, dtype: torch.dtype) -> None:
        from r3trace.kernels.mla_decode.fixed_split import fixed_split_decoder, row_chunks

        self.decoder = fixed_split_decoder(shape.num_heads, dtype)
        self._row_chunks = row_chunks

    def absorbed(
        self, q: torch.Tensor, kv_cache: torch.Tensor, fb: ForwardBatch, kv_lora_rank: int, scale: float
    ) -> torch.Tensor:
        max_len = max(fb.seq_lens_cpu, default=1)  # host lengths: the grid's bounds only
        max_rows = max(fb.extend_lens_cpu, default=1)
        row_keys = fb.positions + 1
        t, h = q.shape[0], q.shape[1]
        per_row = h * -(-max(1, max_len) // self.decoder.split_keys) * kv_lora_rank * 4  # partial bytes a row
        limit = max(1, PARTIAL_BYTES // per_row)
        if t <= limit:
            return self.decoder(q, kv_cache, fb.req_to_token, fb.req_pool_indices, fb.extend_start_loc,
                                fb.extend_lens, row_keys, kv_lora_rank, scale, max_len, max_rows)  # fmt: skip
        out = q.new_empty(t, h, kv_lora_rank)
        lens = fb.extend_lens_cpu
        for b0, b1, r0, r1 in self._row_chunks(lens, limit):
            if r1 - r0 < sum(lens[b0:b1]):  # a piece of one request's rows: a request of its own
                q_start = torch.zeros(1, dtype=fb.extend_start_loc.dtype, device=q.device)
                q_lens = torch.full((1,), r1 - r0, dtype=fb.extend_lens.dtype, device=q.device)
            else:
                q_start, q_lens = fb.extend_start_loc[b0:b1] - r0, fb.extend_lens[b0:b1]
            self.decoder(q[r0:r1], kv_cache, fb.req_to_token, fb.req_pool_indices[b0:b1], q_start, q_lens,
                         row_keys[r0:r1], kv_lora_rank, scale, max_len, min(max_rows, r1 - r0),
                         out=out[r0:r1])  # fmt: skip
        return out

    def mha(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        fb: ForwardBatch,
        k_starts: list[int],
        k_lens: list[int],
        scale: float,
    ) -> torch.Tensor:
        raise ValueError("batch_invariant attention runs the absorbed MLA path only (EngineConfig.mla_impl)")


class RowInvariantAttention:
    """row_invariant's attention (the MLA's split path, layers/mla.py): the absorbed rows (decodes and verifies) through
    InvariantAttention's fixed splits, so a token's decode row has the same bits in a plain step of any batch and in
    a verify; the prompt rows through TritonAttention's MHA kernel over every key of the request, whose rows follow
    their own keys only (on a cached prefix too), at the normal path's cost (the absorbed form of an 8 x 2048 prefill
    is 4x the MHA kernel, BENCHMARKS.md#batch-invariant-mode)."""

    def __init__(self, fast: TritonAttention, invariant: InvariantAttention) -> None:
        self.fast, self.invariant = fast, invariant

    def absorbed(
        self, q: torch.Tensor, kv_cache: torch.Tensor, fb: ForwardBatch, kv_lora_rank: int, scale: float
    ) -> torch.Tensor:
        return self.invariant.absorbed(q, kv_cache, fb, kv_lora_rank, scale)

    def mha(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        fb: ForwardBatch,
        k_starts: list[int],
        k_lens: list[int],
        scale: float,
    ) -> torch.Tensor:
        return self.fast.mha(q, k, v, fb, k_starts, k_lens, scale)


def make_attention_backend(
    name: str, device: str, decode_kernel: str, page_size: int, shape: DecodeShape, dtype: torch.dtype
) -> AttentionBackend:
    """shape: this rank's heads and the latent row's parts, for the triton backend's decode kernel."""
    if name == "exact":
        return ExactAttention()
    if name == "invariant":
        return InvariantAttention(shape, dtype)
    if name == "row_invariant":
        fast = TritonAttention(device, decode_kernel, page_size, shape, dtype)
        return RowInvariantAttention(fast, InvariantAttention(shape, dtype))
    return RefAttention() if name == "ref" else TritonAttention(device, decode_kernel, page_size, shape, dtype)
