"""GPT-2's byte-level spelling of tokens: the bytes each token of a byte-level BPE vocabulary stands for, and
`AsciiWords`, a faster encoder of ASCII text for SmolLM's pre-tokenizer over the tokenizer's own BPE model.

Invariant: `byte_level_token_bytes` gives every id exactly the bytes `tokenizers`' ByteLevel decoder gives it,
so decoding by the table (the streaming detokenizer) and by the library agree.
"""

from __future__ import annotations

import json
import re
from typing import Any

import tokenizers

from dynserve.errors import TokenizerError

__all__ = ["AsciiWords", "byte_level_alphabet", "byte_level_token_bytes"]


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's reversible map from printable stand-in characters back to the 256 byte values."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    char_to_byte = {chr(byte): byte for byte in printable}
    num_extra = 0
    for byte in range(256):
        if byte not in printable:
            char_to_byte[chr(256 + num_extra)] = byte
            num_extra += 1
    return char_to_byte


def byte_level_token_bytes(raw: tokenizers.Tokenizer, vocab_size: int) -> tuple[bytes, ...]:
    """The bytes the ByteLevel decoder produces for each id (a token whose characters are not all in
    the byte alphabet, such as an added token "<|im start|>" with a space, decodes to its own UTF-8)."""
    char_to_byte = byte_level_alphabet()
    table = []
    for token_id in range(vocab_size):
        token = raw.id_to_token(token_id)
        if token is None:
            raise TokenizerError(f"the vocabulary has a hole at id {token_id}")
        try:
            table.append(bytes(char_to_byte[char] for char in token))
        except KeyError:
            table.append(token.encode("utf-8"))
    return tuple(table)


class AsciiWords:
    """ASCII text to ids 6-10x faster than `tokenizers` does it, for SmolLM's pre-tokenizer (each digit apart,
    then GPT-2's byte-level pattern: GGUFs whose tokenizer.ggml.pre is smollm, starcoder, refact or command-r).
    Any other pre-tokenizer (llama-bpe, qwen2, ...) fails the JSON match below and keeps the library's path.

    `tokenizers` spends most of an encode in that pattern (Oniguruma, with a look-ahead). On ASCII text the
    pattern's Unicode classes are plain ASCII ranges, so Python's `re` splits the text the same way (the
    two steps as one pattern: a digit ends a run of spaces as the end of the text would), and each piece
    goes through the tokenizer's own BPE model, its ids cached by piece: words recur. Other text keeps the
    library's path, since its Unicode tables and ours differ by version. `tests/test_tokenizer.py` checks
    this path against the library on random ASCII; `for_tokenizer` also checks a probe and declines on
    any difference."""

    _PRE_TOKENIZER = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}]}
    _SPACE = r"\t\n\v\f\r "  # Unicode's White_Space in ASCII (unlike str.isspace, not \x1c-\x1f)
    _PIECES = re.compile(
        rf"[0-9]|'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[^{_SPACE}A-Za-z0-9]+|[{_SPACE}]+(?![^{_SPACE}0-9])"
        rf"|[{_SPACE}]+")
    _PROBE = "Hi, it's 2025-11-23:\n\t  x  y 'll\x1c\x7f~ 12ab  3 "
    _MAX_CACHED = 200_000

    def __init__(self, model: Any) -> None:
        self._model = model
        alphabet = byte_level_alphabet()
        self._to_byte_chars = str.maketrans({byte: char for char, byte in alphabet.items() if byte < 128})
        self._ids: dict[str, list[int]] = {}

    @classmethod
    def for_tokenizer(cls, raw: tokenizers.Tokenizer) -> AsciiWords | None:
        if raw.normalizer is not None or raw.pre_tokenizer is None:
            return None
        # the pre-tokenizer's own JSON (its pickled state): the whole tokenizer's (`to_str`) costs 125 ms
        pre_tokenizer = json.loads(raw.pre_tokenizer.__getstate__())
        given = pre_tokenizer.get("pretokenizers") or []
        wanted = cls._PRE_TOKENIZER["pretokenizers"]
        steps = [{key: step.get(key) for key in want} for step, want in zip(given, wanted)]
        if pre_tokenizer.get("type") != "Sequence" or len(given) != len(wanted) or steps != wanted:
            return None
        words = cls(raw.model)
        probe_ids = raw.encode(cls._PROBE, add_special_tokens=False).ids
        return words if words.encode(cls._PROBE) == probe_ids else None

    def encode(self, text: str) -> list[int]:
        cached, token_ids = self._ids, []
        for piece in self._PIECES.findall(text):
            ids = cached.get(piece)
            if ids is None:
                if len(cached) >= self._MAX_CACHED:
                    cached.clear()
                byte_chars = piece.translate(self._to_byte_chars)
                ids = cached[piece] = [token.id for token in self._model.tokenize(byte_chars)]
            token_ids += ids
        return token_ids
