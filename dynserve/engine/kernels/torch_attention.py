"""Paged attention in plain torch: the CPU serving path and the reference for the Triton kernels.

Invariant kept: after `forward`, the step's keys and values are in the cache at `meta.slot_mapping`, and each
query row has attended exactly to positions `0 .. its own position` of its sequence.

Fast paths: a prefill chunk with no cached prefix attends over the keys it already holds (no gather);
single-token decode rows are batched into one masked attention over K/V gathered from the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dynserve.engine.kernels import AttentionMetadata

__all__ = ["forward", "write_kv"]


def write_kv(
    kv_cache: torch.Tensor, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store `key`/`value` ([num_tokens, num_kv_heads, head_dim]) at their slots of `layer`."""
    block_size = kv_cache.shape[3]
    block_ids = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - block_ids * block_size
    kv_cache[block_ids, layer, 0, offsets] = key.to(kv_cache.dtype)
    kv_cache[block_ids, layer, 1, offsets] = value.to(kv_cache.dtype)


def _gather(kv_cache: torch.Tensor, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `block_ids` ([..., n]) of `layer` as `[..., n * block_size, num_kv_heads, head_dim]`."""
    kv = kv_cache[block_ids, layer]  # [..., n, 2, block_size, kv_heads, head_dim]
    shape = (*block_ids.shape[:-1], -1, kv.shape[-2], kv.shape[-1])
    return kv.select(-4, 0).reshape(shape), kv.select(-4, 1).reshape(shape)


def forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    write_kv(kv_cache, layer, key, value, meta.slot_mapping)
    out = torch.empty_like(query)
    starts, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    decode_rows: list[int] = []
    for i, seq_len in enumerate(seq_lens):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        if q_len == 1 and seq_len > 1:
            decode_rows.append(i)
            continue
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, head_dim]
        if q_len == seq_len:  # nothing cached before this chunk: attend over the keys in hand
            k = key[start:end].transpose(0, 1).unsqueeze(0).to(query.dtype)
            v = value[start:end].transpose(0, 1).unsqueeze(0).to(query.dtype)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            num_blocks = -(-seq_len // kv_cache.shape[3])
            k, v = _gather(kv_cache, layer, meta.block_tables[i, :num_blocks].long())
            k = k[:seq_len].transpose(0, 1).unsqueeze(0).to(query.dtype)
            v = v[:seq_len].transpose(0, 1).unsqueeze(0).to(query.dtype)
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = o.squeeze(0).transpose(0, 1)
    if decode_rows:
        _decode(query, kv_cache, layer, meta, scale, decode_rows, out)
    return out


def _decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    rows: list[int],
    out: torch.Tensor,
) -> None:
    """One masked attention for all single-token rows, over K/V gathered to the longest of them."""
    block_size = kv_cache.shape[3]
    token_idx = torch.tensor([meta.query_start_loc_cpu[i] for i in rows], device=query.device)
    lens = [meta.seq_lens_cpu[i] for i in rows]
    max_len = max(lens)
    num_blocks = -(-max_len // block_size)
    tables = meta.block_tables[rows, :num_blocks].long()
    k, v = _gather(kv_cache, layer, tables)  # [n, num_blocks * block_size, kv_heads, head_dim]
    k = k.transpose(1, 2).to(query.dtype)
    v = v.transpose(1, 2).to(query.dtype)
    lens_t = torch.tensor(lens, device=query.device)
    mask = torch.arange(num_blocks * block_size, device=query.device)[None, :] < lens_t[:, None]
    q = query[token_idx].unsqueeze(2)  # [n, heads, 1, head_dim]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
    out[token_idx] = o.squeeze(2)
