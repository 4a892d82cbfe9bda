"""One config-driven decoder for every supported family (Llama 1-3, Mistral, Qwen2/2.5, Qwen3, Gemma 3,
Phi-3), over packed, unpadded batches.

Input is a flat list of tokens from many sequences with their positions; attention goes through a backend
(`dynserve.engine.kernels`) that reads and writes the paged KV cache. Q/K/V and gate/up projections are
fused into one matmul each. Logits are computed only for the rows asked for (the last token of each
sequence that samples), which keeps prefill from paying for a vocabulary-sized matmul per token.

What differs between families is data in `ModelConfig`, each feature a step of the same layer:
- a bias on the Q/K/V projection (Qwen2) and on the output projection, added in the rope op;
- q/k norm: each query and key head RMS-normalised before rope (Qwen3, Gemma 3), in the rope op;
- sandwich norms: the attention's and the MLP's outputs normalised before they join the residual (Gemma 3);
- scaled embeddings, the query scale, GELU-tanh instead of SiLU (Gemma 3);
- per-layer sliding windows, and a separate rope base for the windowed layers (Mistral, Gemma 3's local
  layers); the window is applied by the attention backend, on the one block table every layer shares;
- rope scalings (`models.rope`).
Norm weights arrive as the multiplier itself (Gemma's `1 + w` is folded in by the loader).

The ops other than attention come from `kernels.cpu_ops` (`select_ops`): eager torch, for bf16 on CPU the
fused C++ kernels, on CUDA the Triton ones. The choice is made once, when the model first runs (after any
`.to(device)`); then each linear weight is prepared for those ops, and when that makes a packed copy the
original's memory is released, so the weights are held once.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from dynserve.engine.kernels import AttentionMetadata
from dynserve.engine.kernels.cpu_ops import StepOps, Weight, select_ops
from dynserve.engine.loader import ModelConfig
from dynserve.engine.models.rope import Rope, build_rope

__all__ = ["CausalLM"]


def _param(*shape: int, dtype: torch.dtype, fill: float | None = None) -> nn.Parameter:
    data = torch.empty(*shape, dtype=dtype) if fill is None else torch.full(shape, fill, dtype=dtype)
    return nn.Parameter(data, requires_grad=False)


class _DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        q_dim, kv_dim = config.num_heads * d, config.num_kv_heads * d
        self.input_norm = _param(h, dtype=dtype, fill=1.0)
        self.post_attn_norm = _param(h, dtype=dtype, fill=1.0)  # before the MLP
        self.qkv_proj = _param(q_dim + 2 * kv_dim, h, dtype=dtype)
        self.o_proj = _param(h, q_dim, dtype=dtype)
        self.gate_up_proj = _param(2 * config.intermediate_size, h, dtype=dtype)
        self.down_proj = _param(h, config.intermediate_size, dtype=dtype)
        optional = {
            "qkv_bias": (config.qkv_bias, (q_dim + 2 * kv_dim,)),
            "o_bias": (config.o_bias, (h,)),
            "q_norm": (config.qk_norm, (d,)),
            "k_norm": (config.qk_norm, (d,)),
            "attn_out_norm": (config.sandwich_norm, (h,)),
            "mlp_out_norm": (config.sandwich_norm, (h,)),
        }
        for name, (used, shape) in optional.items():
            self.register_parameter(name, _param(*shape, dtype=dtype, fill=0.0) if used else None)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.embed_tokens = _param(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(_DecoderLayer(config, dtype) for _ in range(config.num_layers))
        self.norm = _param(config.hidden_size, dtype=dtype, fill=1.0)
        self.lm_head: torch.Tensor = self.embed_tokens
        if not config.tie_word_embeddings:
            self.lm_head = _param(config.vocab_size, config.hidden_size, dtype=dtype)
        self.windows = config.layer_windows or (0,) * config.num_layers
        self._rope = build_rope(config.head_dim, config.rope_theta, config.rope_scaling)
        self._local_rope: Rope | None = None
        if config.rope_local_theta is not None:
            self._local_rope = build_rope(config.head_dim, config.rope_local_theta, None)
        self.scale = config.attention_scale or config.head_dim**-0.5
        self._ops: StepOps | None = None
        self._weights: list[tuple[Weight, Weight, Weight, Weight]] = []  # per layer: qkv, o, gate_up, down
        self._lm_head_weight: Weight | None = None

    def step_ops(self) -> StepOps:
        """The ops this model runs on, chosen and its linear weights prepared on first use."""
        if self._ops is None:
            device = self.embed_tokens.device
            ops = select_ops(self.embed_tokens.dtype, device)
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
            self._rope = self._rope.to(device)
            self._local_rope = self._local_rope.to(device) if self._local_rope is not None else None
            self._ops = ops
        return self._ops

    @staticmethod
    def _release(weight: torch.Tensor, prepared: Weight) -> None:
        if prepared is not weight:
            weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy weights named as in Hugging Face checkpoints (the loader's names), fusing Q/K/V and gate/up
        where they come apart (before the model first runs: its prepared weights are made then)."""
        if self._ops is not None:
            raise RuntimeError("weights must be loaded before the model first runs")
        cfg = self.config
        with torch.no_grad():
            self.embed_tokens.copy_(state["model.embed_tokens.weight"])
            self.norm.copy_(state["model.norm.weight"])
            if not cfg.tie_word_embeddings:
                self.lm_head.copy_(state["lm_head.weight"])
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                attn, mlp = p + "self_attn.", p + "mlp."
                layer.input_norm.copy_(state[p + "input_layernorm.weight"])
                if cfg.sandwich_norm:  # Gemma 3: post_attention_layernorm is the attention's output norm
                    layer.attn_out_norm.copy_(state[p + "post_attention_layernorm.weight"])
                    layer.post_attn_norm.copy_(state[p + "pre_feedforward_layernorm.weight"])
                    layer.mlp_out_norm.copy_(state[p + "post_feedforward_layernorm.weight"])
                else:
                    layer.post_attn_norm.copy_(state[p + "post_attention_layernorm.weight"])
                if attn + "qkv_proj.weight" in state:
                    layer.qkv_proj.copy_(state[attn + "qkv_proj.weight"])
                else:
                    _copy_stacked(layer.qkv_proj, [state[attn + f"{n}_proj.weight"] for n in "qkv"])
                if cfg.qkv_bias:
                    _copy_stacked(layer.qkv_bias, [state[attn + f"{n}_proj.bias"] for n in "qkv"])
                if cfg.o_bias:
                    layer.o_bias.copy_(state[attn + "o_proj.bias"])
                if cfg.qk_norm:
                    layer.q_norm.copy_(state[attn + "q_norm.weight"])
                    layer.k_norm.copy_(state[attn + "k_norm.weight"])
                layer.o_proj.copy_(state[attn + "o_proj.weight"])
                if mlp + "gate_up_proj.weight" in state:
                    layer.gate_up_proj.copy_(state[mlp + "gate_up_proj.weight"])
                else:
                    _copy_stacked(layer.gate_up_proj, [state[mlp + "gate_proj.weight"], state[mlp + "up_proj.weight"]])
                layer.down_proj.copy_(state[mlp + "down_proj.weight"])

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
        rope = self._rope.tables(ops, positions, meta)
        local_rope = self._local_rope.tables(ops, positions, meta) if self._local_rope is not None else rope
        hidden = F.embedding(input_ids, self.embed_tokens)
        if cfg.embed_scale is not None:  # in the weights' dtype, as the reference rounds it
            hidden = hidden * torch.tensor(cfg.embed_scale, dtype=hidden.dtype, device=hidden.device)
        mlp_act = ops.gelu_tanh_mul if cfg.hidden_act == "gelu_tanh" else ops.silu_mul
        n = hidden.shape[0]
        x = ops.rms_norm(hidden, self.layers[0].input_norm, eps) if len(self.layers) else hidden
        for layer_idx, (layer, (qkv_w, o_w, gate_up_w, down_w)) in enumerate(zip(self.layers, self._weights, strict=True)):
            window = self.windows[layer_idx]
            q, k, v = ops.rope_qkv(
                ops.linear(x, qkv_w), local_rope if window else rope, cfg.num_heads, cfg.num_kv_heads,
                cfg.head_dim, layer.qkv_bias, layer.q_norm, layer.k_norm, eps,
            )
            attn = attention.forward(q, k, v, kv_cache, layer_idx, meta, self.scale, window)
            out = ops.linear(attn.reshape(n, q_dim), o_w)
            if layer.o_bias is not None:
                out = out + layer.o_bias
            if layer.attn_out_norm is not None:
                out = ops.rms_norm(out, layer.attn_out_norm, eps)
            x, hidden = ops.add_rms_norm(out, hidden, layer.post_attn_norm, eps)
            mlp = ops.linear(mlp_act(ops.linear(x, gate_up_w)), down_w)
            if layer.mlp_out_norm is not None:
                mlp = ops.rms_norm(mlp, layer.mlp_out_norm, eps)
            if layer_idx + 1 < len(self.layers):
                x, hidden = ops.add_rms_norm(mlp, hidden, self.layers[layer_idx + 1].input_norm, eps)
            else:
                hidden = hidden + mlp
        last = ops.rms_norm(hidden[logits_indices], self.norm, eps)
        return ops.logits(last, self._lm_head_weight)


def _copy_stacked(fused: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """Copy `parts` one under another into `fused` (rows), without building their concatenation first."""
    if sum(part.shape[0] for part in parts) != fused.shape[0]:
        raise ValueError(f"parts of {[tuple(p.shape) for p in parts]} do not stack to {tuple(fused.shape)}")
    row = 0
    for part in parts:
        fused[row:row + part.shape[0]].copy_(part)
        row += part.shape[0]
