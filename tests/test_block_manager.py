"""The block manager against plain models: a set of cached hashes rebuilt from its KV events, and a fake KV
store that records, for every written slot, the exact prefix of tokens whose KV it holds.

The fake KV store (`FakeKV`, a stand-in for the model runner's tensor) is what makes a prefix hit checkable:
a sequence may only ever read slots that hold KV computed for exactly its own tokens up to that position.
A state machine drives allocation, computing (prefill chunks and decodes), freeing, preemption with
re-admission, cache filling (so allocations evict) and cache resets; the unit tests pin single behaviours.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dynserve.engine.block_manager import BlockManager
from dynserve.engine.sequence import Sequence
from dynserve.hashing import BlockHash, hash_block, hash_blocks
from dynserve.protocol import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, SamplingParams

VOCAB = 4  # tiny, so prompts share prefixes and whole blocks often
TOKENS = st.integers(0, VOCAB - 1)
SALT = 0


def make_seq(token_ids: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, list(token_ids), SamplingParams(max_tokens=16))


class FakeKV:
    """Stand-in for the KV tensor: slot (block_id, offset) -> the token prefix whose KV was written there."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}

    def write(self, seq: Sequence, start: int, stop: int) -> None:
        for pos in range(start, stop):
            slot = (seq.block_table[pos // self.block_size], pos % self.block_size)
            self.slots[slot] = tuple(seq.token_ids[: pos + 1])

    def assert_reads_own_prefix(self, seq: Sequence, stop: int) -> None:
        """Every position below `stop` must hold KV for exactly `seq`'s own tokens up to it."""
        for pos in range(stop):
            slot = (seq.block_table[pos // self.block_size], pos % self.block_size)
            assert self.slots.get(slot) == tuple(seq.token_ids[: pos + 1]), (
                f"{seq.request_id} position {pos} (block {slot[0]}) holds KV of another prefix"
            )


def compute(bm: BlockManager, kv: FakeKV, seq: Sequence, num_new: int) -> None:
    """What one engine step does for `seq`: read its context, write `num_new` tokens, offer full blocks."""
    kv.assert_reads_own_prefix(seq, seq.num_computed_tokens)
    kv.write(seq, seq.num_computed_tokens, seq.num_computed_tokens + num_new)
    seq.num_computed_tokens += num_new
    bm.register_computed_blocks(seq)


def run_and_keep(bm: BlockManager, kv: FakeKV, token_ids: list[int], request_id: str) -> Sequence:
    """Admit and compute a whole prompt; the sequence keeps its blocks."""
    seq = make_seq(token_ids, request_id)
    assert bm.allocate(seq)
    compute(bm, kv, seq, seq.num_tokens - seq.num_computed_tokens)
    return seq


def run_and_free(bm: BlockManager, kv: FakeKV, token_ids: list[int], request_id: str) -> list[int]:
    """Admit, compute and finish a whole prompt; returns the block table it had."""
    seq = run_and_keep(bm, kv, token_ids, request_id)
    block_table = list(seq.block_table)
    bm.free(seq)
    return block_table


def state_of(bm: BlockManager) -> tuple:
    """Everything an allocation could change, through the public surface."""
    return (
        [(b.ref_count, b.block_hash, b.token_ids) for b in bm.blocks],
        bm.num_free_blocks,
        sorted(bm.cached_block_hashes()),
    )


# ---- the state machine ----------------------------------------------------------------------------------


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives one BlockManager; `cached` is the plain model of cached hashes, rebuilt only from events."""

    @initialize(num_blocks=st.integers(8, 24), block_size=st.integers(2, 4))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.bm = BlockManager(num_blocks, block_size, hash_salt=SALT)
        self.kv = FakeKV(block_size)
        self.running: list[Sequence] = []
        self.preempted: list[Sequence] = []
        self.history: list[list[int]] = [[]]  # token lists seen so far, to draw shared prefixes from
        self.cached: set[int] = set()  # the model: hashes cached, according to the events alone
        self.true_parent: dict[int, BlockHash | None] = {}
        self.next_event_id = 0
        self.num_seqs = 0

    # -- helpers --

    def _new_seq(self, token_ids: list[int]) -> Sequence:
        self.num_seqs += 1
        self.history.append(list(token_ids))
        return make_seq(token_ids, f"r{self.num_seqs}")

    def _expected_hit_blocks(self, token_ids: list[int]) -> int:
        """The longest prefix of full blocks the model says is cached, leaving at least one token."""
        num_hits = 0
        for block_hash in hash_blocks(token_ids, self.bm.block_size, SALT):
            if block_hash not in self.cached:
                break
            num_hits += 1
        if num_hits * self.bm.block_size >= len(token_ids):
            num_hits -= 1
        return num_hits

    def _admit(self, seq: Sequence, num_reserved_blocks: int) -> bool:
        """`allocate` and check the outcome against the models; True if admitted."""
        expected_hits = self._expected_hit_blocks(seq.token_ids)
        held = {b for s in self.running for b in s.block_table}
        num_free_model = self.bm.num_blocks - len(held)
        hit_hashes = hash_blocks(seq.token_ids, self.bm.block_size, SALT)[:expected_hits]
        hit_ids = [b.block_id for b in self.bm.blocks if b.block_hash in set(hit_hashes)]
        num_needed = self.bm.blocks_needed(seq.num_tokens) - expected_hits
        num_from_cache = sum(1 for b in hit_ids if b not in held)
        fits = num_needed + num_from_cache + num_reserved_blocks <= num_free_model
        before = state_of(self.bm)

        admitted = self.bm.allocate(seq, num_reserved_blocks)

        assert admitted == fits
        if not admitted:
            assert state_of(self.bm) == before, "a refused allocation changed the block manager"
            assert seq.block_table == [] and seq.num_computed_tokens == 0
            return False
        block_size = self.bm.block_size
        assert seq.num_computed_tokens == expected_hits * block_size
        assert seq.num_computed_tokens < seq.num_tokens, "no token left to compute"
        assert len(seq.block_table) == self.bm.blocks_needed(seq.num_tokens)
        assert len(set(seq.block_table)) == len(seq.block_table), "a block twice in one table"
        for i in range(expected_hits):  # the reused blocks hold exactly these tokens
            block = self.bm.blocks[seq.block_table[i]]
            assert block.token_ids == tuple(seq.token_ids[i * block_size : (i + 1) * block_size])
            assert block.block_hash == seq.block_hashes[i]
        self.kv.assert_reads_own_prefix(seq, seq.num_computed_tokens)
        self.running.append(seq)
        return True

    def _compute(self, seq: Sequence, num_new: int) -> None:
        compute(self.bm, self.kv, seq, num_new)
        for i, block_hash in enumerate(seq.block_hashes):
            self.true_parent[block_hash] = seq.block_hashes[i - 1] if i else None

    def _pick(self, seqs: list[Sequence], index: int) -> Sequence:
        return seqs[index % len(seqs)]

    # -- rules --

    @rule(
        source=st.integers(0, 10**6),
        prefix_len=st.integers(0, 40),
        extra=st.lists(TOKENS, max_size=10),
        num_reserved_blocks=st.integers(0, 2),
    )
    def admit(self, source: int, prefix_len: int, extra: list[int], num_reserved_blocks: int) -> None:
        prefix = self.history[source % len(self.history)][:prefix_len]
        token_ids = (prefix + extra) or [0]
        self._admit(self._new_seq(token_ids), num_reserved_blocks)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 10**6), num_tokens=st.integers(1, 12), sampled=TOKENS)
    def step(self, index: int, num_tokens: int, sampled: int) -> None:
        """One engine step for a running sequence: a prefill chunk, or a decode of a freshly sampled token.
        If its new block cannot be had, it is preempted, as the scheduler does."""
        seq = self._pick(self.running, index)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(sampled)
        num_new = min(num_tokens, seq.num_tokens - seq.num_computed_tokens)
        table_before = list(seq.block_table)
        num_free_before = self.bm.num_free_blocks
        if not self.bm.ensure_slots(seq, seq.num_computed_tokens + num_new):
            assert seq.block_table == table_before and self.bm.num_free_blocks == num_free_before
            needed = self.bm.blocks_needed(seq.num_computed_tokens + num_new) - len(table_before)
            assert needed > num_free_before
            self._preempt(seq)
            return
        assert len(seq.block_table) * self.bm.block_size >= seq.num_computed_tokens + num_new
        self._compute(seq, num_new)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 10**6))
    def finish(self, index: int) -> None:
        seq = self._pick(self.running, index)
        num_free_before = self.bm.num_free_blocks
        others = {b for s in self.running if s is not seq for b in s.block_table}
        num_released = len(set(seq.block_table) - others)
        self.running.remove(seq)
        self.history.append(list(seq.token_ids))
        self.bm.free(seq)
        assert seq.block_table == []
        assert self.bm.num_free_blocks == num_free_before + num_released

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 10**6))
    def preempt(self, index: int) -> None:
        self._preempt(self._pick(self.running, index))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        assert seq.block_table == [] and seq.num_computed_tokens == 0 and seq.num_registered_blocks == 0
        self.preempted.append(seq)

    @precondition(lambda self: self.preempted)
    @rule(index=st.integers(0, 10**6), num_reserved_blocks=st.integers(0, 1))
    def readmit(self, index: int, num_reserved_blocks: int) -> None:
        """A preempted sequence comes back with its prompt and outputs, recomputing what is not cached."""
        seq = self._pick(self.preempted, index)
        if self._admit(seq, num_reserved_blocks):
            self.preempted.remove(seq)

    @precondition(lambda self: self.bm.num_free_blocks > 0)
    @rule(seed=st.integers(0, 2**32 - 1))
    def fill_cache(self, seed: int) -> None:
        """Run a prompt that takes every available block and free it: the cache is then full, so the next
        allocation has to evict."""
        rng = random.Random(seed)
        token_ids = [rng.randrange(VOCAB) for _ in range(self.bm.num_free_blocks * self.bm.block_size)]
        seq = self._new_seq(token_ids)
        if self._admit(seq, 0):
            self._compute(seq, seq.num_tokens - seq.num_computed_tokens)
            self.running.remove(seq)
            self.bm.free(seq)

    @rule(roll=st.integers(0, 3))
    def reset_prefix_cache(self, roll: int) -> None:
        if roll:  # a reset empties the cache, so make it a rarer step than the others
            return
        num_used = self.bm.num_used_blocks
        self.bm.reset_prefix_cache()
        assert self.bm.cached_block_hashes() == []
        assert all(b.block_hash is None for b in self.bm.blocks)
        assert self.bm.num_used_blocks == num_used  # running sequences keep their blocks

    # -- invariants --

    @invariant()
    def blocks_are_consistent(self) -> None:
        self.bm.check_integrity(self.running)
        assert all(b.ref_count >= 0 for b in self.bm.blocks)
        held = {b for s in self.running for b in s.block_table}
        assert self.bm.num_used_blocks == len(held)
        for seq in self.running:  # a cached block in a table holds that sequence's tokens
            for i, block_id in enumerate(seq.block_table):
                block = self.bm.blocks[block_id]
                if block.block_hash is not None:
                    assert block.block_hash == seq.block_hashes[i]
                    bs = self.bm.block_size
                    assert block.token_ids == tuple(seq.token_ids[i * bs : (i + 1) * bs])

    @invariant()
    def events_replay_to_the_cached_set(self) -> None:
        after_clear = False
        for event in self.bm.drain_events():
            assert event.event_id == self.next_event_id, "event ids must be consecutive from 0"
            self.next_event_id += 1
            self._apply(event, check_parents=not after_clear)
            after_clear = isinstance(event, AllBlocksCleared)
        assert self.cached == set(self.bm.cached_block_hashes())
        assert self.bm.num_cached_blocks == len(self.cached)

    def _apply(self, event: KVEvent, check_parents: bool) -> None:
        # The Stored event right after a Cleared re-announces in-use blocks; its parents are checked by
        # test_reset_reannounces_in_use_blocks_under_their_true_parents instead.
        match event:
            case BlockStored(parent_hash=parent, block_hashes=hashes):
                assert hashes, "empty Stored event"
                for block_hash in hashes:
                    assert block_hash not in self.cached, "hash stored twice without a removal"
                    if check_parents:
                        assert self.true_parent[block_hash] == parent, "Stored event out of chain order"
                    self.cached.add(block_hash)
                    parent = block_hash
            case BlockRemoved(block_hashes=hashes):
                for block_hash in hashes:
                    assert block_hash in self.cached, "removed a hash that was not cached"
                    self.cached.discard(block_hash)
            case AllBlocksCleared():
                self.cached.clear()


BlockManagerMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_block_manager_state_machine = BlockManagerMachine.TestCase


# ---- unit tests -----------------------------------------------------------------------------------------


def test_second_sequence_reuses_the_shared_four_block_prefix() -> None:
    bm, kv = BlockManager(16, 2), FakeKV(2)
    first = run_and_keep(bm, kv, [1, 2, 3, 0, 1, 1, 2, 2, 3], "a")  # 4 full blocks + 1 token
    second = make_seq([1, 2, 3, 0, 1, 1, 2, 2, 0, 0, 3], "b")
    assert bm.allocate(second)
    assert second.block_table[:4] == first.block_table[:4]
    assert second.num_computed_tokens == 8
    assert not set(second.block_table[4:]) & set(first.block_table)
    assert [bm.blocks[b].ref_count for b in first.block_table[:4]] == [2, 2, 2, 2]
    kv.assert_reads_own_prefix(second, 8)
    bm.check_integrity([first, second])


def test_hash_collision_is_not_served() -> None:
    """Two different first blocks forced to one hash: the second must not read the first's KV."""
    bm, kv = BlockManager(8, 2), FakeKV(2)
    first = run_and_keep(bm, kv, [1, 1, 2, 2], "a")
    colliding = make_seq([3, 3, 2, 2, 0], "b")
    colliding.block_hashes = [first.block_hashes[0], hash_block(first.block_hashes[0], [2, 2], SALT)]
    assert bm.allocate(colliding)
    assert colliding.num_computed_tokens == 0
    assert not set(colliding.block_table) & set(first.block_table)
    bm.check_integrity([first, colliding])


def test_collision_is_not_served_through_a_later_block() -> None:
    """A collision's damage reaches every later block: KV of a block depends on all tokens before it.

    `b` collides with `a` on block 0, so its block 0 is not cached but its block 1 is, under the chain hash
    hash(h0, [2, 2]). A third sequence made of a's block 0 and b's block 1 hashes to the same chain and
    finds both blocks with matching token ids; b's block 1, though, holds KV computed after [3, 3], not
    after [1, 1]. Only a's block 0 may be served.
    """
    bm, kv = BlockManager(12, 2), FakeKV(2)
    a = run_and_keep(bm, kv, [1, 1, 0, 0], "a")
    h0 = a.block_hashes[0]
    b = make_seq([3, 3, 2, 2, 0], "b")
    b.block_hashes = [h0, hash_block(h0, [2, 2], SALT)]  # what an xxh3 collision on block 0 produces
    assert bm.allocate(b)
    compute(bm, kv, b, b.num_tokens)
    c = make_seq([1, 1, 2, 2, 0], "c")
    assert bm.allocate(c)
    kv.assert_reads_own_prefix(c, c.num_computed_tokens)
    assert c.num_computed_tokens == 2


def test_freed_sequence_is_evicted_tail_first() -> None:
    bm, kv = BlockManager(4, 2), FakeKV(2)
    token_ids = [0, 1, 2, 3, 3, 2, 1, 0]
    run_and_free(bm, kv, token_ids, "a")  # 4 cached blocks, all evictable
    hashes = hash_blocks(token_ids, 2, SALT)
    assert bm.drain_events() == [BlockStored(0, None, hashes)]
    for i in range(4):
        assert bm.allocate(make_seq([2, 2], f"new{i}"))
    removed = [e.block_hashes for e in bm.drain_events()]
    assert removed == [[h] for h in reversed(hashes)]


def test_reused_blocks_become_most_recently_used() -> None:
    """A cached prefix that was just hit (and freed again) outlives an older, untouched one."""
    bm, kv = BlockManager(4, 2), FakeKV(2)
    run_and_free(bm, kv, [2, 2, 2], "hot")
    run_and_free(bm, kv, [1, 1, 1], "old")
    run_and_free(bm, kv, [2, 2, 0], "hot-again")  # hits hot's block, freeing it again
    bm.drain_events()
    assert bm.allocate(make_seq([3, 3, 3, 3, 3, 3], "filler"))  # needs 3 blocks: 2 free + 1 evicted
    assert [e.block_hashes for e in bm.drain_events()] == [hash_blocks([1, 1], 2, SALT)]
    assert hash_blocks([2, 2], 2, SALT)[0] in bm.cached_block_hashes()


@pytest.mark.parametrize("num_tokens", [8, 7])
def test_fully_cached_prompt_still_computes_its_last_token(num_tokens: int) -> None:
    bm, kv = BlockManager(8, 2), FakeKV(2)
    token_ids = [0, 1, 2, 3, 0, 1, 2, 3][:num_tokens]
    first_table = run_and_free(bm, kv, token_ids, "a")
    again = make_seq(token_ids, "b")
    assert bm.allocate(again)
    assert again.num_computed_tokens == 6
    assert again.num_computed_tokens < again.num_tokens
    assert again.block_table[:3] == first_table[:3]
    kv.assert_reads_own_prefix(again, 6)


def test_single_block_prompt_fully_cached_computes_from_scratch() -> None:
    bm, kv = BlockManager(4, 2), FakeKV(2)
    run_and_free(bm, kv, [1, 2], "a")
    again = make_seq([1, 2], "b")
    assert bm.allocate(again)
    assert again.num_computed_tokens == 0


def test_refused_allocation_changes_nothing() -> None:
    bm, kv = BlockManager(6, 2), FakeKV(2)
    holder = run_and_keep(bm, kv, [3, 3, 3, 3], "holder")  # 2 blocks in use
    run_and_free(bm, kv, [0, 1, 0, 1], "cached")  # 2 evictable blocks, 2 free
    bm.drain_events()
    before = state_of(bm)
    too_big = make_seq([2] * 9, "big")  # 5 blocks > 4 available
    assert not bm.allocate(too_big)
    assert state_of(bm) == before and bm.drain_events() == []
    assert too_big.block_table == [] and too_big.num_computed_tokens == 0
    bm.check_integrity([holder])


def test_reserved_headroom_counts_blocks_taken_back_from_the_cache() -> None:
    """A prefix hit on evictable blocks uses up free capacity just like new blocks do."""
    bm, kv = BlockManager(4, 2), FakeKV(2)
    cached_table = run_and_free(bm, kv, [1, 2, 3, 1, 2, 3], "cached")  # 3 evictable, 1 free
    grow = make_seq([1, 2, 3, 1, 2, 3, 0, 0], "grow")  # 3 hits + 1 new block: exactly the 4 available
    before = state_of(bm)
    assert not bm.allocate(grow, num_reserved_blocks=1)
    assert state_of(bm) == before and grow.block_table == []
    assert bm.allocate(grow, num_reserved_blocks=0)
    assert grow.block_table[:3] == cached_table and grow.num_computed_tokens == 6
    assert bm.num_free_blocks == 0
    bm.check_integrity([grow])


def test_ensure_slots_refusal_changes_nothing() -> None:
    bm, kv = BlockManager(2, 2), FakeKV(2)
    seq = run_and_keep(bm, kv, [0, 1, 2, 3], "a")
    seq.append_token(0)
    assert not bm.ensure_slots(seq, 5)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 0


def test_reset_uncaches_everything_and_keeps_blocks_in_use() -> None:
    """After a reset nothing is cached (the router drops the worker on Cleared); blocks in use stay with
    their sequence and return to the free list, uncached, when it finishes."""
    bm, kv = BlockManager(8, 2), FakeKV(2)
    kept = run_and_keep(bm, kv, [0, 1, 2, 3, 0], "kept")
    run_and_free(bm, kv, [3, 3, 3, 3], "dropped")
    bm.drain_events()
    bm.reset_prefix_cache()
    assert bm.drain_events() == [AllBlocksCleared(bm._next_event_id - 1)]
    assert bm.cached_block_hashes() == []
    assert bm.num_free_blocks == 8 - len(kept.block_table)
    again = make_seq([0, 1, 2, 3, 1], "again")
    assert bm.allocate(again) and again.num_computed_tokens == 0
    bm.check_integrity([kept, again])
    bm.free(kept)
    assert bm.cached_block_hashes() == []
    bm.check_integrity([again])


def test_event_ids_are_consecutive_across_drains() -> None:
    bm, kv = BlockManager(2, 2), FakeKV(2)
    run_and_free(bm, kv, [0, 0, 1, 1], "a")
    first = bm.drain_events()
    run_and_free(bm, kv, [2, 2, 3, 3], "b")  # evicts both of a's blocks, stores two new
    bm.reset_prefix_cache()
    ids = [e.event_id for e in first + bm.drain_events()]
    assert ids == list(range(len(ids)))


def test_prefix_caching_disabled_never_hits_or_emits() -> None:
    bm, kv = BlockManager(8, 2, enable_prefix_caching=False), FakeKV(2)
    run_and_free(bm, kv, [1, 2, 3, 0, 1], "a")
    again = make_seq([1, 2, 3, 0, 1], "b")
    assert bm.allocate(again) and again.num_computed_tokens == 0
    assert bm.cached_block_hashes() == [] and bm.drain_events() == []
    bm.check_integrity([again])


def test_block_hashes_are_xxh3_of_the_parent_then_the_ids_in_little_endian() -> None:
    """The format every worker's prefix cache and every router must share (it is on the wire in KV events):
    pinned here against xxh3 of the spelled-out bytes, chained block to block."""
    import struct

    import xxhash

    ids = [0, 1, 49151, 2**40, 7, 7, 7, 3]
    first = xxhash.xxh3_64_intdigest(bytes(8) + struct.pack("<4q", *ids[:4]), SALT)
    second = xxhash.xxh3_64_intdigest(first.to_bytes(8, "little") + struct.pack("<4q", *ids[4:]), SALT)
    assert hash_blocks(ids + [9], 4, SALT) == [first, second]  # the partial tail is not hashed
    assert [hash_block(None, ids[:4], SALT), hash_block(first, ids[4:], SALT)] == [first, second]
    assert hash_blocks(ids[4:], 4, SALT, parent=first) == [second]
