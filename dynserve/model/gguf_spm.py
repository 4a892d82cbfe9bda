"""SentencePiece GGUF vocabularies (`tokenizer.ggml.model` "llama": Llama 2, Mistral v0.1, Phi-3, Gemma 3) as a
`tokenizers.Tokenizer` that splits text the way llama.cpp's SPM tokenizer does.

llama.cpp's algorithm, which this module reproduces with the library's BPE model:
- text is cut at the vocabulary's control and user-defined tokens first (`Tokenizer.encode` does this); for
  Phi-3 (a `general.name` holding "phi-3" or "phi3"), the whitespace after most of them is dropped, as
  llama.cpp sets its RSTRIP attribute on them (`rstrip_token_ids`);
- each piece between them gets a leading space when the GGUF says `tokenizer.ggml.add_space_prefix` (true
  when absent, as llama.cpp assumes), then every space becomes "▁";
- starting from single characters, the adjacent pair whose concatenation is a token with the highest score is
  merged, leftmost first among equals, until no pair forms a token. The GGUF holds no merge list, so one is
  derived here: every split of every token into two tokens, ranked by the whole token's score (equal scores,
  such as Llama 2's runs of "▁", all -1e9, by the token's id, where llama.cpp takes the leftmost pair: the
  same ids on every string the tests try, whitespace runs included);
- a character that is no token comes out as its UTF-8 bytes, the byte-fallback tokens `<0xNN>`.

Decoding is a table of each token's bytes: "▁" is a space in ordinary tokens, `<0xNN>` is its byte, control
and user-defined tokens are their own text. Invariants: the derived merges only ever form tokens of the
vocabulary. Refused (TokenizerError), as they would be encoded wrong silently: a vocabulary without all 256
byte tokens (text it cannot spell would be dropped or become `<unk>`), and one with an ordinary token
holding a character that is no token itself (llama.cpp can still merge into it; the library spells such a character
in bytes first).

transformers' GGUF loader differs from llama.cpp on Gemma's user-defined runs of 2-31 spaces: it respells
them as "▁" runs and merges them, while llama.cpp cuts the longest run out first; the ids agree except on
runs longer than 31 spaces and on a literal "▁" typed next to a space (tests/test_gguf_tokenizers.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tokenizers
from tokenizers import AddedToken, models, normalizers

from dynserve.errors import TokenizerError

__all__ = ["SpmVocabulary", "build_spm_vocabulary", "rstrip_token_ids", "spm_merges", "spm_token_bytes"]

# llama.cpp's token types (the GGUF's tokenizer.ggml.token_type)
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6
_SPACE = "\u2581"  # "▁", SentencePiece's visible space


@dataclass(frozen=True, slots=True)
class SpmVocabulary:
    """What `Tokenizer` needs of a SentencePiece GGUF: the library tokenizer (control and unknown tokens added
    as special, user-defined ones as ordinary added tokens), each token's bytes, and whether `encode` put a
    space in front (`decode` of a whole text takes it off again, as llama.cpp and transformers do)."""

    raw: tokenizers.Tokenizer
    token_bytes: tuple[bytes, ...]
    add_space_prefix: bool
    rstrip_token_ids: frozenset[int]  # the whitespace after these is not encoded


def build_spm_vocabulary(metadata: dict[str, Any], source: str) -> SpmVocabulary:
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    scores: list[float] | None = metadata.get("tokenizer.ggml.scores")
    token_types: list[int] | None = metadata.get("tokenizer.ggml.token_type")
    if scores is None or token_types is None or not len(tokens) == len(scores) == len(token_types):
        raise TokenizerError(f"{source}: a SentencePiece GGUF needs tokenizer.ggml.scores and "
                             "tokenizer.ggml.token_type, one per token")
    byte_tokens = {tokens[i] for i, kind in enumerate(token_types) if kind == TOKEN_TYPE_BYTE}
    missing = [f"<0x{byte:02X}>" for byte in range(256) if f"<0x{byte:02X}>" not in byte_tokens]
    if missing:
        raise TokenizerError(f"{source}: the SentencePiece vocabulary lacks byte-fallback tokens "
                             f"({', '.join(missing[:4])}, ...): text outside it could not be encoded")
    singles = {token for token in tokens if len(token) == 1}
    unformable = [token for token, kind in zip(tokens, token_types, strict=True)
                  if kind == TOKEN_TYPE_NORMAL and not singles.issuperset(token)]
    if unformable:  # llama.cpp merges characters that are no token; the library's BPE spells them in bytes
        raise TokenizerError(f"{source}: SentencePiece tokens with a character that is no token itself "
                             f"({unformable[0]!r}, ...) are not supported")
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise TokenizerError(f"{source}: the SentencePiece vocabulary spells some tokens twice")
    model = models.BPE(vocab, spm_merges(tokens, scores, token_types), byte_fallback=True)
    raw = tokenizers.Tokenizer(model)
    add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", _SPACE)
    raw.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), replace]) if add_space_prefix else replace
    raw.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, kind in enumerate(token_types)
                            if kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN)])
    raw.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, kind in enumerate(token_types) if kind == TOKEN_TYPE_USER_DEFINED])
    rstrip = rstrip_token_ids(str(metadata.get("general.name", "")), tokens, token_types)
    return SpmVocabulary(raw, spm_token_bytes(tokens, token_types), add_space_prefix, rstrip)


def rstrip_token_ids(model_name: str, tokens: list[str], token_types: list[int]) -> frozenset[int]:
    """The tokens after which llama.cpp drops whitespace, chosen as it chooses them by the model's name: for
    Phi-3, every control, unknown and user-defined token and "</s>", but for "<unk>", "<s>" and
    "<|endoftext|>"; for any other model none."""
    name = model_name.lower()
    if "phi-3" not in name and "phi3" not in name:
        return frozenset()
    kinds, kept = (TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED), {"<unk>", "<s>", "<|endoftext|>"}
    return frozenset(token_id for token_id, (token, kind) in enumerate(zip(tokens, token_types, strict=True))
                     if (kind in kinds or token == "</s>") and token not in kept)


def spm_merges(tokens: list[str], scores: list[float], token_types: list[int]) -> list[tuple[str, str]]:
    """Every (left, right) pair llama.cpp could merge, best first: it merges the adjacent pair whose
    concatenation is the token with the highest score (equal scores: here by the token's id, then by the
    split point). Left out, as they never apply: pairs forming a control, unknown or user-defined token
    (`encode` cuts those out of the text before merging), and pairs with a part no merge can form."""
    mergeable = (TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNUSED, TOKEN_TYPE_BYTE)
    formable = {token for token in tokens if len(token) == 1}
    splits_of: dict[int, list[int]] = {}
    for token_id in sorted(range(len(tokens)), key=lambda i: len(tokens[i])):  # parts before what they form
        token = tokens[token_id]
        if len(token) < 2 or token_types[token_id] not in mergeable:
            continue
        splits = [k for k in range(1, len(token)) if token[:k] in formable and token[k:] in formable]
        if splits:
            splits_of[token_id] = splits
            formable.add(token)
    merges = []
    for token_id in sorted(splits_of, key=lambda i: (-scores[i], i)):
        token = tokens[token_id]
        merges += [(token[:k], token[k:]) for k in splits_of[token_id]]
    return merges


def spm_token_bytes(tokens: list[str], token_types: list[int]) -> tuple[bytes, ...]:
    """The bytes each token contributes to decoded text, as llama.cpp's `token_to_piece` gives them."""
    table = []
    for token, kind in zip(tokens, token_types, strict=True):
        if kind == TOKEN_TYPE_BYTE:
            table.append(bytes([int(token[3:5], 16)]))
        elif kind == TOKEN_TYPE_NORMAL:
            table.append(token.replace(_SPACE, " ").encode("utf-8"))
        elif kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_USER_DEFINED):  # their own text
            table.append(token.encode("utf-8"))
        else:  # unused tokens, and types llama.cpp does not know, decode to nothing there
            table.append(b"")
    return tuple(table)
