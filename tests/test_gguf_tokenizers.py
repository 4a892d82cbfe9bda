"""GGUF tokenizers against llama.cpp's own tokenizer tests, and the refusals for the rest.

llama.cpp's `tests/test-tokenizer-0.cpp` reads `ggml-vocab-<name>.gguf.inp` (strings separated by a line
`__ggml_vocab_test__`) and `.gguf.out` (the expected ids per string, space-separated) and tokenizes with
`add_special = false`: the expected ids hold no BOS, so a BOS our `encode` adds is taken off before comparing.
`make setup` (scripts/llama-vocab.sh) extracts those files from the llama-cpp-python sdist into the user's
cache; without them these tests fail, saying so.

Also here: `dynctl serve` refusing a model whose architecture the engine cannot run, before Ray starts.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import gguf
import pytest

from dynserve.errors import TokenizerError
from dynserve.model.gguf_pretokenizers import supported_pre_names
from dynserve.model.tokenizer import Tokenizer

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # scripts/llama-vocab.sh fetches this one
# every vocabulary claimed, by its tokenizer.ggml.pre (each has a test file)
CLAIMED = ["command-r", "deepseek-coder", "deepseek-llm", "falcon", "gpt-2", "llama-bpe", "mpt", "qwen2", "qwen35",
           "refact", "starcoder"]
# vocabularies refused, and the name the refusal must give
REFUSED = {"bert-bge": "'bert'", "llama-spm": "'llama'", "phi-3": "'llama'"}
SEPARATOR = "\n__ggml_vocab_test__\n"
DYNCTL = str(Path(sys.executable).parent / "dynctl")
load = functools.cache(Tokenizer.load)  # a 128k-token vocabulary takes about a second to load


@pytest.fixture(scope="module")
def vocab_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = cache / "dynserve" / "llama-vocab" / LLAMA_CPP_PYTHON_VERSION
    if not (path / "complete").exists():
        pytest.fail(f"llama.cpp's tokenizer test files are not in {path} (make setup fetches them)")
    return path


def read_cases(vocab_dir: Path, name: str) -> list[tuple[str, list[int]]]:
    """(text, expected ids) per string of llama.cpp's test file, in file order."""
    texts = (vocab_dir / f"ggml-vocab-{name}.gguf.inp").read_text("utf-8").split(SEPARATOR)
    if texts[-1] == "":  # the file ends with a separator
        texts.pop()
    lines = (vocab_dir / f"ggml-vocab-{name}.gguf.out").read_text("utf-8").splitlines()
    assert len(texts) == len(lines), f"{name}: {len(texts)} strings, {len(lines)} expected lines"
    return [(text, [int(token) for token in line.split()]) for text, line in zip(texts, lines, strict=True)]


def encode_as_llama_cpp_test(tokenizer: Tokenizer, text: str) -> list[int]:
    """Our ids for `text` without the BOS `encode` adds when the model asks (the test files hold none)."""
    token_ids = tokenizer.encode(text)
    if tokenizer.add_bos_token and tokenizer.bos_token_id is not None:
        assert token_ids[:1] == [tokenizer.bos_token_id]
        return token_ids[1:]
    return token_ids


def test_the_claimed_vocabularies_are_the_supported_pre_tokenizers() -> None:
    assert sorted([*CLAIMED, "smollm"]) == supported_pre_names()  # smollm: tests/test_tokenizer.py


@pytest.mark.parametrize("name", CLAIMED)
def test_every_string_of_llama_cpps_test_file_gets_its_ids(vocab_dir: Path, name: str) -> None:
    tokenizer = load(vocab_dir / f"ggml-vocab-{name}.gguf")
    cases = read_cases(vocab_dir, name)
    wrong = [(text, got, want) for text, want in cases if (got := encode_as_llama_cpp_test(tokenizer, text)) != want]
    assert not wrong, f"{name}: {len(cases) - len(wrong)} of {len(cases)} match; first wrong: {wrong[0]}"
    assert len(cases) >= 46


def test_llama3_adds_its_bos_when_the_gguf_does_not_say(vocab_dir: Path) -> None:
    # llama.cpp adds a BOS for llama-bpe unless tokenizer.ggml.add_bos_token says otherwise (this file has none)
    llama3 = load(vocab_dir / "ggml-vocab-llama-bpe.gguf")
    assert llama3.encode("Hello world") == [128000, 9906, 1917]
    qwen2 = load(vocab_dir / "ggml-vocab-qwen2.gguf")
    assert not qwen2.add_bos_token and qwen2.encode("Hello world") == [9707, 1879]


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_other_tokenizer_models_are_refused_by_name(vocab_dir: Path, name: str) -> None:
    with pytest.raises(TokenizerError, match=f"tokenizer model {REFUSED[name]}.*supported: 'gpt2'"):
        Tokenizer.load(vocab_dir / f"ggml-vocab-{name}.gguf")


def _write_header_gguf(path: Path, arch: str, pre: str | None) -> None:
    """A GGUF with a tokenizer (byte-level, one token per byte) and no tensors."""
    tokens = [chr(byte) if chr(byte).isprintable() and byte > 32 else f"<0x{byte:02X}>" for byte in range(256)]
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges([])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


@pytest.mark.parametrize("pre", ["default", "tekken", None])
def test_unknown_or_missing_pre_tokenizers_are_refused_by_name(tmp_path: Path, pre: str | None) -> None:
    path = tmp_path / "m.gguf"
    _write_header_gguf(path, "llama", pre)
    named = "no tokenizer.ggml.pre" if pre is None else f"pre-tokenizer '{pre}'"
    with pytest.raises(TokenizerError, match=f"{named}.*supported.*llama-bpe, mpt, qwen2"):
        Tokenizer.load(path)


def test_serve_refuses_an_unsupported_architecture_before_ray_starts(tmp_path: Path) -> None:
    model = tmp_path / "tiny-qwen.gguf"
    _write_header_gguf(model, "qwen2", "qwen2")
    ray_tmp = tmp_path / "ray"
    ray_tmp.mkdir()
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp)}
    env.pop("RAY_ADDRESS", None)
    start_s = time.monotonic()
    done = subprocess.run([DYNCTL, "serve", "--model", str(model), "--port", "0"], capture_output=True, text=True,
                          env=env, timeout=60)
    elapsed_s = time.monotonic() - start_s
    assert done.returncode != 0 and "architecture 'qwen2' is not supported" in done.stderr, done.stderr
    assert "--engine vllm" in done.stderr
    assert not any(ray_tmp.iterdir()), "Ray started"
    assert elapsed_s < 20, elapsed_s
