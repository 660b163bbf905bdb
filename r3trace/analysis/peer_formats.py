"""Route-carrying response bodies of SGLang, vLLM and OpenAI-shaped servers, decoded into rows.

Each format: where the routes are; the payload; what dense layers hold; which position row 0 is.
- sglang: meta_info.routed_experts of /generate (an object, or a list of them); base64 of little-endian
  `routed_experts_dtype` (int32 unless named, uint16, uint8), flat over [rows, L, K]; dense layers 0
  (r3trace: -1); row 0 is meta_info.routed_experts_start_len (r3trace's stream deltas: routed_experts_offset).
- openai: SGLang's response-level `sglext.routed_experts` (streaming: one chunk with `choices: []`, the routes
  of the first choice), r3trace's `sglext.choices[i]` (several choices), or older r3trace's per-choice
  `choices[i].sgl_ext`; the payload and fields as sglang.
- vllm: `choices[i].routed_experts`, base64 of `.npy` bytes [rows, L, K], uint8 when E <= 256 else uint16;
  dense layers 0; row 0 is `routed_experts_prompt_start` when the body has it, else prompt + completion - 1
  - rows (vLLM routes every token but the last, which no forward has seen).

L is num_hidden_layers: every peer sends a row for every layer. Dense layers are dropped using the model's
layer layout (moe_layer_ids), after checking they hold only 0 or -1: expert ids on a layer the layout calls
dense mean the layout given to ingest is not the model's.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

Format = Literal["sglang", "openai", "vllm"]
FORMATS: tuple[Format, ...] = ("sglang", "openai", "vllm")
WIRE_DTYPES = ("int32", "uint16", "uint8")  # SGLang's routed_experts_dtype values
NPY_MAGIC = b"\x93NUMPY"


class BodyError(ValueError):
    """A body that does not hold what its format promises; the message names the field and the limit."""


@dataclass(frozen=True)
class Routes:
    """One request's rows from one body (or a chunk of it); ids is None for a chunk that only summarises."""

    request_id: str
    field: str  # where the rows came from, for messages
    ids: np.ndarray | None  # [rows, num_hidden_layers, K] as sent; None: the field is absent from this body
    start: int  # position of row 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None


def detect(obj: Any) -> Format | None:
    """The format of one JSON body, from the keys only its format has; None when none matches."""
    if isinstance(obj, list):
        return "sglang" if obj and all(isinstance(o, dict) and "meta_info" in o for o in obj) else None
    if not isinstance(obj, dict):
        return None
    choices = _choices(obj)
    if "meta_info" in obj or any("meta_info" in c for c in choices):
        return "sglang"
    if "sglext" in obj or any("sgl_ext" in c for c in choices):
        return "openai"
    if any(isinstance(c.get("routed_experts"), str) for c in choices):
        return "vllm"
    if "object" in obj and "choices" in obj:  # an OpenAI body or chunk without routes (a text delta, usage)
        return "openai"
    return None


def routes_of(obj: Any, fmt: Format, shape: tuple[int, int], wire_dtype: str = "int32") -> list[Routes]:
    """Every request's rows in one body. shape: (num_hidden_layers, K); wire_dtype: SGLang's payload dtype
    when the body does not name it (a server started with a narrow dtype and no routed_experts_dtype key)."""
    if fmt == "sglang":
        return _sglang(obj, shape, wire_dtype)
    if not isinstance(obj, dict):
        raise BodyError(f"body is a JSON {type(obj).__name__}, an {fmt} body is an object")
    return _openai(obj, shape, wire_dtype) if fmt == "openai" else _vllm(obj, shape)


def moe_rows(r: Routes, moe_layer_ids: tuple[int, ...], num_experts: int) -> np.ndarray:
    """[rows, L_moe, K] int32 of r's MoE layers, after checking dense layers hold 0 or -1 and MoE layers ids in
    0..E-1."""
    assert r.ids is not None
    ids = r.ids.astype(np.int64)
    dense = np.setdiff1d(np.arange(ids.shape[1]), moe_layer_ids)
    bad = dense[((ids[:, dense] != 0) & (ids[:, dense] != -1)).any(axis=(0, 2))] if len(dense) else dense
    if len(bad):
        raise BodyError(f"field {r.field} holds expert ids on layer {int(bad[0])}, which the model layout "
                        f"(moe_layer_ids {_span(moe_layer_ids)}) says is dense: give the model's --manifest, "
                        "--first-k-dense or --moe-layer-ids")
    out = ids[:, list(moe_layer_ids), :]
    if out.size and (out.min() < 0 or out.max() >= num_experts):
        v = int(out.min()) if out.min() < 0 else int(out.max())
        raise BodyError(f"field {r.field} holds id {v} on a MoE layer, outside 0..{num_experts - 1}")
    return out.astype(np.int32)


def _span(ids: tuple[int, ...]) -> str:
    """(3, 4, ..., 60) -> '3..60'; a layout with gaps as its list."""
    return f"{ids[0]}..{ids[-1]}" if list(ids) == list(range(ids[0], ids[-1] + 1)) else ",".join(map(str, ids))


def _flat(payload: Any, field: str, dtype: str, shape: tuple[int, int], named: Any) -> np.ndarray:
    """SGLang's payload: base64 of little-endian `dtype`, flat [rows * L * K]; `named` the shape it says."""
    if not isinstance(payload, str):
        raise BodyError(f"field {field} missing or not a base64 string")
    if dtype not in WIRE_DTYPES:
        raise BodyError(f"field {field}_dtype is {dtype!r}; SGLang sends one of {', '.join(WIRE_DTYPES)}")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise BodyError(f"field {field} is not valid base64 ({e})") from e
    item = np.dtype(dtype).itemsize
    if len(raw) % item:
        raise BodyError(f"field {field} holds {len(raw)} bytes, not a multiple of {item} ({dtype})")
    flat = np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<"))
    per_row = shape[0] * shape[1]
    if flat.size % per_row:
        raise BodyError(f"field {field} has {flat.size} ids, not a multiple of num_hidden_layers x K = "
                        f"{shape[0]} x {shape[1]} = {per_row}")
    ids = flat.reshape(-1, *shape)
    if named is not None and (not isinstance(named, list) or named != list(ids.shape)):
        raise BodyError(f"field {field}_shape says {named!r}, the payload is {list(ids.shape)}")
    return ids


def _choices(obj: dict[str, Any]) -> list[dict[str, Any]]:
    c = obj.get("choices")
    return [x for x in c if isinstance(x, dict)] if isinstance(c, list) else []


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _finish(f: Any) -> str | None:
    return f.get("type") if isinstance(f, dict) else f if isinstance(f, str) else None


def _sglang(obj: Any, shape: tuple[int, int], wire_dtype: str) -> list[Routes]:
    """/generate: an object with meta_info, a list of them, or (older r3trace) choices[i].meta_info."""
    if isinstance(obj, list):
        return [r for o in obj for r in _sglang(o, shape, wire_dtype)]
    if not isinstance(obj, dict):
        raise BodyError(f"body is a JSON {type(obj).__name__}; field meta_info missing")
    if "meta_info" in obj:
        metas = [(obj["meta_info"], obj.get("id"), "meta_info")]
    else:
        metas = [(c["meta_info"], _choice_id(obj, c, i), f"choices[{i}].meta_info")
                 for i, c in enumerate(_choices(obj)) if "meta_info" in c]
    if not metas:
        raise BodyError("field meta_info missing (nor choices[].meta_info)")
    out = []
    for meta, rid, where in metas:
        if not isinstance(meta, dict):
            raise BodyError(f"field {where} is not an object")
        out.append(_sglang_block(meta, f"{where}.routed_experts", meta.get("id") or rid, shape, wire_dtype))
    return out


def _sglang_block(block: dict[str, Any], field: str, rid: Any, shape: tuple[int, int], wire_dtype: str,
                  ) -> Routes:
    """The routes of a meta_info or sglext block, with its start position and request summary; without
    routed_experts (a streamed chunk before the last) only the summary."""
    dtype = block.get("routed_experts_dtype", wire_dtype)
    summary = (_int(block.get("prompt_tokens")), _int(block.get("completion_tokens")),
               _finish(block.get("finish_reason")))
    if block.get("routed_experts") is None:
        return Routes(str(rid) if rid is not None else "", field, None, 0, *summary)
    ids = _flat(block.get("routed_experts"), field, str(dtype), shape, block.get("routed_experts_shape"))
    start = _int(block.get("routed_experts_offset", block.get("routed_experts_start_len", 0) or 0))
    if start is None or start < 0:
        raise BodyError(f"field {field}_start_len must be an integer >= 0")
    return Routes(str(rid) if rid is not None else "", field, ids, start, *summary)


def _choice_id(obj: dict[str, Any], c: dict[str, Any], i: int) -> str:
    """A choice's request id: the body's id, with the choice index when the body has several choices."""
    base = str(obj.get("id") or "")
    n = len(_choices(obj))
    return f"{base}.{c.get('index', i)}" if n > 1 else base


def _usage(obj: dict[str, Any]) -> tuple[int | None, int | None]:
    u = obj.get("usage")
    return (_int(u.get("prompt_tokens")), _int(u.get("completion_tokens"))) if isinstance(u, dict) else (None, None)


def _openai(obj: dict[str, Any], shape: tuple[int, int], wire_dtype: str) -> list[Routes]:
    """SGLang's response-level sglext (routes of the body's first choice, as SGLang sends them) or r3trace's
    per-choice sgl_ext; a chunk with neither gives a summary-only record (usage, finish reason)."""
    prompt, completion = _usage(obj)
    choices = _choices(obj)
    fin = next((_finish(c.get("finish_reason")) for c in choices if c.get("finish_reason")), None)
    rid = str(obj.get("id") or "")
    ext = obj.get("sglext")
    if isinstance(ext, dict) and isinstance(ext.get("choices"), list):  # r3trace: several choices, each its own
        return [Routes(r.request_id, r.field, r.ids, r.start, prompt, None,
                       _finish(choices[i].get("finish_reason")) if i < len(choices) else None)
                for i, sub in enumerate(ext["choices"])
                for r in [_sglang_block(sub, f"sglext.choices[{i}].routed_experts", _choice_id(obj, sub, i),
                                        shape, wire_dtype)]]
    if isinstance(ext, dict) and ext.get("routed_experts") is not None:
        r = _sglang_block(ext, "sglext.routed_experts", rid, shape, wire_dtype)
        return [Routes(rid, r.field, r.ids, r.start, prompt, completion if len(choices) <= 1 else None, fin)]
    out = []
    for i, c in enumerate(choices):
        sub = c.get("sgl_ext")
        if isinstance(sub, dict) and sub.get("routed_experts") is not None:
            r = _sglang_block(sub, f"choices[{i}].sgl_ext.routed_experts", _choice_id(obj, c, i), shape, wire_dtype)
            out.append(Routes(r.request_id, r.field, r.ids, r.start, prompt,
                              completion if len(choices) == 1 else None, _finish(c.get("finish_reason"))))
    if out:
        return out
    if ext is not None or obj.get("object") is None:
        raise BodyError("field sglext.routed_experts missing (nor choices[].sgl_ext.routed_experts)")
    return [Routes(rid, "", None, 0, prompt, completion, fin)]  # a streamed text or usage chunk


def _npy(payload: Any, field: str, shape: tuple[int, int]) -> np.ndarray:
    """vLLM's payload: base64 of the bytes np.save writes, an integer array [rows, L, K]."""
    if not isinstance(payload, str):
        raise BodyError(f"field {field} missing or not a base64 string")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise BodyError(f"field {field} is not valid base64 ({e})") from e
    if not raw.startswith(NPY_MAGIC):
        raise BodyError(f"field {field} is not .npy bytes (vLLM's format); for SGLang's raw int32 use "
                        "--format sglang or openai")
    try:
        ids = np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, EOFError, OSError) as e:
        raise BodyError(f"field {field}: .npy bytes do not load ({e})") from e
    if ids.dtype.kind not in "iu" or ids.ndim != 3 or tuple(ids.shape[1:]) != shape:
        raise BodyError(f"field {field} is {ids.dtype} {list(ids.shape)}; expected integer [rows, {shape[0]}, "
                        f"{shape[1]}] (num_hidden_layers, K)")
    return ids


def _vllm(obj: dict[str, Any], shape: tuple[int, int]) -> list[Routes]:
    """Per-choice routes; row 0 is routed_experts_prompt_start (choice or body), else inferred from counts."""
    choices = _choices(obj)
    if not choices:
        raise BodyError("field choices[].routed_experts missing (vLLM returns routes per choice)")
    prompt_u, completion_u = _usage(obj)
    out = []
    for i, c in enumerate(choices):
        field = f"choices[{i}].routed_experts"
        ids = _npy(c.get("routed_experts"), field, shape)
        p_ids = c.get("prompt_token_ids") or obj.get("prompt_token_ids")
        prompt = len(p_ids) if isinstance(p_ids, list) else prompt_u
        t_ids = c.get("token_ids")
        completion = len(t_ids) if isinstance(t_ids, list) else completion_u if len(choices) == 1 else None
        given = c.get("routed_experts_prompt_start", obj.get("routed_experts_prompt_start"))
        start = _int(given) if given is not None else (
            prompt + completion - 1 - len(ids) if prompt is not None and completion is not None else 0)
        if start is None or start < 0:
            raise BodyError(f"field {field} has {len(ids)} rows, more than prompt + completion - 1 = "
                            f"{(prompt or 0) + (completion or 0) - 1}" if given is None else
                            f"field routed_experts_prompt_start must be an integer >= 0, got {given!r}")
        out.append(Routes(_choice_id(obj, c, i), field, ids, start, prompt, completion,
                          _finish(c.get("finish_reason"))))
    return out
