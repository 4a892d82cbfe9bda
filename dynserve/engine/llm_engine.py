"""The offline engine: requests in, token deltas out.

`LLMEngine` ties the parts together: the tokenizer (text in, text out), the scheduler and block manager
(what runs, where its KV lives), and the model runner (tensors). `step()` runs one batch and returns a
`TokenDelta` per request that produced output or finished. The engine is single-threaded; a worker drives
it from one loop.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence as SequenceABC
from dataclasses import dataclass, field

import torch

from dynserve.config import Settings, torch_dtype
from dynserve.engine.block_manager import BlockManager
from dynserve.engine.loader import ModelConfig, load_model_weights, resolve_model_path
from dynserve.engine.model_runner import ModelRunner, kv_block_size_bytes
from dynserve.engine.models.llama import LlamaForCausalLM
from dynserve.engine.output import OutputText
from dynserve.engine.scheduler import ScheduledBatch, Scheduler
from dynserve.engine.sequence import Sequence
from dynserve.engine.tokenizer import Tokenizer
from dynserve.errors import CacheCapacityError, InvalidRequestError
from dynserve.hashing import model_salt
from dynserve.protocol import KVEvent, SamplingParams, TokenDelta, TokenLogprob

__all__ = ["EngineStats", "GenerationResult", "LLMEngine", "LoadedModel", "load_model"]

logger = logging.getLogger(__name__)

ProgressFn = Callable[[str], None]


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    num_prompt_tokens: int = 0  # prompt tokens of admitted requests
    num_computed_prompt_tokens: int = 0  # tokens the model actually ran for prefill (chunks, recomputes)
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    num_generated_tokens: int = 0
    num_preemptions: int = 0


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """Weights and tokenizer in memory, shareable by several engines (each has its own KV cache)."""

    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    device: torch.device


def load_model(settings: Settings, progress: ProgressFn | None = None) -> LoadedModel:
    say = progress or (lambda _msg: None)
    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    device = _resolve_device(settings.device)
    dtype = torch_dtype(settings.dtype)
    path = resolve_model_path(settings.model)
    say(f"loading tokenizer from {path.name}")
    tokenizer = Tokenizer.load(path)
    say(f"loading weights from {path.name}")
    config, state = load_model_weights(path, dtype)
    say("building model")
    model = LlamaForCausalLM(config, dtype)
    model.load_hf_state_dict(state)
    del state
    return LoadedModel(config, model.to(device).eval(), tokenizer, device)


@dataclass(slots=True)
class _Request:
    seq: Sequence
    output: OutputText
    stop_token_ids: frozenset[int]


class LLMEngine:
    def __init__(
        self,
        settings: Settings | None = None,
        progress: ProgressFn | None = None,
        loaded: LoadedModel | None = None,
    ) -> None:
        """Load the model named by `settings` (or reuse `loaded`, which must match its dtype and device)
        and allocate the KV cache."""
        self.settings = settings = settings or Settings()
        say = progress or (lambda _msg: None)
        loaded = loaded or load_model(settings, progress)
        self.device, self.dtype = loaded.device, loaded.model.dtype
        self.tokenizer = loaded.tokenizer
        self.model_config = config = loaded.config
        self.model_id = config.model_id
        self.model = loaded.model
        self.max_model_len = min(settings.max_model_len or config.max_position_embeddings,
                                 config.max_position_embeddings)
        num_blocks = settings.kv_blocks or max(
            1, int(settings.kv_cache_gib * 2**30) // kv_block_size_bytes(config, settings.block_size, self.dtype)
        )
        self.block_manager = BlockManager(
            num_blocks, settings.block_size, model_salt(self.model_id), settings.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager, settings.max_num_seqs, settings.max_num_batched_tokens, self.max_model_len
        )
        self.runner = ModelRunner(self.model, num_blocks, settings.block_size, self.device,
                                  settings.attention_backend)
        self.stats = EngineStats()
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._eos_ids = frozenset(i for i in (self.tokenizer.eos_token_id, config.eos_token_id) if i is not None)
        say(f"ready: {self.model_id}, {num_blocks} KV blocks, {self.device} {settings.dtype}")

    # ---- requests -------------------------------------------------------------------------------------

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request (text or token ids). Raises InvalidRequestError for bad input."""
        params = params or SamplingParams()
        params.validate()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_prompt(token_ids)
        if params.seed is None and not params.greedy:
            params = _with_seed(params, self.settings.seed + next(self._ids))
        seq = Sequence(request_id, token_ids, params)
        self.scheduler.add(seq)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self._eos_ids))
        self._requests[request_id] = _Request(
            seq, OutputText(self.tokenizer.detokenizer(), params.stop), frozenset(stop_ids)
        )
        self.stats.num_prompt_tokens += len(token_ids)
        return request_id

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens; this model's context length is {self.max_model_len}",
                param="prompt",
            )
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False if it is unknown or already finished."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.finish(request.seq, "abort")
        return True

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def drain_kv_events(self) -> list[KVEvent]:
        return self.block_manager.drain_events()

    # ---- stepping -------------------------------------------------------------------------------------

    def step(self) -> list[TokenDelta]:
        batch = self.scheduler.schedule()
        self.stats.num_preemptions += len(batch.preempted)
        if batch.is_empty:
            return []
        self._count_prefill(batch)
        sampled, result = self.runner.execute(batch)
        self.scheduler.complete_step(batch)
        self.stats.num_steps += 1
        if result is None:
            return []
        deltas = []
        for seq, token_id, logprob in zip(sampled, result.token_ids, result.logprobs, strict=True):
            deltas.append(self._append(self._requests[seq.request_id], token_id, logprob))
        return deltas

    def _count_prefill(self, batch: ScheduledBatch) -> None:
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            is_decode = num_new == 1 and seq.num_output_tokens > 0 and seq.num_computed_tokens == seq.num_tokens - 1
            if not is_decode:
                self.stats.num_computed_prompt_tokens += num_new
        self.stats.num_cached_prompt_tokens = self.scheduler.num_cached_prompt_tokens

    def _append(self, request: _Request, token_id: int, logprob: TokenLogprob | None) -> TokenDelta:
        seq = request.seq
        seq.append_token(token_id)
        self.stats.num_generated_tokens += 1
        if logprob is not None:
            seq.output_logprobs.append(logprob)
        text = "" if token_id in request.stop_token_ids else request.output.push(token_id)
        reason = None
        if token_id in request.stop_token_ids or request.output.stopped:
            reason = "stop"
        elif seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            text += request.output.finish()
            self.scheduler.finish(seq, reason)
            del self._requests[seq.request_id]
        return TokenDelta(
            request_id=seq.request_id,
            token_ids=[token_id],
            text=text,
            finished=reason is not None,
            finish_reason=reason,
            logprobs=None if logprob is None else [logprob],
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_output_tokens,
        )

    # ---- convenience ----------------------------------------------------------------------------------

    def generate(
        self,
        prompts: SequenceABC[str | list[int]],
        params: SamplingParams | SequenceABC[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Run `prompts` to completion together; results in prompt order."""
        per_prompt = list(params) if isinstance(params, SequenceABC) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, per_prompt, strict=True)]
        results: dict[str, GenerationResult] = {}
        seqs = {rid: self._requests[rid].seq for rid in ids}
        texts: dict[str, list[str]] = {rid: [] for rid in ids}
        while any(rid not in results for rid in ids):
            for delta in self.step():
                texts[delta.request_id].append(delta.text)
                if delta.finished:
                    seq = seqs[delta.request_id]
                    results[delta.request_id] = GenerationResult(
                        seq.request_id, seq.prompt_token_ids, seq.output_token_ids, "".join(texts[seq.request_id]),
                        seq.finish_reason, seq.num_cached_tokens, seq.output_logprobs,
                    )
        return [results[rid] for rid in ids]

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

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    import msgspec

    return msgspec.structs.replace(params, seed=seed)

