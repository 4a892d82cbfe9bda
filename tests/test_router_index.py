"""The KV index against a plain dict model, driven by random event streams with lost events and resyncs."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dynserve.protocol import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from dynserve.router.indexer import RUN_BLOCKS, KVIndex

WORKERS = ["w0", "w1", "w2", "w3"]
HASHES = st.integers(min_value=0, max_value=24)


def model_match(known: dict[str, set[int]], prompt: list[int]) -> dict[str, int]:
    overlaps = {}
    for worker, blocks in known.items():
        depth = 0
        while depth < len(prompt) and prompt[depth] in blocks:
            depth += 1
        if depth:
            overlaps[worker] = depth
    return overlaps


class IndexMachine(RuleBasedStateMachine):
    """Workers change their caches and emit numbered events; some events are lost in transit. The index
    must always agree with what it has been told, detect every loss at the next delivered event, and
    after a resync agree with the worker's true cache."""

    def __init__(self) -> None:
        super().__init__()
        self.index = KVIndex()
        self.truth: dict[str, set[int]] = {}  # each worker's real cache
        self.known: dict[str, set[int]] = {}  # what the index has been told
        self.next_id: dict[str, int] = {}
        self.gap: dict[str, bool] = {}

    def _emit(self, worker: str, event: KVEvent, lost: bool) -> None:
        if lost:
            self.gap[worker] = True
            return
        applied = self.index.apply(worker, [event])
        if self.gap.get(worker):
            assert not applied, "a lost event went unnoticed"
            self.index.resync(worker, self.truth[worker], event.event_id)
            self.known[worker] = set(self.truth[worker])
            self.gap[worker] = False
        else:
            assert applied
            self.known[worker] = set(self.truth[worker])

    def _next(self, worker: str) -> int:
        event_id = self.next_id.get(worker, 0)
        self.next_id[worker] = event_id + 1
        self.truth.setdefault(worker, set())
        return event_id

    @rule(worker=st.sampled_from(WORKERS), hashes=st.lists(HASHES, min_size=1, max_size=6), lost=st.booleans())
    def store(self, worker: str, hashes: list[int], lost: bool) -> None:
        event_id = self._next(worker)
        self.truth[worker] |= set(hashes)
        self._emit(worker, BlockStored(event_id, None, hashes), lost)

    @rule(worker=st.sampled_from(WORKERS), data=st.data(), lost=st.booleans())
    def remove(self, worker: str, data: st.DataObject, lost: bool) -> None:
        event_id = self._next(worker)
        held = sorted(self.truth[worker])
        gone = data.draw(st.lists(st.sampled_from(held), max_size=4)) if held else []
        self.truth[worker] -= set(gone)
        self._emit(worker, BlockRemoved(event_id, gone), lost)

    @rule(worker=st.sampled_from(WORKERS), lost=st.booleans())
    def clear(self, worker: str, lost: bool) -> None:
        event_id = self._next(worker)
        self.truth[worker] = set()
        self._emit(worker, AllBlocksCleared(event_id), lost)

    @precondition(lambda self: bool(self.truth))
    @rule(data=st.data())
    def worker_leaves(self, data: st.DataObject) -> None:
        worker = data.draw(st.sampled_from(sorted(self.truth)))
        self.index.remove_worker(worker)
        for table in (self.truth, self.known, self.next_id, self.gap):
            table.pop(worker, None)

    @rule(worker=st.sampled_from(WORKERS))
    def replayed_event_is_ignored(self, worker: str) -> None:
        last = self.index.last_event_id(worker)
        if last is not None:
            assert self.index.apply(worker, [BlockStored(last, None, [999])])
            assert 999 not in self.index.worker_blocks(worker)

    @rule(prompt=st.lists(HASHES, min_size=1, max_size=8))
    def match_agrees_with_the_model(self, prompt: list[int]) -> None:
        assert self.index.match(prompt) == model_match(self.known, prompt)

    @invariant()
    def index_holds_what_it_was_told(self) -> None:
        self.index.check_integrity()
        for worker, blocks in self.known.items():
            assert self.index.worker_blocks(worker) == blocks
        assert self.index.num_blocks == len(set().union(*self.known.values()))


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_match_counts_leading_blocks_only() -> None:
    index = KVIndex()
    index.apply("a", [BlockStored(0, None, [1, 2, 3])])
    index.apply("b", [BlockStored(0, None, [1, 3])])
    assert index.match([1, 2, 3, 4]) == {"a": 3, "b": 1}
    assert index.match([2, 3]) == {"a": 2}
    assert index.match([7]) == {}


def test_a_worker_seen_mid_stream_needs_a_snapshot() -> None:
    index = KVIndex()
    assert not index.apply("late", [BlockStored(5, None, [1])])
    index.resync("late", [1, 2], last_event_id=5)
    assert index.apply("late", [BlockStored(6, None, [3])])
    assert index.worker_blocks("late") == {1, 2, 3}


def test_removing_a_worker_frees_its_bit_for_the_next() -> None:
    index = KVIndex()
    for i in range(100):
        index.apply(f"w{i}", [BlockStored(0, None, [i, 1000])])
        index.remove_worker(f"w{i}")
    index.check_integrity()
    assert index.num_blocks == 0 and index._next_bit == 1


class MaskWalkIndexMachine(IndexMachine):
    """The same, with an index that walks the shared masks until one worker is left, then scans its set."""

    def __init__(self) -> None:
        super().__init__()
        self.index = KVIndex(scan_max_workers=1)


TestMaskWalkIndexMachine = MaskWalkIndexMachine.TestCase
TestMaskWalkIndexMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


@given(st.dictionaries(st.sampled_from(WORKERS), st.sets(HASHES, max_size=20), min_size=1),
       st.lists(HASHES, max_size=12))
@settings(max_examples=300, deadline=None)
def test_match_does_not_depend_on_how_it_walks(known: dict[str, set[int]], prompt: list[int]) -> None:
    """Mask walk, per-worker scan, or a switch between them part-way: the same overlaps."""
    answers = []
    for scan_max_workers in range(len(WORKERS) + 1):
        index = KVIndex(scan_max_workers=scan_max_workers)
        for worker, blocks in known.items():
            index.add_blocks(worker, blocks)
        answers.append(index.match(prompt))
    assert all(answer == model_match(known, prompt) for answer in answers)


def test_blocks_added_and_removed_outside_the_event_numbering() -> None:
    index = KVIndex()
    index.add_blocks("a", [1, 2, 3])
    index.add_blocks("b", [1])
    index.remove_blocks("a", [3, 99])  # 99 was never held: skipped
    index.remove_blocks("nobody", [1])
    assert index.match([1, 2, 3]) == {"a": 2, "b": 1}
    assert index.last_event_id("a") is None  # events for "a" would still start at 0
    index.check_integrity()


CHAIN_HASHES = st.integers(min_value=0, max_value=120)


@given(st.lists(st.tuples(st.sampled_from(["w0", "w1"]), st.booleans(),
                          st.lists(CHAIN_HASHES, min_size=1, max_size=3 * RUN_BLOCKS)), max_size=12),
       st.lists(st.lists(CHAIN_HASHES, max_size=3 * RUN_BLOCKS), min_size=1, max_size=4))
@settings(max_examples=300, deadline=None)
def test_long_runs_stored_removed_and_stored_again_match_like_sets(
        operations: list[tuple[str, bool, list[int]]], prompts: list[list[int]]) -> None:
    """Events longer than a run, removals inside runs, hashes stored again in other runs: prompts made of
    stored stretches (and random ones) still match exactly what a set per worker says."""
    index = KVIndex(scan_max_workers=0 if len(prompts) % 2 else 8)
    known: dict[str, set[int]] = {"w0": set(), "w1": set()}
    stored: list[list[int]] = []
    for worker, is_store, hashes in operations:
        if is_store:
            index.add_blocks(worker, hashes)
            known[worker] |= set(hashes)
            stored.append(hashes)
        else:
            index.remove_blocks(worker, hashes)
            known[worker] -= set(hashes)
        index.check_integrity()
    for prompt in prompts + [s[:len(s) // 2] + p for s in stored for p in prompts[:1]] + stored:
        assert index.match(prompt) == model_match({w: b for w, b in known.items() if b}, prompt)


def test_runs_left_without_live_blocks_are_dropped_as_they_pile_up() -> None:
    """A worker that keeps caching and evicting (one event per block) holds a bounded number of runs."""
    index = KVIndex()
    for i in range(5000):
        index.apply("w0", [BlockStored(2 * i, None, [i]), BlockRemoved(2 * i + 1, [i - 10])])
    index.check_integrity()
    assert index.num_worker_blocks("w0") == 10 and index.worker_blocks("w0") == set(range(4990, 5000))
    assert len(index._workers["w0"].runs) <= 2 * 10 + 64 + 1
    assert index.match([4990, 4991, 7]) == {"w0": 2}
