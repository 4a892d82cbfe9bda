"""Text <-> token ids for one model: encoding, decoding and chat rendering.

A `Tokenizer` is built either from a GGUF file's metadata (`tokenizer.ggml.*`) or from a Hugging Face
directory (`tokenizer.json`, `tokenizer_config.json`, `generation_config.json`), and in both cases wraps a
`tokenizers.Tokenizer`. GGUF: byte-level BPE (`tokenizer.ggml.model` "gpt2": SmolLM, Llama 3, Qwen, ...), its
pre-tokenizer from `gguf_pretokenizers` by its `tokenizer.ggml.pre`, one it does not know refused by name; and
SentencePiece (`tokenizer.ggml.model` "llama": Llama 2, Mistral v0.1, Phi-3, Gemma 3) from `gguf_spm`. Any
other tokenizer model is refused by name. Hugging Face directories: byte-level BPE only.

Invariants kept here:
- `encode` never inserts special tokens except one leading BOS when the model asks for it
  (`add_bos_token`) and the text does not already begin with it (a chat template that writes
  `{{ bos_token }}` gets one BOS, not two); special-token text such as "<|im_start|>" in the input
  encodes to its single id.
- Every token id maps to exactly the bytes the decoder gives it, so `IncrementalDetokenizer` (which
  works on bytes) agrees with `decode` on the whole sequence, and never emits half of a UTF-8
  character. One difference, on purpose: for a SentencePiece model that puts a space in front of the
  text (`add_space_prefix`), `decode` of a whole text takes that space off again, while a stream of
  generated tokens, which continues a prompt, keeps it.
- `end_of_generation_ids` holds every token that ends a generation: the EOS, the GGUF's end-of-turn and
  end-of-message tokens, generation_config.json's EOS list, and the special token the chat template
  writes right after an assistant message (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, ...).
- Chat templates render exactly as `transformers`' `apply_chat_template(..., tokenize=False)` does; a
  Gemma GGUF without one gets Gemma's turn format (`chat_template.default_chat_template`).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import msgspec
import tokenizers
from tokenizers import AddedToken, decoders, models

from dynserve.errors import TokenizerError
from dynserve.model.added_tokens import added_token_splitter
from dynserve.model.byte_level import AsciiWords, byte_level_token_bytes
from dynserve.model.chat_template import (
    chat_template_variables,
    compile_chat_template,
    default_chat_template,
    plain_message,
)
from dynserve.model.detokenizer import IncrementalDetokenizer
from dynserve.model.gguf_metadata import read_gguf_metadata
from dynserve.model.gguf_pretokenizers import gguf_pre_tokenizer
from dynserve.model import tokenizer_cache
from dynserve.model.gguf_spm import build_spm_vocabulary
from dynserve.model.tokenizer_cache import TokenizerParts

__all__ = ["IncrementalDetokenizer", "Tokenizer", "ids_in_vocab"]

_GGUF_TOKEN_TYPE_CONTROL = 3  # special tokens such as <|im_start|>: matched in text, skippable in decode
_GGUF_TOKEN_TYPE_USER_DEFINED = 4  # added tokens that are ordinary text: matched in text, always decoded
_GGUF_TOKENIZER_MODELS = "'gpt2' (byte-level BPE), 'llama' (SentencePiece)"
# the GGUF keys naming tokens that end a turn or a message, besides tokenizer.ggml.eos_token_id
_GGUF_END_TOKEN_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def ids_in_vocab(token_ids: list[int], vocab_size: int) -> bool:
    """Every id in [0, vocab_size); `token_ids` is not empty. Two C loops (`min`, `max`): a per-id Python
    check costs about 0.2 us an id, 100 us for a 500-token prompt."""
    return min(token_ids) >= 0 and max(token_ids) < vocab_size


def _whole_texts(token_bytes: tuple[bytes, ...]) -> tuple[str | None, ...]:
    """Each token's text where its bytes are whole UTF-8 characters on their own (most tokens), else None."""
    texts: list[str | None] = []
    for raw in token_bytes:
        try:
            texts.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            texts.append(None)
    return tuple(texts)


# --- the tokenizer --------------------------------------------------------------------------------------


_PIECE_CACHE_SIZE = 4096
_C_WHITESPACE = " \t\n\v\f\r"
_MAX_CACHED_PIECE_CHARS = 32_768  # longer pieces are encoded each time rather than pinned in the cache


@dataclass(frozen=True, slots=True)
class _SpecialTokens:
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    end_token_ids: tuple[int, ...] = ()  # other ids that end a generation (GGUF eot/eom, generation_config)
    rstrip_token_ids: frozenset[int] = frozenset()  # `encode` drops the whitespace after these (Phi-3's)


@dataclass(frozen=True, slots=True)
class _Decoding:
    """How ids become bytes: None, the byte-level alphabet of the tokens' spelling; else a table per id.
    `strip_leading_space`: `decode` of a whole text drops the space a SentencePiece `encode` put in front."""

    token_bytes: tuple[bytes, ...] | None = None
    strip_leading_space: bool = False


class Tokenizer:
    """Encode, decode and chat-render for one model; immutable and safe to share between threads."""

    def __init__(self, raw: tokenizers.Tokenizer, special: _SpecialTokens, chat_template: str | None,
                 decoding: _Decoding = _Decoding(), byte_level: tuple[bytes, ...] | None = None) -> None:
        """`byte_level`: the byte-level table of `raw` (`byte_level_token_bytes`) when already known."""
        self._raw = raw
        self.vocab_size: int = raw.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = special.bos_token_id
        self.eos_token_id = special.eos_token_id
        self.add_bos_token = special.add_bos_token
        self.chat_template = chat_template
        self._decodes_by_table = decoding.token_bytes is not None
        self._strip_leading_space = decoding.strip_leading_space
        self._token_bytes = decoding.token_bytes or byte_level or byte_level_token_bytes(raw, self.vocab_size)
        if len(self._token_bytes) != self.vocab_size:
            raise TokenizerError(f"{len(self._token_bytes)} token byte strings for {self.vocab_size} tokens")
        self._token_texts = _whole_texts(self._token_bytes)
        self._special_ids = frozenset(
            token_id for token_id, added in raw.get_added_tokens_decoder().items() if added.special
        )
        self._added_split, self._added_ids = added_token_splitter(raw)
        self._rstrip_ids = special.rstrip_token_ids
        if self._rstrip_ids and self._added_split is None:
            raise TokenizerError("tokens that strip the whitespace after them need the added-token split")
        self._ascii_words = AsciiWords.for_tokenizer(raw) if self._added_split is not None else None
        self._encode_piece = functools.lru_cache(maxsize=_PIECE_CACHE_SIZE)(self._encode_uncached)
        named = [("bos", self.bos_token_id), ("eos", self.eos_token_id)]
        for name, token_id in [*named, *(("end-of-generation", i) for i in special.end_token_ids)]:
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                message = f"{name} token id {token_id} is outside the vocabulary of {self.vocab_size}"
                raise TokenizerError(message)
        bos_text = None if self.bos_token_id is None else raw.id_to_token(self.bos_token_id)
        bos_is_added = bos_text is not None and self._added_ids.get(bos_text) == self.bos_token_id
        self._bos_prefix = bos_text if bos_is_added else None  # text beginning with it has its BOS already
        ends = {self.eos_token_id, *special.end_token_ids, self._template_end_of_turn_id()}
        self.end_of_generation_ids: frozenset[int] = frozenset(i for i in ends if i is not None)
        """Every id that ends a generation: EOS, the GGUF's eot/eom, generation_config.json's EOS list, and
        the special token the chat template closes an assistant turn with. A request stops at any of them
        (unless it asks to ignore EOS)."""

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the control tokens (e.g. `<|im_start|>`), which decoded output text leaves out."""
        return self._special_ids

    # construction

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """From a `.gguf` file or a Hugging Face model directory."""
        path = Path(path)
        if path.is_file() and path.suffix == ".gguf":
            return cls.from_gguf(path)
        if path.is_dir():
            return cls.from_pretrained_dir(path)
        raise TokenizerError(f"{path} is neither a .gguf file nor a model directory with tokenizer.json")

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """From a byte-level BPE GGUF (`tokenizer.ggml.model` "gpt2") whose `tokenizer.ggml.pre` names a
        pre-tokenizer of `gguf_pretokenizers`, or a SentencePiece one ("llama"); anything else is refused
        by name (TokenizerError). What it reads and derives is cached per file (`tokenizer_cache`)."""
        cached = tokenizer_cache.load(path)
        parts = cached or _gguf_parts(path)
        tokenizer = cls._from_gguf_parts(parts, str(path))  # a tokenizer refused here is not cached
        if cached is None:
            table = None if tokenizer._decodes_by_table else list(tokenizer._token_bytes)
            tokenizer_cache.store(path, msgspec.structs.replace(parts, token_bytes=table))
        return tokenizer

    @classmethod
    def _from_gguf_parts(cls, parts: TokenizerParts, path: str) -> Tokenizer:
        metadata = parts.metadata
        model = metadata.get("tokenizer.ggml.model")
        if model not in ("gpt2", "llama") or "tokenizer.ggml.tokens" not in metadata:
            raise TokenizerError(f"{path}: tokenizer model {model!r} (tokenizer.ggml.model) is not supported; "
                                 f"supported: {_GGUF_TOKENIZER_MODELS}")
        end_token_ids = tuple(metadata[key] for key in _GGUF_END_TOKEN_KEYS if key in metadata)
        chat_template = metadata.get("tokenizer.chat_template")
        if chat_template is None:
            chat_template = default_chat_template(metadata.get("general.architecture"))
        if model == "llama":
            spm = build_spm_vocabulary(metadata, path)
            special = _SpecialTokens(
                bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
                eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
                add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", True)),  # llama.cpp's default
                end_token_ids=end_token_ids,
                rstrip_token_ids=spm.rstrip_token_ids,
            )
            return cls(spm.raw, special, chat_template, _Decoding(spm.token_bytes, spm.add_space_prefix))
        pre = gguf_pre_tokenizer(metadata.get("tokenizer.ggml.pre"), path)
        tokens: list[str] = metadata["tokenizer.ggml.tokens"]
        vocab = {token: i for i, token in enumerate(tokens)}
        raw = tokenizers.Tokenizer(models.BPE(vocab, parts.merges, ignore_merges=pre.ignore_merges))
        raw.pre_tokenizer = pre.build()
        raw.decoder = decoders.ByteLevel()
        token_types = metadata.get("tokenizer.ggml.token_type", [])
        raw.add_special_tokens(_added_tokens(tokens, token_types, _GGUF_TOKEN_TYPE_CONTROL, special=True))
        raw.add_tokens(_added_tokens(tokens, token_types, _GGUF_TOKEN_TYPE_USER_DEFINED, special=False))
        special = _SpecialTokens(
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
            add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", pre.add_bos_default)),
            end_token_ids=end_token_ids,
        )
        byte_level = tuple(parts.token_bytes) if parts.token_bytes is not None else None
        return cls(raw, special, chat_template, byte_level=byte_level)

    @classmethod
    def from_pretrained_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """From `tokenizer.json`, plus `tokenizer_config.json` (BOS/EOS, add_bos_token, chat template)
        and `chat_template.jinja` when present."""
        path = Path(path)
        try:
            raw = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises a bare Exception for missing or malformed files
            raise TokenizerError(f"cannot read {path / 'tokenizer.json'}: {exc}") from exc
        config = _read_json_if_present(path / "tokenizer_config.json")
        template_path = path / "chat_template.jinja"
        chat_template = template_path.read_text("utf-8") if template_path.exists() else None
        decoder = json.loads(raw.to_str()).get("decoder") or {}
        if decoder.get("type") != "ByteLevel":
            raise TokenizerError(f"{path}: decoder {decoder.get('type')!r} is not supported (only ByteLevel)")
        bos_token_id = _config_token_id(raw, config.get("bos_token"))
        add_bos_token = config.get("add_bos_token")
        if add_bos_token is None:  # tokenizer.json's post-processor decides, as in transformers
            add_bos_token = bos_token_id is not None and raw.encode("").ids[:1] == [bos_token_id]
        generation = _read_json_if_present(path / "generation_config.json")
        end_token_ids = generation.get("eos_token_id")
        end_token_ids = [end_token_ids] if isinstance(end_token_ids, int) else list(end_token_ids or [])
        if not all(isinstance(token_id, int) for token_id in end_token_ids):
            raise TokenizerError(f"{path / 'generation_config.json'}: eos_token_id {end_token_ids!r} is not ids")
        special = _SpecialTokens(bos_token_id, _config_token_id(raw, config.get("eos_token")), add_bos_token,
                                 tuple(end_token_ids))
        return cls(raw, special, chat_template or _config_chat_template(config.get("chat_template")))

    # encoding and decoding

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; one BOS in front only when the model's `add_bos_token` says so and `text`
        does not begin with the BOS token already (as a rendered chat often does).

        The tokenizer matches added tokens (`<|im_start|>`, ...) whole before anything else and encodes the
        text between them independently, so a rendered chat splits at them into pieces that encode alone
        to the same ids. The pieces are cached: a system prompt or a conversation's earlier turns, which
        come back with every request, are encoded once. (Tokenizers whose added tokens strip neighbouring
        whitespace are not split: `_added_split` is None for them.)"""
        token_ids: list[int] = []
        if self.add_bos_token and self.bos_token_id is not None:
            if self._bos_prefix is None or not text.startswith(self._bos_prefix):
                token_ids.append(self.bos_token_id)
        if self._added_split is None:
            token_ids += self._raw.encode(text, add_special_tokens=False).ids
            return token_ids
        added_ids, encode_piece, rstrip_ids = self._added_ids, self._encode_piece, self._rstrip_ids
        after_rstrip = False
        for index, piece in enumerate(self._added_split.split(text)):
            if index % 2:  # the split alternates text and added tokens
                token_ids.append(added_ids[piece])
                after_rstrip = token_ids[-1] in rstrip_ids
                continue
            if after_rstrip:  # text after a token that strips it, as llama.cpp strips it (C's isspace)
                piece = piece.lstrip(_C_WHITESPACE)
            if not piece:
                continue
            if len(piece) <= _MAX_CACHED_PIECE_CHARS:
                token_ids += encode_piece(piece)
            else:
                token_ids += self._encode_text(piece)
        return token_ids

    def _encode_uncached(self, piece: str) -> tuple[int, ...]:
        return tuple(self._encode_text(piece))

    def _encode_text(self, text: str) -> list[int]:
        """Ids of text holding no added token: ASCII text through `AsciiWords` where it applies."""
        if self._ascii_words is not None and text.isascii():
            return self._ascii_words.encode(text)
        return self._raw.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`; bytes that do not form valid UTF-8 become U+FFFD. For a SentencePiece model
        with `add_space_prefix`, the one space `encode` put in front of the text is taken off."""
        token_ids = list(token_ids)
        if token_ids and not ids_in_vocab(token_ids, self.vocab_size):
            bad = next(i for i in token_ids if not 0 <= i < self.vocab_size)
            raise TokenizerError(f"token id {bad} is outside the vocabulary of {self.vocab_size}")
        if not self._decodes_by_table:
            return self._raw.decode(token_ids, skip_special_tokens=skip_special_tokens)
        skipped, table = (self._special_ids if skip_special_tokens else frozenset()), self._token_bytes
        text = b"".join(table[i] for i in token_ids if i not in skipped).decode("utf-8", errors="replace")
        return text[1:] if self._strip_leading_space and text.startswith(" ") else text

    def token_to_str(self, token_id: int) -> str:
        """The text of one token alone (for logprobs display); a partial UTF-8 character shows as U+FFFD."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token contributes to decoded text."""
        if not 0 <= token_id < self.vocab_size:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary of {self.vocab_size}")
        return self._token_bytes[token_id]

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A fresh streaming decoder for one output sequence."""
        skipped_ids = self._special_ids if skip_special_tokens else frozenset()
        return IncrementalDetokenizer(self._token_bytes, skipped_ids, self._token_texts)

    # chat

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text for a conversation, rendered like transformers' `apply_chat_template` (`tools`: JSON
        schemas of functions, `{"type": "function", "function": {...}}`, for templates with a tools section)."""
        if self.chat_template is None:
            raise TokenizerError("this model has no chat template; send a plain completion prompt instead")
        context: dict[str, Any] = {
            "messages": [plain_message(message, i) for i, message in enumerate(messages)],
            "tools": tools,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        for name, token_id in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id)):
            if token_id is not None:
                context[name] = self._raw.id_to_token(token_id)
        try:
            return self._compiled_chat_template.render(**context)
        except Exception as exc:  # the template is the model's code: any failure in it (TypeError on a
            # None content, raise_exception, a sandbox violation) is a rendering failure for the caller
            raise TokenizerError(f"the chat template failed to render: {exc}") from exc

    @cached_property
    def chat_template_renders_tools(self) -> bool:
        """The chat template has a tools section of its own (it reads the `tools` variable)."""
        return self.chat_template is not None and "tools" in chat_template_variables(self.chat_template)

    def token_id_of(self, text: str) -> int | None:
        """The id of the one token whose text is `text` (a special token's, say); None when there is none."""
        return self._raw.token_to_id(text)

    def _template_end_of_turn_id(self) -> int | None:
        """The special token the chat template writes right after an assistant message's content (ChatML's
        `<|im_end|>`, Llama 3's `<|eot_id|>`, Gemma's `<end_of_turn>`), found by rendering a short
        conversation; None without a template, when it fails on that conversation, or when what follows
        the reply is not a special token (e.g. plain text such as "\n### User:")."""
        if self.chat_template is None:
            return None
        reply = "dynserve-end-of-turn-probe"
        try:
            rendered = self.apply_chat_template(
                [{"role": "user", "content": "hi"}, {"role": "assistant", "content": reply}],
                add_generation_prompt=False,
            )
        except TokenizerError:
            return None
        end = rendered.find(reply)
        if end < 0:
            return None
        after = rendered[end + len(reply):]
        matches = [(len(text), token_id) for token_id in self._special_ids
                   if (text := self._raw.id_to_token(token_id)) and after.startswith(text)]
        return max(matches)[1] if matches else None

    @cached_property
    def _compiled_chat_template(self) -> jinja2.Template:
        assert self.chat_template is not None
        return compile_chat_template(self.chat_template)


def _added_tokens(
    tokens: list[str], token_types: list[int], wanted_type: int, special: bool
) -> list[AddedToken]:
    """The GGUF tokens of one token type, as tokenizers' added tokens (matched whole in input text)."""
    return [
        AddedToken(tokens[token_id], special=special, normalized=False)
        for token_id, token_type in enumerate(token_types)
        if token_type == wanted_type
    ]


def _gguf_parts(path: str | os.PathLike[str]) -> TokenizerParts:
    """What a GGUF tokenizer is built from, read from the file's header: the `tokenizer.*` and `general.*`
    keys, the merges split in pairs."""
    metadata = {k: v for k, v in read_gguf_metadata(path).items() if k.startswith(("tokenizer.", "general."))}
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.pop("tokenizer.ggml.merges", [])]
    return TokenizerParts(metadata=metadata, merges=merges)  # type: ignore[arg-type]


def _read_json_if_present(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text("utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc


def _config_token_id(raw: tokenizers.Tokenizer, token: str | dict[str, Any] | None) -> int | None:
    """The id of a tokenizer_config.json special token, given as text or as a serialized AddedToken."""
    content = token.get("content") if isinstance(token, dict) else token
    return None if content is None else raw.token_to_id(content)


def _config_chat_template(template: str | list[dict[str, str]] | None) -> str | None:
    """tokenizer_config.json holds either one template or a list of named ones ("default" is used)."""
    if template is None or isinstance(template, str):
        return template
    named = {entry.get("name"): entry.get("template") for entry in template}
    return named.get("default")
