"""Request bookkeeping every engine shares: requests in, token deltas out, over the real scheduler and block
manager. What runs a scheduled batch is the subclass's: `LLMEngine` runs the model, the mocker's engine
sleeps for the time its profile gives and draws pseudo-random tokens.

`EngineCore.step()` schedules a batch, asks `_execute` for one token per sequence whose every token is now
computed, records the step with the scheduler (which caches the blocks it filled), and turns each token into a
`TokenDelta`: detokenized text, stop strings, stop ids (EOS unless `ignore_eos`), a completed grammar,
`max_tokens`, the context limit, cumulative usage counts and prefix-cache hits. Everything here is pure Python (no torch), so an engine
without a model imports none.

Disaggregated serving (see `protocol.py`) has two more kinds of request:
- prefill-only: runs as usual up to its first token; unless that token ends it, the request then leaves the
  scheduler holding its blocks under a lease (`kv_lease_s`) and its one delta carries a `KVHandle` naming
  them. `release` (or `abort`, or the lease's end: `expire_leases`) frees them; cached prompt blocks stay in
  the prefix cache.
- remote-prefilled: allocates blocks for the prompt and the first token (reusing its own cached prefix) and
  hands the worker a `ReceivePlan` (`drain_receives`): which of the prefill worker's blocks to read into
  which of its own. `complete_receive` then starts decoding from the first token, or, when the read failed,
  queues the request to prefill here; either way the request's first delta (the first token) comes then.

Peer pulls (`Settings.kv_peer_pulls`) reuse both halves:
- `export_prefix` holds the leading blocks of a prompt this engine caches, on any tier (lower tiers are
  onboarded), under a lease as a prefill-only request's, computing nothing, and returns a `KVHandle` of them;
- a request added with `peer` (such a handle from another worker) allocates as usual (its own prefix first)
  and hands the worker a `ReceivePlan` for the handle's blocks past its own; `complete_receive` then counts
  them as computed (cached tokens) and the request prefills only the rest, or, when the read failed,
  prefills them too. Its first delta says how many blocks it pulled (`kv_pulled_blocks`) or why none.

Hand-back (`shed`): requests queued and never started (nothing computed, scheduled or read for them, no
token, no peer pull's outcome to tell) leave from the queue's tail, each ending with one delta of reason
`REQUEUE`, so the gateway sends them to a worker that joined the pool; the queue's head stays.

Structured output (`structured.py`): a request with a grammar gets its matcher when it is added, fed the
prompt's last `grammar.num_prior_tokens` tokens (a migrated request's earlier output) and, on a decode
worker, the prefill worker's first token; each appended token advances it, and the request finishes with
"stop" once its grammar is complete. What samples the tokens (the model runner, the mocker) keeps them
inside the grammar; a token the grammar refuses all the same ends the request with "abort" (logged), never
with output that breaks the grammar.

Invariants: every added request ends with exactly one finished delta, or is aborted; a finished or aborted
request holds no blocks, except a prefill-only request under lease; a block being written by a transfer is
never freed before the transfer ends (an abort meanwhile frees it at `complete_receive`); `stats` counts only
what this engine did.
"""

from __future__ import annotations

import abc
import itertools
import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from dynserve.config import Settings
from dynserve.engine.block_manager import BlockManager
from dynserve.engine.output import OutputText
from dynserve.engine.scheduler import ScheduledBatch, Scheduler
from dynserve.engine.sequence import Sequence
from dynserve.engine.structured import GrammarState, MaskTimings
from dynserve.errors import InvalidRequestError
from dynserve.hashing import model_salt
from dynserve.model.tokenizer import Tokenizer, ids_in_vocab
from dynserve.protocol import REQUEUE, KVEvent, KVHandle, RemotePrefill, SamplingParams, TokenDelta, TokenLogprob

if TYPE_CHECKING:
    from dynserve.engine.kv_tier_book import TierBook

__all__ = ["LEASE_MARGIN_S", "EngineCore", "EngineStats", "GenerationResult", "ReceivePlan", "StepSamples"]

logger = logging.getLogger(__name__)

LEASE_MARGIN_S = 2.0  # a handle this close to its lease's end is not read (a read, clock skew between hosts)


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    num_prompt_tokens: int = 0  # prompt tokens of admitted requests
    num_computed_prompt_tokens: int = 0  # tokens the model actually ran for prefill (chunks, recomputes)
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    # the last step that ran a batch: its sequences, and its tokens computed as prefill and as decode
    last_batch_size: int = 0
    last_prefill_tokens: int = 0
    last_decode_tokens: int = 0


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(slots=True)
class StepSamples:
    """What running one batch produced: a token (and its logprob, when asked) per sequence that sampled."""

    seqs: list[Sequence]
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


@dataclass(slots=True, frozen=True)
class ReceivePlan:
    """A read the worker must do before request `request_id` can decode: the prefill worker's blocks
    `remote_block_ids[i]` into this engine's `local_block_ids[i]`. `fallback` is set (and nothing is to be
    read) when the request will prefill here instead, e.g. "no_blocks"."""

    request_id: str
    source_worker_id: str
    agent_name: str | None
    remote_block_ids: list[int]
    local_block_ids: list[int]
    fallback: str | None = None
    pull: bool = False  # a peer pull (its source exported a prefix), not a prefill worker's handle


@dataclass(slots=True)
class _Request:
    seq: Sequence
    output: OutputText
    stop_token_ids: frozenset[int]
    prefill_only: bool = False
    # a peer pull's outcome, said on the request's first delta: blocks read, or why none were
    pulled_blocks: int = 0
    pull_fallback: str | None = None


@dataclass(slots=True)
class _Receiving:
    request: _Request
    aborted: bool = False
    pulled_blocks: int = 0  # > 0: a peer pull of this many blocks (the request prefills the rest after it)


class EngineCore(abc.ABC):
    """The engine surface workers drive: `add_request`, `step`, `abort`, `drain_kv_events`, snapshots through
    `block_manager`, loads through `scheduler`. Single-threaded. Subclasses implement `_execute`."""

    def __init__(self, settings: Settings, tokenizer: Tokenizer, *, model_id: str, vocab_size: int,
                 eos_token_id: int | None, max_model_len: int, num_blocks: int,
                 kv_tiers: TierBook | None = None) -> None:
        """`kv_tiers`: the host and disk tiers below the KV cache (None: device only); `close` closes them."""
        self.settings = settings
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_manager = BlockManager(
            num_blocks, settings.block_size, model_salt(model_id), settings.enable_prefix_caching, kv_tiers
        )
        self.scheduler = Scheduler(
            self.block_manager, settings.max_num_seqs, settings.max_num_batched_tokens, max_model_len
        )
        self.stats = EngineStats()
        # the last step scheduled nothing and preempted nothing: its requests wait for blocks that only a
        # release, an abort, a lease's end or a read's end frees, so a driver waits for one of those
        self.stalled = False
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._eos_ids = tokenizer.end_of_generation_ids | frozenset(
            i for i in (tokenizer.eos_token_id, eos_token_id) if i is not None)
        # disaggregated serving: who this engine is to a decode worker (set by its worker), prefills held
        # under lease (request id -> (sequence, lease end), in lease order), requests receiving their KV
        self.kv_source_id = ""
        self.kv_agent_name: str | None = None
        self._leases: dict[str, tuple[Sequence, float]] = {}
        self._receiving: dict[str, _Receiving] = {}
        self._receive_plans: list[ReceivePlan] = []

    @property
    def mask_timings(self) -> MaskTimings | None:
        """How long the grammar masks took per constrained token (None: this engine does not time them)."""
        return None

    @abc.abstractmethod
    def _execute(self, batch: ScheduledBatch) -> StepSamples:
        """Run `batch` (the scheduler has not yet recorded it as computed) and sample a token for every
        sequence scheduled up to its last token, in batch order. Each engine (model, mocker) defines it."""

    # ---- requests -------------------------------------------------------------------------------------

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None, *,
        prefill_only: bool = False, remote: RemotePrefill | None = None, peer: KVHandle | None = None,
    ) -> str:
        """Queue a request (text or token ids). Raises InvalidRequestError for bad input. `prefill_only`,
        `remote` and `peer`: see the module's docstring."""
        params = params or SamplingParams()
        params.validate()
        request_id = request_id or f"req-{next(self._ids)}"
        self._check_request_id(request_id)
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_prompt(token_ids)
        if params.seed is None and not params.greedy:
            params = msgspec.structs.replace(params, seed=self.settings.seed + next(self._ids))
        seq = Sequence(request_id, token_ids, params)
        if params.grammar is not None:
            num_prior = params.grammar.num_prior_tokens
            if num_prior >= len(token_ids):
                raise InvalidRequestError("grammar.num_prior_tokens must be less than the prompt's tokens",
                                          param="grammar")
            seq.grammar = GrammarState.start(params.grammar, self.tokenizer, token_ids[len(token_ids) - num_prior:])
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self._eos_ids))
        request = _Request(seq, OutputText(self.tokenizer.detokenizer(), params.stop), frozenset(stop_ids),
                           prefill_only=prefill_only and remote is None)
        if remote is not None:
            self._add_remote(request, remote)
        elif peer is None or peer.worker_id == self.kv_source_id or not self._add_pull(request, peer):
            self.scheduler.add(seq)
            self._requests[request_id] = request
        self.stats.num_prompt_tokens += len(token_ids)
        return request_id

    def _add_remote(self, request: _Request, remote: RemotePrefill) -> None:
        seq, handle = request.seq, remote.handle
        if not 0 <= remote.first_token_id < self.vocab_size:
            raise InvalidRequestError(f"first token id must be in [0, {self.vocab_size})", param="remote_prefill")
        self.scheduler.check_fits(seq)
        if seq.grammar is not None and not seq.grammar.accept(remote.first_token_id):
            raise InvalidRequestError(f"the first token does not match the grammar: {seq.grammar.error}",
                                      param="remote_prefill")
        seq.append_token(remote.first_token_id)
        if remote.first_logprob is not None:
            seq.output_logprobs.append(remote.first_logprob)
        seq.num_cached_tokens = remote.num_cached_tokens
        self._receiving[seq.request_id] = _Receiving(request)
        blocks = self.block_manager
        fallback = None
        if handle.num_tokens != seq.num_prompt_tokens or len(handle.block_ids) != blocks.blocks_needed(handle.num_tokens):
            fallback = "transfer_error"  # the handle does not describe this prompt
        elif time.time() > handle.lease_ends_unix_s - LEASE_MARGIN_S:
            fallback = "lease_expired"  # the blocks may be someone else's by the time the read lands
        elif not blocks.allocate(seq, self.scheduler.num_reserved_blocks if self.scheduler.running else 0):
            fallback = "no_blocks"
        if fallback is not None:
            self._receive_plans.append(ReceivePlan(seq.request_id, handle.worker_id, handle.agent_name, [], [],
                                                   fallback))
            return
        first = seq.num_computed_tokens // blocks.block_size  # blocks this engine already caches
        self._receive_plans.append(ReceivePlan(
            seq.request_id, handle.worker_id, handle.agent_name, handle.block_ids[first:],
            seq.block_table[first:len(handle.block_ids)]))

    def _add_pull(self, request: _Request, handle: KVHandle) -> bool:
        """Start `request` by reading the blocks of its prompt that `handle` (a peer's export) holds past this
        engine's own prefix; False (nothing changed) when there is nothing to read or no room, so it is
        queued as usual."""
        seq, blocks = request.seq, self.block_manager
        self.scheduler.check_fits(seq)
        num_blocks = min(len(handle.block_ids), handle.num_tokens // blocks.block_size,
                         (seq.num_prompt_tokens - 1) // blocks.block_size)  # the last token is computed here
        if not blocks.enable_prefix_caching or num_blocks <= 0:
            return False
        if time.time() > handle.lease_ends_unix_s - LEASE_MARGIN_S:
            request.pull_fallback = "lease_expired"  # the blocks may be someone else's by the time they land
            return False
        if not blocks.allocate(seq, self.scheduler.num_reserved_blocks if self.scheduler.running else 0):
            request.pull_fallback = "no_blocks"
            return False
        first = seq.num_computed_tokens // blocks.block_size  # blocks this engine already caches
        if first >= num_blocks:  # it holds them all itself: an ordinary request
            blocks.free(seq)
            return False
        self.scheduler.num_queried_prompt_tokens += seq.num_tokens
        self.scheduler.num_cached_prompt_tokens += seq.num_computed_tokens
        self._receiving[seq.request_id] = _Receiving(request, pulled_blocks=num_blocks - first)
        self._receive_plans.append(ReceivePlan(
            seq.request_id, handle.worker_id, handle.agent_name, handle.block_ids[first:num_blocks],
            seq.block_table[first:num_blocks], pull=True))
        return True

    def export_prefix(self, request_id: str, token_ids: list[int]) -> TokenDelta:
        """Hold the leading blocks of `token_ids` that this engine caches (any tier) under a lease for a peer to
        read, as a prefill-only request's (`release`, `abort`, `expire_leases` free them), computing nothing.
        The one delta, finished with reason "exported", carries their `KVHandle`, or none when this engine
        holds no block of the prompt."""
        self._check_request_id(request_id)
        self._check_prompt(token_ids)
        seq = Sequence(request_id, list(token_ids), SamplingParams(max_tokens=1))
        num_blocks = self.block_manager.hold_prefix(seq)
        num_tokens = num_blocks * self.block_manager.block_size
        handle = self._lease(seq, num_blocks, num_tokens) if num_blocks else None
        return TokenDelta(request_id=request_id, token_ids=[], finished=True, finish_reason="exported",
                          num_prompt_tokens=len(token_ids), num_cached_tokens=num_tokens, kv_handle=handle)

    def drain_receives(self) -> list[ReceivePlan]:
        """The reads requested since the last call (each ends with one `complete_receive`)."""
        plans, self._receive_plans = self._receive_plans, []
        return plans

    def complete_receive(self, request_id: str, failure: str | None) -> TokenDelta | None:
        """The read for `request_id` ended (`failure`: None, or why it failed). Starts the request (decoding,
        or prefilling here after a failure) and returns its first delta; None for an aborted request."""
        entry = self._receiving.pop(request_id, None)
        if entry is None:
            return None
        seq = entry.request.seq
        if entry.aborted:
            if seq.block_table:
                self.block_manager.free(seq)
            return None
        if entry.pulled_blocks:
            return self._complete_pull(entry, failure)
        if failure is None:
            seq.num_computed_tokens = seq.num_prompt_tokens
            self.block_manager.register_computed_blocks(seq)
            self.scheduler.add_running(seq)
        else:
            if seq.block_table:
                self.block_manager.free(seq)  # what landed is not trusted: compute it here
            self.scheduler.add(seq)
        self._requests[request_id] = entry.request
        token_id = seq.output_token_ids[0]
        logprob = seq.output_logprobs[0] if seq.output_logprobs else None
        return self._emit(entry.request, token_id, logprob, kv_fallback=failure)

    def _complete_pull(self, entry: _Receiving, failure: str | None) -> None:
        """A peer pull's read ended: its blocks count as computed (and cached) and the request prefills the
        rest, or, after a failure, everything its own cache does not hold. Its first delta comes from a step."""
        request = entry.request
        seq, blocks = request.seq, self.block_manager
        if failure is None:
            num_pulled = entry.pulled_blocks
            seq.num_computed_tokens += num_pulled * blocks.block_size
            seq.num_cached_tokens = seq.num_computed_tokens
            self.scheduler.num_cached_prompt_tokens += num_pulled * blocks.block_size
            blocks.register_computed_blocks(seq)
            request.pulled_blocks = num_pulled
            self.scheduler.add_running(seq)
        else:
            self.scheduler.num_queried_prompt_tokens -= seq.num_tokens  # counted again at admission
            self.scheduler.num_cached_prompt_tokens -= seq.num_computed_tokens
            blocks.free(seq)  # what landed is not trusted: compute it here (its own prefix is found again)
            request.pull_fallback = failure
            self.scheduler.add(seq)
        self._requests[seq.request_id] = request
        return None

    @property
    def num_receiving(self) -> int:
        return len(self._receiving)

    # ---- leases of prefilled KV -------------------------------------------------------------------------

    def release(self, request_id: str) -> bool:
        """Free the blocks a prefill-only request holds; False if it holds none (released, expired)."""
        entry = self._leases.pop(request_id, None)
        if entry is None:
            return False
        self.block_manager.free(entry[0])
        return True

    def expire_leases(self, now_s: float) -> int:
        """Release every lease that ended by `now_s`; returns how many."""
        expired = []
        for request_id, (_seq, end_s) in self._leases.items():
            if end_s > now_s:
                break
            expired.append(request_id)
        for request_id in expired:
            self.release(request_id)
        return len(expired)

    @property
    def next_lease_end_s(self) -> float | None:
        """When the oldest lease ends (`time.monotonic()`), None without leases."""
        return next(iter(self._leases.values()))[1] if self._leases else None

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    def _check_request_id(self, request_id: str) -> None:
        if request_id in self._requests or request_id in self._receiving or request_id in self._leases:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens; this model's context length is {self.max_model_len}",
                param="prompt",
            )
        if not ids_in_vocab(token_ids, self.vocab_size):
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks (a prefill's lease too; a request receiving KV frees its
        blocks when the read ends); False if it is unknown or already finished."""
        receiving = self._receiving.get(request_id)
        if receiving is not None:
            receiving.aborted = True
            return True
        request = self._requests.pop(request_id, None)
        if request is None:
            return self.release(request_id)
        self.scheduler.finish(request.seq, "abort")
        return True

    def shed(self, max_requests: int, allowed: Callable[[str], bool] | None = None) -> list[TokenDelta]:
        """Hand back up to `max_requests` queued requests that never started, newest first, never the queue's
        head (`Scheduler.shed`), nor one whose peer pull has an outcome to tell; `allowed(request_id)`
        narrows them (a connection's own). Each ends here with one finished delta of reason `REQUEUE` and
        no tokens; it held no blocks and computed nothing, so `stats` forget its prompt."""
        def can_go(seq: Sequence) -> bool:
            request = self._requests[seq.request_id]
            return (not request.pulled_blocks and request.pull_fallback is None
                    and (allowed is None or allowed(seq.request_id)))

        deltas = []
        for seq in self.scheduler.shed(max_requests, can_go):
            del self._requests[seq.request_id]
            self.stats.num_prompt_tokens -= seq.num_prompt_tokens
            deltas.append(TokenDelta(request_id=seq.request_id, token_ids=[], finished=True, finish_reason=REQUEUE,
                                     num_prompt_tokens=seq.num_prompt_tokens))
        return deltas

    @property
    def next_step_s(self) -> float:
        """The earliest `time.monotonic()` at which the next step should start: a real engine's steps take
        their own time (0.0, at once); a simulated one that does not sleep through its steps says when its
        modelled time is up."""
        return 0.0

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def drain_kv_events(self) -> list[KVEvent]:
        return self.block_manager.drain_events()

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()

    def close(self) -> None:
        """Release what outlives a step: the KV tiers' writer thread and disk directory. Idempotent."""
        if self.block_manager.tiers is not None:
            self.block_manager.tiers.close()

    # ---- stepping -------------------------------------------------------------------------------------

    def step(self) -> list[TokenDelta]:
        batch = self.scheduler.schedule()
        self.stats.num_preemptions += len(batch.preempted)
        self.stalled = batch.is_empty and not batch.preempted
        if batch.is_empty:  # it ran nothing (at most it preempted): no step to count
            self.stats.last_batch_size = self.stats.last_prefill_tokens = self.stats.last_decode_tokens = 0
            return []
        self._count_step(batch)
        samples = self._execute(batch)
        self.scheduler.complete_step(batch)
        self.stats.num_steps += 1
        return [self._append(self._requests[seq.request_id], token_id, logprob)
                for seq, token_id, logprob in zip(samples.seqs, samples.token_ids, samples.logprobs, strict=True)]

    def _count_step(self, batch: ScheduledBatch) -> None:
        stats = self.stats
        num_decode = 0
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if is_decode(seq, num_new):
                num_decode += 1
        num_prefill = sum(batch.num_new_tokens) - num_decode
        stats.num_computed_prompt_tokens += num_prefill
        stats.last_batch_size, stats.last_prefill_tokens, stats.last_decode_tokens = (
            len(batch.seqs), num_prefill, num_decode)
        stats.num_cached_prompt_tokens = self.scheduler.num_cached_prompt_tokens

    def _append(self, request: _Request, token_id: int, logprob: TokenLogprob | None) -> TokenDelta:
        seq = request.seq
        seq.append_token(token_id)
        self.stats.num_generated_tokens += 1
        if logprob is not None:
            seq.output_logprobs.append(logprob)
        if seq.grammar is not None and not seq.grammar.accept(token_id):
            logger.error("request %s: token %d breaks its grammar (%s); aborting it", seq.request_id, token_id,
                         seq.grammar.error)
            return self._emit(request, token_id, logprob, broke_grammar=True)
        return self._emit(request, token_id, logprob)

    def _emit(self, request: _Request, token_id: int, logprob: TokenLogprob | None,
              kv_fallback: str | None = None, broke_grammar: bool = False) -> TokenDelta:
        """The delta for `token_id`, just appended to the request's sequence; finishes or parks it."""
        seq = request.seq
        output = request.output
        stop_token = token_id in request.stop_token_ids
        text = "" if stop_token or broke_grammar else output.push(token_id)
        num_tokens, num_prompt_tokens = len(seq.token_ids), len(seq.prompt_token_ids)
        num_output_tokens = num_tokens - num_prompt_tokens
        reason = None
        if broke_grammar:
            reason = "abort"
        elif stop_token or output.stopped or (seq.grammar is not None and seq.grammar.is_done):
            reason = "stop"
        elif num_output_tokens >= seq.params.max_tokens or num_tokens >= self.max_model_len:
            reason = "length"
        if reason is None and request.prefill_only:
            return self._park(request, token_id, logprob, text)
        if reason is not None:
            text += output.finish()
            self.scheduler.finish(seq, reason)
            del self._requests[seq.request_id]
        pulled_blocks = request.pulled_blocks
        if pulled_blocks or request.pull_fallback is not None:  # a pull's outcome, on the first delta only
            kv_fallback = kv_fallback or request.pull_fallback
            request.pulled_blocks, request.pull_fallback = 0, None
        return TokenDelta(
            request_id=seq.request_id,
            token_ids=[] if broke_grammar else [token_id],  # a migration continues from the tokens before it
            text=text,
            finished=reason is not None,
            finish_reason=reason,
            logprobs=None if logprob is None or broke_grammar else [logprob],
            num_prompt_tokens=num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=num_output_tokens,
            kv_fallback=kv_fallback,
            kv_pulled_blocks=pulled_blocks,
        )

    def _park(self, request: _Request, token_id: int, logprob: TokenLogprob | None, text: str) -> TokenDelta:
        """End a prefill-only request after its first token, keeping its prompt's blocks under a lease."""
        seq = request.seq
        self.scheduler.detach(seq)
        del self._requests[seq.request_id]
        num_blocks = self.block_manager.blocks_needed(seq.num_prompt_tokens)
        handle = self._lease(seq, num_blocks, seq.num_prompt_tokens)
        return TokenDelta(
            request_id=seq.request_id, token_ids=[token_id], text=text, finished=True, finish_reason="prefilled",
            logprobs=None if logprob is None else [logprob], num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens, num_output_tokens=seq.num_output_tokens, kv_handle=handle,
            kv_fallback=request.pull_fallback, kv_pulled_blocks=request.pulled_blocks,
        )

    def _lease(self, seq: Sequence, num_blocks: int, num_tokens: int) -> KVHandle:
        """Hold `seq`'s blocks under a lease (`kv_lease_s`) and name its first `num_blocks` (its first
        `num_tokens` tokens) for a peer to read."""
        lease_s = self.settings.kv_lease_s
        self._leases[seq.request_id] = (seq, time.monotonic() + lease_s)
        return KVHandle(worker_id=self.kv_source_id, agent_name=self.kv_agent_name,
                        block_ids=seq.block_table[:num_blocks], num_tokens=num_tokens,
                        lease_ends_unix_s=time.time() + lease_s)

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


def is_decode(seq: Sequence, num_new_tokens: int) -> bool:
    """True when a scheduled sequence computes one token after its whole prompt and earlier outputs (a decode,
    not a prefill chunk or a recompute after preemption)."""
    num_tokens = len(seq.token_ids)  # not the properties: this runs for every sequence of every step
    return (num_new_tokens == 1 and seq.num_computed_tokens == num_tokens - 1
            and num_tokens > len(seq.prompt_token_ids))
