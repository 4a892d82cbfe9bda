"""Tensors and kernels: the model, the KV cache tensor, the attention backend, and one step's inputs.

The runner turns a scheduled batch into packed inputs (token ids, positions, slot mapping, block tables),
runs the model, and samples one token for each sequence whose every token is now computed; the masks of
the sequences with a grammar are computed while the forward runs (`structured.MaskFiller`). It owns the KV
cache tensor `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`; the block manager owns which
block ids are in use.

On the CPU, inputs are built from Python lists and sampling runs on CPU logits (`sampler.sample`). On a GPU
(`device.type == "cuda"`), a step's inputs go up in one copy with the slot mapping computed on the device
(`step_inputs`), sampling runs there (`sampler.sample_on_device`, one read back), and decode steps replay
CUDA graphs (`cuda_graphs`, captured by `capture_graphs` for the Triton backend).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from types import ModuleType

import torch

from dynserve.engine import memory, step_inputs
from dynserve.engine.cuda_graphs import DecodeGraphs
from dynserve.engine.kernels import AttentionMetadata
from dynserve.engine.loader import ModelConfig
from dynserve.engine.models.decoder import CausalLM
from dynserve.engine.sampler import SampleResult, sample, sample_on_device
from dynserve.engine.scheduler import ScheduledBatch
from dynserve.engine.sequence import Sequence
from dynserve.engine.structured import MaskFiller

__all__ = ["ModelRunner", "kv_block_size_bytes", "masks_overlap_forward", "select_attention_backend"]

logger = logging.getLogger(__name__)


def kv_block_size_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * elem


def masks_overlap_forward(device: torch.device) -> bool:
    """Whether grammar masks are computed while the forward runs: on an accelerator, or where torch's
    threads leave a CPU core free (else inline: see `structured.MaskFiller`)."""
    return device.type != "cpu" or torch.get_num_threads() < len(os.sched_getaffinity(0))


def select_attention_backend(name: str, device: torch.device) -> ModuleType:
    """'torch', 'triton', or 'auto' (Triton on CUDA when it imports, torch otherwise)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and importlib.util.find_spec("triton") else "torch"
    return importlib.import_module(f"dynserve.engine.kernels.{name}_attention")


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        attention_backend: str = "auto",
    ) -> None:
        cfg = model.config
        self.model = model
        self.device = device
        self.block_size = block_size
        self.attention = select_attention_backend(attention_backend, device)
        self.kv_cache = memory.empty(
            (num_blocks, cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim), model.dtype, device,
        ).zero_()
        self.graphs: DecodeGraphs | None = None
        self.grammar_masks = MaskFiller(overlap=masks_overlap_forward(device))
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB), attention backend %s",
            num_blocks, block_size, self.kv_cache.numel() * self.kv_cache.element_size() / 2**20,
            self.backend_name,
        )

    @property
    def backend_name(self) -> str:
        return self.attention.__name__.rsplit(".", 1)[-1].removesuffix("_attention")

    def capture_graphs(self, max_model_len: int, max_num_seqs: int) -> None:
        """Capture decode graphs for batches up to `max_num_seqs` (CUDA and the Triton backend only)."""
        if self.device.type != "cuda" or self.backend_name != "triton":
            raise ValueError(f"CUDA graphs need the Triton backend on a CUDA device, not {self.backend_name} "
                             f"on {self.device}")
        graphs = DecodeGraphs(self.model, self.kv_cache, self.attention, self.block_size, max_model_len,
                              step_inputs.decode_graph_batch_sizes(max_num_seqs))
        graphs.capture()
        self.graphs = graphs

    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], SampleResult | None]:
        """Run one step. Returns the sequences that sampled a token and their samples (in that order)."""
        pending = self.grammar_masks.start(batch.seqs, batch.num_new_tokens)
        if self.graphs is not None and self.graphs.fits(batch):
            logits, sampling = self.graphs.run(batch.seqs), batch.seqs
        else:
            logits, sampling = self._forward(batch)
        if not sampling:
            return [], None
        masks = None
        if pending is not None:
            assert pending.num_rows == len(sampling), "mask rows must follow the sampling rows"
            masks = pending.result()
        with torch.inference_mode():
            if self.device.type == "cpu":
                return sampling, sample(logits.cpu(), sampling, masks)
            return sampling, sample_on_device(logits, sampling, masks)

    def compute_logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """fp32 logits after the last token of each sequence (each must be scheduled to its end)."""
        logits, sampling = self._forward(batch)
        if len(sampling) != len(batch.seqs):
            raise ValueError("every sequence must be scheduled up to its last token")
        return logits.cpu()

    def _forward(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        if self.device.type != "cpu":
            return self._forward_uploaded(batch)
        return self._forward_from_lists(batch)

    def _forward_uploaded(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        """The accelerator's step: inputs in one upload, slots computed on the device."""
        inputs = step_inputs.upload_step(batch, self.block_size, self.device)
        with torch.inference_mode():
            logits = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta, self.attention,
                                inputs.logits_indices)
        return logits, inputs.sampling

    def _forward_from_lists(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        input_ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sampling: list[Sequence] = []
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start : start + num_new])
            positions.extend(range(start, start + num_new))
            seq_lens.append(start + num_new)
            if start + num_new == seq.num_tokens:
                logits_indices.append(len(input_ids) - 1)
                sampling.append(seq)
        meta = AttentionMetadata.build(
            batch.num_new_tokens, seq_lens, [s.block_table for s in batch.seqs], self.block_size, self.device
        )
        if self.model.config.rope_depends_on_length:
            meta.rope_lens_cpu = [max(s.num_prompt_tokens, n) for s, n in zip(batch.seqs, seq_lens, strict=True)]
        with torch.inference_mode():
            logits = self.model(
                torch.tensor(input_ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device),
                self.kv_cache,
                meta,
                self.attention,
                torch.tensor(logits_indices, dtype=torch.long, device=self.device),
            )
        return logits, sampling
