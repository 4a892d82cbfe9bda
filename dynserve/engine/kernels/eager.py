"""Eager torch pieces the step ops share: the reference q/k/v preparation (bias, q/k norm, rotate-half rope)
and the record of ops that ran here because an implementation has no kernel of its own for them yet."""

from __future__ import annotations

import logging
from collections import Counter

import torch
import torch.nn.functional as F

__all__ = ["fallback_counts", "note_fallback", "rope_qkv_eager"]

logger = logging.getLogger(__name__)

_FALLBACKS: Counter[tuple[str, str]] = Counter()  # (ops implementation, op) -> calls that ran in eager torch


def note_fallback(ops: str, op: str) -> None:
    """Record that `ops` ran `op` in eager torch instead of its own kernel (a warning the first time)."""
    key = (ops, op)
    if key not in _FALLBACKS:
        logger.warning("the %s ops have no kernel for %s yet: it runs in eager torch (slower, same result)", ops, op)
    _FALLBACKS[key] += 1


def fallback_counts() -> dict[tuple[str, str], int]:
    """Calls per (ops implementation, op) that fell back to eager torch in this process."""
    return dict(_FALLBACKS)


def rope_qkv_eager(
    qkv: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], num_heads: int, num_kv_heads: int, head_dim: int,
    bias: torch.Tensor | None, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, q_dim, kv_dim = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    if bias is not None:
        qkv = qkv + bias
    q = qkv[:, :q_dim].view(n, num_heads, head_dim)
    k = qkv[:, q_dim : q_dim + kv_dim].view(n, num_kv_heads, head_dim)
    if q_norm is not None and k_norm is not None:
        q, k = F.rms_norm(q, (head_dim,), q_norm, eps), F.rms_norm(k, (head_dim,), k_norm, eps)
    cos, sin = tables
    cos, sin = cos.to(qkv.dtype), sin.to(qkv.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), qkv[:, q_dim + kv_dim :].view(n, num_kv_heads, head_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


