"""Model weights and configuration from a GGUF file or a Hugging Face directory.

Output is always a `ModelConfig` plus a state dict in Hugging Face naming (`model.layers.N.self_attn.q_proj.weight`,
...), dequantized to the requested dtype, whatever the family: the config says which features a model uses
(projection biases, q/k norm, Gemma's sandwich norms and scaled embeddings, GELU, sliding windows per layer,
rope scaling) and `engine.models.decoder` runs them all. Names the model reads besides Llama's:
`self_attn.{q,k,v,o}_proj.bias`, `self_attn.{q,k}_norm.weight`, `pre_feedforward_layernorm.weight` and
`post_feedforward_layernorm.weight` (Gemma 3, whose `post_attention_layernorm` is the norm after attention,
not the one before the MLP), and the fused `self_attn.qkv_proj.weight` / `mlp.gate_up_proj.weight` (Phi-3).

Loading normalises what differs between formats: Gemma's RMSNorm weights are stored as `w` with the norm
computing `(1 + w)` in Hugging Face checkpoints and as `1 + w` in GGUF (llama.cpp's converter adds it), and
leave here as `1 + w`; llama.cpp permutes the Q and K rows of Llama-family GGUFs for its interleaved rope, and
they are un-permuted; a missing `output.weight` means tied embeddings. Every GGUF tensor is mapped or the load
fails naming it; rope frequency tensors become the config's rope scaling.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dynserve.errors import ModelLoadError, TokenizerError
from dynserve.model.gguf_metadata import read_gguf_header
from dynserve.model.resolve import GGUF_ARCHITECTURES, HF_ARCHITECTURES, model_id_of, resolve_model_path

if TYPE_CHECKING:  # torch is imported where weights are built, so resolving paths and ids needs none
    import torch

__all__ = ["ModelConfig", "load_model_weights"]

# llama.cpp's per-layer tensor names -> Hugging Face's (Gemma 3's and Phi-3's differences below)
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GEMMA3_LAYER_NAMES = _GGUF_LAYER_NAMES | {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GGUF_PHI3_LAYER_NAMES = _GGUF_LAYER_NAMES | {"ffn_up.weight": "mlp.gate_up_proj.weight"}  # gate and up, fused
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# read into the config instead of the state dict: rope frequency factors
_GGUF_ROPE_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


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
    # `rope_type` (llama3, linear, dynamic, yarn, longrope) and its parameters, as in a Hugging Face config
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    architecture: str = "llama"  # the family: llama, mistral, qwen2, qwen3, gemma3, phi3
    qkv_bias: bool = False  # Q/K/V projections carry a bias (Qwen2)
    o_bias: bool = False
    qk_norm: bool = False  # each query and key head RMS-normalised before rope (Qwen3, Gemma 3)
    sandwich_norm: bool = False  # norms after attention and after the MLP too (Gemma 3)
    embed_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden_size))
    hidden_act: str = "silu"  # the MLP's gate activation: silu or gelu_tanh
    attention_scale: float | None = None  # None: head_dim ** -0.5
    # per layer: 0 (attends to its whole context) or its sliding window in tokens; () means every layer is full
    layer_windows: tuple[int, ...] = ()
    rope_local_theta: float | None = None  # rope base of the sliding-window layers when it differs (Gemma 3)

    @property
    def rope_depends_on_length(self) -> bool:
        """The rope frequencies depend on the sequence's length (LongRoPE, dynamic NTK): a KV block computed
        for one length is not valid for another, so such a model runs without prefix caching."""
        return (self.rope_scaling or {}).get("rope_type") in ("longrope", "dynamic")

    @property
    def context_length(self) -> int:
        """The longest sequence the model runs: its positions, stretched by dynamic NTK's factor."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type") == "dynamic":
            return int(self.max_position_embeddings * float(scaling["factor"]))
        return self.max_position_embeddings

    @property
    def sliding_window(self) -> int:
        """The largest window of any layer (0: no layer has one)."""
        return max(self.layer_windows, default=0)

    @property
    def all_layers_windowed(self) -> bool:
        """Every layer attends within a window, so blocks that slid out of it are never read again."""
        return bool(self.layer_windows) and all(self.layer_windows)


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


@dataclass(frozen=True, slots=True)
class _GGUFTensor:
    """A tensor of a GGUF file as `gguf.quants.dequantize` takes it: `data` a view of the file map (the
    elements for float and integer types, the raw blocks as bytes for quantized ones), `shape` in GGUF order."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray
    data: np.ndarray


_GGUF_PLAIN_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                     "I32": np.int32, "I64": np.int64}


def _read_gguf(path: Path) -> tuple[dict[str, Any], list[_GGUFTensor]]:
    """The file's metadata and its tensors, each a view of one read-only map of the file (the header parsed
    by `read_gguf_header`, not `gguf.GGUFReader`, which takes seconds over a 49k-token vocabulary)."""
    import gguf

    try:
        header = read_gguf_header(path)
        file_map = np.memmap(path, dtype=np.uint8, mode="r")
        tensors = []
        for info in header.tensors:
            tensor_type = gguf.GGMLQuantizationType(info.ggml_type)
            shape = tuple(reversed(info.dims))
            num_elements = int(np.prod(info.dims))
            plain = _GGUF_PLAIN_TYPES.get(tensor_type.name)
            if plain is not None:
                item_type, count = np.dtype(plain), num_elements
            else:
                block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
                item_type, count = np.dtype(np.uint8), num_elements * type_size // block_size
                shape = gguf.quants.quant_shape_to_byte_shape(shape, tensor_type)
            end = info.offset + count * item_type.itemsize
            if end > len(file_map):
                raise ValueError(f"tensor {info.name} runs past the end of the file")
            data = file_map[info.offset:end].view(item_type).reshape(shape)
            tensors.append(_GGUFTensor(info.name, tensor_type, np.array(info.dims), data))
    except (TokenizerError, ValueError, KeyError) as exc:  # a corrupt or truncated file
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}", path=str(path)) from exc
    return header.metadata, tensors


def _gguf_config(metadata: dict[str, Any], tensor_names: set[str], path: Path,
                 rope_tensors: dict[str, np.ndarray]) -> ModelConfig:
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(sorted(GGUF_ARCHITECTURES))
        raise ModelLoadError(f"unsupported architecture {arch!r} (supported: {supported})", path=str(path))

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    num_layers = int(get("block_count"))
    head_dim = int(get("attention.key_length", get("rope.dimension_count", hidden // num_heads)))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ModelLoadError(f"partial rotary embeddings (rope.dimension_count {get('rope.dimension_count')} of "
                             f"head size {head_dim}) are not supported", path=str(path))
    context = int(get("context_length", 2048))
    tokens = metadata.get("tokenizer.ggml.tokens")
    window = int(get("attention.sliding_window", 0) or 0)
    layer_windows: tuple[int, ...] = ()
    extra: dict[str, Any] = {}
    if arch == "gemma3":
        # llama.cpp's Gemma 3: every sixth layer is global, the others slide; local rope base rope.freq_base_swa
        # (10,000 when absent, as in files converted before llama.cpp wrote it); the
        # 27B model scales queries by hidden / heads, the others by the head size
        layer_windows = tuple(0 if (i + 1) % 6 == 0 else window for i in range(num_layers))
        scalar = hidden / num_heads if metadata.get("general.size_label") == "27B" else head_dim
        extra = dict(qk_norm=True, sandwich_norm=True, embed_scale=hidden**0.5, hidden_act="gelu_tanh",
                     attention_scale=scalar**-0.5, rope_local_theta=float(get("rope.freq_base_swa", 10000.0)))
    elif window:
        layer_windows = (window,) * num_layers
    if arch == "qwen2":
        extra["qkv_bias"] = True
    if arch == "qwen3":
        extra["qk_norm"] = True
    return ModelConfig(
        model_id=model_id_of(path),
        vocab_size=int(get("vocab_size", len(tokens) if tokens is not None else 0)),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=context,
        tie_word_embeddings="output.weight" not in tensor_names,
        rope_scaling=_gguf_rope_scaling(get, rope_tensors, context, path),
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
        architecture=arch,
        layer_windows=layer_windows,
        **extra,
    )


def _gguf_rope_scaling(get: Any, rope_tensors: dict[str, np.ndarray], context: int, path: Path) -> dict[str, Any] | None:
    kind = get("rope.scaling.type")
    factor = get("rope.scaling.factor")
    original = get("rope.scaling.original_context_length")
    if kind is None and "rope_freqs.weight" in rope_tensors:  # llama.cpp's converter: Llama 3's factors, baked
        return {"rope_type": "freq_factors", "factors": rope_tensors["rope_freqs.weight"].tolist()}
    if "rope_factors_long.weight" in rope_tensors:  # Phi-3's LongRoPE: per-frequency factors as tensors
        return {
            "rope_type": "longrope",
            "long_factor": rope_tensors["rope_factors_long.weight"].tolist(),
            "short_factor": rope_tensors["rope_factors_short.weight"].tolist(),
            "original_max_position_embeddings": int(original or context),
            "max_position_embeddings": context,
            "attention_factor": get("rope.scaling.attn_factor"),
        }
    if kind == "llama3":
        return {
            "rope_type": "llama3",
            "factor": float(get("rope.scaling.factor", 1.0)),
            "low_freq_factor": float(get("rope.scaling.low_freq_factor", 1.0)),
            "high_freq_factor": float(get("rope.scaling.high_freq_factor", 4.0)),
            "original_max_position_embeddings": int(original or 8192),
        }
    if kind in (None, "none") or factor in (None, 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original or context),
                "beta_fast": get("rope.scaling.yarn_beta_fast"), "beta_slow": get("rope.scaling.yarn_beta_slow"),
                "attention_factor": get("rope.scaling.yarn_attn_factor") or None}
    raise ModelLoadError(f"rope scaling {kind!r} in a GGUF is not supported", path=str(path))


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row reordering of Q/K: (heads, d/2, 2) -> (heads, 2, d/2)."""
    out_dim = weight.shape[0]
    head_dim = out_dim // num_heads
    return (
        weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _dequantize_simple(blocks: np.ndarray, kind: str) -> np.ndarray:
    """Q8_0, Q4_0 and Q4_1 (blocks of 32 weights behind an f16 scale, and Q4_1's f16 minimum) over a whole
    tensor at once, in float32 as gguf's reference computes them (it works row group by row group: seconds
    for a 135M model). `blocks`: (num_blocks, bytes per block) uint8."""
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    if kind == "Q8_0":
        return scale * blocks[:, 2:].copy().view(np.int8).astype(np.float32)
    packed = blocks[:, 4:] if kind == "Q4_1" else blocks[:, 2:]
    quants = np.concatenate([packed & 0x0F, packed >> 4], axis=1)  # low nibbles are the block's first 16
    if kind == "Q4_0":
        return scale * (quants.astype(np.int8) - np.int8(8)).astype(np.float32)
    minimum = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    return scale * quants.astype(np.float32) + minimum


_SIMPLE_QUANTS = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}  # bytes per block of 32


def _dequantize(gguf: Any, tensor: Any, path: Path) -> np.ndarray:
    shape = tuple(reversed(tensor.shape.tolist()))
    block_bytes = _SIMPLE_QUANTS.get(tensor.tensor_type.name)
    if block_bytes is not None:
        blocks = np.ascontiguousarray(tensor.data).reshape(-1, block_bytes)
        return _dequantize_simple(blocks, tensor.tensor_type.name).reshape(shape)
    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ModelLoadError(
            f"unsupported quantization {tensor.tensor_type.name} in tensor {tensor.name}", path=str(path)
        ) from exc
    return np.asarray(array, dtype=np.float32).reshape(tuple(reversed(tensor.shape.tolist())))


def _load_gguf(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    import gguf
    import torch

    metadata, tensors = _read_gguf(path)
    rope_tensors = {t.name: _dequantize(gguf, t, path) for t in tensors if t.name in _GGUF_ROPE_TENSORS}
    config = _gguf_config(metadata, {t.name for t in tensors}, path, rope_tensors)
    layer_names = {"gemma3": _GGUF_GEMMA3_LAYER_NAMES, "phi3": _GGUF_PHI3_LAYER_NAMES}.get(
        config.architecture, _GGUF_LAYER_NAMES)
    state: dict[str, torch.Tensor] = {}
    for tensor in tensors:
        if tensor.name in _GGUF_ROPE_TENSORS:
            continue
        name = _hf_name(tensor.name, layer_names)
        if name is None:
            raise ModelLoadError(f"tensor {tensor.name!r} is not one dynserve's {config.architecture} model uses; "
                                 "refusing rather than dropping it", path=str(path))
        array = _dequantize(gguf, tensor, path)
        if config.architecture == "llama":  # only the Llama family's rows are permuted by the converter
            if name.endswith("q_proj.weight"):
                array = _unpermute_rows(array, config.num_heads)
            elif name.endswith("k_proj.weight"):
                array = _unpermute_rows(array, config.num_kv_heads)
        if not array.flags.writeable:  # F32 tensors come back as views of the read-only file map
            array = array.copy()
        state[name] = torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
    _check_complete(config, state, path)
    return config, state


def _hf_name(gguf_name: str, layer_names: dict[str, str]) -> str | None:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
    return None


def _required_layer_names(config: ModelConfig) -> list[str]:
    names = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight",
             "mlp.down_proj.weight"]
    if config.architecture == "phi3":
        names += ["self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"]
    else:
        names += [f"self_attn.{n}_proj.weight" for n in "qkv"] + ["mlp.gate_proj.weight", "mlp.up_proj.weight"]
    if config.qkv_bias:
        names += [f"self_attn.{n}_proj.bias" for n in "qkv"]
    if config.o_bias:
        names.append("self_attn.o_proj.bias")
    if config.qk_norm:
        names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    if config.sandwich_norm:
        names += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
    return names


def _check_complete(config: ModelConfig, state: dict[str, torch.Tensor], path: Path) -> None:
    """Every weight the config's model reads is present, and nothing else is (a tensor the model would not
    read is refused by name rather than dropped)."""
    required = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(config.num_layers):
        required += [f"model.layers.{i}.{n}" for n in _required_layer_names(config)]
    if not config.tie_word_embeddings:
        required.append("lm_head.weight")
    missing = [n for n in required if n not in state]
    if missing:
        raise ModelLoadError(f"{len(missing)} weights missing, e.g. {missing[:3]}", path=str(path))
    unused = sorted(set(state) - set(required))
    if unused:
        raise ModelLoadError(f"{len(unused)} weights the {config.architecture} model would not use, e.g. "
                             f"{unused[:3]}: refusing rather than dropping them", path=str(path))


# ---- Hugging Face directory ---------------------------------------------------------------------------

# per family: what its config class defaults to where config.json says nothing (transformers writes only
# the values that differ from them)
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048},
    "mistral": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 131072,
                "sliding_window": 4096},
    "qwen2": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 32768},
    "qwen3": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 32768},
    "gemma3": {"rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 131072,
               "sliding_window": 4096, "query_pre_attn_scalar": 256, "rope_local_base_freq": 10000.0,
               "head_dim": 256, "tie_word_embeddings": True, "sliding_window_pattern": 6},
    "phi3": {"rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096},
}
_HF_REFUSED_KEYS = {  # features no family here runs: refuse a config that sets them rather than ignore them
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "mlp_bias": False,
    "use_bidirectional_attention": False,
}


def _load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    raw = json.loads((path / "config.json").read_text())
    config = _hf_config(raw, path)
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
    for name in [n for n in state if n.endswith("rotary_emb.inv_freq")]:  # old checkpoints: recomputed
        del state[name]
    if config.architecture == "gemma3":  # Gemma computes (1 + w): store 1 + w, as GGUF does
        for name, tensor in state.items():
            if name.endswith("norm.weight"):
                state[name] = (tensor.float() + 1.0).to(dtype)
    _check_complete(config, state, path)
    return config, state


def _hf_config(raw: dict[str, Any], path: Path) -> ModelConfig:
    archs = raw.get("architectures") or [raw.get("model_type", "?")]
    family = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if family is None:
        supported = ", ".join(sorted(HF_ARCHITECTURES))
        raise ModelLoadError(f"unsupported architecture {archs[0]!r} (supported: {supported})", path=str(path))
    defaults = _HF_DEFAULTS[family]

    def get(key: str) -> Any:
        value = raw.get(key)
        return defaults.get(key) if value is None else value

    for key, allowed in _HF_REFUSED_KEYS.items():
        if raw.get(key) not in (None, allowed):
            raise ModelLoadError(f"{key}={raw[key]!r} is not supported by dynserve's engine", path=str(path))
    num_heads = raw["num_attention_heads"]
    num_layers = raw["num_hidden_layers"]
    head_dim = get("head_dim") or raw["hidden_size"] // num_heads
    rope = _hf_rope_parameters(raw, family)
    if float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise ModelLoadError("partial rotary embeddings (partial_rotary_factor < 1) are not supported", path=str(path))
    extra: dict[str, Any] = {}
    window = get("sliding_window") or 0
    layer_types = raw.get("layer_types")
    if family == "gemma3":
        if not layer_types:
            pattern = get("sliding_window_pattern")
            layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
        local = (raw.get("rope_parameters") or {}).get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError("rope scaling of Gemma 3's sliding layers is not supported", path=str(path))
        extra = dict(qk_norm=True, sandwich_norm=True, embed_scale=raw["hidden_size"] ** 0.5, hidden_act="gelu_tanh",
                     attention_scale=float(get("query_pre_attn_scalar")) ** -0.5,
                     rope_local_theta=float(local.get("rope_theta") or get("rope_local_base_freq")))
    elif family in ("qwen2", "qwen3") and not layer_types:
        use = raw.get("use_sliding_window", False)
        first = raw.get("max_window_layers", 28)
        layer_types = ["sliding_attention" if use and window and i >= first else "full_attention"
                       for i in range(num_layers)]
    elif family == "mistral":
        layer_types = ["sliding_attention" if window else "full_attention"] * num_layers
    if family == "qwen2":
        extra["qkv_bias"] = True
    elif raw.get("attention_bias"):  # Llama, Mistral, Qwen3, Gemma 3: a bias on all four projections
        extra["qkv_bias"] = extra["o_bias"] = True
    if family == "qwen3":
        extra["qk_norm"] = True
    if (get("hidden_act") or get("hidden_activation") or "silu") not in ("silu", "gelu_pytorch_tanh"):
        raise ModelLoadError(f"activation {get('hidden_act')!r} is not supported", path=str(path))
    layer_windows = tuple(window if t == "sliding_attention" else 0 for t in layer_types or ())
    if layer_types and len(layer_types) != num_layers:
        raise ModelLoadError(f"{len(layer_types)} layer types for {num_layers} layers", path=str(path))
    return ModelConfig(
        model_id=model_id_of(path),
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rope_theta=float(rope.get("rope_theta") or get("rope_theta")),
        rms_norm_eps=float(get("rms_norm_eps")),
        max_position_embeddings=get("max_position_embeddings"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", defaults.get("tie_word_embeddings", False))),
        rope_scaling=_rope_scaling(rope, raw),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=_first(raw.get("eos_token_id")),
        architecture=family,
        layer_windows=layer_windows if any(layer_windows) else (),
        **extra,
    )


def _hf_rope_parameters(raw: dict[str, Any], family: str) -> dict[str, Any]:
    """The rope parameters of the (global) layers: `rope_parameters` (transformers 5; per layer type for
    Gemma 3) merged over the older `rope_scaling` and `rope_theta` keys."""
    parameters = dict(raw.get("rope_scaling") or {})
    current = raw.get("rope_parameters") or {}
    if family == "gemma3" and "full_attention" in current:
        current = current["full_attention"] or {}
    parameters.update(current)
    if raw.get("rope_theta") is not None and "rope_theta" not in parameters:
        parameters["rope_theta"] = raw["rope_theta"]
    return parameters


def _rope_scaling(parameters: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any] | None:
    """The rope scaling the model applies (None for the default rope), with the values it needs from the
    config around it."""
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ("llama3", "linear", "dynamic", "yarn", "longrope", "freq_factors"):
        raise ModelLoadError(f"rope scaling {kind!r} is not supported")
    scaling = {k: v for k, v in parameters.items() if k not in ("type", "rope_theta")}
    scaling["rope_type"] = kind
    scaling.setdefault("max_position_embeddings", raw.get("max_position_embeddings"))
    if kind in ("yarn", "longrope"):
        scaling.setdefault("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    return scaling


def _first(value: Any) -> int | None:
    if isinstance(value, list):
        return value[0] if value else None
    return value
