"""The stage-1 kernels mla_decode can run, one record each: name, what it needs, and its launcher.

    record   hopper  supported(shape, dtype, page_size)                          launcher
    triton   no      any float dtype, any shape and page size                     triton_stage1.py
    wide     yes     bf16 / fp16, kv_lora in GLUON_KV_LORA, rope in GLUON_ROPE    wide.py
    narrow   yes     as wide                                                      narrow.py
    seesaw   yes     as wide, and rope 64 on pages of a multiple of 64 slots      seesaw.py

`stage1(name)` returns a record (the Gluon modules are imported on the first request for one); `DecodeTile.kernel`
names it. Which record runs by default is default_decode_tile's table (tile.py, and the package docstring); the
attention backend resolves it once when it is built (decode.resolve_decoder) and every layer calls that.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from r3trace.kernels.mla_decode.tile import DecodeTile

GLUON_KV_LORA = (128, 256, 512)  # the wide kernel: each warpgroup's half of O one wgmma of N = kv_lora / 2 <= 256
GLUON_ROPE = (16, 32, 64, 128)  # a power of two (Gluon tensor shapes), >= one 16-wide wgmma K step
TMA_PAGE = 64  # pages of a multiple of this many slots hold whole 64-key tiles: the Gluon kernels' TMA form
STAGE1_NAMES = ("triton", "wide", "narrow", "seesaw")


class DecodeShape(NamedTuple):
    """What a decode's kernel choice depends on besides dtype and page size: the query heads on this rank and the
    latent row's two parts (C = kv_lora + rope)."""

    num_heads: int
    kv_lora: int
    rope: int


class Stage1Launch(Protocol):
    def __call__(
        self, q: torch.Tensor, kv_cache: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor, kv_lora_rank: int, qk_scale: float,
        tile: DecodeTile, pdl: bool = False, cluster: int = 1,
    ) -> bool: ...  # fmt: skip


class Stage1(NamedTuple):
    """One stage-1 kernel. launch fills part_out [B, H, P, kv_lora] (fp32, or the output itself at P = 1) and
    part_lse [B, H, P] (log2 units) and returns True; with cluster = P > 1 it merges the P splits itself, writing the
    output into part_out [B, H, 1, kv_lora], or returns False having launched nothing (no cluster form, or the
    clusters would not all be resident at once: the caller then runs the merge kernel)."""

    name: str
    hopper: bool  # needs an sm_90 GPU (wgmma, TMA, mbarriers)
    fixed_tile: tuple[int, int, int] | None  # (heads, keys, warps) of a kernel written for one tile; None: any
    supported: Callable[[DecodeShape, torch.dtype, int], str | None]  # None: it runs these inputs, else why not
    launch: Stage1Launch


def gluon_shape_error(shape: DecodeShape, dtype: torch.dtype, kernel: str) -> str | None:
    """Why a Gluon stage 1 cannot run this latent shape and dtype (None: it can)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the {kernel} decode kernel takes bf16/fp16, not {dtype}"
    if shape.kv_lora not in GLUON_KV_LORA or shape.rope not in GLUON_ROPE:
        return (f"the {kernel} decode kernel needs kv_lora in {GLUON_KV_LORA} and rope in {GLUON_ROPE}, "
                f"got {shape.kv_lora}, {shape.rope}")  # fmt: skip
    return None


def stage1(name: str) -> Stage1:
    """The record a DecodeTile.kernel names. The Gluon modules (and triton.experimental.gluon) are imported here,
    on the first request for one of their records."""
    if name == "triton":
        from r3trace.kernels.mla_decode.triton_stage1 import STAGE1 as record
    elif name == "wide":
        from r3trace.kernels.mla_decode.wide import STAGE1 as record
    elif name == "narrow":
        from r3trace.kernels.mla_decode.narrow import STAGE1 as record
    elif name == "seesaw":
        from r3trace.kernels.mla_decode.seesaw import STAGE1 as record
    else:
        from r3trace.kernels.contract import KernelInputError

        raise KernelInputError(f"DecodeTile.kernel {name!r} not in {STAGE1_NAMES}")
    return record


def tile_error(record: Stage1, tile: DecodeTile) -> str | None:
    """Why `tile` does not fit the record's kernel (None: it does). The Gluon kernels are written for one tile."""
    if record.fixed_tile is None:
        return None
    heads, keys, warps = record.fixed_tile
    if (tile.block_h, tile.block_n, tile.num_warps, tile.num_stages, tile.v_splits) != (heads, keys, warps, 2, 1) \
            or tile.keys_major:  # fmt: skip
        return (f"the {record.name} Gluon kernel's tile is fixed: {heads} heads x {keys} keys x {warps} warps, "
                f"2 stages; got {tile}")  # fmt: skip
    return None
