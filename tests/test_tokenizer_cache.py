"""The tokenizer cache (`model/tokenizer_cache.py`): a GGUF's tokenizer built a second time comes from the
cache, without reading the GGUF's header, and is the same tokenizer; a changed file, a corrupt entry or a
cache that cannot be written cost a build, never a failure; the cache keeps at most `MAX_ENTRIES` files.
The bundled SmolLM2 GGUF; a fraction of a second each."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from dynserve.model import tokenizer as tokenizer_module
from dynserve.model import tokenizer_cache
from dynserve.model.resolve import default_model_path
from dynserve.model.tokenizer import Tokenizer

TEXT = "Hello wörld! <|im_start|>user\n  12345 你好 \t x<|im_end|>"


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "dynserve" / "tokenizers"


def no_header_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(path: object) -> None:
        raise AssertionError(f"read the GGUF header of {path}")

    monkeypatch.setattr(tokenizer_module, "read_gguf_metadata", refuse)


def assert_same(a: Tokenizer, b: Tokenizer) -> None:
    ids = a.encode(TEXT)
    assert ids == b.encode(TEXT) and a.decode(ids) == b.decode(ids)
    assert (a.vocab_size, a.bos_token_id, a.eos_token_id, a.add_bos_token, a.chat_template) == (
        b.vocab_size, b.bos_token_id, b.eos_token_id, b.add_bos_token, b.chat_template)
    assert a.end_of_generation_ids == b.end_of_generation_ids and a.special_token_ids == b.special_token_ids
    assert [a.token_bytes(i) for i in range(a.vocab_size)] == [b.token_bytes(i) for i in range(b.vocab_size)]


def test_the_second_load_comes_from_the_cache_and_equals_the_first(cache_home: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = default_model_path()
    first = Tokenizer.load(path)
    assert [p.name for p in cache_home.iterdir()] == [tokenizer_cache.cache_path(path).name]  # type: ignore[union-attr]
    no_header_reads(monkeypatch)
    assert_same(first, Tokenizer.load(path))


def test_a_changed_gguf_misses_and_a_corrupt_entry_is_rebuilt(cache_home: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "model.gguf"
    shutil.copyfile(default_model_path(), path)
    first = Tokenizer.load(path)
    entry = tokenizer_cache.cache_path(path)
    assert entry is not None and entry.exists()
    os.utime(path, ns=(1, 1))  # the same bytes, another modification time: another key
    assert tokenizer_cache.load(path) is None
    entry = tokenizer_cache.cache_path(path)
    assert entry is not None
    entry.parent.mkdir(parents=True, exist_ok=True)
    entry.write_bytes(b"\x92\x01")  # a half-written or foreign file
    assert_same(first, Tokenizer.load(path))  # built again, and the entry rewritten
    assert tokenizer_cache.load(path) is not None


def test_a_cache_that_cannot_be_written_costs_a_build_not_a_failure(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache directory would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    assert_same(Tokenizer.load(default_model_path()), Tokenizer.load(default_model_path()))


def test_the_cache_keeps_its_most_recently_used_entries(cache_home: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizer_cache, "MAX_ENTRIES", 2)
    parts = tokenizer_cache.TokenizerParts(metadata={}, merges=[])
    files = []
    for i in range(3):
        files.append(tmp_path / f"m{i}.gguf")
        files[-1].write_bytes(b"x" * (i + 1))
        tokenizer_cache.store(files[-1], parts)
        os.utime(tokenizer_cache.cache_path(files[-1]), ns=(i + 10, i + 10))  # type: ignore[arg-type]
    tokenizer_cache.store(files[0], parts)  # written again: now the newest; m1 is the oldest
    tokenizer_cache.store(tmp_path / "missing.gguf", parts)  # no file, no entry
    assert {p.name for p in cache_home.iterdir()} == {
        tokenizer_cache.cache_path(files[i]).name for i in (0, 2)}  # type: ignore[union-attr]
