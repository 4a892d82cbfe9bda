"""The KV index: which worker caches which block, kept from the workers' KV events.

Each worker gets a bit; each block hash maps to the bitmask of the workers holding it, and each worker
keeps the set of its hashes, so dropping a worker costs its own blocks, not the whole index. `match`
walks a prompt's block hashes in order and ANDs the masks, so a decision costs one dict lookup and one
integer AND per block whatever the number of workers (up to any count: Python ints are unbounded).

Events are numbered per worker. `apply` takes them in order and stops at the first gap (a lost event,
or a worker seen for the first time mid-stream), returning False: the caller then asks that worker for a
snapshot (its cached hashes and the id of its last event) and calls `resync`, after which events
continue from there. Invariants, checked by `check_integrity`: a hash's mask has a worker's bit exactly
when the worker's set has the hash, no mask is 0, and bits belong to known workers only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dynserve.protocol import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["KVIndex"]


@dataclass(slots=True)
class _Worker:
    bit: int
    blocks: set[int] = field(default_factory=set)
    last_event_id: int | None = None  # None: no event seen yet, accept only a first event (id 0) or a resync


class KVIndex:
    def __init__(self) -> None:
        self._holders: dict[int, int] = {}  # block hash -> bitmask of workers
        self._workers: dict[str, _Worker] = {}
        self._owners: dict[int, str] = {}  # bit -> worker id
        self._free_bits: list[int] = []
        self._next_bit = 0

    # ---- workers ---------------------------------------------------------------------------------------

    @property
    def worker_ids(self) -> list[str]:
        return list(self._workers)

    @property
    def num_blocks(self) -> int:
        """Distinct block hashes held by at least one worker."""
        return len(self._holders)

    def num_worker_blocks(self, worker_id: str) -> int:
        worker = self._workers.get(worker_id)
        return len(worker.blocks) if worker is not None else 0

    def worker_blocks(self, worker_id: str) -> set[int]:
        worker = self._workers.get(worker_id)
        return set(worker.blocks) if worker is not None else set()

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
            worker = self._workers[worker_id] = _Worker(bit)
            self._owners[bit] = worker_id
        return worker

    def remove_worker(self, worker_id: str) -> None:
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return
        self._drop_all(worker)
        del self._owners[worker.bit]
        self._free_bits.append(worker.bit)

    # ---- events ----------------------------------------------------------------------------------------

    def apply(self, worker_id: str, events: Iterable[KVEvent]) -> bool:
        """Apply `worker_id`'s events in order; False at the first gap (the rest is not applied: resync)."""
        worker = self._worker(worker_id)
        for event in events:
            expected = 0 if worker.last_event_id is None else worker.last_event_id + 1
            if event.event_id < expected:
                continue  # already applied (a replay after a resync)
            if event.event_id > expected:
                return False
            if isinstance(event, BlockStored):
                self._store(worker, event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self._remove(worker, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self._drop_all(worker)
            worker.last_event_id = event.event_id
        return True

    def resync(self, worker_id: str, block_hashes: Iterable[int], last_event_id: int | None) -> None:
        """Replace what the index knows of `worker_id` by its snapshot, taken after event `last_event_id`."""
        worker = self._worker(worker_id)
        self._drop_all(worker)
        self._store(worker, block_hashes)
        worker.last_event_id = last_event_id

    def _store(self, worker: _Worker, block_hashes: Iterable[int]) -> None:
        holders, bit, blocks = self._holders, worker.bit, worker.blocks
        for block_hash in block_hashes:
            holders[block_hash] = holders.get(block_hash, 0) | bit
            blocks.add(block_hash)

    def _remove(self, worker: _Worker, block_hashes: Iterable[int]) -> None:
        holders, keep, blocks = self._holders, ~worker.bit, worker.blocks
        for block_hash in block_hashes:
            if block_hash not in blocks:
                continue
            blocks.discard(block_hash)
            mask = holders[block_hash] & keep
            if mask:
                holders[block_hash] = mask
            else:
                del holders[block_hash]

    def _drop_all(self, worker: _Worker) -> None:
        self._remove(worker, list(worker.blocks))

    # ---- matching --------------------------------------------------------------------------------------

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """For each worker holding the prompt's first block: how many leading blocks of it the worker
        holds (its prefix overlap). Workers holding none are absent."""
        holders = self._holders
        candidates = 0
        depth = 0
        dropped_at: list[tuple[int, int]] = []  # (mask of workers that stopped matching, their overlap)
        for block_hash in block_hashes:
            mask = holders.get(block_hash, 0)
            remaining = mask if depth == 0 else candidates & mask
            if depth and remaining != candidates:
                dropped_at.append((candidates & ~remaining, depth))
            candidates = remaining
            if not candidates:
                break
            depth += 1
        if candidates:
            dropped_at.append((candidates, depth))
        overlaps: dict[str, int] = {}
        owners = self._owners
        for mask, overlap in dropped_at:
            while mask:  # one step per matching worker, not per worker known
                low = mask & -mask
                overlaps[owners[low]] = overlap
                mask ^= low
        return overlaps

    def check_integrity(self) -> None:
        """Raise AssertionError if the masks and the per-worker sets disagree."""
        known = 0
        for worker in self._workers.values():
            assert not known & worker.bit, "two workers share a bit"
            known |= worker.bit
            for block_hash in worker.blocks:
                assert self._holders.get(block_hash, 0) & worker.bit, f"{block_hash} lacks the holder's bit"
        assert set(self._owners) == {w.bit for w in self._workers.values()}, "bit owners disagree with workers"
        for block_hash, mask in self._holders.items():
            assert mask, f"{block_hash} has an empty mask"
            assert not mask & ~known, f"{block_hash} names unknown workers"
            for worker in self._workers.values():
                if mask & worker.bit:
                    assert block_hash in worker.blocks, f"{block_hash} has a bit its worker does not hold"
