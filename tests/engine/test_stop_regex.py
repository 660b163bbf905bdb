"""sampling_params.stop_regex, as SGLang serves it.

The contract, read (not copied) from sgl-project/sglang:
- python/sglang/srt/sampling/sampling_params.py at 00c17cafcb9e289d5ca97c50e44ada54e4fd5b03 (stop_regex: one
  pattern or a list, normalised to stop_regex_strs);
- python/sglang/srt/managers/schedule_batch.py (Req._check_str_based_finish: after the stop strings, each pattern in
  order is re.search-ed in the decoded output; a hit finishes with FINISHED_MATCHED_REGEX, `{"type": "stop",
  "matched": <pattern>}`);
- python/sglang/srt/managers/detokenizer_manager.py at 004c82e07d876f6e4a0ad6e15325706b0f478f1a (trim_matched_stop:
  a str `matched` cuts the text where it occurs literally, so a regex is trimmed only where its own characters
  occur in the text; no_stop_trim keeps everything).

The oracle: the first prefix of the unconstrained greedy output whose decoded text re.search matches.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/engine/test_stop_regex.py
"""

from __future__ import annotations

import re

import pytest

from r3trace.engine.request import InvalidRequestError
from tests.engine.conftest import EngineFactory, greedy, random_prompts

PROMPT = random_prompts(1, 6, 20, seed=4)[0]
NEW = 40


def _first_match(decode: object, full: list[int], pattern: str) -> int:
    """How many output tokens the request keeps: the first k whose decoded prefix the pattern matches."""
    assert callable(decode)
    return next(k for k in range(1, len(full) + 1) if re.search(pattern, decode(full[:k])))


def _printable(full: list[int]) -> list[int]:
    """Positions of byte-level ids that decode to one printable ASCII character, not a regex metacharacter."""
    return [i for i, t in enumerate(full) if 32 <= t < 127 and re.escape(chr(t)) == chr(t)]


def test_regex_stops_at_the_first_match_untrimmed(make_engine: EngineFactory) -> None:
    """A pattern spanning tokens (first char .* a later char) stops at the token completing it; its text is not
    trimmed (the pattern's own characters are not in it); a never-matching pattern listed first is skipped;
    the stream's deltas join to the same text."""
    e = make_engine()
    full = e.generate(input_ids=PROMPT, sampling_params=greedy(NEW))["output_ids"]
    spots = [i for i in _printable(full) if i > 0 and chr(full[i]) not in e.tokenizer.decode(full[:i])]
    assert len(spots) >= 2, full
    a, b = chr(full[spots[0]]), chr(full[spots[-1]])
    pattern = f"{a}[^\\x00]*{b}"  # metacharacters: its own text never occurs, so nothing is trimmed
    keep = _first_match(e.tokenizer.decode, full, pattern)
    assert re.match(pattern, e.tokenizer.decode(full[:keep])) is None  # the match starts inside the text: search
    out = e.generate(input_ids=PROMPT, sampling_params=greedy(NEW, stop_regex=["\\x00{5}", pattern]))
    assert out["output_ids"] == full[:keep]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert out["text"] == e.tokenizer.decode(full[:keep])
    chunks = list(e.generate(input_ids=PROMPT, sampling_params=greedy(NEW, stop_regex=pattern), stream=True))
    assert "".join(c["text"] for c in chunks) == out["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}


def test_literal_pattern_is_trimmed_like_a_stop_string(make_engine: EngineFactory) -> None:
    """A pattern without metacharacters: SGLang's trim finds it in the text and cuts before it (no_stop_trim keeps
    it); a stop string listed beside it that matches at the same token wins (stop strings are checked first)."""
    e = make_engine()
    full = e.generate(input_ids=PROMPT, sampling_params=greedy(NEW))["output_ids"]
    j = _printable(full)[0]
    c = chr(full[j])
    keep = _first_match(e.tokenizer.decode, full, c)
    out = e.generate(input_ids=PROMPT, sampling_params=greedy(NEW, stop_regex=c))
    assert out["output_ids"] == full[:keep]
    text = e.tokenizer.decode(full[:keep])
    assert out["text"] == text[: text.find(c)]
    kept = e.generate(input_ids=PROMPT, sampling_params=greedy(NEW, stop_regex=c, no_stop_trim=True))
    assert kept["text"] == text and kept["meta_info"]["finish_reason"] == {"type": "stop", "matched": c}
    chunks = list(e.generate(input_ids=PROMPT, sampling_params=greedy(NEW, stop_regex=c), stream=True))
    assert "".join(ch["text"] for ch in chunks) == out["text"]
    both = e.generate(input_ids=PROMPT, sampling_params=greedy(NEW, stop=c, stop_regex=f"[{c}]"))
    assert both["meta_info"]["finish_reason"] == {"type": "stop", "matched": c}


@pytest.mark.parametrize("value, fragment", [
    ("(", "is not a regex"),
    ("", "non-empty string"),
    ([3], "non-empty string"),
])
def test_bad_stop_regex_names_the_field(make_engine: EngineFactory, value: object, fragment: str) -> None:
    with pytest.raises(InvalidRequestError, match="sampling_params.stop_regex") as err:
        make_engine().generate(input_ids=PROMPT, sampling_params=greedy(2, stop_regex=value))
    assert fragment in str(err.value)
