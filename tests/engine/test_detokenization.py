"""The text SGLang's detokenizer returns: stop trimming (no_stop_trim) and special tokens (skip_special_tokens).

The contract, read (not copied) from sgl-project/sglang python/sglang/srt/managers/detokenizer_manager.py at
000935bdda57675933def88a37dcd6786a2de0d1 (trim_matched_stop: with no_stop_trim the output is returned as is;
otherwise a matched stop string cuts the text at its first occurrence and a matched stop token is dropped from the
ids before decoding; batch_decode gets skip_special_tokens and spaces_between_special_tokens) and from
transformers 5.24.0's tokenization_utils_tokenizers.py (_decode: a tokenizer.json tokenizer takes
skip_special_tokens and ignores spaces_between_special_tokens, which only slow tokenizers read).

Run: .venv/bin/pytest -q tests/engine/test_detokenization.py
"""

from __future__ import annotations

from pathlib import Path

from bench.tiny_models import make_checkpoint
from r3trace.engine import Engine
from tests.engine.conftest import VOCAB, EngineFactory, greedy, random_prompts

PROMPT = random_prompts(1, 4, 24, seed=2)[0]


def test_no_stop_trim_keeps_the_matched_stop_string_and_token(make_engine: EngineFactory) -> None:
    e = make_engine()
    full = e.generate(input_ids=PROMPT, sampling_params=greedy(40))["output_ids"]
    j = next(i for i, t in enumerate(full) if 32 <= t < 127)  # byte-level ids: the first printable character
    stop = chr(full[j])
    trimmed = e.generate(input_ids=PROMPT, sampling_params=greedy(40, stop=stop))
    kept = e.generate(input_ids=PROMPT, sampling_params=greedy(40, stop=stop, no_stop_trim=True))
    assert trimmed["output_ids"] == kept["output_ids"] == full[: j + 1]
    assert trimmed["text"] == e.tokenizer.decode(full[:j])
    assert kept["text"] == e.tokenizer.decode(full[: j + 1]) and kept["text"].endswith(stop)
    assert kept["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    chunks = list(e.generate(input_ids=PROMPT, sampling_params=greedy(40, stop=stop, no_stop_trim=True),
                             stream=True))  # deltas
    assert "".join(c["text"] for c in chunks) == kept["text"]

    k = next(i for i, t in enumerate(full) if 32 <= t < 127 and full.index(t) == i and i != j)
    by_id = e.generate(input_ids=PROMPT, sampling_params=greedy(40, stop_token_ids=[full[k]], no_stop_trim=True,
                                                                        ignore_eos=False))
    assert by_id["output_ids"] == full[: k + 1]
    assert by_id["text"] == e.tokenizer.decode(full[: k + 1]) and by_id["text"].endswith(chr(full[k]))


def test_skip_special_tokens_false_keeps_them_in_the_text(tmp_path: Path, tiny_ckpt: Path,
                                                            make_engine: EngineFactory) -> None:
    """A tokenizer.json whose EOS (w<eos>) is a special token, on a checkpoint whose EOS is the greedy fifth token:
    the text shows it only with skip_special_tokens false, and at the end only with no_stop_trim too (a matched
    stop token is trimmed otherwise)."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    full = make_engine().generate(input_ids=PROMPT, sampling_params=greedy(12))["output_ids"]
    eos = full[4]
    first = full.index(eos)
    ckpt = make_checkpoint(tmp_path / "special", "v3_noaux_groups", seed=3, eos_token_id=eos)
    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w2"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.add_special_tokens([AddedToken(f"w{eos}", special=True)])
    tok.save(str(ckpt / "tokenizer.json"))
    words = [f"w{t}" for t in full[:first]]
    with Engine(ckpt) as e:
        def text(**extra: object) -> str:
            out = e.generate(input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 12, **extra})
            assert out["output_ids"] == full[: first + 1]
            return str(out["text"])

        assert text().split() == words
        assert text(skip_special_tokens=False).split() == words  # the matched EOS is trimmed before decoding
        assert text(no_stop_trim=True).split() == words  # kept, then skipped as special
        assert text(skip_special_tokens=False, no_stop_trim=True).split() == words + [f"w{eos}"]
        # without stopping on it, a special token inside the output: skipped, or kept with skip_special_tokens false
        cont = e.generate(input_ids=PROMPT, sampling_params=greedy(12))
        assert cont["output_ids"] == full and f"w{eos}" not in cont["text"].split()
        kept = e.generate(input_ids=PROMPT, sampling_params=greedy(12, skip_special_tokens=False))["text"]
        assert kept.split() == [f"w{t}" for t in full]
        # spaces_between_special_tokens is a slow tokenizer's option: tokenizer.json decoding ignores it
        spaced = {e.generate(input_ids=PROMPT, sampling_params=greedy(
            12, skip_special_tokens=False, spaces_between_special_tokens=flag))["text"] for flag in (True, False)}
        assert spaced == {kept}


def test_byte_tokenizer_has_no_special_tokens(make_engine: EngineFactory) -> None:
    """Without tokenizer.json (byte-level ids), skip_special_tokens changes nothing: no id is special."""
    e = make_engine()
    a = e.generate(input_ids=PROMPT, sampling_params=greedy(20))["text"]
    assert e.generate(input_ids=PROMPT, sampling_params=greedy(20, skip_special_tokens=False))["text"] == a
