"""Text <-> token ids: the checkpoint's tokenizer.json through `tokenizers`, else byte-level."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from r3trace.engine.request import InvalidRequestError

NUM_BYTES = 256  # byte-level ids 0..255 are the bytes themselves


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class HFTokenizer:
    """tokenizer.json via the Rust `tokenizers` package (thread-safe: callers encode concurrently)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """As transformers' fast tokenizers decode for SGLang's detokenizer: the tokenizer.json decoder, special
        tokens kept or skipped; spaces_between_special_tokens is a slow tokenizer's option they ignore."""
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))


class ByteTokenizer:
    """ids 0..255 are UTF-8 bytes; ids >= 256 (the model's other tokens) decode to nothing."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        if self.vocab_size < NUM_BYTES:
            raise InvalidRequestError(
                "prompt",
                f"the checkpoint has no tokenizer.json and vocab_size={self.vocab_size} < {NUM_BYTES} "
                "cannot hold byte-level ids; pass input_ids instead",
            )
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """No token is special here: skip_special_tokens changes nothing."""
        # errors="replace": a cut multi-byte character shows as U+FFFD until its last byte arrives.
        return bytes(i for i in ids if 0 <= i < NUM_BYTES).decode("utf-8", errors="replace")


def load_tokenizer(model_dir: str | Path, vocab_size: int) -> TextTokenizer:
    path = Path(model_dir) / "tokenizer.json"
    if path.is_file():
        return HFTokenizer(path)
    return ByteTokenizer(vocab_size)
