"""The event-plane interface: workers publish numbered KV events and register themselves; routers read
the events in order and list the live workers.

Ordering: one worker's events are read in the order it published them. Loss: a backend may drop old
events (a trimmed stream, a consumer that fell too far behind); consumers detect that from the gap in the
worker's event ids (see `router.indexer.KVIndex.apply`) and resync from the worker's snapshot.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence

import msgspec

from dynserve.protocol import KVEvent, WorkerInfo

__all__ = ["EventBatch", "EventPlane"]


class EventBatch(msgspec.Struct, array_like=True):
    """Events one worker published together (one XADD entry). `published_s` is the wall-clock time
    (`time.time()`, comparable across processes of one host; across hosts only as far as their clocks agree)
    at which the batch was built for publishing; consumers report their lag from it."""

    worker_id: str
    events: list[KVEvent]
    published_s: float = msgspec.field(default_factory=time.time)


class EventPlane(abc.ABC):
    """Async interface; every method may raise `ConnectionError` when the backend is unreachable."""

    @abc.abstractmethod
    async def publish(self, worker_id: str, events: Sequence[KVEvent]) -> None:
        """Append `events` (in order) for `worker_id`; a no-op for an empty list."""

    @abc.abstractmethod
    async def read(self, cursor: str, *, max_batches: int = 1000, block_s: float = 1.0) -> tuple[list[EventBatch], str]:
        """Batches after `cursor` ("0" for the oldest kept, "$" for only new ones), waiting up to `block_s`
        for the first; returns them and the cursor to pass next time."""

    @abc.abstractmethod
    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        """Announce (or refresh) a worker; it disappears `ttl_s` after its last registration."""

    @abc.abstractmethod
    async def deregister(self, worker_id: str) -> None: ...

    @abc.abstractmethod
    async def workers(self) -> list[WorkerInfo]:
        """Workers whose lease has not expired, sorted by id."""

    async def close(self) -> None:
        """Release connections; the default has none."""
