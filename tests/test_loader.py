"""Model loading: GGUF and Hugging Face directories give the same model; bad inputs get clear errors."""

from __future__ import annotations

import json
from pathlib import Path

from typing import TYPE_CHECKING

import gguf
import numpy as np
import pytest
from conftest import lazy_import

from dynserve.config import Settings
from dynserve.errors import ModelLoadError
from dynserve.model.resolve import resolve_model_path

if TYPE_CHECKING:
    from dynserve.engine.llm_engine import LoadedModel

torch = lazy_import("torch")
loader = lazy_import("dynserve.engine.loader")


def _hf_state_dict(loaded: LoadedModel) -> dict[str, torch.Tensor]:
    """The session model's weights under Hugging Face Llama names (Q/K/V and gate/up unfused)."""
    cfg, model = loaded.config, loaded.model
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    state = {"model.embed_tokens.weight": model.embed_tokens, "model.norm.weight": model.norm}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = layer.qkv_proj.split([q_dim, kv_dim, kv_dim])
        gate, up = layer.gate_up_proj.chunk(2)
        state |= {
            p + "input_layernorm.weight": layer.input_norm, p + "post_attention_layernorm.weight": layer.post_attn_norm,
            p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": layer.o_proj, p + "mlp.gate_proj.weight": gate,
            p + "mlp.up_proj.weight": up, p + "mlp.down_proj.weight": layer.down_proj,
        }
    return {name: t.detach().contiguous().clone() for name, t in state.items()}


def test_hf_directory_loads_the_same_model(tmp_path: Path, loaded_model: LoadedModel, make_engine, tokenizer) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import save_file

    from dynserve.engine.llm_engine import LLMEngine, LoadedModel

    cfg = loaded_model.config
    save_file(_hf_state_dict(loaded_model), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2,
    }))
    config, state = loader.load_model_weights(tmp_path)
    assert config.num_layers == cfg.num_layers and config.tie_word_embeddings
    assert "lm_head.weight" not in state
    prompt = tokenizer.encode("The capital of France is")
    from dynserve.engine.models.decoder import CausalLM

    model = CausalLM(config)
    model.load_hf_state_dict(state)
    hf_dir = LLMEngine(Settings(kv_blocks=16), loaded=LoadedModel(config, model.eval(), tokenizer, torch.device("cpu")))
    expected = make_engine(kv_blocks=16).compute_logits([prompt])
    torch.testing.assert_close(hf_dir.compute_logits([prompt]), expected, atol=1e-5, rtol=0)


def test_missing_and_wrong_paths_are_named(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path(tmp_path / "nope.gguf")
    with pytest.raises(ModelLoadError, match="without config.json"):
        resolve_model_path(tmp_path)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="neither a .gguf file"):
        resolve_model_path(other)


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        loader.load_model_weights(path)


def test_corrupt_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        loader.load_model_weights(path)


def test_the_header_reader_gives_gguf_readers_tensors_and_refuses_a_truncated_file(tmp_path: Path) -> None:
    """The loader reads a GGUF's header itself (gguf.GGUFReader parses a 49k-token vocabulary for seconds):
    every tensor's name, type, shape and bytes are the ones gguf's reader gives; a file cut short is refused."""
    from dynserve.engine.loader import _dequantize, _dequantize_simple, _read_gguf

    path = resolve_model_path(None)
    metadata, tensors = _read_gguf(path)
    reference = gguf.GGUFReader(str(path))
    assert metadata["general.architecture"] == "llama" and len(tensors) == len(reference.tensors)
    for ours, theirs in zip(tensors, reference.tensors, strict=True):
        assert (ours.name, ours.tensor_type, ours.shape.tolist()) == (theirs.name, theirs.tensor_type,
                                                                      theirs.shape.tolist())
        assert np.array_equal(ours.data, theirs.data), ours.name
    # Q8_0 and Q4_1 (and Q4_0) are dequantized whole-tensor by the loader: bit for bit gguf's reference
    for kind in ("Q8_0", "Q4_1"):
        tensor = next(t for t in tensors if t.tensor_type.name == kind)
        expected = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        assert np.array_equal(_dequantize(gguf, tensor, path), expected.reshape(tuple(reversed(tensor.shape))))
    rows = np.random.default_rng(0).integers(0, 256, (64, 18), dtype=np.uint8)
    rows[:, 1] &= 0x3B  # finite f16 scales
    expected = gguf.quants.dequantize(rows.reshape(-1), gguf.GGMLQuantizationType.Q4_0).reshape(-1)
    assert np.array_equal(_dequantize_simple(rows, "Q4_0").reshape(-1), expected)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: tensors[-1].data.nbytes // 2 + int(path.stat().st_size // 2)])
    with pytest.raises(ModelLoadError, match="cannot read GGUF file .*runs past the end"):
        loader.load_model_weights(cut)
