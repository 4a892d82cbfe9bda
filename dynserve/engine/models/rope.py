"""Rotary position embeddings: the frequencies of each scaling a supported model uses, and a step's tables.

`build_rope(head_dim, theta, scaling)` turns a config's rope (`ModelConfig.rope_scaling`: `rope_type` and its
parameters, as in a Hugging Face config) into a `Rope`: one set of inverse frequencies and the attention
factor that multiplies cos and sin (YaRN, LongRoPE). Two scalings depend on a sequence's length, and are
computed per row of a step from its sequence's rope length (`AttentionMetadata.rope_lens_cpu`: the longer of
its prompt and its length at the end of the step, so a prompt prefilled in chunks gets the frequencies of a
whole-prompt prefill, and decode steps those of the reference's step-by-step generation):
- `longrope` (Phi-3): the short factors up to `original_max_position_embeddings`, the long ones past it;
- `dynamic` (NTK): the base grows with the length past `max_position_embeddings`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dynserve.engine.kernels import AttentionMetadata
from dynserve.engine.kernels.cpu_ops import StepOps

__all__ = ["Rope", "build_rope"]


@dataclass(frozen=True, slots=True)
class Rope:
    inv_freq: torch.Tensor  # [head_dim / 2] fp32
    attention_factor: float = 1.0
    long_inv_freq: torch.Tensor | None = None  # longrope: rows of sequences longer than `long_after`
    long_after: int = 0
    dynamic: tuple[float, float, int] | None = None  # dynamic NTK: (base, factor, max_position_embeddings)

    def to(self, device: torch.device) -> Rope:
        long = None if self.long_inv_freq is None else self.long_inv_freq.to(device)
        return Rope(self.inv_freq.to(device), self.attention_factor, long, self.long_after, self.dynamic)

    def tables(self, ops: StepOps, positions: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the step's rows (`ops.rope_tables`)."""
        inv_freq = self.inv_freq
        lengths = meta.rope_lens_cpu or meta.seq_lens_cpu
        longest = max(lengths, default=0)
        if self.long_inv_freq is not None and longest > self.long_after:
            rows = [n for n, q in zip(lengths, _query_lens(meta), strict=True) for _ in range(q)]
            long = torch.tensor([n > self.long_after for n in rows], device=positions.device)
            inv_freq = torch.where(long[:, None], self.long_inv_freq[None, :], self.inv_freq[None, :])
        elif self.dynamic is not None and longest > self.dynamic[2]:
            per_seq = [self._dynamic_inv_freq(n) for n in lengths]
            index = torch.repeat_interleave(torch.arange(meta.num_seqs), torch.tensor(_query_lens(meta)))
            inv_freq = torch.stack(per_seq)[index].to(positions.device)
        return ops.rope_tables(positions, inv_freq, self.attention_factor)

    def _dynamic_inv_freq(self, seq_len: int) -> torch.Tensor:
        assert self.dynamic is not None
        base, factor, max_len = self.dynamic
        dim = 2 * self.inv_freq.numel()
        if seq_len > max_len:
            base = base * ((factor * seq_len / max_len) - (factor - 1)) ** (dim / (dim - 2))
        return _default_inv_freq(base, dim).to(self.inv_freq.device)


def _query_lens(meta: AttentionMetadata) -> list[int]:
    starts = meta.query_start_loc_cpu
    return [starts[i + 1] - starts[i] for i in range(meta.num_seqs)]


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def build_rope(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> Rope:
    """The rope of layers with this base and scaling (None: the default rope)."""
    inv_freq = _default_inv_freq(theta, head_dim)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return Rope(inv_freq)
    assert scaling is not None
    if kind == "linear":
        return Rope(inv_freq / scaling["factor"])
    if kind == "freq_factors":  # a GGUF's per-frequency divisors (llama.cpp's `rope_freqs`: Llama 3's scaling)
        return Rope(inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32))
    if kind == "llama3":
        return Rope(_llama3(inv_freq, scaling))
    if kind == "dynamic":
        return Rope(inv_freq, dynamic=(theta, float(scaling["factor"]), int(scaling["max_position_embeddings"])))
    if kind == "yarn":
        return _yarn(theta, head_dim, scaling)
    if kind == "longrope":
        original = int(scaling["original_max_position_embeddings"])
        factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * theta**shape)
        long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * theta**shape)
        return Rope(short, float(attention_factor), long, original)
    raise ValueError(f"rope scaling {kind!r} is not supported")


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_len / low, old_len / high
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def _yarn(theta: float, dim: int, scaling: dict[str, Any]) -> Rope:
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return Rope(inv_freq, float(attention_factor))
