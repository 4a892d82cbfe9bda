"""Paged attention in plain torch: the CPU serving path and the reference for the Triton kernels.

Invariant kept: after `forward`, the step's keys and values are in the cache at `meta.slot_mapping`, and each
query row has attended exactly to positions `0 .. its own position` of its sequence, or with a sliding
`window` > 0 to the last `window` of them (`position - window + 1 .. position`); blocks wholly before a row's
window are never read, so the block manager may have freed them.

How it stays fast on CPU (where attention, not matmuls, dominates a large decode batch):
- a `_Plan` is derived once per step and reused by every layer (slot split, row groups, masks);
- a bf16 cache with a bf16 query on a CPU with AVX512-BF16: every row of the step, prefill and decode alike,
  goes to the C++ kernel `cpu_native.paged_attention` (csrc/attention_bf16_cpu.cpp), which computes each row
  with one arithmetic over the keys and values as stored in the cache: a row's result, and so the KV a prompt
  leaves in the cache and its last logits, do not depend on which of its tokens came from the prefix cache, a
  decode step or an earlier prefill chunk. The paths below serve every other case;
- a prefill chunk with nothing cached before it attends over the keys in hand (no gather);
- decode rows (one query token each) go to the C++ kernel of `cpu_native` when it is available (fp32 or bf16;
  a step of decode rows only writes its keys and values in the same call),
  which reads the cache through the block tables without copying; otherwise, in pure torch:
  - decode rows are sorted by context length and grouped, so each group pads only to its own longest;
  - K and V are gathered block-wise straight into `[rows, tokens, kv_heads, head_dim]` (one copy each), and
    the query heads of a KV head attend as that head's query rows, so GQA never repeats K/V.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from dynserve.engine.kernels import AttentionMetadata, cpu_native

__all__ = ["USE_NATIVE_DECODE", "forward", "write_kv"]

# Decode rows go through the C++ kernel (`cpu_native`) when it can be built; tests switch it off to check
# the pure torch path, which stays the reference.
USE_NATIVE_DECODE = True

# A decode group pads every row to its longest context; start a new group past this much padding.
_MAX_GROUP_PAD_RATIO = 1.25
# ... and past this many rows, which bounds each gather buffer (A/B runs showed no speed difference
# between 4, 8 and unbounded rows at batch 32).
_MAX_GROUP_ROWS = 8


def write_kv(
    kv_cache: torch.Tensor, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store `key`/`value` ([num_tokens, num_kv_heads, head_dim]) at their slots of `layer`."""
    _write(kv_cache, layer, key, value, *_slot_coords(slot_mapping, kv_cache.shape[3]))


def _slot_coords(slot_mapping: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block id, offset in block) of each slot."""
    block_ids = torch.div(slot_mapping, block_size, rounding_mode="floor")
    return block_ids, slot_mapping - block_ids * block_size


def _write(
    kv_cache: torch.Tensor, layer: int, key: torch.Tensor, value: torch.Tensor,
    block_ids: torch.Tensor, offsets: torch.Tensor,
) -> None:
    kv_cache[block_ids, layer, 0, offsets] = key.to(kv_cache.dtype)
    kv_cache[block_ids, layer, 1, offsets] = value.to(kv_cache.dtype)


@dataclass(slots=True)
class _DecodeGroup:
    token_idx: torch.Tensor  # rows of the packed query
    block_ids: torch.Tensor  # [rows * num_blocks] flattened block tables
    num_blocks: int
    mask: torch.Tensor  # [rows, 1, 1, num_blocks * block_size], True where a key is in context


@dataclass(slots=True)
class _PrefillRow:
    start: int
    end: int
    seq_len: int
    seq_index: int
    mask: torch.Tensor | None  # None when nothing is cached before the chunk (plain causal)


@dataclass(slots=True)
class _NativeDecode:
    """All decode rows at once, for the C++ kernel (which reads the cache through the block tables)."""

    kernel: Any  # the compiled `cpu_native` module
    token_idx: torch.Tensor
    block_tables: torch.Tensor  # [rows, max_blocks] int32
    seq_lens: torch.Tensor  # [rows] int32


@dataclass(slots=True)
class _NativeBf16:
    """Every row of the step at once (prefill chunks and decode rows), for the C++ bf16 kernel."""

    kernel: Any
    block_tables: torch.Tensor  # [seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [seqs] int32
    query_start_loc: torch.Tensor  # [seqs + 1] int32


@dataclass(slots=True)
class _Plan:
    block_ids: torch.Tensor
    offsets: torch.Tensor
    native_bf16: _NativeBf16 | None = None
    prefill_rows: list[_PrefillRow] = field(default_factory=list)
    decode_groups: list[_DecodeGroup] = field(default_factory=list)
    native_decode: _NativeDecode | None = None
    # per (window, sequence index): (first block read, mask over the keys from that block on); made on first use
    windowed: dict[tuple[int, int], tuple[int, torch.Tensor]] = field(default_factory=dict)


def _plan(meta: AttentionMetadata, block_size: int, device: torch.device, native_kernel: Any | None,
          native_bf16: bool = False) -> _Plan:
    plan = _Plan(*_slot_coords(meta.slot_mapping, block_size))
    if native_bf16:
        plan.native_bf16 = _NativeBf16(native_kernel, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    starts, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    decode: list[tuple[int, int]] = []  # (seq_len, seq index)
    for i, seq_len in enumerate(seq_lens):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if q_len == 1 and seq_len > 1:
            decode.append((seq_len, i))
        elif q_len > 0:
            mask = None
            if q_len != seq_len and not native_bf16:  # (the bf16 kernel needs no mask)
                q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
                mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
            plan.prefill_rows.append(_PrefillRow(start, end, seq_len, i, mask))
    if native_kernel is not None and decode:
        seq_idx = [i for _, i in decode]
        plan.native_decode = _NativeDecode(
            kernel=native_kernel,
            token_idx=torch.tensor([starts[i] for i in seq_idx], device=device),
            block_tables=meta.block_tables[seq_idx].contiguous(),
            seq_lens=meta.seq_lens[seq_idx].contiguous(),
        )
        return plan
    decode.sort()
    while decode:
        longest = decode[-1][0]
        cut = len(decode)
        while cut > 0 and len(decode) - cut < _MAX_GROUP_ROWS and decode[cut - 1][0] * _MAX_GROUP_PAD_RATIO >= longest:
            cut -= 1
        group, decode = decode[cut:], decode[:cut]
        plan.decode_groups.append(_decode_group(meta, group, block_size, device))
    return plan


def _decode_group(
    meta: AttentionMetadata, rows: list[tuple[int, int]], block_size: int, device: torch.device
) -> _DecodeGroup:
    seq_idx = [i for _, i in rows]
    num_blocks = -(-max(n for n, _ in rows) // block_size)
    lens = torch.tensor([n for n, _ in rows], device=device)
    mask = torch.arange(num_blocks * block_size, device=device)[None, :] < lens[:, None]
    return _DecodeGroup(
        token_idx=torch.tensor([meta.query_start_loc_cpu[i] for i in seq_idx], device=device),
        block_ids=meta.block_tables[seq_idx, :num_blocks].reshape(-1).long(),
        num_blocks=num_blocks,
        mask=mask[:, None, None, :],
    )


def _gather(kv_cache: torch.Tensor, layer: int, block_ids: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `block_ids` (num_rows equal-length block lists, flattened) as
    `[num_rows, num_kv_heads, tokens, head_dim]` views over one contiguous copy each."""
    _, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    k = kv_cache[:, layer, 0].index_select(0, block_ids).view(num_rows, -1, num_kv_heads, head_dim)
    v = kv_cache[:, layer, 1].index_select(0, block_ids).view(num_rows, -1, num_kv_heads, head_dim)
    return k.transpose(1, 2), v.transpose(1, 2)


def _native_decode_kernel(query: torch.Tensor, kv_cache: torch.Tensor) -> Any | None:
    """The C++ decode kernel when it applies (an fp32 or bf16 cache on CPU, the query fp32 or the cache's
    dtype) and could be built; None otherwise."""
    if not USE_NATIVE_DECODE or query.device.type != "cpu" or kv_cache.dtype not in (torch.float32, torch.bfloat16):
        return None
    if query.dtype not in (torch.float32, kv_cache.dtype):
        return None
    return cpu_native.load()


def _native_bf16_applies(query: torch.Tensor, kv_cache: torch.Tensor, kernel: Any | None) -> bool:
    """Whether every row of the step goes to the C++ bf16 kernel (a bf16 query and cache, AVX512-BF16, a
    head_dim it is built for): then a row's result does not depend on how its sequence was split into
    steps."""
    return (kernel is not None and query.dtype == torch.bfloat16 and kv_cache.dtype == torch.bfloat16
            and query.shape[-1] in (64, 128, 256) and bool(kernel.has_avx512_bf16()))


def _grouped_query(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """`[rows, heads, q_len, d]` -> `[rows, kv_heads, heads_per_kv * q_len, d]`: each KV head's query heads
    become its query rows (head h reads KV head h // heads_per_kv)."""
    rows, heads, q_len, d = q.shape
    return q.reshape(rows, num_kv_heads, (heads // num_kv_heads) * q_len, d)


def _window_span(plan: _Plan, meta: AttentionMetadata, seq_index: int, q_len: int, window: int, block_size: int,
                 device: torch.device) -> tuple[int, torch.Tensor]:
    """(first block, mask `[q_len, keys from that block to the end]`) of a sequence's rows under a window."""
    span = plan.windowed.get((window, seq_index))
    if span is None:
        seq_len = meta.seq_lens_cpu[seq_index]
        first_block = max(0, seq_len - q_len - window + 1) // block_size
        k_pos = torch.arange(first_block * block_size, seq_len, device=device)[None, :]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
        span = plan.windowed[(window, seq_index)] = (first_block, (k_pos <= q_pos) & (k_pos > q_pos - window))
    return span


def forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    block_size, num_kv_heads = kv_cache.shape[3], kv_cache.shape[4]
    if meta.backend_plan is None:
        kernel = _native_decode_kernel(query, kv_cache)
        meta.backend_plan = _plan(meta, block_size, query.device, kernel,
                                  _native_bf16_applies(query, kv_cache, kernel))
    plan: _Plan = meta.backend_plan
    if plan.native_bf16 is not None and plan.prefill_rows:
        # prefill chunks (and any decode rows beside them) in the arithmetic of the bf16 decode kernel, over
        # the keys and values as stored
        nb = plan.native_bf16
        _write(kv_cache, layer, key, value, plan.block_ids, plan.offsets)
        return nb.kernel.paged_attention(query, kv_cache, layer, nb.block_tables, nb.seq_lens,
                                         nb.query_start_loc, scale, window)
    if plan.native_decode is not None and not plan.prefill_rows and key.dtype == kv_cache.dtype:
        # decode rows only, in order: the cache write and the attention in one call
        nd = plan.native_decode
        return nd.kernel.write_and_decode(query, key, value, kv_cache, layer, meta.slot_mapping, nd.block_tables,
                                          nd.seq_lens, scale, window)
    _write(kv_cache, layer, key, value, plan.block_ids, plan.offsets)
    out = torch.empty_like(query)
    # bf16 prefill attends in fp32 on CPU: torch's CPU flash attention is slower in bf16 (30 layers of a
    # 512-token prompt: 0.15 s against 0.10 s, conversions included) and fp32 is the more exact
    compute = torch.float32 if query.device.type == "cpu" and query.dtype == torch.bfloat16 else query.dtype
    for row in plan.prefill_rows:
        q = query[row.start : row.end].transpose(0, 1).unsqueeze(0).to(compute)  # [1, heads, q_len, head_dim]
        if window and row.seq_len > window:
            out[row.start : row.end] = _attend_window(
                q, kv_cache, layer, meta, plan, row.seq_index, row.end - row.start, window, scale, compute
            ).squeeze(0).transpose(0, 1)
            continue
        if row.mask is None:  # nothing cached before this chunk: attend over the keys in hand
            k = key[row.start : row.end].transpose(0, 1).unsqueeze(0).to(compute)
            v = value[row.start : row.end].transpose(0, 1).unsqueeze(0).to(compute)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            num_blocks = -(-row.seq_len // block_size)
            k, v = _gather(kv_cache, layer, meta.block_tables[row.seq_index, :num_blocks].long(), 1)
            k, v = k[:, :, : row.seq_len].to(compute), v[:, :, : row.seq_len].to(compute)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=row.mask, scale=scale, enable_gqa=True)
        out[row.start : row.end] = o.squeeze(0).transpose(0, 1)
    if plan.native_decode is not None:
        nd = plan.native_decode
        out[nd.token_idx] = nd.kernel.paged_decode(
            query[nd.token_idx], kv_cache, layer, nd.block_tables, nd.seq_lens, scale, window
        )
    for group in plan.decode_groups:
        rows = group.token_idx.shape[0]
        if window:  # the torch path's windowed decode rows: one at a time (the native kernel is the fast path)
            for token in group.token_idx.tolist():
                seq_index = meta.query_start_loc_cpu.index(token)
                q = query[token : token + 1].transpose(0, 1).unsqueeze(0)
                out[token] = _attend_window(q, kv_cache, layer, meta, plan, seq_index, 1, window, scale,
                                            query.dtype)[0, :, 0]
            continue
        k, v = _gather(kv_cache, layer, group.block_ids, rows)
        q = _grouped_query(query[group.token_idx].unsqueeze(2), num_kv_heads)
        o = F.scaled_dot_product_attention(q, k.to(query.dtype), v.to(query.dtype), attn_mask=group.mask, scale=scale)
        out[group.token_idx] = o.reshape(rows, -1, query.shape[-1])
    return out


def _attend_window(
    q: torch.Tensor, kv_cache: torch.Tensor, layer: int, meta: AttentionMetadata, plan: _Plan, seq_index: int,
    q_len: int, window: int, scale: float, compute: torch.dtype,
) -> torch.Tensor:
    """Attention of one sequence's `q_len` last rows (`q`: `[1, heads, q_len, head_dim]`) over the keys in
    their windows, read from the cache starting at the first block any of them needs."""
    block_size = kv_cache.shape[3]
    first_block, mask = _window_span(plan, meta, seq_index, q_len, window, block_size, q.device)
    seq_len = meta.seq_lens_cpu[seq_index]
    num_blocks = -(-seq_len // block_size)
    k, v = _gather(kv_cache, layer, meta.block_tables[seq_index, first_block:num_blocks].long(), 1)
    keys = seq_len - first_block * block_size
    k, v = k[:, :, :keys].to(compute), v[:, :, :keys].to(compute)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
