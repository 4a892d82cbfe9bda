"""A model step's ops other than attention (linear, RMSNorm, rope, SiLU-and-multiply), in two implementations
here and a third for GPUs (`triton_ops.TritonOps`, fused Triton kernels, chosen on CUDA by `select_ops`).

- `TorchOps`: eager torch. The reference, and the path of every dtype but bf16 on CPU (the fp32 path stays
  exactly what Hugging Face parity tests check).
- `NativeBf16Ops`: the C++ kernels of `cpu_native` for bf16 on CPU. Linear weights are packed once for
  the kernel's `vdpbf16ps` tiles (`prepare`): a decode step's few rows stream each weight at close to the
  machine's memory bandwidth (an eager bf16 matrix-vector product reaches about a third of it), and
  prefill's many rows run a register-tiled GEMM. Norms, rope and the activation are fused, one call each
  instead of several eager ops. Without AVX512-BF16 the linears stay torch's.

Every op exists in every implementation. Where one has no kernel of its own for a model's feature yet (the
Triton ops' projection bias, q/k norm and GELU), it runs that piece in eager torch and says so: a warning
once per op and a count in `eager.fallback_counts()` (a worker's `/metrics` exports it), never silently.

A model prepares its linear weights once (`prepare(weight)`, the packed copy or the weight itself) and calls
the ops with what `prepare` returned. `select_ops(dtype, device)` picks the implementation;
`USE_NATIVE_OPS = False` (tests, A/B runs) forces the torch one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from dynserve.engine import memory
from dynserve.engine.kernels import cpu_native, rope_angles
from dynserve.engine.kernels.eager import rope_qkv_eager

__all__ = ["NativeBf16Ops", "PackedWeight", "StepOps", "TorchOps", "USE_NATIVE_OPS", "USE_TRITON_OPS", "pack_linear",
           "select_ops"]

USE_NATIVE_OPS = True
USE_TRITON_OPS = True  # on CUDA (tests and A/B runs switch it off)

_PANEL = 16  # output columns per packed panel (one fp32 vector of results)

@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A linear weight `[out_features, in_features]` laid out for `cpu_native.linear`:
    `[ceil(out / 16), in / 2, 16, 2]`, padded with zeros."""

    packed: torch.Tensor
    out_features: int


def pack_linear(weight: torch.Tensor) -> PackedWeight:
    """`weight` (bf16 `[N, K]`, K even) packed: two consecutive k of 16 consecutive output columns per
    64-byte line."""
    n, k = weight.shape
    if weight.dtype != torch.bfloat16:
        raise ValueError(f"only bf16 weights are packed, not {weight.dtype}")
    if k % 2:
        raise ValueError(f"cannot pack a weight with an odd number of input features ({k})")
    padded = weight.detach() if n % _PANEL == 0 else F.pad(weight.detach(), (0, 0, 0, -n % _PANEL))
    layout = padded.view(-1, _PANEL, k // 2, 2).permute(0, 2, 1, 3)
    packed = memory.empty(tuple(layout.shape), weight.dtype, weight.device).copy_(layout)
    return PackedWeight(packed, n)


Weight = torch.Tensor | PackedWeight


class StepOps(Protocol):
    name: str

    def prepare(self, weight: torch.Tensor) -> Weight:
        """What `linear` and `logits` take for this weight (made once, when the model is first run)."""
        ...

    def linear(self, x: torch.Tensor, weight: Any) -> torch.Tensor: ...

    def logits(self, x: torch.Tensor, weight: Any) -> torch.Tensor:
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

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) * up of `[rows, 2 * inter]` (gate first)."""
        ...

    def rope_tables(
        self, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) `[rows, head_dim / 2]` of each position, times `scale`, once per step (`rope_angles`)."""
        ...

    def rope_qkv(
        self, qkv: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], num_heads: int, num_kv_heads: int,
        head_dim: int, bias: torch.Tensor | None = None, q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None, eps: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split a fused QKV projection `[rows, (heads + 2 kv_heads) * head_dim]` into q, k, v
        (`[rows, heads, head_dim]` each), q and k rotated (rotate-half, Hugging Face layout). First, when
        given: `bias` is added to the projection, and each q and k head is RMS-normalised with `q_norm` /
        `k_norm` (`[head_dim]`)."""
        ...


class TorchOps:
    name = "torch"

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def prepare(self, weight: torch.Tensor) -> Weight:
        return weight

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

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def rope_tables(
        self, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope_angles(positions, inv_freq, scale)
        return cos.to(self.dtype), sin.to(self.dtype)

    def rope_qkv(
        self, qkv: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], num_heads: int, num_kv_heads: int,
        head_dim: int, bias: torch.Tensor | None = None, q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None, eps: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return rope_qkv_eager(qkv, tables, num_heads, num_kv_heads, head_dim, bias, q_norm, k_norm, eps)


class NativeBf16Ops:
    """bf16 on CPU through `cpu_native`'s kernels (fp32 sums, one rounding to bf16 per result)."""

    name = "native-bf16"

    def __init__(self, kernels: Any) -> None:
        self._k = kernels
        self._native_linear = bool(kernels.has_avx512_bf16())

    def prepare(self, weight: torch.Tensor) -> Weight:
        if self._native_linear and weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0:
            return pack_linear(weight)
        return weight

    def linear(self, x: torch.Tensor, weight: Weight) -> torch.Tensor:
        if isinstance(weight, PackedWeight):
            return self._k.linear(x, weight.packed, weight.out_features, False)
        return F.linear(x, weight)

    def logits(self, x: torch.Tensor, weight: Weight) -> torch.Tensor:
        if isinstance(weight, PackedWeight):
            return self._k.linear(x, weight.packed, weight.out_features, True)
        return F.linear(x, weight).float()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._k.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._k.add_rms_norm(x, residual, weight, eps), residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._k.silu_mul(gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._k.gelu_tanh_mul(gate_up)

    def rope_tables(
        self, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_angles(positions, inv_freq, scale)  # fp32: the kernel rotates in fp32

    def rope_qkv(
        self, qkv: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], num_heads: int, num_kv_heads: int,
        head_dim: int, bias: torch.Tensor | None = None, q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None, eps: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self._k.rope_(qkv, tables[0], tables[1], num_heads, num_kv_heads, head_dim, bias, q_norm, k_norm,
                                eps)
        return q, k, v


def select_ops(dtype: torch.dtype, device: torch.device) -> StepOps:
    """The native bf16 ops on CPU when the kernels build; on CUDA the fused Triton ops (`triton_ops`) when
    Triton imports; the torch ops otherwise."""
    if USE_NATIVE_OPS and dtype == torch.bfloat16 and device.type == "cpu":
        kernels = cpu_native.load()
        if kernels is not None:
            return NativeBf16Ops(kernels)
    if USE_TRITON_OPS and device.type == "cuda":
        from dynserve.engine.kernels import triton_ops

        if triton_ops.triton is not None:
            return triton_ops.TritonOps(dtype)
    return TorchOps(dtype)
