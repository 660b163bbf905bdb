"""SGLang's wire format for routes: base64 (pybase64) of little-endian int32 [rows, L, K].

`meta_info["routed_experts"]` decodes unchanged with SGLang's own client helper; r3trace adds
`routed_experts_shape`, `routed_experts_dtype` and `moe_layer_ids` so nobody has to guess the shape,
and writes -1 (never 0, which reads as "expert 0") for dense layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pybase64


class WireFormatError(ValueError):
    """A base64 route payload does not decode to the expected shape; the message says what differs."""


def encode_int32(rows: np.ndarray) -> str:
    """rows: [R, L, K] integer -> base64 of little-endian int32."""
    return pybase64.b64encode(np.ascontiguousarray(rows, dtype="<i4").tobytes()).decode("ascii")


def encode_float16(rows: np.ndarray) -> str:
    """rows: [R, L, K] float -> base64 of little-endian float16."""
    return pybase64.b64encode(np.ascontiguousarray(rows, dtype="<f2").tobytes()).decode("ascii")


def decode_array(payload: str | bytes, dtype: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """Decode a base64 payload; with `shape`, check that it holds exactly that many elements."""
    try:
        raw = pybase64.b64decode(payload, validate=True)
    except (ValueError, TypeError) as exc:
        raise WireFormatError(f"routed_experts is not valid base64 ({exc})") from exc
    itemsize = np.dtype(dtype).itemsize
    if len(raw) % itemsize:
        raise WireFormatError(f"routed_experts holds {len(raw)} bytes, not a multiple of {itemsize} ({dtype})")
    arr = np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype)
    if shape is None:
        return arr
    want = int(np.prod(shape))
    if arr.size != want:
        raise WireFormatError(f"routed_experts holds {arr.size} values; shape {list(shape)} needs {want}")
    return arr.reshape(shape)


def decode_routed_experts(meta_info: Mapping[str, Any], key: str = "routed_experts") -> np.ndarray:
    """meta_info of an r3trace (or SGLang) response -> int32 [rows, L, K].

    Without `routed_experts_shape` (plain SGLang) the flat array is returned, as SGLang's helper does.
    """
    if key not in meta_info:
        raise WireFormatError(f"meta_info has no {key!r}: was return_routed_experts set?")
    shape = meta_info.get(f"{key}_shape")
    dtype = meta_info.get(f"{key}_dtype", "int32" if key == "routed_experts" else "float16")
    return decode_array(meta_info[key], dtype, None if shape is None else tuple(shape))


def decode_routed_weights(meta_info: Mapping[str, Any]) -> np.ndarray:
    """meta_info -> float16 [rows, L, K] top-k weights (when return_routed_weights was set)."""
    return decode_routed_experts(meta_info, key="routed_weights")
