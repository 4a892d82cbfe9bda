"""The approximate router's memory: which prompt blocks this router sent to which worker, for `ttl_s`.

Without KV events the router can still keep affinity: a worker that just prefilled a prompt most likely
still caches its blocks for a while. `RouteMemory.remember` records the chosen worker's prompt block hashes
(refreshing ones it already had), `match` answers like `KVIndex.match` from that memory, and blocks are
forgotten `ttl_s` after they were last routed, or, oldest first, when a worker has more than
`max_blocks_per_worker` remembered (no worker caches more than its KV blocks, so neither should its memory).

Time is passed in (`now_s`, from one clock that never goes back), so the structure is pure and tests drive
it without sleeping. Expiry is lazy, at each `match`/`expire`, and costs O(1) per forgotten block: each
worker keeps its blocks in an ordered dict in expiry order (a refresh moves a block to the end; the TTL is
one constant), and a queue of (deadline, worker) pairs, one per `remember`, says whose front to look at.

Invariants, checked by `check_integrity`: the index holds exactly each worker's remembered blocks; each
worker's deadlines are non-decreasing in order; no worker remembers more than `max_blocks_per_worker`.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from dynserve.router.indexer import KVIndex

__all__ = ["RouteMemory"]


class RouteMemory:
    def __init__(self, *, ttl_s: float, max_blocks_per_worker: int) -> None:
        if ttl_s <= 0 or max_blocks_per_worker < 1:
            raise ValueError(f"need ttl_s > 0 and max_blocks_per_worker >= 1, not {ttl_s} and "
                             f"{max_blocks_per_worker}")
        self.ttl_s, self.max_blocks_per_worker = ttl_s, max_blocks_per_worker
        self.index = KVIndex()
        self._deadlines_s: dict[str, OrderedDict[int, float]] = {}  # worker -> block hash -> forget at
        self._pending: deque[tuple[float, str]] = deque()  # (deadline, worker), in deadline order

    def remember(self, worker_id: str, block_hashes: Sequence[int], now_s: float) -> None:
        """`worker_id` was sent a prompt made of `block_hashes` at `now_s`."""
        if not block_hashes:
            return
        deadline_s = now_s + self.ttl_s
        remembered = self._deadlines_s.setdefault(worker_id, OrderedDict())
        new: list[int] = []
        for block_hash in block_hashes:
            if block_hash in remembered:
                remembered.move_to_end(block_hash)
            else:
                new.append(block_hash)
            remembered[block_hash] = deadline_s
        self.index.add_blocks(worker_id, new)
        overflow = len(remembered) - self.max_blocks_per_worker
        if overflow > 0:
            self.index.remove_blocks(worker_id, [remembered.popitem(last=False)[0] for _ in range(overflow)])
        self._pending.append((deadline_s, worker_id))

    def expire(self, now_s: float) -> None:
        """Forget every block whose deadline is at or before `now_s`."""
        pending = self._pending
        while pending and pending[0][0] <= now_s:
            _, worker_id = pending.popleft()
            remembered = self._deadlines_s.get(worker_id)
            if not remembered:
                continue  # forgotten already (by an earlier deadline of the same worker, or forget_worker)
            gone = []
            for block_hash, deadline_s in remembered.items():
                if deadline_s > now_s:
                    break
                gone.append(block_hash)
            for block_hash in gone:
                del remembered[block_hash]
            self.index.remove_blocks(worker_id, gone)

    def match(self, block_hashes: Sequence[int], now_s: float) -> dict[str, int]:
        """Each worker's remembered prefix overlap with the prompt, as of `now_s` (see `KVIndex.match`)."""
        self.expire(now_s)
        return self.index.match(block_hashes)

    def forget_worker(self, worker_id: str) -> None:
        self._deadlines_s.pop(worker_id, None)
        self.index.remove_worker(worker_id)

    def num_blocks(self, worker_id: str) -> int:
        remembered = self._deadlines_s.get(worker_id)
        return len(remembered) if remembered is not None else 0

    def check_integrity(self) -> None:
        """Raise AssertionError if the memory and its index disagree, or an order or bound is broken."""
        self.index.check_integrity()
        for worker_id, remembered in self._deadlines_s.items():
            assert self.index.worker_blocks(worker_id) == set(remembered), f"{worker_id}: index != memory"
            deadlines = list(remembered.values())
            assert deadlines == sorted(deadlines), f"{worker_id}: deadlines out of order"
            assert len(remembered) <= self.max_blocks_per_worker, f"{worker_id}: over its bound"
        for worker_id in self.index.worker_ids:
            assert self.index.num_worker_blocks(worker_id) == 0 or worker_id in self._deadlines_s
        pending = [deadline_s for deadline_s, _ in self._pending]
        assert pending == sorted(pending), "pending deadlines out of order"
