"""Engine.generate end to end on a tiny random DeepSeek-V3: sampling, stops, streaming, logprobs.

Run: .venv/bin/pytest -q tests/engine/test_generate.py
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.tiny_models import direct_forward, load_engine_model, make_checkpoint
from r3trace.engine import Engine, InvalidRequestError
from r3trace.engine.engine_config import EngineConfigError
from tests.engine.conftest import VOCAB, EngineFactory, assert_pool_whole, greedy, random_prompts

PROMPTS = random_prompts(4, 4, 24, seed=2)
SAMPLED = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "max_new_tokens": 12, "ignore_eos": True}


def _ids(out: Any) -> list[list[int]]:
    return [r["output_ids"] for r in out]


def test_seeded_sampling_is_independent_of_the_batch(make_engine: EngineFactory) -> None:
    params = [{**SAMPLED, "seed": 100 + i} for i in range(len(PROMPTS))]
    alone = make_engine(enable_prefix_cache=False)
    pairs = zip(PROMPTS, params, strict=True)
    expected = [alone.generate(input_ids=p, sampling_params=s)["output_ids"] for p, s in pairs]
    e = make_engine(chunked_prefill_size=5, page_size=2)
    assert _ids(e.generate(input_ids=PROMPTS, sampling_params=params)) == expected
    assert _ids(e.generate(input_ids=PROMPTS[::-1], sampling_params=params[::-1])) == expected[::-1]
    # preemption keeps the tokens sampled so far and the request's generator
    tight = make_engine(kv_pool_tokens=48, chunked_prefill_size=8)
    assert _ids(tight.generate(input_ids=PROMPTS, sampling_params=params)) == expected
    assert tight.scheduler.num_retractions > 0
    assert len({tuple(x) for x in expected}) == len(expected)


def test_seeded_rows_beside_unseeded_ones_keep_their_tokens(make_engine: EngineFactory) -> None:
    """A batch mixing seeded and unseeded rows: the unseeded rows' noise lands in their rows only (an indexed
    copy), so every seeded row still samples what it samples alone."""
    params = [{**SAMPLED, "seed": 300 + i} if i % 2 == 0 else dict(SAMPLED) for i in range(len(PROMPTS))]
    alone = make_engine(enable_prefix_cache=False)
    expected = [alone.generate(input_ids=p, sampling_params=s)["output_ids"]
                for p, s in zip(PROMPTS, params, strict=True) if "seed" in s]
    mixed = _ids(make_engine().generate(input_ids=PROMPTS, sampling_params=params))
    assert mixed[0::2] == expected
    assert all(len(x) == SAMPLED["max_new_tokens"] for x in mixed[1::2])


def test_unseeded_offline_is_reproducible_and_top_k_1_is_greedy(make_engine: EngineFactory) -> None:
    a = make_engine().generate(input_ids=PROMPTS, sampling_params=SAMPLED)
    b = make_engine().generate(input_ids=PROMPTS, sampling_params=SAMPLED)
    assert _ids(a) == _ids(b)
    e = make_engine()
    top1 = e.generate(input_ids=PROMPTS, sampling_params={**SAMPLED, "top_k": 1, "temperature": 1.3})
    greedy_ids = _ids(e.generate(input_ids=PROMPTS, sampling_params=greedy(12)))
    assert _ids(top1) == greedy_ids
    # top_p this small keeps only the most likely token (always at least that one)
    tiny_p = e.generate(input_ids=PROMPTS, sampling_params={**SAMPLED, "top_k": -1, "top_p": 1e-6})
    assert _ids(tiny_p) == greedy_ids
    assert _ids(a) != greedy_ids


def _first_ascii(full: list[int]) -> int:
    return next(i for i, t in enumerate(full) if 32 <= t < 127)


def test_stop_strings_stop_token_ids_and_max_new_tokens_0(make_engine: EngineFactory) -> None:
    e = make_engine()
    prompt = PROMPTS[0]
    full = e.generate(input_ids=prompt, sampling_params=greedy(40))["output_ids"]
    j = _first_ascii(full)  # earlier tokens are non-ASCII bytes or ids >= 256: never this character
    stop = chr(full[j])
    out = e.generate(input_ids=prompt, sampling_params=greedy(40, stop=[stop + "\x00\x00", stop]))
    assert out["output_ids"] == full[: j + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == e.tokenizer.decode(full[:j])  # trimmed before the stop string
    chunks = list(e.generate(input_ids=prompt, sampling_params=greedy(40, stop=stop), stream=True))
    assert "".join(c["text"] for c in chunks) == out["text"]

    k = 3
    out = e.generate(input_ids=prompt, sampling_params=greedy(40, stop_token_ids=[full[k]], ignore_eos=False))
    first = full.index(full[k])
    assert out["output_ids"] == full[: first + 1]  # the stop token is kept in output_ids ...
    assert out["text"] == e.tokenizer.decode(full[:first])  # ... and left out of the text
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": full[k]}

    out = e.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                     logprob_start_len=0)
    assert out["output_ids"] == [] and out["text"] == ""
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert len(out["meta_info"]["input_token_logprobs"]) == len(prompt)
    assert out["meta_info"]["output_token_logprobs"] == []
    assert_pool_whole(e)


def test_eos_stops_unless_ignored(tmp_path: Path, tiny_ckpt: Path, make_engine: EngineFactory) -> None:
    full = make_engine().generate(input_ids=PROMPTS[1], sampling_params=greedy(12))["output_ids"]
    eos = full[4]
    # same seed, same weights; only eos_token_id differs
    ckpt = make_checkpoint(tmp_path / "eos", "v3_noaux_groups", seed=3, eos_token_id=eos)
    with Engine(ckpt) as e:
        out = e.generate(input_ids=PROMPTS[1], sampling_params={"temperature": 0, "max_new_tokens": 12})
        first = full.index(eos)
        assert out["output_ids"] == full[: first + 1]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
        assert e.generate(input_ids=PROMPTS[1], sampling_params=greedy(12))["output_ids"] == full


def test_streaming_chunks_concatenate_to_the_result(make_engine: EngineFactory) -> None:
    e = make_engine(chunked_prefill_size=4)
    prompt = "Routing decisions, streamed: "
    whole = e.generate(prompt, sampling_params=greedy(20), return_logprob=True)
    chunks = list(e.generate(prompt, sampling_params=greedy(20), stream=True, return_logprob=True))
    assert [c["meta_info"]["finish_reason"] is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert sum((c["output_ids"] for c in chunks), []) == whole["output_ids"]
    streamed_lp: list[tuple[float, int, None]] = []
    for c in chunks:
        streamed_lp += c["meta_info"]["output_token_logprobs"]
    whole_lp = whole["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in streamed_lp] == [t for _, t, _ in whole_lp]
    # the second run hits the prefix cache (absorbed MLA instead of normal): same to float rounding
    assert max(abs(a[0] - b[0]) for a, b in zip(streamed_lp, whole_lp, strict=True)) < 1e-5
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]


@pytest.mark.parametrize("chunk,start", [(512, 0), (5, 0), (5, 7)])
def test_input_logprobs_equal_a_direct_forward(make_engine: EngineFactory, tiny_ckpt: Path, chunk: int,
                                               start: int) -> None:
    prompt = PROMPTS[3] + PROMPTS[2]
    ref = direct_forward(load_engine_model(tiny_ckpt), prompt)[0].log_softmax(-1)  # [T, V]
    e = make_engine(chunked_prefill_size=chunk, page_size=2)
    e.generate(input_ids=prompt[:12], sampling_params=greedy(2))  # a cached prefix to be capped
    out = e.generate(input_ids=prompt, sampling_params=greedy(3), return_logprob=True,
                     logprob_start_len=start, top_logprobs_num=3)
    meta = out["meta_info"]
    got = meta["input_token_logprobs"]
    assert [t for _, t, _ in got] == prompt[start:]
    if start == 0:
        assert got[0] == (None, prompt[0], None) and meta["input_top_logprobs"][0] is None
    for p, (lp, tok, _) in enumerate(got):
        pos = start + p
        if pos == 0:
            continue
        assert abs(lp - ref[pos - 1, tok].item()) < 1e-4, (pos, lp, ref[pos - 1, tok].item())
        top = meta["input_top_logprobs"][p]
        assert [i for _, i, _ in top] == ref[pos - 1].topk(3).indices.tolist()
    first_lp, first_tok, _ = meta["output_token_logprobs"][0]
    assert first_tok == int(ref[-1].argmax()) and abs(first_lp - ref[-1, first_tok].item()) < 1e-4
    assert len(meta["output_top_logprobs"]) == 3


def test_default_logprob_start_len_scores_the_last_prompt_token(make_engine: EngineFactory) -> None:
    out = make_engine().generate(input_ids=PROMPTS[0], sampling_params=greedy(2), return_logprob=True)
    assert [t for _, t, _ in out["meta_info"]["input_token_logprobs"]] == PROMPTS[0][-1:]


def test_tokenizer_json_is_used(tmp_path: Path, tiny_ckpt: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    ckpt = tmp_path / "with_tok"
    shutil.copytree(tiny_ckpt, ckpt)
    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w2"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(ckpt / "tokenizer.json"))
    with Engine(ckpt) as e:
        out = e.generate("w5 w17 w300", sampling_params=greedy(4))
        assert out["meta_info"]["prompt_tokens"] == 3
        assert out["text"].split() == [f"w{i}" for i in out["output_ids"]]
        same = e.generate(input_ids=[5, 17, 300], sampling_params=greedy(4))
        assert out["output_ids"] == same["output_ids"]


def test_api_errors(make_engine: EngineFactory, tiny_ckpt: Path) -> None:
    with pytest.raises(EngineConfigError, match="unknown engine option 'chunk_size'"):
        Engine(tiny_ckpt, chunk_size=3)
    with pytest.raises(EngineConfigError, match="page_size"):
        Engine(tiny_ckpt, page_size=0)
    with pytest.raises(EngineConfigError, match="decode_kernel='gluon': expected auto or triton"):
        Engine(tiny_ckpt, decode_kernel="gluon")
    e = make_engine()
    with pytest.raises(InvalidRequestError, match="return_routed_weights"):
        e.generate(input_ids=[3, 4], return_routed_weights=True)  # needs capture_weights=True
    e.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        e.generate(input_ids=[3, 4])


def test_engine_dtype_bfloat16_runs(make_engine: EngineFactory) -> None:
    e = make_engine(dtype="bfloat16", chunked_prefill_size=6)
    assert e.kv_pool.kv_buffer.dtype == torch.bfloat16
    out = e.generate(input_ids=PROMPTS[:2], sampling_params=greedy(5))
    assert [r["meta_info"]["completion_tokens"] for r in out] == [5, 5]


def test_cuda_graph_options_are_checked(tiny_ckpt: Path) -> None:
    """Graphs need CUDA and the triton backends; on a CPU engine they are off by default."""
    from r3trace.engine.engine_config import EngineConfig, EngineConfigError

    with pytest.raises(EngineConfigError, match="needs device cuda"):
        EngineConfig(cuda_graph_batch_sizes=(1, 2))
    with pytest.raises(EngineConfigError, match=r"\[128\] outside 1..max_running_requests=64"):
        EngineConfig(device="cuda", attention_backend="triton", moe_backend="triton", topk_backend="triton",
                     cuda_graph_batch_sizes=(1, 128))
    assert EngineConfig().graph_batch_sizes == ()
    cfg = EngineConfig(device="cuda", attention_backend="triton", moe_backend="triton", topk_backend="triton")
    assert cfg.graph_batch_sizes[:4] == (1, 2, 4, 8) and cfg.graph_batch_sizes[-1] == 64
