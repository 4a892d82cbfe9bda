"""Attention backends over the paged, block-major KV cache.

The KV cache of a worker is one tensor `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`
(ARCHITECTURE.md). A step's tokens are packed without padding: `query` is `[num_tokens, num_heads,
head_dim]`, sequence i owns rows `query_start_loc[i]:query_start_loc[i+1]`, and those rows sit at positions
`seq_lens[i] - query_len_i ... seq_lens[i] - 1` of the sequence. Every backend implements

    forward(query, key, value, kv_cache, layer, meta, scale, window=0) -> output [num_tokens, num_heads, head_dim]

which first writes the step's `key`/`value` into the cache at `meta.slot_mapping` and then attends each
query row causally over its sequence's whole context (cached prefix included) through `meta.block_tables`;
with `window` > 0 (a sliding-window layer), over its last `window` positions only.

- `torch_attention`: the CPU serving path and the reference the Triton kernels are tested against.
- `triton_attention`: Triton kernels for GPUs (run on CPU only under TRITON_INTERPRET=1, for tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["AttentionMetadata", "rope_angles"]


@dataclass(slots=True)
class AttentionMetadata:
    """Where a packed step's tokens come from and go to.

    `slot_mapping[t]` is `block_id * block_size + offset` of token t's K/V slot. `block_tables[i]` lists
    sequence i's blocks in order, padded with 0 past the blocks it uses. Host-side lists mirror the small
    tensors so the torch path never synchronizes to read them.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    # whatever a backend derives once per step and reuses in every layer (set by the backend)
    backend_plan: Any = None
    # per sequence, the length its rope frequencies depend on when they do (LongRoPE, dynamic NTK: the longer
    # of its prompt and `seq_lens`); None: `seq_lens`
    rope_lens_cpu: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata for sequences with these query lengths, context lengths and block lists."""
        query_start_loc = [0]
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
            query_start_loc.append(query_start_loc[-1] + q_len)
            for pos in range(s_len - q_len, s_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        max_blocks = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).view(len(padded), max_blocks),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=list(seq_lens),
            max_query_len=max(query_lens, default=0),
        )


def rope_angles(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos and sin of each position's rotary angles (`[rows, head_dim / 2]`), times `scale` (the
    attention factor of YaRN and LongRoPE), the step ops' shared rope tables. `inv_freq` is one set
    (`[head_dim / 2]`) or one per row (`[rows, head_dim / 2]`, for scalings that depend on a sequence's length)."""
    freqs = positions.float()[:, None] * (inv_freq if inv_freq.dim() == 2 else inv_freq[None, :])
    if scale == 1.0:
        return freqs.cos(), freqs.sin()
    return freqs.cos() * scale, freqs.sin() * scale
