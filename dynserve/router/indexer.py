"""The KV index: which worker caches which block, kept from the workers' KV events.

Blocks are kept in *runs*: the hashes of one `BlockStored` event, in chain order, in lists of at most
`RUN_BLOCKS` that start with their worker's bit (`[bit, hash, hash, ...]`). One dict maps each block hash
to the run it is live in, or, for a hash several workers hold, to their runs by bit and their mask. A removed
hash is blanked (None) in its run, and a hash stored again is blanked where it was, so a run's live
entries are exactly hashes its worker holds, each live in one run only.

Why runs: on a large index a hash lookup is a cache and TLB miss, and those misses, not the arithmetic,
were the cost of a decision. `match` finds the run of the prompt's next block with one lookup and then
confirms as many blocks as the run and the prompt share with one list comparison over memory that lies
together; a prefix stored by a few events costs a few lookups, not one per block. Ingest is one dict
write per new block. `match` reads the first block's entry to learn which workers hold any of the prompt;
while more than `scan_max_workers` of them still match it walks the blocks ANDing their holder masks (one
lookup per block whatever the number of workers); once few remain it follows each one's runs: the common
case (a prefix lives on one or two workers). Both give the same answer (tests check every switch point).

Events are numbered per worker. `apply` takes them in order and stops at the first gap (a lost event,
or a worker seen for the first time mid-stream), returning False: the caller then asks that worker for a
snapshot (its cached hashes and the id of its last event) and calls `resync`, after which events
continue from there. `apply` indexes device blocks; events on a lower medium keep their place in the
numbering and go to a callback (`tiers.TieredIndex` indexes them in an index of their own).
`add_blocks`/`remove_blocks` change a worker's blocks outside the numbering (the approximate router's
memory of where it sent prompts, `router.approx`).

Invariants, checked by `check_integrity`: every live entry of a run maps back to that run; a shared entry
names two workers or more; each worker's count is its number of live entries; its list of runs holds every
run with a live entry (dead runs are dropped as the list grows); bits belong to known workers only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import takewhile
from operator import eq, truth

from dynserve.protocol import MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["RUN_BLOCKS", "KVIndex"]

DEVICE = MEDIA[0]  # the medium this index holds (`tiers.TieredIndex` keeps one of these per medium)
RUN_BLOCKS = 32  # longest run: bounds the search for a hash inside its run (entering mid-run, removing)

_Run = list  # [worker bit, hash or None, ...]: held hashes in chain order, None where one is no longer live


@dataclass(slots=True)
class _Shared:
    """A hash that several workers hold: each one's run, by bit, and the OR of those bits."""

    mask: int
    runs: dict[int, _Run]


_Entry = _Run | _Shared  # the run of the one worker holding a hash, or the runs of several


@dataclass(slots=True)
class _Worker:
    worker_id: str
    bit: int
    num_blocks: int = 0
    runs: list[_Run] = field(default_factory=list)
    last_event_id: int | None = None  # None: no event seen yet, accept only a first event (id 0) or a resync


class KVIndex:
    def __init__(self, *, scan_max_workers: int = 8) -> None:
        """`scan_max_workers`: when at most this many workers still match, `match` follows each one's runs
        instead of walking the shared masks (a speed knob only: answers do not depend on it)."""
        if scan_max_workers < 0:
            raise ValueError(f"scan_max_workers must not be negative: {scan_max_workers}")
        self.scan_max_workers = scan_max_workers
        self._entries: dict[int, _Entry] = {}  # block hash -> where it is live
        self._workers: dict[str, _Worker] = {}
        self._owners: dict[int, _Worker] = {}  # bit -> its worker
        self._free_bits: list[int] = []
        self._next_bit = 0

    # ---- workers ---------------------------------------------------------------------------------------

    @property
    def worker_ids(self) -> list[str]:
        return list(self._workers)

    @property
    def num_blocks(self) -> int:
        """Distinct block hashes held by at least one worker."""
        return len(self._entries)

    def num_worker_blocks(self, worker_id: str) -> int:
        worker = self._workers.get(worker_id)
        return worker.num_blocks if worker is not None else 0

    def worker_blocks(self, worker_id: str) -> set[int]:
        worker = self._workers.get(worker_id)
        if worker is None:
            return set()
        return {h for run in worker.runs for h in run[1:] if h is not None}

    def last_event_id(self, worker_id: str) -> int | None:
        worker = self._workers.get(worker_id)
        return worker.last_event_id if worker is not None else None

    def _worker(self, worker_id: str) -> _Worker:
        worker = self._workers.get(worker_id)
        if worker is None:
            if self._free_bits:
                bit = self._free_bits.pop()
            else:
                bit, self._next_bit = 1 << self._next_bit, self._next_bit + 1
            worker = self._workers[worker_id] = _Worker(worker_id, bit)
            self._owners[bit] = worker
        return worker

    def remove_worker(self, worker_id: str) -> None:
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return
        self._drop_all(worker)
        del self._owners[worker.bit]
        self._free_bits.append(worker.bit)

    # ---- events ----------------------------------------------------------------------------------------

    def apply(self, worker_id: str, events: Iterable[KVEvent],
              elsewhere: Callable[[str, KVEvent], None] | None = None) -> bool:
        """Apply `worker_id`'s events in order; False at the first gap (the rest is not applied: resync).
        This index holds device blocks: a store or removal on another medium is handed to `elsewhere` (in
        its place in the numbering) or skipped without one; a clear is applied and handed on too."""
        worker = self._worker(worker_id)
        for event in events:
            expected = 0 if worker.last_event_id is None else worker.last_event_id + 1
            if event.event_id < expected:
                continue  # already applied (a replay after a resync)
            if event.event_id > expected:
                return False
            if isinstance(event, BlockStored):
                if event.medium == DEVICE:
                    self._store(worker, event.block_hashes)
                elif elsewhere is not None:
                    elsewhere(worker_id, event)
            elif isinstance(event, BlockRemoved):
                if event.medium == DEVICE:
                    self._remove(worker, event.block_hashes)
                elif elsewhere is not None:
                    elsewhere(worker_id, event)
            elif isinstance(event, AllBlocksCleared):
                self._drop_all(worker)
                if elsewhere is not None:
                    elsewhere(worker_id, event)
            worker.last_event_id = event.event_id
        return True

    def resync(self, worker_id: str, block_hashes: Iterable[int], last_event_id: int | None) -> None:
        """Replace what the index knows of `worker_id` by its snapshot, taken after event `last_event_id`."""
        worker = self._worker(worker_id)
        self._drop_all(worker)
        self._store(worker, block_hashes)
        worker.last_event_id = last_event_id

    def add_blocks(self, worker_id: str, block_hashes: Iterable[int]) -> None:
        """Record that `worker_id` holds `block_hashes` (in chain order), outside the event numbering."""
        self._store(self._worker(worker_id), block_hashes)

    def remove_blocks(self, worker_id: str, block_hashes: Iterable[int]) -> None:
        """Record that `worker_id` no longer holds `block_hashes` (those it does not hold are skipped)."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            self._remove(worker, block_hashes)

    def clear_blocks(self, worker_id: str) -> None:
        """Drop every block `worker_id` holds, outside the event numbering (it stays known, bit and numbering
        kept)."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            self._drop_all(worker)

    def _store(self, worker: _Worker, block_hashes: Iterable[int]) -> None:
        entries, bit, runs = self._entries, worker.bit, worker.runs
        entry_of = entries.get
        hashes = block_hashes if isinstance(block_hashes, list) else list(block_hashes)
        num_new = 0
        for start in range(0, len(hashes), RUN_BLOCKS):
            chunk = hashes[start:start + RUN_BLOCKS]
            run: _Run = [bit, *chunk]
            runs.append(run)
            for block_hash in chunk:
                entry = entry_of(block_hash)
                if entry is None:  # the common case: nobody holds it
                    entries[block_hash] = run
                    num_new += 1
                else:
                    num_new += self._store_held(entry, block_hash, run, bit)
        worker.num_blocks += num_new
        if len(runs) > 2 * worker.num_blocks + 64:  # many runs have no live entry left: drop those
            worker.runs = [run for run in runs if run.count(None) < len(run) - 1]

    def _store_held(self, entry: _Entry, block_hash: int, run: _Run, bit: int) -> int:
        """Make `run` the live place of `block_hash`, which some worker holds already; 1 if new to `bit`."""
        if isinstance(entry, list):
            if entry[0] != bit:  # another worker's: now shared
                self._entries[block_hash] = _Shared(entry[0] | bit, {entry[0]: entry, bit: run})
                return 1
            entry[entry.index(block_hash, 1)] = None  # stored again (or repeated in this run): one live place
            self._entries[block_hash] = run
            return 0
        old = entry.runs.get(bit)
        entry.runs[bit] = run
        if old is None:
            entry.mask |= bit
            return 1
        old[old.index(block_hash, 1)] = None
        return 0

    def _remove(self, worker: _Worker, block_hashes: Iterable[int]) -> None:
        entries, bit = self._entries, worker.bit
        for block_hash in block_hashes:
            entry = entries.get(block_hash)
            if entry is None:
                continue
            if isinstance(entry, list):
                if entry[0] != bit:
                    continue
                run = entry
                del entries[block_hash]
            else:
                run = entry.runs.pop(bit, None)
                if run is None:
                    continue
                entry.mask &= ~bit
                if len(entry.runs) == 1:
                    entries[block_hash] = next(iter(entry.runs.values()))
            run[run.index(block_hash, 1)] = None
            worker.num_blocks -= 1

    def _drop_all(self, worker: _Worker) -> None:
        self._remove(worker, [h for run in worker.runs for h in run[1:] if h is not None])
        worker.runs = []

    # ---- matching --------------------------------------------------------------------------------------

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """For each worker holding the prompt's first block: how many leading blocks of it the worker
        holds (its prefix overlap). Workers holding none are absent."""
        if not block_hashes:
            return {}
        if not isinstance(block_hashes, list):  # runs are lists: compare like with like
            block_hashes = list(block_hashes)
        entry_of, owners = self._entries.get, self._owners
        candidates = _mask(entry_of(block_hashes[0]))  # workers holding block_hashes[:depth]
        depth = 1
        overlaps: dict[str, int] = {}
        num_blocks, scan_max = len(block_hashes), self.scan_max_workers
        while candidates and depth < num_blocks and candidates.bit_count() > scan_max:
            entry = entry_of(block_hashes[depth])  # _mask, inlined: this loop runs once per block
            if entry is None:
                remaining = 0
            else:
                remaining = candidates & (entry[0] if type(entry) is list else entry.mask)
            if remaining != candidates:
                dropped = candidates ^ remaining
                while dropped:  # one step per worker that stopped matching, not per worker known
                    low = dropped & -dropped
                    overlaps[owners[low].worker_id] = depth
                    dropped ^= low
                candidates = remaining
            depth += 1
        while candidates:
            low = candidates & -candidates
            overlaps[owners[low].worker_id] = _follow_runs(self._entries, low, block_hashes, depth)
            candidates ^= low
        return overlaps

    def extend(self, worker_id: str, block_hashes: list[int], start: int) -> int:
        """The end of the stretch of `block_hashes` that `worker_id` holds from `start` on: `start` when it
        does not hold `block_hashes[start]` (the tiered index continues a prefix from one medium in the
        next)."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return start
        return _follow_runs(self._entries, worker.bit, block_hashes, start)

    # ---- integrity -------------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError unless the runs and the entries agree (see the module docstring)."""
        listed = {id(run) for worker in self._workers.values() for run in worker.runs}
        for block_hash, entry in self._entries.items():
            shared = isinstance(entry, _Shared)
            places = list(entry.runs.values()) if shared else [entry]
            assert not shared or len(places) >= 2, f"{block_hash}: a shared entry of one worker"
            assert _mask(entry) == sum(run[0] for run in places), f"{block_hash}: its mask is off"
            for run in places:
                assert run[0] in self._owners, f"{block_hash} names an unknown worker"
                assert id(run) in listed, f"{block_hash}: its run is missing from its worker's runs"
                assert not shared or entry.runs[run[0]] is run, f"{block_hash}: keyed by the wrong bit"
                assert block_hash in run[1:], f"{block_hash} is not live in its run"
        for worker in self._workers.values():
            assert self._owners[worker.bit] is worker, f"{worker.worker_id}: bit owners disagree"
            live = []
            for run in worker.runs:
                assert run[0] == worker.bit and len(run) <= RUN_BLOCKS + 1
                for block_hash in run[1:]:
                    if block_hash is not None:
                        live.append(block_hash)
                        where = _run_of(self._entries.get(block_hash), worker.bit)
                        assert where is run, f"{block_hash}: live in a run it does not map to"
            assert len(live) == len(set(live)), f"{worker.worker_id}: a hash live twice"
            assert len(live) == worker.num_blocks, f"{worker.worker_id}: miscounted"
        assert len(self._owners) == len(self._workers)


def _mask(entry: _Entry | None) -> int:
    """The bits of the workers an entry names (0 for none)."""
    if entry is None:
        return 0
    return entry[0] if isinstance(entry, list) else entry.mask


def _run_of(entry: _Entry | None, bit: int) -> _Run | None:
    if entry is None:
        return None
    if isinstance(entry, list):
        return entry if entry[0] == bit else None
    return entry.runs.get(bit)


def _follow_runs(entries: dict[int, _Entry], bit: int, block_hashes: list[int], depth: int) -> int:
    """How far the worker `bit`, holding `block_hashes[:depth]`, holds the prompt: find the run of the next
    block, take as many blocks as the run and the prompt share from there, repeat."""
    num_blocks = len(block_hashes)
    while depth < num_blocks:
        block_hash = block_hashes[depth]
        run = _run_of(entries.get(block_hash), bit)
        if run is None:
            break
        ahead = run[run.index(block_hash, 1):]
        stop = depth + len(ahead)
        if block_hashes[depth:stop] == ahead:
            depth = stop
        else:  # they part (or the prompt ends) inside the run: count the shared stretch, at least this block
            depth += len(list(takewhile(truth, map(eq, ahead, block_hashes[depth:stop]))))
    return depth
