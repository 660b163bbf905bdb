"""Text <-> token ids: the checkpoint's tokenizer.json through `tokenizers`, else byte-level."""

from __future__ import annotations

import json
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
        spec = json.loads(self._tok.to_str())
        # Byte-level BPE (GPT-2's, DeepSeek's): each vocabulary string spells its bytes through GPT-2's
        # byte-to-character table, so a token's bytes are exact even when it ends inside a UTF-8 character.
        self._byte_level = (spec.get("decoder") or {}).get("type") == "ByteLevel"
        self._special = frozenset(t["id"] for t in spec.get("added_tokens", []) if t.get("special"))
        self._char_to_byte = {c: b for b, c in enumerate(_byte_chars())}

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """As transformers' fast tokenizers decode for SGLang's detokenizer: the tokenizer.json decoder, special
        tokens kept or skipped; spaces_between_special_tokens is a slow tokenizer's option they ignore."""
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token_id adds to decoded text (b"" for a special token, which decode() skips)."""
        piece = self._tok.id_to_token(token_id)
        if piece is None or token_id in self._special:
            return b""
        if self._byte_level and all(c in self._char_to_byte for c in piece):
            return bytes(self._char_to_byte[c] for c in piece)
        return self.decode([token_id]).encode("utf-8")


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

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if 0 <= token_id < NUM_BYTES else b""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """No token is special here: skip_special_tokens changes nothing."""
        # errors="replace": a cut multi-byte character shows as U+FFFD until its last byte arrives.
        return bytes(i for i in ids if 0 <= i < NUM_BYTES).decode("utf-8", errors="replace")


def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: the character that stands for byte b in a byte-level BPE vocabulary, b = 0..255
    (printable Latin-1 bytes stand for themselves; the other 68 map to U+0100 onwards, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = iter(range(NUM_BYTES, 2 * NUM_BYTES))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(NUM_BYTES)]


def load_tokenizer(model_dir: str | Path, vocab_size: int) -> TextTokenizer:
    path = Path(model_dir) / "tokenizer.json"
    if path.is_file():
        return HFTokenizer(path)
    return ByteTokenizer(vocab_size)
