"""A model step's ops other than attention (linear, RMSNorm, rope, SiLU-and-multiply), in two implementations.

- `TorchOps`: eager torch. The reference, and the path of every dtype but bf16 on CPU (the fp32 path stays
  exactly what Hugging Face parity tests check).
- `NativeBf16Ops`: the C++ kernels of `cpu_native` for bf16 on CPU. A step with few rows (decode) runs its
  linears through `linear`, which streams each weight once at close to the machine's memory bandwidth (an
  eager bf16 matrix-vector product reaches about a third of it); more rows (prefill) go to torch's GEMM,
  which is bound by compute there. Norms, rope and the activation are fused, one call each instead of
  several eager ops, so a decode step spends its time reading weights rather than dispatching ops.

`select_ops(dtype, device)` picks one; `USE_NATIVE_OPS = False` (tests, A/B runs) forces the torch one.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

from dynserve.engine.kernels import cpu_native

__all__ = ["NativeBf16Ops", "StepOps", "TorchOps", "USE_NATIVE_OPS", "select_ops"]

USE_NATIVE_OPS = True

# Up to this many rows a linear goes through the C++ kernel, beyond it to torch's GEMM (where the weight is
# no longer what bounds the time); measured on AVX512-BF16, see docs/benchmarks.md (decode step).
NATIVE_LINEAR_MAX_ROWS = 32


class StepOps(Protocol):
    name: str

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """fp32 `x @ weight.T`."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(residual + x), residual + x); `residual` may be updated in place."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of `[rows, 2 * inter]` (gate first)."""
        ...

    def rope_tables(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) `[rows, head_dim / 2]` of each position, once per step."""
        ...

    def rope_qkv(
        self, qkv: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], num_heads: int, num_kv_heads: int,
        head_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split a fused QKV projection `[rows, (heads + 2 kv_heads) * head_dim]` into q, k, v
        (`[rows, heads, head_dim]` each), q and k rotated (rotate-half, Hugging Face layout)."""
        ...


class TorchOps:
    name = "torch"

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight).float()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope_tables(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * inv_freq[None, :]
        return freqs.cos().to(self.dtype), freqs.sin().to(self.dtype)

    def rope_qkv(
        self, qkv: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], num_heads: int, num_kv_heads: int,
        head_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, q_dim, kv_dim = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
        cos, sin = tables
        q = _rotate(qkv[:, :q_dim].view(n, num_heads, head_dim), cos, sin)
        k = _rotate(qkv[:, q_dim : q_dim + kv_dim].view(n, num_kv_heads, head_dim), cos, sin)
        return q, k, qkv[:, q_dim + kv_dim :].view(n, num_kv_heads, head_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class NativeBf16Ops:
    """bf16 on CPU through `cpu_native`'s kernels (fp32 sums, one rounding to bf16 per result)."""

    name = "native-bf16"

    def __init__(self, kernels: Any) -> None:
        self._k = kernels
        self._native_linear = bool(kernels.has_avx512_bf16())

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._native_linear and x.shape[0] <= NATIVE_LINEAR_MAX_ROWS:
            return self._k.linear(x, weight, False)
        return F.linear(x, weight)

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._native_linear and x.shape[0] <= NATIVE_LINEAR_MAX_ROWS:
            return self._k.linear(x, weight, True)
        return F.linear(x, weight).float()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._k.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._k.add_rms_norm(x, residual, weight, eps), residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._k.silu_mul(gate_up)

    def rope_tables(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * inv_freq[None, :]
        return freqs.cos(), freqs.sin()  # fp32: the kernel rotates in fp32

    def rope_qkv(
        self, qkv: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], num_heads: int, num_kv_heads: int,
        head_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self._k.rope_(qkv, tables[0], tables[1], num_heads, num_kv_heads, head_dim)
        n, q_dim, kv_dim = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
        return (qkv[:, :q_dim].view(n, num_heads, head_dim),
                qkv[:, q_dim : q_dim + kv_dim].view(n, num_kv_heads, head_dim),
                qkv[:, q_dim + kv_dim :].view(n, num_kv_heads, head_dim))


def select_ops(dtype: torch.dtype, device: torch.device) -> StepOps:
    """The native bf16 ops on CPU when the kernels build, the torch ops otherwise."""
    if USE_NATIVE_OPS and dtype == torch.bfloat16 and device.type == "cpu":
        kernels = cpu_native.load()
        if kernels is not None:
            return NativeBf16Ops(kernels)
    return TorchOps(dtype)
