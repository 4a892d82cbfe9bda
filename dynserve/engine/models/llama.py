"""The Llama family (Llama 2/3, SmolLM2, Mistral without sliding window) over packed, unpadded batches.

Input is a flat list of tokens from many sequences with their positions; attention goes through a backend
(`dynserve.engine.kernels`) that reads and writes the paged KV cache. Q/K/V and gate/up projections are
fused into one matmul each. Logits are computed only for the rows asked for (the last token of each
sequence that samples), which keeps prefill from paying for a vocabulary-sized matmul per token.

The ops other than attention come from `kernels.cpu_ops` (`select_ops`): eager torch, or for bf16 on CPU
the fused C++ kernels. The choice is made once, when the model first runs (after any `.to(device)`); then
each linear weight is prepared for those ops, and when that makes a packed copy the original's memory is
released, so the weights are held once.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from dynserve.engine.kernels import AttentionMetadata
from dynserve.engine.kernels.cpu_ops import StepOps, Weight, select_ops
from dynserve.engine.loader import ModelConfig

__all__ = ["LlamaForCausalLM"]


def _rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        return inv_freq
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_len / low, old_len / high
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


class _DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, q_dim, kv_dim = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.input_norm = nn.Parameter(torch.ones(h, dtype=dtype), requires_grad=False)
        self.post_attn_norm = nn.Parameter(torch.ones(h, dtype=dtype), requires_grad=False)
        self.qkv_proj = nn.Parameter(torch.empty(q_dim + 2 * kv_dim, h, dtype=dtype), requires_grad=False)
        self.o_proj = nn.Parameter(torch.empty(h, q_dim, dtype=dtype), requires_grad=False)
        self.gate_up_proj = nn.Parameter(torch.empty(2 * config.intermediate_size, h, dtype=dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(h, config.intermediate_size, dtype=dtype), requires_grad=False)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList(_DecoderLayer(config, dtype) for _ in range(config.num_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size, dtype=dtype), requires_grad=False)
        self.lm_head: torch.Tensor = self.embed_tokens
        if not config.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype), requires_grad=False)
        self.register_buffer("inv_freq", _rope_inv_freq(config).float(), persistent=False)
        self.scale = config.head_dim**-0.5
        self._ops: StepOps | None = None
        self._weights: list[tuple[Weight, Weight, Weight, Weight]] = []  # per layer: qkv, o, gate_up, down
        self._lm_head_weight: Weight | None = None

    def step_ops(self) -> StepOps:
        """The ops this model runs on, chosen and its linear weights prepared on first use."""
        if self._ops is None:
            ops = select_ops(self.embed_tokens.dtype, self.embed_tokens.device)
            with torch.no_grad():
                weights = [(layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj) for layer in self.layers]
                prepared = [tuple(ops.prepare(w) for w in four) for four in weights]
                lm_head = ops.prepare(self.lm_head)
            # only once everything is prepared (a failure leaves the model as it was): drop the originals of
            # packed copies; the LM head tied to the embedding stays, lookups read it
            for four, done in zip(weights, prepared, strict=True):
                for weight, copy in zip(four, done, strict=True):
                    self._release(weight, copy)
            if self.lm_head is not self.embed_tokens:
                self._release(self.lm_head, lm_head)
            self._weights = prepared  # type: ignore[assignment]
            self._lm_head_weight = lm_head
            self._ops = ops
        return self._ops

    @staticmethod
    def _release(weight: torch.Tensor, prepared: Weight) -> None:
        if prepared is not weight:
            weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy weights named as in Hugging Face Llama checkpoints, fusing Q/K/V and gate/up (before the model
        first runs: its prepared weights are made then)."""
        if self._ops is not None:
            raise RuntimeError("weights must be loaded before the model first runs")
        with torch.no_grad():
            self.embed_tokens.copy_(state["model.embed_tokens.weight"])
            self.norm.copy_(state["model.norm.weight"])
            if not self.config.tie_word_embeddings:
                self.lm_head.copy_(state["lm_head.weight"])
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                layer.input_norm.copy_(state[p + "input_layernorm.weight"])
                layer.post_attn_norm.copy_(state[p + "post_attention_layernorm.weight"])
                layer.qkv_proj.copy_(torch.cat([state[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
                layer.o_proj.copy_(state[p + "self_attn.o_proj.weight"])
                layer.gate_up_proj.copy_(torch.cat([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]]))
                layer.down_proj.copy_(state[p + "mlp.down_proj.weight"])

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        attention: ModuleType,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run the packed tokens through the model; return fp32 logits of the rows in `logits_indices`."""
        cfg = self.config
        ops = self.step_ops()
        eps, q_dim = cfg.rms_norm_eps, cfg.num_heads * cfg.head_dim
        rope = ops.rope_tables(positions, self.inv_freq)
        hidden = F.embedding(input_ids, self.embed_tokens)
        n = hidden.shape[0]
        x = ops.rms_norm(hidden, self.layers[0].input_norm, eps) if len(self.layers) else hidden
        for layer_idx, (layer, (qkv_w, o_w, gate_up_w, down_w)) in enumerate(zip(self.layers, self._weights, strict=True)):
            q, k, v = ops.rope_qkv(ops.linear(x, qkv_w), rope, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
            attn = attention.forward(q, k, v, kv_cache, layer_idx, meta, self.scale)
            x, hidden = ops.add_rms_norm(ops.linear(attn.reshape(n, q_dim), o_w), hidden, layer.post_attn_norm, eps)
            mlp = ops.linear(ops.silu_mul(ops.linear(x, gate_up_w)), down_w)
            if layer_idx + 1 < len(self.layers):
                x, hidden = ops.add_rms_norm(mlp, hidden, self.layers[layer_idx + 1].input_norm, eps)
            else:
                hidden = hidden + mlp
        last = ops.rms_norm(hidden[logits_indices], self.norm, eps)
        return ops.logits(last, self._lm_head_weight)
