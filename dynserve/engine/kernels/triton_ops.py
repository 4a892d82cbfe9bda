"""A step's ops other than attention and the linears, fused in Triton: the GPU's `StepOps`.

A small decode batch on a GPU is bound by how many kernels a step launches, not by their work: eager torch
spends about 30 launches per layer on RMSNorm, the residual add, rope and SiLU-and-multiply. `TritonOps`
does each in one kernel: `add_rms_norm` (the residual updated in place, rounded to the model dtype before it
is normalized, as the eager ops round it), `rms_norm`, `rope_qkv` (q and k rotated in place in the fused
QKV projection, in fp32), `silu_mul`. Linears stay cuBLAS's (`F.linear`). Arithmetic is fp32 inside each
kernel, with one rounding to the model dtype per result.

Like the attention kernels they run on the CPU only under TRITON_INTERPRET=1, where the tests compare them
with `cpu_ops.TorchOps`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dynserve.engine.kernels import rope_angles
from dynserve.engine.kernels.eager import note_fallback, rope_qkv_eager

try:
    import triton
    import triton.language as tl
except ImportError:  # optional: select_ops never picks these ops without Triton
    triton = None
    tl = None

__all__ = ["TritonOps"]


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


@_jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o, num_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        summed = x + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        rounded = summed.to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r + cols, rounded, mask=mask)
        x = rounded.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / num_cols
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(variance + eps) * weight
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@_jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@_jit
def _rope_kernel(qkv_ptr, cos_ptr, sin_ptr, stride_row, stride_cs, head_dim, HALF: tl.constexpr,
                 BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    base = qkv_ptr + row * stride_row + head * head_dim
    x1 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + row * stride_cs + offs, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + row * stride_cs + offs, mask=mask, other=0.0)
    tl.store(base + offs, (x1 * cos - x2 * sin).to(qkv_ptr.dtype.element_ty), mask=mask)
    tl.store(base + HALF + offs, (x2 * cos + x1 * sin).to(qkv_ptr.dtype.element_ty), mask=mask)


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


class TritonOps:
    name = "triton"

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight).float()

    def _norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows, cols = x.shape
        out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
        if rows == 0:
            return out
        x = x if x.stride(-1) == 1 else x.contiguous()
        block = triton.next_power_of_2(cols)
        res = residual if residual is not None else x
        _rms_norm_kernel[(rows,)](
            x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_warps(block),
        )  # fmt: skip
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._norm(x, None, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
        return self._norm(x, residual, weight, eps), residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        rows, width = gate_up.shape
        inter = width // 2
        out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
        if rows == 0:
            return out
        gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(rows, triton.cdiv(inter, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block, num_warps=_warps(block),
        )  # fmt: skip
        return out

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        note_fallback(self.name, "gelu_tanh_mul")
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def rope_tables(
        self, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_angles(positions, inv_freq, scale)  # fp32: the kernel rotates in fp32

    def rope_qkv(
        self, qkv: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], num_heads: int, num_kv_heads: int,
        head_dim: int, bias: torch.Tensor | None = None, q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None, eps: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if bias is not None or q_norm is not None:
            note_fallback(self.name, "qkv bias and q/k norm")
            return rope_qkv_eager(qkv, tables, num_heads, num_kv_heads, head_dim, bias, q_norm, k_norm, eps)
        n, q_dim, kv_dim = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
        if qkv.stride(-1) != 1:
            qkv = qkv.contiguous()
        cos, sin = (t.contiguous() for t in tables)
        if n:
            half = head_dim // 2
            _rope_kernel[(n, num_heads + num_kv_heads)](
                qkv, cos, sin, qkv.stride(0), cos.stride(0), head_dim,
                HALF=half, BLOCK=triton.next_power_of_2(half), num_warps=1,
            )  # fmt: skip
        q = qkv[:, :q_dim].view(n, num_heads, head_dim)
        k = qkv[:, q_dim : q_dim + kv_dim].view(n, num_kv_heads, head_dim)
        return q, k, qkv[:, q_dim + kv_dim :].view(n, num_kv_heads, head_dim)
