"""A worker's place on the event plane (`Registration`): its record in the registry under a lease that a
heartbeat renews every third of the lease, and its KV events, published in the order its engine emitted
them, until it leaves (`leave`: the heartbeat stops, the record is removed) or stops (`cancel`).

KV events: at most one publish per `_PUBLISH_INTERVAL_S` while they keep coming, so a busy worker's steps
batch up into one publish, and each publish costs the plane's actor CPU (the interval's measurement:
docs/benchmarks.md). A router sees a stream's blocks at most this much later; the first events after a quiet
spell still go out at once, and a conversation's next turn comes seconds later.

Invariants: one publisher task, so batches reach the plane in order; events queued before `join` has
registered the worker are dropped; a publish that fails is logged and dropped (routers see the gap in the
numbering and resync from the worker's snapshot); a renewal that fails is logged and tried again at the
next beat. Runs on the worker's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from dynserve.protocol import KVEvent, WorkerInfo

__all__ = ["Registration"]

logger = logging.getLogger(__name__)

_PUBLISH_INTERVAL_S = 0.05


class Registration:
    """One worker on `plane` (an `EventPlane`) under a lease of `lease_s`."""

    def __init__(self, plane: Any, worker_id: str, lease_s: float) -> None:
        self.plane = plane
        self.worker_id = worker_id
        self._lease_s = lease_s
        self._outbox: asyncio.Queue[list[KVEvent]] | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._publisher: asyncio.Task[None] | None = None

    async def join(self, info: WorkerInfo) -> None:
        """Register `info`, then keep its lease alive and publish what `queue_kv_events` is given."""
        await self.plane.register(info, self._lease_s)
        self._outbox = asyncio.Queue()
        self._heartbeat = asyncio.create_task(self._heartbeat_forever(info))
        self._publisher = asyncio.create_task(self._publish_forever())

    def queue_kv_events(self, events: list[KVEvent]) -> None:
        if self._outbox is not None:
            self._outbox.put_nowait(events)

    async def leave(self) -> None:
        """Stop renewing the lease and leave the registry (if the plane is down, the lease runs out instead);
        events already queued are still published."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        try:
            await self.plane.deregister(self.worker_id)
        except Exception:  # the plane is down: the lease runs out instead
            logger.exception("worker %s could not leave the registry", self.worker_id)

    def cancel(self) -> None:
        """Stop publishing and renewing, at once."""
        for task in (self._publisher, self._heartbeat):
            if task is not None:
                task.cancel()

    async def _publish_forever(self) -> None:
        """One publisher, so events reach the plane in the order the engine emitted them. Events after a quiet
        spell go out at once; while they keep coming, at most one batch goes out per `_PUBLISH_INTERVAL_S`
        (each publish is a call to the plane, which under load costs more CPU than the routing it informs)."""
        assert self._outbox is not None
        last_publish_s = -_PUBLISH_INTERVAL_S
        while True:
            events = await self._outbox.get()
            wait_s = last_publish_s + _PUBLISH_INTERVAL_S - time.monotonic()
            if wait_s > 0:  # a stream of events: the steps of the interval go out as one batch
                await asyncio.sleep(wait_s)
            last_publish_s = time.monotonic()
            while not self._outbox.empty():
                events = events + self._outbox.get_nowait()
            try:
                await self.plane.publish(self.worker_id, events)
            except Exception:  # the plane is down: routers will see the gap and resync
                logger.exception("worker %s could not publish %d KV events", self.worker_id, len(events))

    async def _heartbeat_forever(self, info: WorkerInfo) -> None:
        while True:
            await asyncio.sleep(self._lease_s / 3)
            try:
                await self.plane.register(info, self._lease_s)
            except Exception:
                logger.exception("worker %s could not renew its lease", self.worker_id)
