"""Ingest of peers' response bodies, each built as the peer's own code builds it, compared value by value.

vLLM: vllm/entrypoints/openai/completion/serving.py at vllm-project/vllm commit
030ea52effcb05071543c8c42b8f0145e94cee43 (request_output_to_completion_response: per choice
`routed_experts=numpy2base64(output.routed_experts)`, usage with prompt_tokens and completion_tokens); the
CompletionResponseChoice.routed_experts comment of vllm/entrypoints/openai/completion/protocol.py (base64 of
.npy bytes, shape (num_tokens - 1, num_layers, num_experts_per_tok), uint8/uint16, decoded with np.load);
vLLM's scheduler-side RoutedExpertsManager (a zeroed [slots, num_hidden_layers, K] buffer, uint8 when
num_experts <= 256 else uint16, so dense layers read 0; get() drops the first routed_experts_prompt_start rows).
SGLang: python/sglang/srt/entrypoints/openai/serving_completions.py at sgl-project/sglang commit
004c82e07d876f6e4a0ad6e15325706b0f478f1a (_build_completion_response: response-level
sglext=SglExt(routed_experts=..., cached_tokens_details=...) from the first result; the stream's sglext chunk
with choices=[] after the text chunks, then the usage chunk, then [DONE]); meta_info.routed_experts_dtype
names the narrow wire dtypes (int32, uint16, uint8). r3trace: r3trace/server/openai_api.py's sglext (with
`choices` when there are several), and the per-choice sgl_ext of older r3trace servers.
Run: .venv/bin/pytest tests/analysis/test_ingest_peers.py -q
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from r3trace.analysis.ingest import IngestError, ModelShape, ingest_responses
from r3trace.analysis.store import TraceStore
from r3trace.cli import main

SHAPE = ModelShape(num_hidden_layers=4, moe_layer_ids=(1, 2, 3), num_experts=16, top_k=2)
MOE = list(SHAPE.moe_layer_ids)


def routes(rng: np.random.Generator, rows: int, experts: int = 16, dense: int = 0) -> np.ndarray:
    """[rows, 4, 2] as a peer's buffer holds them: MoE layers 1..3 routed, dense layer 0 never written."""
    ids = np.argsort(rng.random((rows, 4, experts)), axis=-1)[..., :2]  # 2 distinct experts a layer, as a router picks
    ids[:, 0] = dense
    return ids


def npy_b64(a: np.ndarray) -> str:
    """vLLM's numpy2base64: np.save bytes, base64."""
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def raw_b64(a: np.ndarray, dtype: str = "<i4") -> str:
    """SGLang's payload: the flat little-endian bytes, base64."""
    return base64.b64encode(np.ascontiguousarray(a, dtype=dtype).tobytes()).decode()


def vllm_completion(rid: str, choices: list[dict[str, Any]], prompt: int, completion: int) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": 1, "model": "m", "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
            "system_fingerprint": None, "kv_transfer_params": None}


def vllm_choice(i: int, ids: np.ndarray, token_ids: list[int] | None = None) -> dict[str, Any]:
    return {"index": i, "text": "x", "logprobs": None, "finish_reason": "length", "stop_reason": None,
            "token_ids": token_ids, "prompt_logprobs": None, "prompt_token_ids": None, "routed_experts": npy_b64(ids)}


def stored(store: Path) -> dict[str, tuple[np.ndarray, np.ndarray, list[str]]]:
    """request_id -> (token_pos [T], topk_ids [T, 3, 2], phase per token) read back from the store."""
    got = TraceStore(store).query("select request_id, token_pos, layer_id, topk_ids, phase from routes "
                                  "order by request_id, token_pos, layer_id")
    out = {}
    for rid in got["request_id"].unique().to_list():
        g = got.filter(got["request_id"] == rid)
        assert g["layer_id"].to_list() == MOE * (len(g) // 3)
        pos = np.asarray(g["token_pos"].to_list()[::3])
        out[rid] = (pos, np.stack(g["topk_ids"].to_list()).reshape(-1, 3, 2), g["phase"].to_list()[::3])
    return out


def lines(tmp_path: Path, *bodies: Any, raw: tuple[str, ...] = ()) -> Path:
    src = tmp_path / "bodies.jsonl"
    src.write_text("".join(json.dumps(b) + "\n" for b in bodies) + "".join(raw))
    return src


def test_vllm_bodies_uint8_prompt_start_and_n2(tmp_path: Path) -> None:
    rng = np.random.default_rng(21)
    a = routes(rng, 5 + 4 - 1)  # prompt 5, completion 4: every token but the last was forwarded
    b = routes(rng, 9 + 3 - 1 - 6)[:]  # routed_experts_prompt_start 6 in the request: rows from position 6
    c0, c1 = routes(rng, 4 + 2 - 1), routes(rng, 4 + 5 - 1)  # n=2, token_ids returned per choice
    bodies = [vllm_completion("cmpl-a", [vllm_choice(0, a.astype(np.uint8))], 5, 4),
              vllm_completion("cmpl-b", [vllm_choice(0, b.astype(np.uint8))], 9, 3),
              vllm_completion("cmpl-c", [vllm_choice(0, c0.astype(np.uint8), [7, 8]),
                                         vllm_choice(1, c1.astype(np.uint8), [7, 8, 9, 10, 11])], 4, 7)]
    assert all(np.load(io.BytesIO(base64.b64decode(x["choices"][0]["routed_experts"]))).dtype == np.uint8
               for x in bodies)
    store = tmp_path / "store"
    m = ingest_responses(lines(tmp_path, *bodies), store, SHAPE, run_id="v")
    assert m.rows == (len(a) + len(b) + len(c0) + len(c1)) * 3
    got = stored(store)
    for rid, ids, start, prompt in [("cmpl-a", a, 0, 5), ("cmpl-b", b, 6, 9), ("cmpl-c.0", c0, 0, 4),
                                    ("cmpl-c.1", c1, 0, 4)]:
        pos, topk, phase = got[rid]
        np.testing.assert_array_equal(pos, start + np.arange(len(ids)))
        np.testing.assert_array_equal(topk, ids[:, MOE])
        assert phase == ["prefill" if p < prompt else "decode" for p in pos]


def test_vllm_uint16_when_more_than_256_experts(tmp_path: Path) -> None:
    rng = np.random.default_rng(22)
    shape = ModelShape(num_hidden_layers=4, moe_layer_ids=(1, 2, 3), num_experts=300, top_k=2)
    ids = routes(rng, 6, experts=300)
    assert ids[:, MOE].max() > 255  # ids a uint8 would wrap
    body = vllm_completion("cmpl-w", [vllm_choice(0, ids.astype(np.uint16))], 4, 3)
    ingest_responses(lines(tmp_path, body), tmp_path / "s", shape, run_id="w")
    np.testing.assert_array_equal(stored(tmp_path / "s")["cmpl-w"][1], ids[:, MOE])


def sglang_completion(rid: str, ids: np.ndarray, prompt: int, completion: int) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": "stop", "matched_stop": 2,
                         "hidden_states": None, "token_ids": None, "prompt_token_ids": None}],
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
                      "prompt_tokens_details": None, "reasoning_tokens": 0},
            "metadata": {"weight_version": "default"},
            "sglext": {"routed_experts": raw_b64(ids), "cached_tokens_details": None}}


def sglang_stream(rid: str, ids: np.ndarray, prompt: int, completion: int) -> tuple[str, ...]:
    """The SSE lines of a streamed completion with include_usage: text chunks, the sglext chunk, usage, [DONE]."""
    def chunk(choices: list[Any], **extra: Any) -> str:
        body = {"id": rid, "object": "text_completion", "created": 1, "model": "m", "choices": choices,
                "usage": None, **extra}
        return f"data: {json.dumps(body)}\n\n"
    text = [chunk([{"index": 0, "text": "t", "logprobs": None, "finish_reason": None if i < completion - 1
                    else "length", "matched_stop": None}]) for i in range(completion)]
    ext = chunk([], sglext={"routed_experts": raw_b64(ids), "cached_tokens_details": None})
    usage = {"id": rid, "object": "text_completion", "created": 1, "model": "m", "choices": [],
             "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}
    return (*text, ext, f"data: {json.dumps(usage)}\n\n", "data: [DONE]\n\n")


def test_sglang_sglext_response_and_stream_and_narrow_generate(tmp_path: Path) -> None:
    rng = np.random.default_rng(23)
    a, s, n16, n8 = routes(rng, 6 + 3 - 1), routes(rng, 4 + 3 - 1), routes(rng, 5), routes(rng, 4)
    gen16 = {"text": "x", "meta_info": {"id": "g16", "prompt_tokens": 3, "completion_tokens": 3,
                                        "finish_reason": {"type": "length", "length": 3},
                                        "routed_experts": raw_b64(n16, "<u2"), "routed_experts_dtype": "uint16"}}
    gen8 = {"text": "y", "meta_info": {"id": "g8", "prompt_tokens": 2, "completion_tokens": 3,
                                       "finish_reason": {"type": "stop"}, "routed_experts": raw_b64(n8, "u1"),
                                       "routed_experts_dtype": "uint8"}}
    src = lines(tmp_path, sglang_completion("cmpl-s", a, 6, 3), [gen16, gen8],
                raw=sglang_stream("cmpl-t", s, 4, 3))
    ingest_responses(src, tmp_path / "store", SHAPE, run_id="s")
    got = stored(tmp_path / "store")
    for rid, ids, prompt in [("cmpl-s", a, 6), ("cmpl-t", s, 4), ("g16", n16, 3), ("g8", n8, 2)]:
        pos, topk, phase = got[rid]
        np.testing.assert_array_equal(pos, np.arange(len(ids)))
        np.testing.assert_array_equal(topk, ids[:, MOE])
        assert phase == ["prefill" if p < prompt else "decode" for p in pos]  # the stream's from its usage chunk
    req = TraceStore(tmp_path / "store").query("select request_id, prompt_tokens, finish_reason from requests "
                                               "order by request_id")
    assert req.rows() == [("cmpl-s", 6, "stop"), ("cmpl-t", 4, "length"), ("g16", 3, "length"), ("g8", 2, "stop")]


def test_r3trace_sgl_ext_stream_deltas_and_wire_dtype_flag(tmp_path: Path) -> None:
    from r3trace.server.openai_stream import route_fields  # what older r3trace sent per choice as `sgl_ext`

    rng = np.random.default_rng(24)
    full = routes(rng, 7, dense=-1)
    chunks = []
    for lo, hi in [(0, 4), (4, 6), (6, 7)]:  # prefill rows, then decode deltas with their offsets
        meta = {"routed_experts": raw_b64(full[lo:hi]), "routed_experts_shape": [hi - lo, 4, 2],
                "routed_experts_dtype": "int32", "moe_layer_ids": MOE, "routed_experts_offset": lo}
        chunks.append({"id": "chatcmpl-r", "object": "chat.completion.chunk", "created": 1, "model": "m",
                       "choices": [{"index": 0, "delta": {"content": "t"}, "finish_reason": None,
                                    "sgl_ext": route_fields(meta)}]})
    narrow = routes(rng, 3)
    bare = {"meta_info": {"id": "plain8", "routed_experts": raw_b64(narrow, "u1")}}  # no routed_experts_dtype
    src = lines(tmp_path, *chunks)
    ingest_responses(src, tmp_path / "a", SHAPE, run_id="r")
    pos, topk, _ = stored(tmp_path / "a")["chatcmpl-r"]
    np.testing.assert_array_equal(pos, np.arange(7))
    np.testing.assert_array_equal(topk, full[:, MOE])
    ingest_responses(lines(tmp_path, bare), tmp_path / "b", SHAPE, run_id="n", fmt="sglang", wire_dtype="uint8")
    np.testing.assert_array_equal(stored(tmp_path / "b")["plain8"][1], narrow[:, MOE])



def test_r3trace_sglext_with_several_choices(tmp_path: Path) -> None:
    from r3trace.server.openai_stream import sglext  # r3trace's response-level block, `choices` when there are several

    rng = np.random.default_rng(25)
    a, b = routes(rng, 5, dense=-1), routes(rng, 3, dense=-1)
    metas = [{"meta_info": {"routed_experts": raw_b64(x), "routed_experts_shape": list(x.shape),
                            "routed_experts_dtype": "int32", "moe_layer_ids": MOE, "routed_experts_start_len": s}}
             for x, s in [(a, 0), (b, 1)]]
    body = {"id": "cmpl-m", "object": "text_completion", "created": 1, "model": "m", "sglext": sglext(metas),
            "choices": [{"index": i, "text": "x", "finish_reason": "length", "logprobs": None} for i in range(2)],
            "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}}
    ingest_responses(lines(tmp_path, body), tmp_path / "s", SHAPE, run_id="m")
    got = stored(tmp_path / "s")
    np.testing.assert_array_equal(got["cmpl-m.0"][1], a[:, MOE])
    np.testing.assert_array_equal(got["cmpl-m.1"][0], np.arange(1, 4))  # from routed_experts_start_len
    np.testing.assert_array_equal(got["cmpl-m.1"][1], b[:, MOE])

def _bad(rng: np.random.Generator) -> list[tuple[dict[str, Any], str]]:
    ok = routes(rng, 4)
    return [
        (vllm_completion("v", [{**vllm_choice(0, ok.astype(np.uint8)), "routed_experts": raw_b64(ok)}], 3, 2),
         "field choices[0].routed_experts is not .npy bytes (vLLM's format)"),
        (vllm_completion("v", [vllm_choice(0, ok[:, :3].astype(np.uint8))], 2, 2),
         "field choices[0].routed_experts is uint8 [4, 3, 2]; expected integer [rows, 4, 2]"),
        (vllm_completion("v", [vllm_choice(0, ok.astype(np.uint8))], 2, 1),
         "field choices[0].routed_experts has 4 rows, more than prompt + completion - 1 = 2"),
        ({**sglang_completion("s", ok, 3, 2), "sglext": {"routed_experts": "!!"}},
         "field sglext.routed_experts is not valid base64"),
        ({"meta_info": {"routed_experts": raw_b64(ok, "<u2"), "routed_experts_dtype": "int8"}},
         "field meta_info.routed_experts_dtype is 'int8'; SGLang sends one of int32, uint16, uint8"),
        ({"meta_info": {"routed_experts": raw_b64(np.full((2, 4, 2), 5))}},
         "field meta_info.routed_experts holds expert ids on layer 0, which the model layout"),
        ({"meta_info": {"routed_experts": raw_b64(ok), "routed_experts_shape": 7}},
         "field meta_info.routed_experts_shape says 7, the payload is [4, 4, 2]"),
        ({"id": 3, "result": []}, "no route field found"),
    ]


def test_bad_bodies_one_line_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for i, (body, message) in enumerate(_bad(np.random.default_rng(25))):
        src = lines(tmp_path, body)
        with pytest.raises(IngestError, match="bodies.jsonl:1: " + message.replace("[", r"\[").replace("(", r"\(")
                           .replace(")", r"\)").replace("+", r"\+")):
            ingest_responses(src, tmp_path / f"s{i}", SHAPE, run_id="x")
        assert list((tmp_path / f"s{i}").iterdir()) == []  # nothing left behind
    capsys.readouterr()
    src = lines(tmp_path, _bad(np.random.default_rng(25))[0][0])
    assert main(["ingest", str(src), "--store", str(tmp_path / "cli"), "--format", "responses",
                 "--num-hidden-layers", "4", "--first-k-dense", "1", "--num-experts", "16", "--top-k", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0] and "choices[0].routed_experts is not .npy bytes" in err[0]


def test_cli_formats_and_layout_from_flag_or_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(26)
    ids = routes(rng, 5)
    ids[:, 2] = 0  # layers 0 and 2 dense: a layout --first-k-dense cannot say
    body = vllm_completion("v", [vllm_choice(0, ids.astype(np.uint8))], 3, 3)
    src = lines(tmp_path, body)
    flags = ["--num-hidden-layers", "4", "--num-experts", "16", "--top-k", "2"]
    store = tmp_path / "store"
    assert main(["ingest", str(src), "--store", str(store), "--format", "vllm", "--moe-layer-ids", "1,3",
                 "--run-id", "a", *flags]) == 0
    assert main(["ingest", str(src), "--store", str(store), "--format", "responses", "--run-id", "b"]) == 0
    assert main(["ingest", str(src), "--store", str(store), "--format", "sglang", "--run-id", "c"]) == 2
    out = capsys.readouterr()
    assert "run a: routes, 10 rows" in out.out and "run b: routes, 10 rows" in out.out  # b: the layout of a
    assert "field meta_info missing" in out.err
    assert main(["ingest", str(src), "--store", str(store), "--format", "vllm", "--moe-layer-ids", "1,3",
                 "--run-id", "d", *flags[:-4], "--top-k", "2", "--num-experts", "24"]) == 0
    assert main(["ingest", str(src), "--store", str(store), "--format", "vllm", "--run-id", "e"]) == 2
    assert "holds runs of 2 model shapes; give --manifest or the shape flags" in capsys.readouterr().err
    got = TraceStore(store).query("select run_id, layer_id, topk_ids from routes order by run_id, request_id, "
                                  "token_pos, layer_id")
    for run in ("a", "b"):
        g = got.filter(got["run_id"] == run)
        assert g["layer_id"].to_list() == [1, 3] * 5
        np.testing.assert_array_equal(np.stack(g["topk_ids"].to_list()).reshape(5, 2, 2), ids[:, [1, 3]])


def test_generate_stream_routes_in_the_last_chunk(tmp_path: Path) -> None:
    """A saved /generate event stream whose routes come once, in the last chunk (SGLang's behaviour as issue 23
    states it; r3trace's default): earlier chunks' meta_info has no routed_experts, and that is no error; a
    request none of whose lines has it is one, naming its first line."""
    rng = np.random.default_rng(27)
    ids = routes(rng, 3 + 2 - 1)
    def chunk(done: bool) -> str:
        meta = {"id": "g", "prompt_tokens": 3, "completion_tokens": 2 if done else 1,
                "finish_reason": {"type": "length"} if done else None}
        if done:
            meta["routed_experts"] = raw_b64(ids)
        return f"data: {json.dumps({'text': 'ab' if done else 'a', 'meta_info': meta})}\n\n"
    ingest_responses(lines(tmp_path, raw=(chunk(False), chunk(True), "data: [DONE]\n\n")), tmp_path / "s",
                     SHAPE, run_id="g")
    pos, topk, phase = stored(tmp_path / "s")["g"]
    np.testing.assert_array_equal(topk, ids[:, MOE])
    assert phase == ["prefill"] * 3 + ["decode"]
    with pytest.raises(IngestError, match=r"bodies.jsonl:1: field meta_info.routed_experts missing"):
        ingest_responses(lines(tmp_path, raw=(chunk(False),)), tmp_path / "t", SHAPE, run_id="g")
