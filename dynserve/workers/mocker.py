"""The mocker: a worker without a model, for routing and scaling experiments at any size on any machine.

`MockEngine` is an `EngineCore` like the real engine, over the real `Scheduler` and `BlockManager`, so
continuous batching, chunked prefill, preemption, the prefix cache, cached-token counts, KV events and
snapshots are the real ones. Running a scheduled batch is simulated instead: the step takes the wall time its
`MockerProfile` gives for the work in it (uncached prompt tokens, decoding sequences, their context), divided
by `mocker_speedup`, and each sequence that finished its prefill or decodes gets a pseudo-random token.

It runs inside the ordinary `EngineWorker` (set `Settings.mocker` to a profile name; `launch_mocker`, in
`worker.py`, also reserves almost no Ray CPU), so the worker channel, loads, KV events and the gateway work
unchanged; and standalone, behind our own gateway, as an OpenAI-compatible server that other routers can
front (`dynctl mocker`, in `dynserve/cli/mocker.py`).

Invariants:
- Nothing here imports torch (`import dynserve.workers.mocker` leaves it out of `sys.modules`).
- Tokens are a pure function of (the request's seed, the token's position): the seed the engine assigns or
  the request gives, or for greedy requests the prompt, so the same greedy prompt always gets the same
  answer. Tokens are never control tokens, so EOS never comes and a request runs to `max_tokens` unless one
  of its `stop_token_ids` or `stop` strings comes first.
- Answers re-encode to the tokens that made them, as a real model's text almost always does: tokens are
  drawn from the vocabulary's plain words (a space and two or more ASCII letters), whose concatenation the
  byte-level BPE splits back at the same places. So a multi-turn chat that resends an answer finds it in
  the prefix cache of the worker that wrote it. (A vocabulary with fewer than `_MIN_WORD_TOKENS` such
  words falls back to every non-control token.)
- Steps are paced on a clock that carries over between back-to-back steps: a sleep that overshoots is taken
  back from the next step, so a busy mocker keeps the profile's throughput; an idle one starts afresh. In
  a worker the engine does not sleep: it steps on the worker's event loop (`InlineEngineLoop`), which
  waits for `next_step_s`; a step begun before the clock's time (a wait under the loop's timer resolution)
  starts from the clock, so the debt carries over the same way.
- A request with a grammar gets tokens its grammar allows (any token, control tokens and EOS included, drawn
  as above from the allowed ones), so structured output, its migration and its disaggregation run here too;
  such answers are valid but not plain words.
- Logprobs are synthetic but well-formed: the chosen token first and most likely, then `k - 1` others.
- KV tiers (`kv_host_bytes`, `kv_disk_bytes`) are the engine's bookkeeping without pages
  (`kv_tier_book.TierBook` over `NoPages`, a block taking the profile's KV bytes per token times the block
  size on the host and on disk): the same moves, `medium`-tagged KV events and `TierStats`. A step takes
  longer by the profile's `onboard_time_ms` of the blocks onboarded since the step before (at admission, in
  `schedule`, or between steps for a remote prefill or an export), divided by `mocker_speedup`, and that
  time is the tiers' `onboard_s`.
"""

from __future__ import annotations

import logging
import math
import re
import struct
import time
from typing import Any

import msgspec
import xxhash

from dynserve.config import Settings
from dynserve.engine.core import EngineCore, ReceivePlan, StepSamples, is_decode
from dynserve.engine.kv_tier_book import DISK, HOST, NoPages, TierBook, TierPolicy, TierStats
from dynserve.engine.scheduler import ScheduledBatch
from dynserve.engine.sequence import Sequence
from dynserve.errors import KVTransferTimeoutError
from dynserve.model.resolve import model_id_of, resolve_model_path
from dynserve.model.tokenizer import Tokenizer
from dynserve.protocol import SamplingParams, TokenDelta, TokenLogprob
from dynserve.workers.mocker_profiles import MockerProfile, StepWork, get_profile

__all__ = ["MockEngine", "mock_tiers", "step_work"]

logger = logging.getLogger(__name__)

_SEED_MASK = 2**64 - 1
_KEY = struct.Struct("<QQ")
_LOGPROB_SALT = 0x9E3779B97F4A7C15
_CATCH_UP_S = 0.005  # a step that starts this soon after the last one's deadline continues its clock
_SCHEDULER_LIMITS = ("max_num_seqs", "max_num_batched_tokens")
_WORD_TOKEN = re.compile(rb" [A-Za-z]{2,}")
_MIN_WORD_TOKENS = 1024


def step_work(batch: ScheduledBatch) -> StepWork:
    """The work a scheduled batch does, in the units profiles price (call before `complete_step`)."""
    num_prefill = num_pairs = num_decode = num_context = 0
    for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
        if is_decode(seq, num_new):
            num_decode += 1
            num_context += len(seq.token_ids)
        else:
            num_prefill += num_new
            num_pairs += num_new * seq.num_computed_tokens + num_new * (num_new + 1) // 2
    return StepWork(num_prefill, num_pairs, num_decode, num_context)


def mock_tiers(settings: Settings, profile: MockerProfile) -> TierBook | None:
    """The KV tiers `settings` ask for, without pages: a block is the profile's KV bytes per token times the
    block size, on the host and on disk (None when both sizes are 0 or prefix caching is off)."""
    policy = TierPolicy(settings.kv_host_bytes, settings.kv_disk_bytes)
    if not policy.enabled or not settings.enable_prefix_caching:
        return None
    stats = TierStats()
    tiers = TierBook(stats, NoPages.sized(stats, policy, profile.kv_bytes_per_token * settings.block_size))
    logger.info("KV tiers (mocker, no pages): %d host blocks, %d disk blocks", tiers.num_host_slots,
                tiers.num_disk_blocks_max)
    return tiers


class MockEngine(EngineCore):
    """An engine whose steps take the profile's time and whose tokens are pseudo-random."""

    def __init__(self, settings: Settings, tokenizer: Tokenizer | None = None,
                 profile: MockerProfile | None = None, *, sleep: bool = True) -> None:
        """Profile `settings.mocker` (default `cpu`); tokenizer, vocabulary and model id of `settings.model`
        (default the bundled SmolLM2). KV blocks, context and scheduler limits are the profile's unless
        settings set them. `sleep`: each step sleeps until its modelled end (offline use, `generate`);
        without, `step` returns at once and `next_step_s` says when the next may start (the worker's
        `InlineEngineLoop` waits for it on its event loop)."""
        self.profile = profile or get_profile(settings.mocker or "cpu")
        path = resolve_model_path(settings.model)
        tokenizer = tokenizer or Tokenizer.load(path)
        overrides = {n: getattr(self.profile, n) for n in _SCHEDULER_LIMITS if n not in settings.model_fields_set}
        settings = settings.model_copy(update=overrides)
        super().__init__(
            settings, tokenizer, model_id=model_id_of(path), vocab_size=tokenizer.vocab_size, eos_token_id=None,
            max_model_len=settings.max_model_len or self.profile.max_model_len,
            num_blocks=settings.kv_blocks or self.profile.num_kv_blocks(settings.block_size),
            kv_tiers=mock_tiers(settings, self.profile),  # the same book, no pages
        )
        self.speedup = settings.mocker_speedup
        self.simulated_busy_s = 0.0  # the sum of every step's modelled time (after the speedup)
        self._drawable_ids = _drawable_token_ids(tokenizer, tokenizer.special_token_ids | self._eos_ids)
        self._sleep = sleep
        self._step_started_s = 0.0
        self._clock_s = 0.0
        self._num_onboarded_paid = {HOST: 0, DISK: 0}  # the tiers' onboarded blocks whose time a step took

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, **kwargs: Any) -> str:
        params = params or SamplingParams()
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if params.seed is None and params.greedy:  # a greedy answer depends on the prompt alone
            params = msgspec.structs.replace(params, seed=hash(tuple(token_ids)) & _SEED_MASK)
        return super().add_request(token_ids, params, request_id, **kwargs)

    def transfer_time_s(self, num_blocks: int) -> float:
        """How long reading `num_blocks` KV blocks from a prefill worker takes on the profile's hardware,
        after the speedup."""
        size_bytes = num_blocks * self.block_manager.block_size * self.profile.kv_bytes_per_token
        return self.profile.transfer_time_ms(size_bytes) / 1e3 / self.speedup

    def simulate_read(self, plan: ReceivePlan) -> None:
        """A mocker's KV read (there are no pages to move): takes the profile's transfer time; past
        `transfer_timeout_s` it fails as a real read would."""
        duration_s = self.transfer_time_s(len(plan.local_block_ids))
        timeout_s = self.settings.transfer_timeout_s
        if duration_s > timeout_s:
            time.sleep(timeout_s)
            raise KVTransferTimeoutError(
                f"reading {len(plan.local_block_ids)} blocks from {plan.source_worker_id!r} took over {timeout_s:g} s",
                backend="mocker", peer=plan.source_worker_id, num_blocks=len(plan.local_block_ids),
                timeout_s=timeout_s, elapsed_s=timeout_s, cancelled=True)
        time.sleep(duration_s)

    @property
    def next_step_s(self) -> float:
        return 0.0 if self._sleep else self._clock_s

    def step(self) -> list[TokenDelta]:
        self._step_started_s = time.monotonic()
        return super().step()

    def _execute(self, batch: ScheduledBatch) -> StepSamples:
        samples = StepSamples([], [], [])
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            num_tokens = len(seq.token_ids)
            if seq.num_computed_tokens + num_new != num_tokens:
                continue  # a prefill chunk that is not the last: no token yet
            token_id = self._draw(seq.params.seed, num_tokens)
            if seq.grammar is not None:  # a constrained request: a token its grammar allows, drawn the same way
                allowed = seq.grammar.allowed_token_ids()
                token_id = int(allowed[self._key(seq.params.seed, num_tokens) % len(allowed)])
            samples.seqs.append(seq)
            samples.token_ids.append(token_id)
            samples.logprobs.append(None if seq.params.logprobs is None else self._logprob(seq, token_id))
        self._pace(self.profile.step_time_ms(step_work(batch)) / 1e3 / self.speedup + self._onboard_time_s())
        return samples

    def _onboard_time_s(self) -> float:
        """The modelled time of the blocks onboarded since the last step ran (this step's admissions; between
        steps, a remote-prefilled request's own cached prefix or a prefix exported for a peer's pull), after
        the speedup; counted as the tiers' `onboard_s`."""
        tiers = self.block_manager.tiers
        if tiers is None:
            return 0.0
        onboarded = tiers.stats.num_onboarded
        num_host, num_disk = (onboarded[m] - self._num_onboarded_paid[m] for m in (HOST, DISK))
        if not num_host and not num_disk:
            return 0.0
        self._num_onboarded_paid = dict(onboarded)
        block_bytes = self.block_manager.block_size * self.profile.kv_bytes_per_token
        duration_ms = self.profile.onboard_time_ms(num_host * block_bytes, num_disk * block_bytes)
        duration_s = duration_ms / 1e3 / self.speedup
        tiers.stats.onboard_s += duration_s
        return duration_s

    def _pace(self, duration_s: float) -> None:
        """Move the clock to this step's modelled end and, when sleeping, sleep until then (see the module's
        invariants)."""
        self.simulated_busy_s += duration_s
        started_s = self._step_started_s
        start_s = self._clock_s if started_s - self._clock_s < _CATCH_UP_S else started_s
        self._clock_s = start_s + duration_s
        remaining_s = self._clock_s - time.monotonic()
        if self._sleep and remaining_s > 0:
            time.sleep(remaining_s)

    def _draw(self, seed: int | None, position: int, salt: int = 0) -> int:
        """A drawable token id (see the module's invariants), fixed by (seed, position, salt)."""
        return self._drawable_ids[self._key(seed, position, salt) % len(self._drawable_ids)]

    @staticmethod
    def _key(seed: int | None, position: int, salt: int = 0) -> int:
        return xxhash.xxh3_64_intdigest(_KEY.pack((seed or 0) & _SEED_MASK, (position + salt * 1_000_003) & _SEED_MASK))

    def _logprob(self, seq: Sequence, token_id: int) -> TokenLogprob:
        seed = ((seq.params.seed or 0) ^ _LOGPROB_SALT) & _SEED_MASK
        p = 0.5 + 0.45 * (xxhash.xxh3_64_intdigest(_KEY.pack(seed, seq.num_tokens)) % 10_000) / 10_000
        k = seq.params.logprobs or 0
        top: list[tuple[int, float]] = [(token_id, math.log(p))] if k else []
        rest = 1.0 - p
        for i in range(1, k):
            other = self._draw(seq.params.seed, seq.num_tokens, salt=i)
            if other != token_id and all(other != t for t, _ in top):
                rest /= 2
                top.append((other, math.log(rest)))
        return TokenLogprob(token_id, math.log(p), top)


def _drawable_token_ids(tokenizer: Tokenizer, skipped_ids: set[int] | frozenset[int]) -> tuple[int, ...]:
    """The plain-word tokens of the vocabulary, or every token but `skipped_ids` when it has too few."""
    words = tuple(i for i in range(tokenizer.vocab_size)
                  if i not in skipped_ids and _WORD_TOKEN.fullmatch(tokenizer.token_bytes(i)))
    if len(words) >= _MIN_WORD_TOKENS:
        return words
    return tuple(i for i in range(tokenizer.vocab_size) if i not in skipped_ids)

