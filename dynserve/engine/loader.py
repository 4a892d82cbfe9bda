"""Model weights and configuration from a GGUF file or a Hugging Face directory.

Output is always a `ModelConfig` plus a state dict in Hugging Face Llama naming
(`model.layers.N.self_attn.q_proj.weight`, ...), dequantized to the requested dtype. GGUF specifics handled
here: quantized tensors are dequantized with the `gguf` package; Q and K rows are un-permuted (llama.cpp
reorders each head's rows for its interleaved rope); a missing `output.weight` means tied embeddings.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dynserve.errors import ModelLoadError
from dynserve.model.resolve import SUPPORTED_ARCHITECTURES, model_id_of, resolve_model_path

if TYPE_CHECKING:  # torch is imported where weights are built, so resolving paths and ids needs none
    import torch

__all__ = ["ModelConfig", "load_model_weights"]

_SUPPORTED_ARCHITECTURES = SUPPORTED_ARCHITECTURES  # shared with `dynctl serve`'s check before Ray

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_id: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    bos_token_id: int | None = None
    eos_token_id: int | None = None


def load_model_weights(
    model: str | os.PathLike[str] | None, dtype: torch.dtype | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and a state dict in `dtype` (default float32)."""
    import torch

    path = resolve_model_path(model)
    if path.is_dir():
        return _load_hf_dir(path, dtype or torch.float32)
    return _load_gguf(path, dtype or torch.float32)


# ---- GGUF ---------------------------------------------------------------------------------------------


def _gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    field_ = reader.fields.get(key)
    return default if field_ is None else field_.contents()


def _gguf_config(reader: Any, path: Path) -> ModelConfig:
    arch = _gguf_field(reader, "general.architecture")
    if arch not in _SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {arch!r} (supported: llama family)", path=str(path))

    def get(key: str, default: Any = None) -> Any:
        return _gguf_field(reader, f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    tensor_names = {t.name for t in reader.tensors}
    scaling = None
    if get("rope.scaling.type") == "llama3" or get("rope.scaling.factor") is not None:
        scaling = {
            "rope_type": "llama3",
            "factor": float(get("rope.scaling.factor", 1.0)),
            "low_freq_factor": float(get("rope.scaling.low_freq_factor", 1.0)),
            "high_freq_factor": float(get("rope.scaling.high_freq_factor", 4.0)),
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length", 8192)),
        }
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return ModelConfig(
        model_id=model_id_of(path),
        vocab_size=int(get("vocab_size", len(tokens.data) if tokens is not None else 0)),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=int(get("rope.dimension_count", hidden // num_heads)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        rope_scaling=scaling,
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_gguf_field(reader, "tokenizer.ggml.eos_token_id"),
    )


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row reordering of Q/K: (heads, d/2, 2) -> (heads, 2, d/2)."""
    out_dim = weight.shape[0]
    head_dim = out_dim // num_heads
    return (
        weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _load_gguf(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    import gguf
    import torch

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the gguf package raises bare ValueError/struct errors on corrupt files
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}", path=str(path)) from exc
    config = _gguf_config(reader, path)
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            continue
        try:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise ModelLoadError(
                f"unsupported quantization {tensor.tensor_type.name} in tensor {tensor.name}", path=str(path)
            ) from exc
        array = np.asarray(array, dtype=np.float32).reshape(tuple(reversed(tensor.shape.tolist())))
        if name.endswith("q_proj.weight"):
            array = _unpermute_rows(array, config.num_heads)
        elif name.endswith("k_proj.weight"):
            array = _unpermute_rows(array, config.num_kv_heads)
        if not array.flags.writeable:  # F32 tensors come back as views of the read-only file map
            array = array.copy()
        state[name] = torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
    _check_complete(config, state, path)
    return config, state


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}"
    return None  # e.g. rope_freqs: recomputed from the config


def _check_complete(config: ModelConfig, state: dict[str, torch.Tensor], path: Path) -> None:
    required = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(config.num_layers):
        required += [f"model.layers.{i}.{n}" for n in _GGUF_LAYER_NAMES.values()]
    if not config.tie_word_embeddings:
        required.append("lm_head.weight")
    missing = [n for n in required if n not in state]
    if missing:
        raise ModelLoadError(f"{len(missing)} weights missing, e.g. {missing[:3]}", path=str(path))


# ---- Hugging Face directory ---------------------------------------------------------------------------


def _load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    raw = json.loads((path / "config.json").read_text())
    archs = raw.get("architectures") or [raw.get("model_type", "?")]
    if not any(a in _SUPPORTED_ARCHITECTURES for a in archs):
        raise ModelLoadError(f"unsupported architecture {archs[0]!r} (supported: llama family)", path=str(path))
    num_heads = raw["num_attention_heads"]
    config = ModelConfig(
        model_id=model_id_of(path),
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads", num_heads),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        rope_theta=float(raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rope_scaling=_rope_scaling(raw),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=_first(raw.get("eos_token_id")),
    )
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no .safetensors files in {path}", path=str(path))
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                state[name] = f.get_tensor(name).to(dtype)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    _check_complete(config, state, path)
    return config, state


def _rope_scaling(raw: dict[str, Any]) -> dict[str, Any] | None:
    """A config's rope scaling: `rope_scaling`, or (transformers 5's configs) `rope_parameters` when its
    type is not the default."""
    if raw.get("rope_scaling"):
        return raw["rope_scaling"]
    parameters = raw.get("rope_parameters") or {}
    return parameters if parameters.get("rope_type", "default") != "default" else None


def _first(value: Any) -> int | None:
    if isinstance(value, list):
        return value[0] if value else None
    return value

