"""Random-weight Llama models for the GPU tests and benchmark (no model hub reaches the GPU machine).

- `write_byte_tokenizer`: a byte-level BPE `tokenizer.json` of any vocabulary size (the 256 byte symbols,
  then filler tokens of two or three symbols, then `<|endoftext|>`), so every id a random model emits
  decodes.
- `write_tiny_llama`: a small Hugging Face Llama directory (config, safetensors, tokenizer), loaded by
  dynserve as a user's model directory and by `transformers` as the parity reference.
- `LLAMA_3_1_8B`: Llama-3.1-8B's shape as `transformers.LlamaConfig` keyword arguments.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

__all__ = ["EOS", "LLAMA_3_1_8B", "write_byte_tokenizer", "write_tiny_llama"]

EOS = "<|endoftext|>"

LLAMA_3_1_8B: dict[str, Any] = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False,
}


def write_byte_tokenizer(path: Path, vocab_size: int) -> int:
    """Write `tokenizer.json` and `tokenizer_config.json` with exactly `vocab_size` tokens into `path`;
    returns the end-of-text id (the last)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < len(alphabet) + 1:
        raise ValueError(f"a byte-level vocabulary needs at least {len(alphabet) + 1} tokens")
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    fillers = itertools.chain(
        ("".join(p) for p in itertools.product(alphabet, repeat=2)),
        ("".join(p) for p in itertools.product(alphabet, repeat=3)),
    )
    while len(vocab) < vocab_size - 1:
        vocab.setdefault(next(fillers), len(vocab))
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens([EOS])
    path.mkdir(parents=True, exist_ok=True)
    raw.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "bos_token": None}))
    return vocab_size - 1


def write_tiny_llama(path: Path, *, seed: int = 0, **overrides: Any) -> Any:
    """A random-weight Llama (fp32) saved as a Hugging Face directory at `path`; returns its
    `transformers` model (on the CPU, eval mode). Weights are drawn wider than transformers' default so
    that the greedy choice is rarely a near tie."""
    import torch
    import transformers

    shape: dict[str, Any] = {
        "vocab_size": 320, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "initializer_range": 0.08,
    } | overrides
    eos = write_byte_tokenizer(path, shape["vocab_size"])
    config = transformers.LlamaConfig(**shape, eos_token_id=eos, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(str(path), safe_serialization=True)
    return model
