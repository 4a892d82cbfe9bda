"""The offline engine: requests in, token deltas out.

`LLMEngine` ties the parts together: the tokenizer (text in, text out), the scheduler and block manager
(what runs, where its KV lives), and the model runner (tensors). Request handling and deltas are
`EngineCore`'s (`core.py`), shared with the mocker; this module adds the model: loading it, running each
scheduled batch on it (`_execute`), and `compute_logits`. The engine is single-threaded; a worker drives it
from one loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass

import torch

from dynserve.config import DType, Settings
from dynserve.engine.core import EngineCore, EngineStats, GenerationResult, StepSamples
from dynserve.engine.kv_tiers import KVTiers, PageLayout, TierPolicy
from dynserve.engine.loader import ModelConfig, load_model_weights
from dynserve.engine.model_runner import ModelRunner, kv_block_size_bytes
from dynserve.engine.models.decoder import CausalLM
from dynserve.engine.scheduler import ScheduledBatch
from dynserve.engine.sequence import Sequence
from dynserve.engine.structured import MaskTimings
from dynserve.errors import CacheCapacityError
from dynserve.hashing import model_salt
from dynserve.model.resolve import resolve_model_path
from dynserve.model.tokenizer import Tokenizer
from dynserve.protocol import SamplingParams

__all__ = ["EngineStats", "GenerationResult", "LLMEngine", "LoadedModel", "load_model", "resolve_dtype", "torch_dtype"]

logger = logging.getLogger(__name__)

ProgressFn = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """Weights and tokenizer in memory, shareable by several engines (each has its own KV cache)."""

    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    device: torch.device


def load_model(settings: Settings, progress: ProgressFn | None = None) -> LoadedModel:
    say = progress or (lambda _msg: None)
    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    device = _resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    path = resolve_model_path(settings.model)
    say(f"loading tokenizer from {path.name}")
    tokenizer = Tokenizer.load(path)
    say(f"loading weights from {path.name}")
    config, state = load_model_weights(path, dtype)
    say("building model")
    model = CausalLM(config, dtype)
    model.load_hf_state_dict(state)
    del state
    return LoadedModel(config, model.to(device).eval(), tokenizer, device)



def torch_dtype(name: DType) -> torch.dtype:
    """The torch dtype a `Settings.dtype` names ('auto' is `resolve_dtype`'s)."""
    if name == "auto":
        raise ValueError("dtype 'auto' depends on the device: use resolve_dtype")
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def resolve_dtype(name: DType, device: torch.device) -> torch.dtype:
    """`Settings.dtype` on `device`: 'auto' is bfloat16 on a CUDA device that supports it (what GPU serving
    runs) and on a CPU whose bf16 kernels run (AVX512-BF16 and a compiler to build them), about 2-3x faster
    at decode than float32 within bf16's parity tolerance; float32 elsewhere. bfloat16 asked for on a CPU
    without those kernels is served (torch's bf16 linears), with a warning: there it is several times slower
    than float32."""
    if name != "auto":
        if name == "bfloat16" and device.type == "cpu" and not _cpu_bf16_kernels():
            logger.warning("dtype bfloat16 on a CPU without AVX512-BF16 (or without the native kernels): "
                           "torch's bf16 linears run several times slower than float32 here; dtype auto "
                           "picks float32")
        return torch_dtype(name)
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    if device.type == "cpu" and _cpu_bf16_kernels():
        return torch.bfloat16
    return torch.float32


def _cpu_bf16_kernels() -> bool:
    """Whether this CPU runs the native bf16 kernels (AVX512-BF16, and the library built)."""
    from dynserve.engine.kernels import cpu_native

    kernels = cpu_native.load()
    return kernels is not None and kernels.has_avx512_bf16()


class LLMEngine(EngineCore):
    """The engine over a real model; request handling and deltas come from `EngineCore`."""

    def __init__(
        self,
        settings: Settings | None = None,
        progress: ProgressFn | None = None,
        loaded: LoadedModel | None = None,
    ) -> None:
        """Load the model named by `settings` (or reuse `loaded`, which must match its dtype and device)
        and allocate the KV cache."""
        settings = settings or Settings()
        say = progress or (lambda _msg: None)
        loaded = loaded or load_model(settings, progress)
        self.device, self.dtype = loaded.device, loaded.model.dtype
        self.model_config = config = loaded.config
        self.model = loaded.model
        max_model_len = min(settings.max_model_len or config.context_length, config.context_length)
        if config.rope_depends_on_length and settings.enable_prefix_caching:
            logger.warning("%s: its rope (%s) depends on the sequence's length, so a cached KV block is not valid "
                           "for another length: prefix caching is off", config.model_id,
                           (config.rope_scaling or {}).get("rope_type"))
            settings = settings.model_copy(update={"enable_prefix_caching": False})
        num_blocks = settings.kv_blocks or max(
            1, int(settings.kv_cache_gib * 2**30) // kv_block_size_bytes(config, settings.block_size, self.dtype)
        )
        self.runner = ModelRunner(self.model, num_blocks, settings.block_size, self.device,
                                  settings.attention_backend)
        super().__init__(settings, loaded.tokenizer, model_id=config.model_id, vocab_size=config.vocab_size,
                         eos_token_id=config.eos_token_id, max_model_len=max_model_len, num_blocks=num_blocks,
                         kv_tiers=_build_tiers(settings, config.model_id, self.runner.kv_cache))
        if config.all_layers_windowed:  # Mistral-style: blocks that slid out of the window are given back
            self.scheduler.use_sliding_window(min(config.layer_windows))
        if settings.cuda_graphs and self.device.type == "cuda" and self.runner.backend_name == "triton":
            say(f"capturing CUDA graphs of decode batches up to {settings.max_num_seqs}")
            self.runner.capture_graphs(max_model_len, settings.max_num_seqs)
        say(f"ready: {self.model_id}, {num_blocks} KV blocks, {self.device} {str(self.dtype).removeprefix('torch.')}")

    @property
    def mask_timings(self) -> MaskTimings:
        return self.runner.grammar_masks.timings

    def _execute(self, batch: ScheduledBatch) -> StepSamples:
        sampled, result = self.runner.execute(batch)
        if result is None:
            return StepSamples([], [], [])
        return StepSamples(sampled, result.token_ids, result.logprobs)

    def compute_logits(self, prompts: SequenceABC[list[int]]) -> torch.Tensor:
        """Next-token logits ([len(prompts), vocab], fp32) after each prompt, all prefilled in one batch.

        Uses cached prefixes but caches nothing new; the blocks are returned before this returns.
        """
        seqs = [Sequence(f"logits-{i}", list(p), SamplingParams(max_tokens=1)) for i, p in enumerate(prompts)]
        for seq in seqs:
            self._check_prompt(seq.prompt_token_ids)
        try:
            for seq in seqs:
                if not self.block_manager.allocate(seq):
                    raise CacheCapacityError(
                        "prompts do not fit in the free KV blocks",
                        num_blocks_needed=self.block_manager.blocks_needed(seq.num_tokens),
                        num_blocks_total=self.block_manager.num_blocks,
                    )
            batch = ScheduledBatch(seqs, [s.num_tokens - s.num_computed_tokens for s in seqs])
            return self.runner.compute_logits(batch)
        finally:
            for seq in seqs:
                if seq.block_table:
                    self.block_manager.free(seq)


def _build_tiers(settings: Settings, model_id: str, kv_cache: torch.Tensor) -> KVTiers | None:
    """The host and disk tiers the settings ask for below `kv_cache` (None when both sizes are 0 or prefix
    caching is off)."""
    policy = TierPolicy(settings.kv_host_bytes, settings.kv_disk_bytes, settings.kv_disk_dir,
                        settings.kv_disk_write)
    if not policy.enabled or not settings.enable_prefix_caching:
        return None
    layout = PageLayout(kv_cache.dtype, tuple(kv_cache.shape[1:]), settings.block_size, model_salt(model_id))
    tiers = KVTiers(policy, layout, kv_cache)
    logger.info("KV tiers: %d host blocks, %d disk blocks in %s", tiers.num_host_slots,
                tiers.num_disk_blocks_max, tiers.disk_dir)
    return tiers


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)

