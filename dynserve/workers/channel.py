"""The worker channel: the data path between a gateway and a worker.

Ray places, starts and stops workers; token traffic does not go through Ray's object store. Each gateway
holds one TCP connection per worker and multiplexes all its requests over it as length-prefixed
MessagePack frames (`ClientFrame` one way, `WorkerFrame` the other). A worker writes one `DeltaBatch` per
engine step per connection, so the per-token cost is paid once per step, not once per request; the client
side also merges deltas that queue up behind a slow consumer.

A connection opens with the client's `Hello`, carrying the cluster's token (`Settings.cluster_token`) and
the id of the worker the client means; a worker that has a token serves nothing on a connection whose first
frame is not a `Hello` presenting it, nor any worker on one meant for another worker (a gone worker's address
that it took since) (`framing.read_hello`, `framing.meant_for`), and closes it: the client's requests then
fail over as from a worker that is down. One frame per connection: the data path pays nothing for it.

Invariants: a request's deltas arrive in order and end with exactly one finished delta or one
`RequestError`; when the connection drops every open stream ends with `WorkerUnavailableError`, and the
worker aborts every request that connection owned (so its KV blocks are freed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from dynserve.errors import ChannelError, InvalidRequestError, WorkerUnavailableError
from dynserve.framing import encode_frame, keep_alive, read_frame
from dynserve.protocol import (
    AbortRequest,
    ClientFrame,
    DeltaBatch,
    GenerateRequest,
    HandBackRequest,
    Hello,
    KVSnapshot,
    LoadRequest,
    ReleaseRequest,
    RequestError,
    SnapshotRequest,
    TokenDelta,
    WorkerFrame,
    WorkerInfo,
    WorkerLoad,
)

__all__ = ["FrameWriter", "WarnOnce", "WorkerConnection", "merge_deltas"]

logger = logging.getLogger(__name__)

_WORKER_FRAMES = msgspec.msgpack.Decoder(WorkerFrame)


class WarnOnce:
    """The level to log an event at that repeats each poll (a channel to a gone worker's address, refused
    by the worker there, or disowned by the gateway): WARNING the first time for a key, DEBUG after. At most
    `max_keys` are remembered, then all are forgotten (a bound, not a policy: each is warned of afresh)."""

    def __init__(self, max_keys: int = 1024) -> None:
        self._seen: set[Any] = set()
        self._max_keys = max_keys

    def level(self, key: Any) -> int:
        if key in self._seen:
            return logging.DEBUG
        if len(self._seen) >= self._max_keys:
            self._seen.clear()
        self._seen.add(key)
        return logging.WARNING


def merge_deltas(deltas: list[TokenDelta]) -> TokenDelta:
    """One delta equivalent to `deltas` (same request, in order): tokens, text and logprobs joined, counts and
    the finish state from the last."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    first = deltas[0]
    if first.kv_fallback is not None or first.kv_pulled_blocks:  # only a first delta says them; keep them
        last = msgspec.structs.replace(last, kv_fallback=first.kv_fallback, kv_pulled_blocks=first.kv_pulled_blocks)
    logprobs = None
    if any(d.logprobs for d in deltas):
        logprobs = [lp for d in deltas for lp in (d.logprobs or [])]
    return msgspec.structs.replace(
        last,
        token_ids=[t for d in deltas for t in d.token_ids],
        text="".join(d.text for d in deltas),
        logprobs=logprobs,
    )


class FrameWriter:
    """The worker's side of a connection, for writing: frames from any thread, in the order written.

    The engine thread writes a step's deltas itself the moment the step ends: handing them to the event loop
    first costs a wake-up of the loop's thread and a GIL hand-off, far more than the send itself (about 1 ms
    a step at 16 requests in flight; docs/benchmarks.md). A frame the socket cannot take whole waits, with
    every frame after it, in a backlog that the loop sends when the socket is writable. The writer owns a
    duplicate of the connection's descriptor (the loop watches it for writability apart from the stream
    reading the original), so the connection ends only once both are closed, in either order.
    """

    def __init__(self, sock: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._sock = socket.socket(fileno=os.dup(sock.fileno()))
        self._sock.setblocking(False)
        self._loop = loop
        self._lock = threading.Lock()
        self._backlog: deque[memoryview] = deque()
        self._watching = False
        self._closed = False

    def write(self, data: bytes) -> None:
        """Send `data` now, or after what waits before it; dropped once the connection is closed or broken."""
        with self._lock:
            if self._closed:
                return
            if not self._backlog:
                try:
                    sent = self._sock.send(data)
                except BlockingIOError:
                    sent = 0
                except OSError:  # the peer is gone: the reading side sees the end and cleans up
                    self._closed = True
                    return
                if sent == len(data):
                    return
                data = data[sent:]
            self._backlog.append(memoryview(data))
            if len(self._backlog) == 1:
                try:
                    self._loop.call_soon_threadsafe(self._watch)
                except RuntimeError:  # the loop has closed: the worker is gone, and its connections with it
                    self._closed = True

    async def close(self, timeout_s: float = 5.0) -> None:
        """Send what waits (up to `timeout_s`), then close this writer's descriptor. On the loop."""
        deadline_s = time.monotonic() + timeout_s
        while self._backlog and not self._closed and time.monotonic() < deadline_s:
            await asyncio.sleep(0.005)
        with self._lock:
            self._closed = True
            self._backlog.clear()
            if self._watching:
                self._loop.remove_writer(self._sock.fileno())
                self._watching = False
            self._sock.close()

    def _watch(self) -> None:
        with self._lock:
            if self._backlog and not self._closed and not self._watching:
                self._watching = True
                self._loop.add_writer(self._sock.fileno(), self._send_backlog)

    def _send_backlog(self) -> None:
        with self._lock:
            while self._backlog and not self._closed:
                head = self._backlog[0]
                try:
                    sent = self._sock.send(head)
                except BlockingIOError:
                    return
                except OSError:
                    self._closed = True
                    break
                if sent < len(head):
                    self._backlog[0] = head[sent:]
                    return
                self._backlog.popleft()
            self._backlog.clear()
            self._loop.remove_writer(self._sock.fileno())
            self._watching = False


class _Closed:
    """Sentinel put on every open stream when the connection ends."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


_StreamItem = TokenDelta | RequestError | _Closed
_Reply = WorkerLoad | KVSnapshot


class WorkerConnection:
    """A client's connection to one worker. Many requests share it; `generate` streams one of them.

    Safe to use from one asyncio loop only. `connect` raises WorkerUnavailableError when the worker does not
    answer; after the connection drops, `is_open` is false and every call raises WorkerUnavailableError.
    """

    def __init__(self, info: WorkerInfo) -> None:
        self.info = info
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._outbox: list[bytes] = []  # frames waiting for the end of this pass of the loop (see `_send`)
        self._reader_task: asyncio.Task[None] | None = None
        self._streams: dict[str, asyncio.Queue[_StreamItem]] = {}
        self._load_waiters: deque[asyncio.Future[_Reply]] = deque()
        self._snapshot_waiters: deque[asyncio.Future[_Reply]] = deque()
        self._closed_reason: str | None = "not connected"

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def is_open(self) -> bool:
        return self._closed_reason is None

    @property
    def num_open_streams(self) -> int:
        return len(self._streams)

    async def connect(self, timeout_s: float = 5.0, *, cluster_token: str | None = None) -> None:
        """Open the connection and present `cluster_token` (the worker's `Settings.cluster_token`). A worker
        that refuses the token closes the connection: the first call then raises WorkerUnavailableError."""
        try:
            self._reader, self._writer = await asyncio.wait_for(
                asyncio.open_connection(self.info.host, self.info.port), timeout_s
            )
        except (OSError, TimeoutError) as exc:
            raise WorkerUnavailableError(
                f"cannot connect to worker {self.worker_id} at {self.info.host}:{self.info.port}: {exc}",
                worker_id=self.worker_id,
            ) from exc
        keep_alive(self._writer.get_extra_info("socket"))  # a worker whose machine vanished is an error
        # the first frame, before any request; naming the worker, so that another one at its address refuses
        self._writer.write(encode_frame(Hello(cluster_token, worker_id=self.worker_id)))
        self._closed_reason = None  # (asyncio and uvloop turn Nagle off on every TCP stream themselves)
        self._reader_task = asyncio.create_task(self._read_loop(), name=f"channel-{self.worker_id}")

    async def close(self) -> None:
        self._shut("closed by client")
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task

    def _send(self, message: ClientFrame) -> None:
        """Queue `message` for the end of this pass of the loop: the frames of one pass go out in one write,
        requests included, so a burst of requests reaches its worker together and is scheduled together
        (sent one by one, a mocker at the frontend benchmark's speedup took twice the steps for them; the
        experiments: docs/benchmarks.md, gateway)."""
        if self._closed_reason is not None or self._writer is None:
            raise WorkerUnavailableError(
                f"worker {self.worker_id} is unavailable ({self._closed_reason})", worker_id=self.worker_id
            )
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append(encode_frame(message))

    def _flush(self) -> None:
        if self._writer is not None:  # else the connection ended meanwhile: its requests failed already
            self._writer.write(b"".join(self._outbox))
        self._outbox.clear()

    async def load(self, timeout_s: float = 2.0) -> WorkerLoad:
        return await self._ask(LoadRequest(), self._load_waiters, timeout_s, "report its load")

    async def snapshot(self, timeout_s: float = 10.0) -> KVSnapshot:
        """The worker's cached block hashes and the last KV event id they reflect (for a router resync)."""
        return await self._ask(SnapshotRequest(), self._snapshot_waiters, timeout_s, "send a KV snapshot")

    async def _ask(self, question: ClientFrame, waiters: deque[asyncio.Future[_Reply]], timeout_s: float,
                   what: str) -> Any:
        """Send `question` and wait for its reply; replies of one kind come back in the order asked."""
        waiter: asyncio.Future[_Reply] = asyncio.get_running_loop().create_future()
        self._send(question)
        waiters.append(waiter)
        try:
            return await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError as exc:
            raise WorkerUnavailableError(f"worker {self.worker_id} did not {what} within {timeout_s} s",
                                         worker_id=self.worker_id) from exc

    def release(self, request_id: str) -> None:
        """Tell a prefill worker to free the KV it holds for `request_id`; harmless if it holds none or the
        connection is gone (its lease runs out instead)."""
        if self.is_open:
            self._send(ReleaseRequest(request_id))

    def hand_back(self, max_requests: int) -> None:
        """Ask the worker to hand back up to `max_requests` of this connection's queued requests that have not
        started: each stream then ends with a `REQUEUE` delta (the dispatcher sends it elsewhere). Harmless
        when none is queued or the connection is gone."""
        if self.is_open and max_requests > 0:
            self._send(HandBackRequest(max_requests))

    def abort(self, request_id: str) -> None:
        """Stop a request; harmless if it already finished or the connection is gone."""
        self._streams.pop(request_id, None)
        if self.is_open:
            self._send(AbortRequest(request_id))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Stream `request`'s deltas, merging those that queued up while the consumer was busy.

        Raises InvalidRequestError when the worker refuses the request as invalid, WorkerUnavailableError
        when the worker is gone or stopping. Closing the iterator early aborts the request on the worker.
        """
        if request.request_id in self._streams:
            raise InvalidRequestError(f"request id {request.request_id!r} is already streaming", param="request_id")
        queue: asyncio.Queue[_StreamItem] = asyncio.Queue()
        self._streams[request.request_id] = queue
        finished = False
        try:
            self._send(request)  # inside: a connection found closed here must not leave the stream listed
            while not finished:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                deltas = [item for item in items if isinstance(item, TokenDelta)]
                if deltas:
                    merged = merge_deltas(deltas)
                    finished = merged.finished
                    yield merged
                for item in items:
                    if isinstance(item, RequestError):
                        finished = True
                        if item.retryable:
                            raise WorkerUnavailableError(item.message, worker_id=self.worker_id)
                        raise InvalidRequestError(item.message, param=item.param)
                    if isinstance(item, _Closed):
                        finished = True
                        raise WorkerUnavailableError(
                            f"worker {self.worker_id} went away ({item.reason})", worker_id=self.worker_id
                        )
        finally:
            if not finished:
                self.abort(request.request_id)
            self._streams.pop(request.request_id, None)

    async def _read_loop(self) -> None:
        assert self._reader is not None
        reason = "worker closed the connection"
        try:
            while (body := await read_frame(self._reader)) is not None:
                self._dispatch(_WORKER_FRAMES.decode(body))
        except (ChannelError, msgspec.DecodeError, OSError) as exc:
            reason = f"channel error: {exc}"
            logger.warning("worker %s channel failed: %s", self.worker_id, exc)
        finally:
            self._shut(reason)

    def _dispatch(self, frame: WorkerFrame) -> None:
        if isinstance(frame, DeltaBatch):
            for delta in frame.deltas:
                queue = self._streams.get(delta.request_id)
                if queue is not None:
                    queue.put_nowait(delta)
        elif isinstance(frame, RequestError):
            queue = self._streams.get(frame.request_id)
            if queue is not None:
                queue.put_nowait(frame)
        else:
            waiters = self._snapshot_waiters if isinstance(frame, KVSnapshot) else self._load_waiters
            if waiters:
                waiter = waiters.popleft()
                if not waiter.done():  # a timed-out ask has given up on this reply
                    waiter.set_result(frame)

    def _shut(self, reason: str) -> None:
        if self._closed_reason is not None and self._writer is None:
            return
        self._closed_reason = self._closed_reason or reason
        for queue in self._streams.values():
            queue.put_nowait(_Closed(reason))
        for waiters in (self._load_waiters, self._snapshot_waiters):
            while waiters:
                waiter = waiters.popleft()
                if not waiter.done():
                    waiter.set_exception(WorkerUnavailableError(reason, worker_id=self.worker_id))
        if self._writer is not None:
            self._writer.close()
            self._writer = None
