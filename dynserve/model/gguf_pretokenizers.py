"""The pre-tokenizer of a byte-level BPE GGUF, chosen by its `tokenizer.ggml.pre`, as `tokenizers` objects.

llama.cpp splits text before BPE with a list of regexes per pre-tokenizer type (`src/llama-vocab.cpp`):
each regex in turn splits every piece the previous ones left, keeping both the matches and the text
between them. That is a `tokenizers` Sequence of `Split(Regex(pattern), "isolated")` steps, then the
byte-level map without a regex of its own. The table below holds the patterns of the types we claim;
llama.cpp's patterns were read from its source and are restated here in Oniguruma's syntax.

Invariants kept here:
- A type is in `_BY_PRE` only when llama.cpp's vocab test file for it (`ggml-vocab-<name>.gguf.inp` /
  `.out`) passes in full: `tests/test_gguf_tokenizers.py`. Anything else (an unknown or unverified
  `tokenizer.ggml.pre`, a missing one) is refused by name with `TokenizerError`, never approximated.
- `smollm` (and the types llama.cpp gives the same patterns) keep the exact pre-tokenizer dynserve has
  always built (each digit apart, then GPT-2's byte-level pattern), so the bundled model's ids do not move
  and `byte_level.AsciiWords` still recognises it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers

from dynserve.errors import TokenizerError

__all__ = ["GgufPreTokenizer", "gguf_pre_tokenizer", "supported_pre_names"]

# GPT-2's pattern, the base of most types (llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT2)
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# Llama 3's and Qwen2's patterns differ only in how many digits go together (up to 3, or 1)
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
# Qwen3.5's: Qwen2's with combining marks (\p{M}) kept with the letters they follow
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# CJK and Hangul runs (DeepSeek's); written as escapes: some of these characters have canonical
# equivalents an editor may silently substitute
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# DeepSeek LLM's punctuation: ASCII's and its full-width forms, curly quotes, CJK space and stops
_DEEPSEEK_PUNCTUATION = "!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002"
# DeepSeek LLM's letters: the Latin, Greek, Cyrillic, ... ranges its tokenizer.json lists, as llama.cpp does
_DEEPSEEK_LETTERS = (
    "A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
    "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
    "\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)


@dataclass(frozen=True, slots=True)
class GgufPreTokenizer:
    """One llama.cpp pre-tokenizer type: its split patterns (applied in order; None: dynserve's historic
    digits-then-GPT-2 sequence), whether a piece found whole in the vocabulary skips the merges
    (`ignore_merges`), and whether a BOS is added when the GGUF has no `tokenizer.ggml.add_bos_token`."""

    name: str
    patterns: tuple[str, ...] | None
    ignore_merges: bool = False
    add_bos_default: bool = False

    def build(self) -> pre_tokenizers.PreTokenizer:
        if self.patterns is None:
            return pre_tokenizers.Sequence([
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ])  # fmt: skip
        splits = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in self.patterns]
        return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


_DIGITS_THEN_GPT2 = GgufPreTokenizer("smollm", None)
_TYPES = (
    _DIGITS_THEN_GPT2,
    GgufPreTokenizer("gpt-2", (_GPT2,)),
    GgufPreTokenizer("llama-bpe", (_LLAMA3,), ignore_merges=True, add_bos_default=True),
    GgufPreTokenizer("qwen2", (_QWEN2,)),
    GgufPreTokenizer("qwen35", (_QWEN35,)),
    GgufPreTokenizer("deepseek-llm", (
        r"[\r\n]", rf"\s?[{_DEEPSEEK_LETTERS}]+", rf"\s?[{_DEEPSEEK_PUNCTUATION}]+", r"\s+$", _CJK, r"\p{N}+",
    )),  # fmt: skip
    GgufPreTokenizer("deepseek-coder", (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")),
    GgufPreTokenizer("falcon", (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"[0-9][0-9][0-9]")),
)
# `tokenizer.ggml.pre` values -> their type: each one verified against llama.cpp's vocab test file
# (several names share a type in llama.cpp; only the names a test file covers are claimed)
_BY_PRE: dict[str, GgufPreTokenizer] = {
    **{pre.name: pre for pre in _TYPES},
    "mpt": GgufPreTokenizer("mpt", (_GPT2,)),
    "starcoder": GgufPreTokenizer("starcoder", None),
    "refact": GgufPreTokenizer("refact", None),
    "command-r": GgufPreTokenizer("command-r", None),
}


def supported_pre_names() -> list[str]:
    """The `tokenizer.ggml.pre` values a byte-level BPE GGUF may carry, sorted."""
    return sorted(_BY_PRE)


def gguf_pre_tokenizer(pre: str | None, source: str) -> GgufPreTokenizer:
    """The pre-tokenizer a GGUF's `tokenizer.ggml.pre` names; TokenizerError naming it otherwise.

    A GGUF without the key was converted before llama.cpp recorded pre-tokenizers (2024): llama.cpp then
    falls back to its 'default' patterns and warns that generation quality will be degraded. Those patterns
    are a guess no test file checks, so a missing key (or 'default') is refused like an unknown name: a
    wrong split gives the model ids it was never trained on, silently."""
    supported = ", ".join(supported_pre_names())
    if pre is None:
        raise TokenizerError(f"{source}: the GGUF has no tokenizer.ggml.pre, so its pre-tokenizer is unknown "
                             f"(re-convert it with a current llama.cpp); supported pre-tokenizers: {supported}")
    found = _BY_PRE.get(pre)
    if found is None:
        raise TokenizerError(f"{source}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; "
                             f"supported: {supported}")
    return found
