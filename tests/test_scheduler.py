"""The scheduler with a real BlockManager and no model: `FakeRunner` stands in for the model runner.

`FakeRunner` does what the engine does around a step (schedule, compute, sample, finish at max_tokens) and
keeps a fake KV store (slot -> the token prefix whose KV it holds), so every step also proves that each
scheduled sequence reads KV of exactly its own prefix, whatever prefix hits and preemptions happened.
Sampled token ids are a function of (request, position), so recomputation after preemption changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynserve.engine.block_manager import BlockManager
from dynserve.engine.scheduler import ScheduledBatch, Scheduler
from dynserve.engine.sequence import Sequence, SequenceStatus
from dynserve.errors import CacheCapacityError
from dynserve.protocol import SamplingParams

VOCAB = 4


def make_seq(request_id: str, prompt_token_ids: list[int], max_tokens: int) -> Sequence:
    return Sequence(request_id, list(prompt_token_ids), SamplingParams(max_tokens=max_tokens))


def make_scheduler(
    num_blocks: int, block_size: int = 2, max_num_seqs: int = 64, max_num_batched_tokens: int = 1024
) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, max_num_batched_tokens)


def fake_token(seq: Sequence) -> int:
    return (sum(map(ord, seq.request_id)) + seq.num_tokens) % VOCAB


@dataclass
class FakeRunner:
    """Drives a Scheduler step by step as LLMEngine does, checking the scheduler's promises every step."""

    sched: Scheduler
    arrivals: list[Sequence] = field(default_factory=list)  # in add() order
    batches: list[ScheduledBatch] = field(default_factory=list)
    first_admissions: list[Sequence] = field(default_factory=list)
    kv: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)

    def add(self, seq: Sequence) -> None:
        self.sched.add(seq)
        self.arrivals.append(seq)

    def step(self) -> ScheduledBatch:
        sched, bm = self.sched, self.sched.block_manager
        was_running = set(map(id, sched.running))
        batch = sched.schedule()
        self.batches.append(batch)
        self._check_batch(batch, was_running)
        sampled = [s for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
                   if s.num_computed_tokens + n == s.num_tokens]
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            self._read_and_write_kv(seq, num_new)
        sched.complete_step(batch)
        for seq in sampled:
            seq.append_token(fake_token(seq))
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, "length")
        bm.check_integrity(sched.running)
        self._check_queues()
        return batch

    def run(self, max_steps: int) -> int:
        """Step until nothing is unfinished; fails if that takes more than `max_steps` steps."""
        for num_steps in range(max_steps + 1):
            if not self.sched.num_unfinished:
                return num_steps
            self.step()
        raise AssertionError(f"{self.sched.num_unfinished} sequences unfinished after {max_steps} steps")

    def _check_batch(self, batch: ScheduledBatch, was_running: set[int]) -> None:
        sched, bm = self.sched, self.sched.block_manager
        assert batch.num_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        assert len({id(s) for s in batch.seqs}) == len(batch.seqs), "a sequence scheduled twice"
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            assert seq.status is SequenceStatus.RUNNING and seq in sched.running
            assert 1 <= num_new <= seq.num_tokens - seq.num_computed_tokens
            assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens + num_new
        admitted = [s for s in batch.seqs if id(s) not in was_running]
        if batch.preempted:
            assert not admitted, "admitted in a step that preempted"
        for seq in admitted:
            if seq.num_preemptions == 0:
                self.first_admissions.append(seq)
        if any(s.num_preemptions == 0 for s in admitted):  # preempted sequences go back in first
            assert not any(s.num_preemptions for s in sched.waiting)

    def _check_queues(self) -> None:
        sched = self.sched
        assert not {id(s) for s in sched.waiting} & {id(s) for s in sched.running}
        assert all(s.status is SequenceStatus.WAITING and not s.block_table for s in sched.waiting)
        assert all(s.status is SequenceStatus.RUNNING for s in sched.running)
        # the waiting queue: sequences preempted at some point, then never-admitted ones in arrival order
        waiting = list(sched.waiting)
        num_preempted = sum(1 for s in waiting if s.num_preemptions)
        assert all(s.num_preemptions for s in waiting[:num_preempted])
        fresh = waiting[num_preempted:]
        arrival_index = {id(s): i for i, s in enumerate(self.arrivals)}
        assert [arrival_index[id(s)] for s in fresh] == sorted(arrival_index[id(s)] for s in fresh)

    def _read_and_write_kv(self, seq: Sequence, num_new: int) -> None:
        block_size = self.sched.block_manager.block_size
        start = seq.num_computed_tokens
        for pos in range(start + num_new):
            slot = (seq.block_table[pos // block_size], pos % block_size)
            if pos >= start:
                self.kv[slot] = tuple(seq.token_ids[: pos + 1])
            assert self.kv.get(slot) == tuple(seq.token_ids[: pos + 1]), "read KV of another prefix"


def step_bound(seqs: list[Sequence]) -> int:
    """The oldest running sequence computes at least one token every step and is never preempted."""
    return sum(s.num_prompt_tokens + s.params.max_tokens for s in seqs) + 1


def assert_all_finished(seqs: list[Sequence]) -> None:
    for seq in seqs:
        assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "length"
        assert seq.num_output_tokens == seq.params.max_tokens
        assert seq.block_table == []


# ---- budget, chunked prefill, admission -----------------------------------------------------------------


def test_long_prompt_is_chunked_and_shares_steps_with_decodes() -> None:
    runner = FakeRunner(make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=8))
    short = make_seq("short", [1, 2, 3], max_tokens=12)
    long = make_seq("long", [i % VOCAB for i in range(30)], max_tokens=2)
    runner.add(short)
    runner.add(long)
    prefill_chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        batch = runner.step()
        sizes = dict(zip(map(id, batch.seqs), batch.num_new_tokens, strict=True))
        assert batch.num_tokens <= 8
        prefill_chunks.append(sizes[id(long)])
        assert id(short) in sizes, "the decode was starved by the prefill"
    assert prefill_chunks == [5, 7, 7, 7, 4]  # 3 + 5, then one decode + 7 per step
    assert sum(prefill_chunks) == 30
    runner.run(max_steps=step_bound([short, long]))
    assert_all_finished([short, long])


def test_budget_is_never_exceeded_with_many_sequences() -> None:
    runner = FakeRunner(make_scheduler(num_blocks=200, block_size=4, max_num_batched_tokens=10))
    seqs = [make_seq(f"s{i}", [i % VOCAB] * (3 + 4 * i), max_tokens=5) for i in range(8)]
    for seq in seqs:
        runner.add(seq)
    runner.run(max_steps=step_bound(seqs))
    assert all(b.num_tokens <= 10 for b in runner.batches)
    assert max(b.num_tokens for b in runner.batches) == 10
    assert_all_finished(seqs)


def test_admission_is_first_come_first_served_within_max_num_seqs() -> None:
    runner = FakeRunner(make_scheduler(num_blocks=100, max_num_seqs=2))
    seqs = [make_seq(f"s{i}", [i % VOCAB, 1, 2], max_tokens=3 + i % 3) for i in range(6)]
    for seq in seqs:
        runner.add(seq)
    first = runner.step()
    assert first.seqs == seqs[:2]
    while runner.sched.num_unfinished:
        runner.step()
        assert len(runner.sched.running) <= 2
    assert runner.first_admissions == seqs
    assert_all_finished(seqs)


def test_waiting_sequence_takes_the_slot_a_finished_one_left() -> None:
    runner = FakeRunner(make_scheduler(num_blocks=100, max_num_seqs=1))
    a, b = make_seq("a", [1, 2], max_tokens=1), make_seq("b", [3, 0], max_tokens=1)
    runner.add(a)
    runner.add(b)
    assert runner.step().seqs == [a]
    assert a.is_finished
    assert runner.step().seqs == [b]


# ---- preemption -----------------------------------------------------------------------------------------


def test_small_cache_preempts_and_every_sequence_still_finishes() -> None:
    runner = FakeRunner(make_scheduler(num_blocks=8, block_size=2, max_num_batched_tokens=16))
    seqs = [make_seq(f"s{i}", [(i + j) % VOCAB for j in range(4)], max_tokens=6) for i in range(6)]
    for seq in seqs:
        runner.add(seq)
    runner.run(max_steps=step_bound(seqs))
    assert runner.sched.num_preemptions > 0
    assert any(b.preempted for b in runner.batches)
    assert_all_finished(seqs)
    assert runner.first_admissions == seqs
    assert runner.sched.block_manager.num_free_blocks == 8


def test_preempted_sequences_are_readmitted_before_new_ones() -> None:
    runner = FakeRunner(make_scheduler(num_blocks=6, block_size=2))
    old = make_seq("old", [0, 1, 2], max_tokens=8)  # grows to 10 tokens: 5 blocks
    young = make_seq("young", [3, 3, 3], max_tokens=8)
    late = make_seq("late", [2, 2], max_tokens=1)
    runner.add(old)
    runner.add(young)
    while not any(b.preempted for b in runner.batches):
        runner.step()
    preempted_at = len(runner.batches) - 1
    assert runner.batches[-1].preempted == [young]
    assert young.block_table == [] and young.num_computed_tokens == 0
    runner.add(late)
    assert list(runner.sched.waiting) == [young, late]
    runner.run(max_steps=step_bound([old, young, late]))
    assert_all_finished([old, young, late])
    readmitted_at = next(i for i, b in enumerate(runner.batches) if young in b.seqs and i > preempted_at)
    late_at = next(i for i, b in enumerate(runner.batches) if late in b.seqs)
    assert readmitted_at <= late_at


def test_lone_sequence_that_fills_the_whole_cache_finishes() -> None:
    runner = FakeRunner(make_scheduler(num_blocks=4, block_size=2, max_num_batched_tokens=3))
    seq = make_seq("whole", [1, 2, 3, 0, 1], max_tokens=3)  # 7 tokens in the table at most: 4 blocks
    runner.add(seq)
    runner.run(max_steps=step_bound([seq]))
    assert_all_finished([seq])
    assert runner.sched.num_preemptions == 0


def test_request_that_can_never_fit_is_refused() -> None:
    sched = make_scheduler(num_blocks=4, block_size=2)
    seq = make_seq("big", [1] * 6, max_tokens=3)  # 9 tokens: 5 blocks
    with pytest.raises(CacheCapacityError) as excinfo:
        sched.add(seq)
    assert excinfo.value.num_blocks_needed == 5 and excinfo.value.num_blocks_total == 4
    assert sched.num_unfinished == 0


# ---- abort ----------------------------------------------------------------------------------------------


def test_abort_from_waiting_and_running_frees_everything() -> None:
    runner = FakeRunner(make_scheduler(num_blocks=10, block_size=2, max_num_seqs=1))
    running = make_seq("running", [0, 1, 2, 3, 0], max_tokens=4)
    waiting = make_seq("waiting", [1, 1], max_tokens=4)
    runner.add(running)
    runner.add(waiting)
    runner.step()
    bm = runner.sched.block_manager
    assert running.block_table and bm.num_free_blocks == 10 - 3
    runner.sched.finish(waiting, "abort")
    runner.sched.finish(running, "abort")
    for seq in (running, waiting):
        assert seq.is_finished and seq.finish_reason == "abort" and seq.block_table == []
    assert runner.sched.num_unfinished == 0 and bm.num_free_blocks == 10
    bm.check_integrity([])
    assert runner.sched.schedule().is_empty


def test_abort_of_a_preempted_sequence() -> None:
    runner = FakeRunner(make_scheduler(num_blocks=6, block_size=2))
    old, young = make_seq("old", [0, 1, 2], max_tokens=8), make_seq("young", [3, 3, 3], max_tokens=8)
    runner.add(old)
    runner.add(young)
    while not young.num_preemptions:
        runner.step()
    runner.sched.finish(young, "abort")
    assert young not in runner.sched.waiting and young.finish_reason == "abort"
    runner.run(max_steps=step_bound([old]))
    assert_all_finished([old])
    assert runner.sched.block_manager.num_free_blocks == 6


# ---- random workloads -----------------------------------------------------------------------------------


@st.composite
def workloads(draw: st.DrawFn) -> tuple[Scheduler, list[Sequence]]:
    block_size = draw(st.integers(1, 4))
    num_blocks = draw(st.integers(2, 12))
    sched = Scheduler(
        BlockManager(num_blocks, block_size),
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 16)),
    )
    prompts: list[list[int]] = []
    seqs = []
    for i in range(draw(st.integers(1, 8))):
        shared = draw(st.sampled_from(prompts)) if prompts and draw(st.booleans()) else []
        prompt = (shared + draw(st.lists(st.integers(0, VOCAB - 1), max_size=8)))[:16] or [0]
        prompts.append(prompt)
        seqs.append(make_seq(f"r{i}", prompt, max_tokens=draw(st.integers(1, 8))))
    return sched, seqs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_all_finish_with_integrity(workload: tuple[Scheduler, list[Sequence]]) -> None:
    sched, seqs = workload
    runner = FakeRunner(sched)
    accepted = []
    for seq in seqs:
        needed = sched.block_manager.blocks_needed(seq.num_prompt_tokens + seq.params.max_tokens)
        if needed > sched.block_manager.num_blocks:
            with pytest.raises(CacheCapacityError):
                sched.add(seq)
        else:
            runner.add(seq)
            accepted.append(seq)
    runner.run(max_steps=step_bound(accepted))
    assert_all_finished(accepted)
    assert runner.first_admissions == accepted
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
