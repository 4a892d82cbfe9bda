"""Continuous batching: which sequences run in the next step, and how many tokens each computes.

Policy (FCFS): running sequences first, in admission order, each computing all its uncomputed tokens (one
for a decode, a chunk for a prefill) within a per-step token budget, so prefill chunks and decodes share a
step. When a running sequence cannot get a block, the newest running sequence is preempted by recompute
(its blocks freed, back to the front of the queue). Waiting sequences are admitted while the budget, the
sequence limit and the blocks allow, and never in a step that preempted. `shed` takes waiting sequences
that never started out of the queue, from its tail (a worker that joined the pool can take them sooner).

Invariants: a sequence is in at most one of `waiting` / `running`; a running sequence holds blocks for every
token it has computed or is scheduled to compute.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from dynserve.engine.block_manager import BlockManager
from dynserve.engine.sequence import Sequence, SequenceStatus
from dynserve.errors import CacheCapacityError
from dynserve.protocol import REQUEUE

__all__ = ["ScheduledBatch", "Scheduler"]


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 1024,
        max_model_len: int = 8192,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_reserved_blocks = max(1, block_manager.num_blocks // 100)
        self.num_preemptions = 0
        # prefix-cache lookups at first admission: prompt tokens looked up, and those the cache held
        self.num_queried_prompt_tokens = 0
        self.num_cached_prompt_tokens = 0  # prompt tokens served from the prefix cache at admission
        self.sliding_window = 0  # > 0: decoding sequences give back blocks that slid out (`use_sliding_window`)

    def use_sliding_window(self, window: int) -> None:
        """The model attends within `window` tokens in every layer: after each decode step, a sequence gives
        back the blocks no later token reads (`BlockManager.free_slid_out`)."""
        self.sliding_window = window

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        """Queue `seq`; raises CacheCapacityError if it could never fit in the whole cache."""
        self.check_fits(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Run `seq`, which already holds blocks for its tokens (its KV came from another worker), from the
        next step on."""
        assert seq.block_table, "a sequence added as running must hold its blocks"
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def detach(self, seq: Sequence) -> None:
        """Take running `seq` out of scheduling and keep its blocks (a prefill whose KV waits for its decode
        worker); whoever detached it frees them."""
        self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "prefilled"

    def shed(self, max_seqs: int, allowed: Callable[[Sequence], bool]) -> list[Sequence]:
        """Take up to `max_seqs` waiting sequences out of the queue, newest first, and return them finished
        (reason `REQUEUE`): only ones that never started (nothing computed, no block held, no token produced,
        never preempted) and that `allowed` lets go, never the queue's head (it runs next). They hold
        nothing, so nothing is freed."""
        shed: list[Sequence] = []
        for seq in reversed(self.waiting):
            if len(shed) >= max_seqs or seq is self.waiting[0]:
                break
            if (seq.num_computed_tokens == 0 and not seq.block_table and seq.num_preemptions == 0
                    and seq.num_output_tokens == 0 and allowed(seq)):
                shed.append(seq)
        for seq in shed:
            self.waiting.remove(seq)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = REQUEUE
        return shed

    def check_fits(self, seq: Sequence) -> None:
        """Raise CacheCapacityError if `seq` could never fit in the whole cache."""
        max_len = min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_model_len)
        needed = self.block_manager.blocks_needed(max_len)
        if needed > self.block_manager.num_blocks:
            raise CacheCapacityError(
                f"request needs {needed} KV blocks for {max_len} tokens; the cache has "
                f"{self.block_manager.num_blocks}",
                num_blocks_needed=needed,
                num_blocks_total=self.block_manager.num_blocks,
            )

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        pending, self.running = deque(self.running), []
        while pending:
            seq = pending.popleft()
            num_new = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            if num_new <= 0:
                self.running.append(seq)
                continue
            while not self.block_manager.ensure_slots(seq, seq.num_computed_tokens + num_new):
                victim = pending.pop() if pending else seq
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.running.append(seq)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
        if not batch.preempted:
            budget = self._admit(batch, budget)
        return batch

    def _admit(self, batch: ScheduledBatch, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            reserve = self.num_reserved_blocks if self.running else 0
            if not self.block_manager.allocate(seq, reserve):
                break
            self.waiting.popleft()
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
                self.num_cached_prompt_tokens += seq.num_cached_tokens
                self.num_queried_prompt_tokens += seq.num_tokens
            seq.status = SequenceStatus.RUNNING
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        return budget

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def complete_step(self, batch: ScheduledBatch) -> None:
        """Record that the batch's tokens now have KV in the cache and cache the blocks they filled."""
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted after it was scheduled
            seq.num_computed_tokens += num_new
            self.block_manager.register_computed_blocks(seq)
            if self.sliding_window and seq.num_computed_tokens > seq.num_prompt_tokens:  # decoding
                self.block_manager.free_slid_out(seq, self.sliding_window)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire `seq` (stop, length or abort) and free its blocks. Safe to call in any state."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
