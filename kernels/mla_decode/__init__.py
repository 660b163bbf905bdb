"""MLA decode attention over the paged latent KV cache (split-KV flash decoding)."""

from r3trace.kernels.mla_decode.decode import mla_decode, mla_decode_ref
from r3trace.kernels.mla_decode.tile import DecodeTile, choose_num_kv_splits, default_decode_tile

__all__ = ["DecodeTile", "choose_num_kv_splits", "default_decode_tile", "mla_decode", "mla_decode_ref"]
