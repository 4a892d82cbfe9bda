"""The gateway's view of its workers: one channel each, their polled loads, and which one gets a request.

`WorkerSet.generate` picks a worker (least loaded: its reported running + waiting requests plus what this
gateway has sent it since), streams the request from it, and, when the worker fails before the first token
reaches the client, retries on another worker, so a dead worker costs a retry, not a request. Loads are
polled every `poll_interval_s`; a worker whose channel drops is reconnected on the next poll if it is still
alive, and left out of picking until then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from dynserve.errors import WorkerUnavailableError
from dynserve.protocol import GenerateRequest, KVSnapshot, TokenDelta, WorkerInfo, WorkerLoad
from dynserve.router.router import Router
from dynserve.workers.channel import WorkerConnection

__all__ = ["WorkerSet"]

logger = logging.getLogger(__name__)


class WorkerSet:
    def __init__(
        self,
        infos: list[WorkerInfo],
        *,
        router: Router | None = None,
        poll_interval_s: float = 0.5,
        on_load: Callable[[WorkerLoad], None] | None = None,
        on_down: Callable[[WorkerInfo], None] | None = None,
        on_retry: Callable[[], None] | None = None,
    ) -> None:
        if not infos:
            raise ValueError("a WorkerSet needs at least one worker")
        self.connections = {info.worker_id: WorkerConnection(info) for info in infos}
        self.router = router
        self.loads: dict[str, WorkerLoad] = {}
        self._load_seen_s: dict[str, float] = {}
        self._poll_interval_s = poll_interval_s
        self._on_load, self._on_down, self._on_retry = on_load, on_down, on_retry
        self._poller: asyncio.Task[None] | None = None

    @property
    def model_id(self) -> str:
        return next(iter(self.connections.values())).info.model_id

    @property
    def max_model_len(self) -> int:
        return min(c.info.max_model_len for c in self.connections.values())

    async def start(self) -> None:
        await asyncio.gather(*(self._connect(c) for c in self.connections.values()))
        await self.poll_once()
        self._poller = asyncio.create_task(self._poll_forever(), name="worker-load-poller")

    async def snapshot(self, worker_id: str) -> KVSnapshot:
        connection = self.connections.get(worker_id)
        if connection is None:
            raise WorkerUnavailableError(f"unknown worker {worker_id}", worker_id=worker_id)
        return await connection.snapshot()

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        await asyncio.gather(*(c.close() for c in self.connections.values()))

    def is_ready(self) -> bool:
        """True when some worker's channel is open and it reported a load within the last 3 polls."""
        now = time.monotonic()
        horizon_s = max(3 * self._poll_interval_s, 1.0)
        return any(c.is_open and now - self._load_seen_s.get(wid, -1e9) <= horizon_s
                   for wid, c in self.connections.items())

    def pick(self, exclude: set[str], token_ids: list[int] | None = None) -> WorkerConnection | None:
        """An open worker not in `exclude`: the router's choice when there is one, else the least busy."""
        candidates = [c for wid, c in self.connections.items() if c.is_open and wid not in exclude]
        if not candidates:
            return None
        if self.router is not None and token_ids is not None and len(candidates) > 1:
            chosen, _overlap = self.router.pick(token_ids, [c.worker_id for c in candidates], self.loads)
            return self.connections[chosen]
        return min(candidates, key=self._pending)

    def _pending(self, connection: WorkerConnection) -> int:
        load = self.loads.get(connection.worker_id)
        reported = load.num_running + load.num_waiting if load is not None else 0
        return max(reported, connection.num_open_streams)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Stream `request` from the best worker, retrying elsewhere until its first delta arrives."""
        tried: set[str] = set()
        while True:
            connection = self.pick(tried, request.token_ids)
            if connection is None:
                raise WorkerUnavailableError(
                    f"no worker can take the request (tried {sorted(tried) or 'none'})", worker_id=None
                )
            started = False
            if self.router is not None:
                block_size = connection.info.block_size
                self.router.routed(request.request_id, connection.worker_id,
                                   (len(request.token_ids) + request.params.max_tokens) // block_size + 1)
            try:
                async for delta in connection.generate(request):
                    started = True
                    yield delta
                return
            except WorkerUnavailableError as exc:
                if started:
                    raise
                tried.add(connection.worker_id)
                logger.warning("request %s: worker %s failed before its first token (%s); retrying",
                               request.request_id, connection.worker_id, exc)
                if self._on_retry is not None:
                    self._on_retry()
            finally:
                if self.router is not None:
                    self.router.finished(request.request_id)

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(c) for c in self.connections.values()))

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval_s)
            await self.poll_once()

    async def _poll(self, connection: WorkerConnection) -> None:
        if not connection.is_open and not await self._connect(connection):
            return
        try:
            load = await connection.load(timeout_s=max(2 * self._poll_interval_s, 1.0))
        except WorkerUnavailableError:
            self._mark_down(connection)
            return
        self.loads[connection.worker_id] = load
        self._load_seen_s[connection.worker_id] = time.monotonic()
        if self._on_load is not None:
            self._on_load(load)

    async def _connect(self, connection: WorkerConnection) -> bool:
        try:
            await connection.connect(timeout_s=2.0)
            return True
        except WorkerUnavailableError as exc:
            logger.debug("worker %s unreachable: %s", connection.worker_id, exc)
            self._mark_down(connection)
            return False

    def _mark_down(self, connection: WorkerConnection) -> None:
        self.loads.pop(connection.worker_id, None)
        self._load_seen_s.pop(connection.worker_id, None)
        if self._on_down is not None:
            self._on_down(connection.info)
