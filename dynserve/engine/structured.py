"""Grammar-constrained decoding: one llguidance matcher per constrained sequence, and the step's masks.

A request whose `SamplingParams.grammar` is set gets a `GrammarState` when it is added: a matcher over the
grammar, already fed the tokens produced under it elsewhere (a migrated request's earlier output, the first
token a prefill worker sampled). Each token the engine appends advances it; a sequence whose grammar is
complete finishes with "stop". Before a step samples, `MaskFiller` computes the allowed-token bitmask of each
constrained sequence that samples in it (on a helper thread while the model's forward runs where that costs
the forward nothing: llguidance releases the GIL), and the sampler sets every other token's logit to -inf. The mask depends only on tokens
already appended, so chunked prefill (only the row that samples is masked), preemption (a recompute re-runs
the prompt and outputs, not the matcher) and the prefix cache leave it unchanged.

llguidance needs the vocabulary as bytes: `ll_tokenizer` builds it once per `Tokenizer` from
`Tokenizer.token_bytes` and its control tokens, and keeps it for as long as the tokenizer lives. Each distinct
grammar is compiled once (the most recent `MAX_CACHED_GRAMMARS` are kept) and each request gets a copy of
that matcher, which shares its lexer's caches: a schema's second request neither compiles it again (about
1-5 ms) nor rebuilds the lexer states its masks need (the slowest masks).

No torch here (the mocker uses `GrammarState` too); the sampler turns bitmasks into logit masks.

Invariants: a `GrammarState` has consumed exactly the sequence's output tokens (and the prior tokens its
grammar names); a mask row is computed from that state, before the token it constrains is appended.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import llguidance
import numpy as np

from dynserve.errors import InvalidRequestError
from dynserve.model.tokenizer import Tokenizer
from dynserve.protocol import Grammar

if TYPE_CHECKING:
    from collections.abc import Sequence as SequenceABC

__all__ = ["MASK_BUCKETS_S", "GrammarMasks", "GrammarState", "MaskFiller", "MaskTimings", "compile_grammar",
           "ll_tokenizer"]

# JSON as people write it, one way: `{"a": 1, "b": [2, 3]}`. Free whitespace would let a model pad a
# document with newlines until max_tokens runs out.
JSON_OPTIONS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def compile_grammar(grammar: Grammar) -> str:
    """The llguidance grammar (its serialized form) of `grammar`; not yet checked."""
    if grammar.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(
            grammar.source, overrides={**JSON_OPTIONS, "lenient": grammar.lenient})  # type: ignore[typeddict-item]
    if grammar.kind == "regex":  # `\d` is an ASCII digit, as in JSON Schema's patterns (not any Unicode one)
        return llguidance.LLMatcher.grammar_from_lark(f"start: /{llguidance.regex_to_lark(grammar.source, 'd')}/")
    return llguidance.LLMatcher.grammar_from_lark(grammar.source)


class _Vocabulary:
    """What `llguidance.TokenizerWrapper` reads of a tokenizer: each token's bytes, EOS, BOS, control tokens,
    and an encoder of bytes (used by llguidance only for grammars that embed text to tokenize)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(tokenizer.special_token_ids)
        self._tokenizer = tokenizer

    def __call__(self, text: bytes) -> list[int]:
        ids = self._tokenizer.encode(text.decode("utf-8", errors="replace"))
        if self._tokenizer.add_bos_token and ids[:1] == [self.bos_token_id]:
            ids = ids[1:]
        return ids


MAX_CACHED_GRAMMARS = 64


class _Compiled:
    """One tokenizer's llguidance view and its recently compiled grammars (fresh matchers, copied per use)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        # every token that ends a generation (Gemma's <end_of_turn>, ...) may end a complete grammar's answer
        ends = sorted(tokenizer.end_of_generation_ids) or None
        self.ll_tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tokenizer)), eos_token=ends)
        self.templates: collections.OrderedDict[tuple[str, str, bool], llguidance.LLMatcher] = (
            collections.OrderedDict())

    def matcher(self, grammar: Grammar) -> llguidance.LLMatcher:
        key = (grammar.kind, grammar.source, grammar.lenient)
        template = self.templates.get(key)
        if template is None:
            template = llguidance.LLMatcher(self.ll_tokenizer, compile_grammar(grammar), log_level=0)
            if template.is_error():  # not kept: an error state is permanent
                return template
            self.templates[key] = template
            if len(self.templates) > MAX_CACHED_GRAMMARS:
                self.templates.popitem(last=False)
        else:
            self.templates.move_to_end(key)
        return template.deep_copy()


_compiled: weakref.WeakKeyDictionary[Tokenizer, _Compiled] = weakref.WeakKeyDictionary()
_compiled_lock = threading.Lock()


def _compiled_for(tokenizer: Tokenizer) -> _Compiled:
    with _compiled_lock:
        cached = _compiled.get(tokenizer)
        if cached is None:
            cached = _compiled[tokenizer] = _Compiled(tokenizer)
        return cached


def ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer`, built on first use (about 0.15-0.25 s for a 49k vocabulary) and kept
    for as long as the tokenizer lives."""
    return _compiled_for(tokenizer).ll_tokenizer


def num_mask_words(vocab_size: int) -> int:
    """32-bit words of one token bitmask (bit `i % 32` of word `i // 32` allows token `i`)."""
    return (vocab_size + 31) // 32


class GrammarState:
    """One sequence's matcher. `accept` each appended token; `is_done` once the grammar is complete."""

    __slots__ = ("matcher", "vocab_size")

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size

    @classmethod
    def start(cls, grammar: Grammar, tokenizer: Tokenizer, prior_token_ids: SequenceABC[int] = ()) -> GrammarState:
        """A matcher for `grammar`, fed `prior_token_ids`. InvalidRequestError when the grammar does not
        compile or the prior tokens break it."""
        compiled = _compiled_for(tokenizer)
        with _compiled_lock:
            matcher = compiled.matcher(grammar)
        if matcher.is_error():
            raise InvalidRequestError(f"the grammar does not compile: {matcher.get_error()}", param="grammar")
        if prior_token_ids and not matcher.consume_tokens(list(prior_token_ids)):
            raise InvalidRequestError(f"the tokens already produced do not match the grammar: {matcher.get_error()}",
                                      param="grammar")
        return cls(matcher, tokenizer.vocab_size)

    def accept(self, token_id: int) -> bool:
        """Advance over `token_id`; False (and the matcher in its error state) when the grammar forbids it."""
        return self.matcher.consume_token(token_id)

    @property
    def is_done(self) -> bool:
        """The grammar is complete: no token but EOS may follow (or the matcher failed)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()

    def allowed_token_ids(self) -> np.ndarray:
        """The token ids the grammar allows next (computed now; the mocker draws from them)."""
        words = np.zeros(num_mask_words(self.vocab_size), dtype=np.int32)
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: self.vocab_size]
        return np.flatnonzero(bits)


@dataclass(slots=True)
class GrammarMasks:
    """Bitmasks for some of a step's sampling rows: `bitmask[j]` constrains row `rows[j]` (rows in the order
    the runner samples), `num_mask_words(vocab)` int32 words each."""

    rows: list[int]
    bitmask: np.ndarray


# bounds of `MaskTimings.bucket_counts` (seconds a constrained token's mask took): tens of microseconds is the
# usual, milliseconds a lexer state built for the first time
MASK_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


class MaskTimings:
    """How long mask computation took per constrained token: the most recent `maxlen` steps' per-token
    times (for percentiles), and a histogram over all of them (`bucket_counts[i]`: tokens whose mask took
    at most `MASK_BUCKETS_S[i]` and more than the bound before; the last: more than every bound), each
    step's rows counted at the step's time over its rows. One writer (the mask thread); a reader copies
    `bucket_counts` before it sums them."""

    def __init__(self, maxlen: int = 4096) -> None:
        self.per_token_s: collections.deque[float] = collections.deque(maxlen=maxlen)
        self.bucket_counts = [0] * (len(MASK_BUCKETS_S) + 1)
        self.num_masks = 0
        self.total_s = 0.0

    def record(self, elapsed_s: float, num_rows: int) -> None:
        per_token_s = elapsed_s / num_rows
        self.bucket_counts[bisect.bisect_left(MASK_BUCKETS_S, per_token_s)] += num_rows
        self.num_masks += num_rows
        self.total_s += elapsed_s
        self.per_token_s.append(per_token_s)

    def percentile_s(self, q: float) -> float | None:
        if not self.per_token_s:
            return None
        return float(np.percentile(np.fromiter(self.per_token_s, dtype=np.float64), q))


class _Scheduled(Protocol):
    """What `MaskFiller` reads of a scheduled sequence (`sequence.Sequence`, which imports this module)."""

    token_ids: list[int]
    num_computed_tokens: int
    grammar: GrammarState | None


class _PendingMasks:
    def __init__(self, masks: GrammarMasks, future: concurrent.futures.Future[None] | None, num_rows: int) -> None:
        self.masks, self.future, self.num_rows = masks, future, num_rows

    def result(self) -> GrammarMasks:
        if self.future is not None:
            self.future.result()
        return self.masks


class MaskFiller:
    """Computes a step's masks. With `overlap` (the forward runs on an accelerator, or leaves CPU cores
    free), on one helper thread while the forward runs (llguidance's executor spreads the rows over its own
    threads), so they are ready when the forward is. Without, at once on the calling thread: when the
    forward's threads take every core, a mask thread beside them preempts one of them, and the whole
    forward waits at its next barrier for that thread's time slice (milliseconds, against tens of
    microseconds a mask: benchmarks.structured). One per model runner; idle until a grammar comes."""

    def __init__(self, *, overlap: bool = True) -> None:
        self.timings = MaskTimings()
        self.overlap = overlap
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None

    def start(self, seqs: SequenceABC[_Scheduled], num_new_tokens: SequenceABC[int]) -> _PendingMasks | None:
        """Begin the masks of a scheduled batch's constrained sequences that sample this step (those scheduled
        up to their last token); None when there are none."""
        rows: list[int] = []
        states: list[GrammarState] = []
        num_rows = 0
        for seq, num_new in zip(seqs, num_new_tokens, strict=True):
            if seq.num_computed_tokens + num_new != len(seq.token_ids):
                continue
            if seq.grammar is not None:
                rows.append(num_rows)
                states.append(seq.grammar)
            num_rows += 1
        if not rows:
            return None
        words = num_mask_words(states[0].vocab_size)  # one tokenizer per engine
        bitmask = np.zeros((len(rows), words), dtype=np.int32)
        if not self.overlap:
            started_s = time.perf_counter()
            # (one thread: sharing the rows over the idle cores measured no faster at 16 rows; 1.08 against 1.07)
            for j, state in enumerate(states):
                state.matcher.unsafe_compute_mask_ptr(bitmask[j].ctypes.data, words * 4)
            self.timings.record(time.perf_counter() - started_s, len(states))
            return _PendingMasks(GrammarMasks(rows, bitmask), None, num_rows)
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
            self._executor = llguidance.LLExecutor()
        future = self._thread.submit(self._fill, states, bitmask)
        return _PendingMasks(GrammarMasks(rows, bitmask), future, num_rows)

    def _fill(self, states: list[GrammarState], bitmask: np.ndarray) -> None:
        assert self._executor is not None
        started_s = time.perf_counter()
        self._executor.unsafe_compute_mask_ptr([(state.matcher, j) for j, state in enumerate(states)],
                                               bitmask.ctypes.data, bitmask.shape[1] * 4, bitmask.shape[0])
        self.timings.record(time.perf_counter() - started_s, len(states))

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False)
            self._thread = None
