"""A step's packed inputs for an accelerator: one upload, the slot mapping computed on the device.

On the CPU the model runner builds its tensors from Python lists (`AttentionMetadata.build`). On a GPU
every small tensor would be its own host-to-device copy, so here the host packs one int32 array per step
(token ids, positions, each token's sequence, context lengths, query starts, the rows that sample, block
tables padded to the batch's widest, rounded up to 16) and moves it with one copy, from pinned memory on CUDA. The slot of
each token (`block_tables[seq, pos // block_size] * block_size + pos % block_size`) is then computed on the
device, so the host never builds a per-token slot list.

`decode_graph_batch_sizes` is the bucket list CUDA graphs are captured for (`cuda_graphs.DecodeGraphs`).
Everything here is plain torch and runs on the CPU too, where the tests compare it with the CPU path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dynserve.engine.kernels import AttentionMetadata
from dynserve.engine.scheduler import ScheduledBatch
from dynserve.engine.sequence import Sequence

__all__ = ["StepInputs", "decode_graph_batch_sizes", "slot_mapping", "upload_step"]

_ALIGN = 16  # int32 elements: 64 bytes


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampling] int64: rows whose logits are computed
    sampling: list[Sequence]  # the sequences those rows belong to, in order


def slot_mapping(
    block_tables: torch.Tensor, seq_index: torch.Tensor, positions: torch.Tensor, block_size: int,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each token's KV slot from its sequence's block table and its position (int64), -1 where `valid` is
    False (padding rows, which the kernels skip)."""
    pos = positions.long()
    blocks = block_tables[seq_index.long(), torch.div(pos, block_size, rounding_mode="floor")].long()
    slots = blocks * block_size + pos % block_size
    return slots if valid is None else torch.where(valid, slots, torch.full_like(slots, -1))


def upload_step(batch: ScheduledBatch, block_size: int, device: torch.device) -> StepInputs:
    """The step's inputs on `device` from one host array (pinned on CUDA) and one copy."""
    num_seqs = len(batch.seqs)
    num_tokens = batch.num_tokens
    # the block tables' width a multiple of 16 and every segment 64-byte aligned: Triton specializes its
    # kernels on pointer alignment and stride divisibility, so varying ones would compile a new variant
    # mid-serving (about a second each)
    width = _round_up(max((len(seq.block_table) for seq in batch.seqs), default=0), _ALIGN)
    sampling: list[Sequence] = []
    logits_rows: list[int] = []
    seq_lens: list[int] = []
    query_start_loc = [0]
    # segments: ids, positions, seq index (num_tokens each), seq_lens, query_start_loc, logits rows, tables
    sizes = [num_tokens, num_tokens, num_tokens, num_seqs, num_seqs + 1, num_seqs, num_seqs * width]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + _round_up(size, _ALIGN))
    host = np.zeros(starts[-1], dtype=np.int32)
    ids, pos, seq_idx, lens_seg, qsl_seg, rows_seg, tables_seg = (
        host[start : start + size] for start, size in zip(starts, sizes, strict=False)
    )
    tables = tables_seg.reshape(num_seqs, width)
    offset = 0
    for i, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
        start = seq.num_computed_tokens
        end = offset + num_new
        ids[offset:end] = seq.token_ids[start : start + num_new]
        pos[offset:end] = np.arange(start, start + num_new, dtype=np.int32)
        seq_idx[offset:end] = i
        tables[i, : len(seq.block_table)] = seq.block_table
        offset = end
        seq_lens.append(start + num_new)
        query_start_loc.append(end)
        if start + num_new == seq.num_tokens:
            logits_rows.append(end - 1)
            sampling.append(seq)
    lens_seg[:] = seq_lens
    qsl_seg[:] = query_start_loc
    num_logits = len(logits_rows)
    rows_seg[:num_logits] = logits_rows
    staged = torch.from_numpy(host)
    if device.type == "cuda":
        staged = staged.pin_memory()
    dev = staged.to(device, non_blocking=True)
    ids_t, pos_t, seq_idx_t, lens_t, qsl_t, rows_t, tables_t = (
        dev[start : start + size] for start, size in zip(starts, sizes, strict=False)
    )
    block_tables = tables_t.view(num_seqs, width)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping(block_tables, seq_idx_t, pos_t, block_size),
        query_start_loc=qsl_t,
        seq_lens=lens_t,
        block_tables=block_tables,
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
        max_query_len=max(batch.num_new_tokens, default=0),
    )
    logits_indices = rows_t[:num_logits].long()
    return StepInputs(ids_t.long(), pos_t.long(), meta, logits_indices, sampling)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def decode_graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes decode graphs are captured for: 1, 2, 4, then every 8 up to 64, every 32 beyond, and
    `max_num_seqs` itself (a batch runs in the smallest that holds it)."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += list(range(8, min(max_num_seqs, 64) + 1, 8)) + list(range(96, max_num_seqs + 1, 32))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sizes
