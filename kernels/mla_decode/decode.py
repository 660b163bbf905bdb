"""mla_decode: split-KV flash decoding over the paged latent cache, stage 1 then the merge (two launches).

Shape legend: B requests (one new token each), H query heads, C = kv_lora + rope (one cache row), S cache slots,
R request rows of req_to_token, P = num_kv_splits.

    q        [B, H, C]   absorbed queries: [q_nope @ w_kc (kv_lora), q_pe roped (rope)]
    kv_cache [S, C]      row = [c_kv (kv_lora, normed), k_pe (rope, roped)]; V = c_kv
    out      [B, H, kv_lora]

Stage 1 (a registry record, registry.py) splits each request's positions 0..seq_len-1 into P runs of whole BLOCK_N
tiles and writes each split's normalised partial output and log-sum-exp; the merge (merge.py) weighs the P partials
by their LSEs. With one split and DecodeTile.direct, stage 1 writes the output itself and no merge runs; with
DecodeTile.cluster, a Gluon stage 1 merges its splits inside thread-block clusters (cluster_merge.py).

Two entry points: mla_decode(..., tile) looks the tile's record up on each call (tests, bench); resolve_decoder picks
the default tile and record once for a shape, dtype, page size and device, and the MlaDecoder it returns is what the
attention backend calls on every layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from r3trace.kernels.contract import FLOAT_DTYPES, INDEX_DTYPES, require, require_tensor
from r3trace.kernels.flash import LOG2E
from r3trace.kernels.mla_decode.merge import merge_splits
from r3trace.kernels.mla_decode.registry import DecodeShape, Stage1, stage1, tile_error
from r3trace.kernels.mla_decode.tile import CLUSTER_SIZES, DecodeTile, default_decode_tile

INTERPRET_SMS = 4  # the SM count assumed off the GPU (the interpreter): a few splits, still > 1


@functools.lru_cache(maxsize=8)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def _major(device: torch.device) -> int:
    """The compute capability's major version, 0 off CUDA."""
    return _capability(device.index or 0)[0] if device.type == "cuda" else 0


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def check_decode_args(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
) -> None:
    """The launchers' input contract (shapes, dtypes, devices, unit strides), shared with mla_decode_ref."""
    dev = q.device
    require_tensor("q", q, 3, FLOAT_DTYPES, dev)
    require_tensor("kv_cache", kv_cache, 2, (q.dtype,), dev)
    require_tensor("req_to_token", req_to_token, 2, INDEX_DTYPES, dev)
    require_tensor("req_pool_indices", req_pool_indices, 1, INDEX_DTYPES, dev)
    require_tensor("seq_lens", seq_lens, 1, INDEX_DTYPES, dev)
    B, _, C = q.shape
    require(kv_cache.shape[1] == C, f"kv_cache row has {kv_cache.shape[1]} columns, q has C={C}")
    require(0 < kv_lora_rank < C, f"kv_lora_rank {kv_lora_rank} must be in 1..C-1={C - 1}")
    require(q.stride(2) == 1, f"q must be contiguous in C, strides {q.stride()}")
    require(req_pool_indices.shape[0] == B, f"req_pool_indices has {req_pool_indices.shape[0]} rows, B={B}")
    require(seq_lens.shape[0] == B, f"seq_lens has {seq_lens.shape[0]} rows, B={B}")


def _runs_here(record: Stage1, tile: DecodeTile, shape: DecodeShape, dtype: torch.dtype, device: torch.device) -> None:
    """Raise KernelInputError naming why the record's kernel cannot run this tile, shape, dtype or device."""
    why = tile_error(record, tile) or record.supported(shape, dtype, tile.page_size)
    if why is None and record.hopper and _major(device) != 9:
        why = f"the {record.name} decode kernel needs a Hopper (sm_90) GPU"
    require(why is None, str(why))


def _run(
    record: Stage1,
    tile: DecodeTile,
    pdl: bool,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    sm_scale: float,
    num_kv_splits: int,
) -> torch.Tensor:
    """Stage 1 by `record` with `tile`, then the merge where one is needed (arguments checked by the caller)."""
    B, H, _ = q.shape
    require(tile.v_splits in (1, 2), f"v_splits {tile.v_splits} not in (1, 2)")
    require(1 <= num_kv_splits <= 1024, f"num_kv_splits {num_kv_splits} not in 1..1024")
    block_c = max(16, triton.next_power_of_2(kv_lora_rank))
    require(block_c // tile.v_splits >= 16, f"kv_lora {kv_lora_rank} too small for {tile.v_splits} value splits")
    out = torch.empty((B, H, kv_lora_rank), dtype=q.dtype, device=q.device)
    if B == 0 or H == 0:
        return out
    tables = (q, kv_cache, req_to_token, req_pool_indices, seq_lens)
    qk_scale = sm_scale * LOG2E
    # the splits merged inside thread-block clusters: stage 1 stores the output; the launcher declines (False) where
    # the clusters would not all fit on the GPU at once, or where its kernel has no cluster form
    if num_kv_splits in CLUSTER_SIZES and num_kv_splits <= tile.cluster and record.launch(
        *tables, out.unsqueeze(2), out, kv_lora_rank, qk_scale, tile, pdl=pdl, cluster=num_kv_splits
    ):
        return out
    # One split with tile.direct: stage 1's normalised tile is the answer, stored straight into out (rounded once,
    # as the merge would: its weight is exp2(0) = 1, so the bits are the same), and the merge is not launched.
    direct = num_kv_splits == 1 and tile.direct
    part_out = out.unsqueeze(2) if direct else torch.empty(
        (B, H, num_kv_splits, kv_lora_rank), dtype=torch.float32, device=q.device)  # fmt: skip
    part_lse = torch.empty((B, H, num_kv_splits), dtype=torch.float32, device=q.device)  # direct: unread
    record.launch(*tables, part_out, part_lse, kv_lora_rank, qk_scale, tile, pdl=pdl)
    if not direct:
        merge_splits(part_out, part_lse, seq_lens, out, tile.block_n, pdl)
    return out


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    sm_scale: float,
    num_kv_splits: int | None = None,
    tile: DecodeTile | None = None,
) -> torch.Tensor:
    """q: [B, H, C] -> out [B, H, kv_lora]; request b attends to positions 0..seq_lens[b]-1.

    tile=None: default_decode_tile(H, dtype), the Triton stage 1 (resolve_decoder picks the Gluon ones on Hopper).
    num_kv_splits=None picks it from max(seq_lens) (one device sync) and the SM count; pass it (tile.num_kv_splits)
    to stay sync-free and CUDA-graph capturable."""
    check_decode_args(q, kv_cache, req_to_token, req_pool_indices, seq_lens, kv_lora_rank)
    B, H, C = q.shape
    tile = tile or default_decode_tile(H, q.dtype)
    record = stage1(tile.kernel)
    _runs_here(record, tile, DecodeShape(H, kv_lora_rank, C - kv_lora_rank), q.dtype, q.device)
    if num_kv_splits is None:
        max_len = int(seq_lens.max().item()) if B > 0 else 1
        sms = _sm_count(q.device.index or 0) if q.is_cuda else INTERPRET_SMS
        num_kv_splits = tile.num_kv_splits(B, H, max_len, sms)
    pdl = tile.pdl and _major(q.device) >= 9  # griddepcontrol: sm_90+; the interpreter has none
    return _run(record, tile, pdl, q, kv_cache, req_to_token, req_pool_indices, seq_lens, kv_lora_rank, sm_scale,
                num_kv_splits)  # fmt: skip


@dataclass(frozen=True)
class MlaDecoder:
    """One decode resolved for a shape, dtype, page size and device (resolve_decoder): its tile, the tile's stage-1
    record, the device's SM count and whether the kernels launch as programmatic dependents. The attention backend
    builds one; every layer calls it, and nothing is looked up per call."""

    shape: DecodeShape
    tile: DecodeTile
    stage1: Stage1
    sm_count: int
    pdl: bool

    def num_kv_splits(self, batch: int, max_seq_len: int) -> int:
        """The tile's split count for this batch (host arithmetic: pass host-side lengths, no device sync)."""
        return self.tile.num_kv_splits(batch, self.shape.num_heads, max_seq_len, self.sm_count)

    def __call__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        sm_scale: float,
        num_kv_splits: int,
    ) -> torch.Tensor:
        """q [B, H, C] -> [B, H, kv_lora], as mla_decode with this decoder's tile."""
        check_decode_args(q, kv_cache, req_to_token, req_pool_indices, seq_lens, self.shape.kv_lora)
        require(q.shape[1] == self.shape.num_heads,
                f"q has {q.shape[1]} heads, the decoder was resolved for {self.shape.num_heads}")  # fmt: skip
        return _run(self.stage1, self.tile, self.pdl, q, kv_cache, req_to_token, req_pool_indices, seq_lens,
                    self.shape.kv_lora, sm_scale, num_kv_splits)  # fmt: skip


def resolve_decoder(
    shape: DecodeShape, dtype: torch.dtype, page_size: int, device: torch.device | str, use_gluon: bool = True
) -> MlaDecoder:
    """The default decode for these inputs (default_decode_tile's table; use_gluon=False keeps the Triton stage 1
    everywhere), checked once: a record that cannot run them raises KernelInputError naming why."""
    dev = torch.device(device)
    major = _major(dev)
    tile = default_decode_tile(shape.num_heads, dtype, use_gluon and major == 9, shape.kv_lora, shape.rope,
                               page_size)  # fmt: skip
    record = stage1(tile.kernel)
    _runs_here(record, tile, shape, dtype, dev)
    sms = _sm_count(dev.index or 0) if dev.type == "cuda" else INTERPRET_SMS
    return MlaDecoder(shape, tile, record, sms, tile.pdl and major >= 9)
