"""The event plane in one process: a bounded log of event batches and a dict of leased worker records.

Same contract as the Redis backend, including loss: the log keeps the last `max_len` batches, and a
reader whose cursor fell off the front continues from the oldest kept batch (its index then sees the gap).
Safe for any number of asyncio readers in the process's loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence

from dynserve.events.base import EventBatch, EventPlane
from dynserve.protocol import KVEvent, WorkerInfo

__all__ = ["MemoryEventPlane"]


class MemoryEventPlane(EventPlane):
    def __init__(self, *, max_len: int = 100_000) -> None:
        self._log: deque[tuple[int, EventBatch]] = deque(maxlen=max_len)
        self._next_seq = 1
        self._changed = asyncio.Event()
        self._leases: dict[str, tuple[WorkerInfo, float]] = {}

    async def publish(self, worker_id: str, events: Sequence[KVEvent]) -> None:
        if not events:
            return
        self._log.append((self._next_seq, EventBatch(worker_id, list(events))))
        self._next_seq += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def read(self, cursor: str, *, max_batches: int = 1000,
                   block_s: float = 1.0) -> tuple[list[EventBatch], str]:
        after = self._next_seq - 1 if cursor == "$" else int(cursor)
        if after >= self._next_seq:  # a cursor of an earlier plane (this one was started again): from the start
            after = 0
        if not self._log or self._log[-1][0] <= after:
            try:
                await asyncio.wait_for(self._changed.wait(), block_s)
            except TimeoutError:
                return [], str(after)
        # sequence numbers are consecutive, so the first batch after `after` is found by position; a caught-up
        # reader's position is near the end, where indexing a deque is cheap
        log, batches = self._log, []
        for index in range(max(0, after + 1 - log[0][0]), len(log)):
            seq, batch = log[index]
            batches.append(batch)
            after = seq
            if len(batches) == max_batches:
                break
        return batches, str(after)

    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        self._leases[info.worker_id] = (info, time.monotonic() + ttl_s)

    async def deregister(self, worker_id: str) -> None:
        self._leases.pop(worker_id, None)

    async def workers(self) -> list[WorkerInfo]:
        now = time.monotonic()
        for worker_id in [w for w, (_, expires) in self._leases.items() if expires <= now]:
            del self._leases[worker_id]
        return sorted((info for info, _ in self._leases.values()), key=lambda i: i.worker_id)
