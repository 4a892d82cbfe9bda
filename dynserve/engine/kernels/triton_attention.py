"""Paged attention as Triton kernels: the GPU serving path, same contract as `torch_attention`.

Three kernels over the block-major cache `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`:

- `_write_kv_kernel` scatters the step's key/value rows of one layer to `meta.slot_mapping`, cast to the cache
  dtype.
- `_decode_kernel` (every sequence has one query row): one program per (sequence, KV head) attends the GQA
  group of query heads, padded to 16 rows for `tl.dot`, over the sequence's blocks with an online softmax.
- `_prefill_kernel` (any batch): one program per (sequence, KV head, query tile). A tile's rows are
  (token, query head of the group) pairs, so each K/V tile is loaded once for the whole group; rows attend
  causally over the cached prefix and the chunk itself.

Invariants kept: after `forward`, the step's keys and values are in the cache at `meta.slot_mapping`, and
each query row has attended exactly to positions `0 .. its own position` of its sequence (with a sliding
`window`, the last `window` of them; keys before a tile's window are neither loaded nor their blocks read). Keys are always read
back from the cache (which `forward` writes first, on the same stream), so a row sees its chunk's keys at
cache precision. Key tiles gather their block ids position by position, so tiles may span several blocks and
any `block_size` works.

Dots run in the query dtype with fp32 accumulation; fp32 inputs use IEEE fp32 dots (no TF32). The Triton
interpreter computes bf16 dots wrongly, so there bf16 operands are upcast to fp32 first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynserve.engine.kernels import AttentionMetadata

try:
    import triton
    import triton.language as tl
except ImportError:  # the Triton backend is optional: is_available() says False and nothing launches
    triton = None
    tl = None

__all__ = ["TUNING", "Tuning", "forward", "is_available", "write_kv"]

_LOG2E = 1.4426950408889634
_MIN_DOT_DIM = 16  # tl.dot needs every dimension >= 16
_INTERPRETER_MAX_BLOCK_M = 64  # prefill tiles under the interpreter (smaller tiles run faster there)


@dataclass(slots=True)
class Tuning:
    """Launch parameters of the attention kernels on a GPU (the interpreter ignores warps and stages).

    `block_n`: keys per tile (a tile may span several cache blocks); `prefill_max_block_m`: query rows
    (token x group head) per prefill tile at most. The defaults are the fastest of `benchmarks.gpu`'s sweep
    on an H200 (docs/benchmarks.md, "gpu").
    """

    decode_block_n: int = 64
    decode_num_warps: int = 4
    decode_num_stages: int = 3
    prefill_max_block_m: int = 128
    prefill_block_n: int = 128
    prefill_num_warps: int = 8
    prefill_num_stages: int = 2


TUNING = Tuning()


_NO_WINDOW = 1 << 30  # the window a kernel is given for "none": longer than any context


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


def _interpreting() -> bool:
    return triton is not None and bool(triton.knobs.runtime.interpret)


def is_available() -> bool:
    """True when Triton imports and its kernels can run: on a CUDA device, or under TRITON_INTERPRET=1."""
    return triton is not None and (torch.cuda.is_available() or _interpreting())


# --------------------------------------------------------------------------------------------- kernels


@_jit
def _write_kv_kernel(
    key_ptr, value_ptr, cache_ptr, slot_mapping_ptr, layer,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_c_block, stride_c_layer, stride_c_kv, stride_c_slot, stride_c_head,
    block_size, num_kv_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    block_id = slot // block_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # a negative slot is a padding row (a CUDA graph's batch filled up to its size): nothing is stored
    mask = (offs_h < num_kv_heads)[:, None] & (offs_d < head_dim)[None, :] & (slot >= 0)
    k = tl.load(key_ptr + tok * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + tok * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :], mask=mask)
    dst = (
        cache_ptr
        + block_id * stride_c_block
        + layer * stride_c_layer
        + (slot - block_id * block_size) * stride_c_slot
        + offs_h[:, None] * stride_c_head
        + offs_d[None, :]
    )
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


@_jit
def _kv_tile_offsets(
    block_table_ptr, offs_n, num_keys, block_size, layer, kv_head,
    stride_c_block, stride_c_layer, stride_c_slot, stride_c_head, offs_d,
):  # fmt: skip
    """Cache offsets `[BLOCK_N, BLOCK_D]` of the K rows at positions `offs_n` (V is `stride_c_kv` further)."""
    in_range = offs_n < num_keys
    block_ids = tl.load(block_table_ptr + offs_n // block_size, mask=in_range, other=0).to(tl.int64)
    row = (
        block_ids * stride_c_block
        + layer * stride_c_layer
        + (offs_n % block_size) * stride_c_slot
        + kv_head * stride_c_head
    )
    return row[:, None] + offs_d[None, :]


@_jit
def _online_softmax_step(q, k, v, mask, acc, m_i, l_i, qk_scale_log2, DOT_FP32: tl.constexpr):
    """Fold one key tile into the running (acc, max, sum) of each row; masked keys weigh exactly 0."""
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale_log2
    else:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * qk_scale_log2
    s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet stay all-zero, not NaN
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_FP32:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@_jit
def _decode_kernel(
    out_ptr, q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    qk_scale_log2, layer, window,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head, stride_bt_seq,
    stride_c_block, stride_c_layer, stride_c_kv, stride_c_slot, stride_c_head,
    block_size, head_dim,
    HEADS_PER_KV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    num_keys = tl.where(q_len > 0, seq_len, 0)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * HEADS_PER_KV + offs_h
    row_mask = (offs_h < HEADS_PER_KV) & (q_len > 0)
    q_mask = row_mask[:, None] & (offs_d < head_dim)[None, :]
    q_rows = q_start * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_rows, mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table_ptr = block_tables_ptr + seq * stride_bt_seq
    first_key = tl.maximum(num_keys - window, 0)  # the sliding window's first key (0 without a window)
    for start in range((first_key // BLOCK_N) * BLOCK_N, num_keys, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        in_window = (offs_n < num_keys) & (offs_n >= first_key)
        kv_mask = in_window[:, None] & (offs_d < head_dim)[None, :]
        offs = _kv_tile_offsets(
            table_ptr, offs_n, num_keys, block_size, layer, kv_head,
            stride_c_block, stride_c_layer, stride_c_slot, stride_c_head, offs_d,
        )  # fmt: skip
        k = tl.load(cache_ptr + offs, mask=kv_mask, other=0.0)
        v = tl.load(cache_ptr + offs + stride_c_kv, mask=kv_mask, other=0.0)
        mask = row_mask[:, None] & in_window[None, :]
        acc, m_i, l_i = _online_softmax_step(q, k, v, mask, acc, m_i, l_i, qk_scale_log2, DOT_FP32)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_rows = q_start * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :]
    tl.store(out_ptr + o_rows, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@_jit
def _prefill_kernel(
    out_ptr, q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    qk_scale_log2, layer, window,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head, stride_bt_seq,
    stride_c_block, stride_c_layer, stride_c_kv, stride_c_slot, stride_c_head,
    block_size, head_dim,
    HEADS_PER_KV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
):  # fmt: skip
    BLOCK_Q: tl.constexpr = BLOCK_M // HEADS_PER_KV  # query tokens per tile
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len
    tile_start = q_tile * BLOCK_Q
    # keys this tile needs: up to its last row's position; none when the sequence has no rows here
    num_keys = tl.where(tile_start < q_len, context_len + tl.minimum(q_len, tile_start + BLOCK_Q), 0)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok = tile_start + offs_m // HEADS_PER_KV
    heads = kv_head * HEADS_PER_KV + offs_m % HEADS_PER_KV
    row_mask = (offs_m < BLOCK_Q * HEADS_PER_KV) & (tok < q_len)
    q_pos = context_len + tok
    q_mask = row_mask[:, None] & (offs_d < head_dim)[None, :]
    q_rows = (q_start + tok)[:, None] * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_rows, mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_ptr = block_tables_ptr + seq * stride_bt_seq
    # the sliding window of the tile's first row begins here (0 without a window); no row needs keys before it
    first_key = tl.maximum(context_len + tile_start - window + 1, 0)
    for start in range((first_key // BLOCK_N) * BLOCK_N, num_keys, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        kv_mask = ((offs_n < num_keys) & (offs_n >= first_key))[:, None] & (offs_d < head_dim)[None, :]
        offs = _kv_tile_offsets(
            table_ptr, offs_n, num_keys, block_size, layer, kv_head,
            stride_c_block, stride_c_layer, stride_c_slot, stride_c_head, offs_d,
        )  # fmt: skip
        k = tl.load(cache_ptr + offs, mask=kv_mask, other=0.0)
        v = tl.load(cache_ptr + offs + stride_c_kv, mask=kv_mask, other=0.0)
        causal = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] > q_pos[:, None] - window)
        mask = row_mask[:, None] & causal
        acc, m_i, l_i = _online_softmax_step(q, k, v, mask, acc, m_i, l_i, qk_scale_log2, DOT_FP32)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_rows = (q_start + tok)[:, None] * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :]
    tl.store(out_ptr + o_rows, out.to(out_ptr.dtype.element_ty), mask=q_mask)


# --------------------------------------------------------------------------------------------- launchers


def _require_triton() -> None:
    if triton is None:
        raise RuntimeError("the Triton attention backend needs `triton` (pip install 'dynserve[triton]')")


def _cache_strides(kv_cache: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(block, layer, K/V, slot, head) strides of the cache; its head_dim axis must be contiguous."""
    assert kv_cache.dim() == 6 and kv_cache.stride(5) == 1, "cache is [blocks, layers, 2, block, heads, dim]"
    return kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(4)


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """`x` ([tokens, heads, head_dim]) with a unit-stride last axis, copied only when it is not."""
    return x if x.stride(-1) == 1 else x.contiguous()


def write_kv(
    kv_cache: torch.Tensor, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store `key`/`value` ([num_tokens, num_kv_heads, head_dim]) at their slots of `layer`."""
    _require_triton()
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value = _rows_contiguous(key), _rows_contiguous(value)
    _write_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping, layer,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *_cache_strides(kv_cache),
        kv_cache.shape[3], num_kv_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or (dtype == torch.bfloat16 and _interpreting())


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
    """Write the step's K/V, then attend every query row causally over its sequence, or its last `window`
    tokens when window > 0 (see module docstring)."""
    _require_triton()
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[4]
    if num_heads % num_kv_heads != 0 or kv_cache.shape[5] != head_dim:
        raise ValueError(
            f"query [.., {num_heads}, {head_dim}] does not fit a cache of {num_kv_heads} KV heads x "
            f"{kv_cache.shape[5]} dims"
        )
    write_kv(kv_cache, layer, key, value, meta.slot_mapping)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0 or meta.num_seqs == 0:
        return out
    query = _rows_contiguous(query)
    heads_per_kv = num_heads // num_kv_heads
    common = (
        out, query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        scale * _LOG2E, layer, window if window > 0 else _NO_WINDOW,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
        *_cache_strides(kv_cache),
        kv_cache.shape[3], head_dim,
    )  # fmt: skip
    interpreting = _interpreting()
    constants = dict(
        HEADS_PER_KV=heads_per_kv,
        BLOCK_D=max(_MIN_DOT_DIM, triton.next_power_of_2(head_dim)),
        DOT_FP32=_dot_in_fp32(query.dtype),
    )
    if meta.max_query_len == 1:
        block_h = max(_MIN_DOT_DIM, triton.next_power_of_2(heads_per_kv))
        stages = min(TUNING.decode_num_stages, 2) if constants["DOT_FP32"] else TUNING.decode_num_stages
        launch = {} if interpreting else {"num_warps": TUNING.decode_num_warps, "num_stages": stages}
        _decode_kernel[(meta.num_seqs, num_kv_heads)](
            *common, BLOCK_H=block_h, BLOCK_N=TUNING.decode_block_n, **constants, **launch
        )
    else:
        max_block_m = _INTERPRETER_MAX_BLOCK_M if interpreting else TUNING.prefill_max_block_m
        stages = TUNING.prefill_num_stages
        if constants["DOT_FP32"]:  # fp32 tiles take twice the shared memory: smaller tiles, fewer stages
            max_block_m, stages = min(max_block_m, 64), min(stages, 2)
        block_m = _prefill_block_m(meta.max_query_len, heads_per_kv, max_block_m)
        num_q_tiles = triton.cdiv(meta.max_query_len, block_m // heads_per_kv)
        launch = {} if interpreting else {"num_warps": TUNING.prefill_num_warps, "num_stages": stages}
        _prefill_kernel[(meta.num_seqs, num_kv_heads, num_q_tiles)](
            *common, BLOCK_M=block_m, BLOCK_N=TUNING.prefill_block_n, **constants, **launch
        )
    return out


def _prefill_block_m(max_query_len: int, heads_per_kv: int, max_block_m: int) -> int:
    """Rows per prefill tile: enough for the longest chunk's group rows, within [16, max_block_m] and >= one
    group."""
    rows = triton.next_power_of_2(max_query_len * heads_per_kv)
    return max(_MIN_DOT_DIM, triton.next_power_of_2(heads_per_kv), min(rows, max_block_m))
