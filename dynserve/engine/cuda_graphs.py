"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step (every sequence computes one token and samples) launches a few hundred small kernels; on a
GPU their launch cost, not their work, sets the step time of a small batch. `DecodeGraphs` captures the
model's whole decode forward once per bucket (`step_inputs.decode_graph_batch_sizes`) over static buffers,
and a step then costs one host-to-device copy of its inputs, one replay and the read of the sampled ids.

Static inputs: one int32 array `[max_batch, 3 + width]`, a row per sequence: token id, position, context
length, then its block table (`width` blocks: the longest context the engine admits). A step writes its
rows into the pinned host twin and copies the rows of its bucket in one copy; rows past the batch are
padding (context length 0), whose slot is -1 (the KV write skips them) and whose attention reads nothing.
The slot mapping is computed inside the graph. The graph's logits `[bucket, vocab]` are read before the
next replay: the engine samples and synchronizes every step, which also makes reusing the pinned host array
safe.

Without CUDA (tests on the CPU, under the Triton interpreter) nothing is captured and `run` executes the
same forward over the same buffers eagerly, so the buffer and padding logic is tested everywhere; the
capture itself (`capture`) is the only part that needs a GPU.
"""

from __future__ import annotations

from types import ModuleType

import torch

from dynserve.engine.kernels import AttentionMetadata
from dynserve.engine.models.decoder import CausalLM
from dynserve.engine.scheduler import ScheduledBatch
from dynserve.engine.sequence import Sequence
from dynserve.engine.step_inputs import slot_mapping

__all__ = ["DecodeGraphs"]

_ID, _POS, _LEN, _TABLE = 0, 1, 2, 3  # columns of a row of the static input array


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: torch.Tensor,
        attention: ModuleType,
        block_size: int,
        max_model_len: int,
        batch_sizes: list[int],
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.attention = attention
        self.block_size = block_size
        self.batch_sizes = sorted(batch_sizes)
        self.width = -(-max_model_len // block_size)
        device = kv_cache.device
        max_batch = self.batch_sizes[-1]
        self._host = torch.zeros((max_batch, _TABLE + self.width), dtype=torch.int32,
                                 pin_memory=device.type == "cuda")
        self._host_np = self._host.numpy()
        self._dev = torch.zeros((max_batch, _TABLE + self.width), dtype=torch.int32, device=device)
        self._rows = torch.arange(max_batch, dtype=torch.long, device=device)
        self._query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def fits(self, batch: ScheduledBatch) -> bool:
        """True when every sequence computes its one last token and the batch fits the largest bucket."""
        if not batch.seqs or len(batch.seqs) > self.batch_sizes[-1]:
            return False
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if num_new != 1 or seq.num_computed_tokens + 1 != seq.num_tokens or len(seq.block_table) > self.width:
                return False
        return True

    def bucket(self, num_seqs: int) -> int:
        return next(size for size in self.batch_sizes if size >= num_seqs)

    def capture(self) -> None:
        """Capture one graph per bucket, largest first, all in one memory pool (CUDA only)."""
        pool = torch.cuda.graph_pool_handle()
        warmup = torch.cuda.Stream()
        self._host.zero_()
        self._dev.zero_()  # every row padding: capturing writes no KV and reads none
        with torch.inference_mode():
            for size in reversed(self.batch_sizes):
                warmup.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(warmup):  # kernels compiled and workspaces made outside the capture
                    self._forward(size)
                torch.cuda.current_stream().wait_stream(warmup)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(size)
                self._graphs[size] = (graph, logits)
        torch.cuda.synchronize()

    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """fp32 logits `[len(seqs), vocab]` of one decode step over `seqs` (a batch `fits` accepted)."""
        num_seqs = len(seqs)
        size = self.bucket(num_seqs)
        host = self._host_np
        for row, seq in enumerate(seqs):
            position = seq.num_tokens - 1
            host[row, _ID] = seq.token_ids[position]
            host[row, _POS] = position
            host[row, _LEN] = seq.num_tokens
            host[row, _TABLE : _TABLE + len(seq.block_table)] = seq.block_table
        host[num_seqs:size, :_TABLE] = 0  # padding rows: context length 0
        self._dev[:size].copy_(self._host[:size], non_blocking=True)
        if size in self._graphs:
            graph, logits = self._graphs[size]
            graph.replay()
        else:
            with torch.inference_mode():
                logits = self._forward(size)
        return logits[:num_seqs]

    def _forward(self, size: int) -> torch.Tensor:
        """The decode forward over the first `size` rows of the static inputs (what a graph captures)."""
        rows = self._dev[:size]
        positions = rows[:, _POS]
        seq_lens = rows[:, _LEN].contiguous()  # the kernels index it as a flat array
        block_tables = rows[:, _TABLE:]
        index = self._rows[:size]
        meta = AttentionMetadata(
            slot_mapping=slot_mapping(block_tables, index, positions, self.block_size, valid=seq_lens > 0),
            query_start_loc=self._query_start_loc[: size + 1],
            seq_lens=seq_lens,
            block_tables=block_tables,
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[1] * size,  # only its length is read on this path (the Triton backend's grid)
            max_query_len=1,
        )
        return self.model(rows[:, _ID].long(), positions.long(), self.kv_cache, meta, self.attention, index)
