"""The embedded event plane: the in-process backend hosted in one named Ray actor per namespace, so workers
and gateways on any node of the Ray cluster share it with no service to run. `connect_event_plane` picks
Redis when a URL is configured and this otherwise.

Namespaces keep deployments that share a Ray cluster or a Redis apart: each has its own event stream and
worker registry (its own actor here, its own key prefix on Redis), so a gateway only ever sees the workers
and KV events of its own namespace.

The actor is detached, in Ray namespace `dynserve`: it belongs to the cluster, not to whichever worker or
gateway happened to create it, so it outlives any of them (a killed worker must not take the registry down
with it) and every job on the cluster finds the same one. It ends with the cluster. If its process dies, Ray
starts it again, empty: workers register again at their next heartbeat, and routers, whose cursors are then
past the new stream's end, read it from its start and resync each worker from the gap in its numbering.

Ray finds the actor; the events do not travel as Ray calls. The actor serves the plane on a TCP socket of
its node (length-prefixed MessagePack frames, as the worker channel uses), and each client holds one
connection to it, on which calls are numbered so that a blocking read does not hold up a publish. A Ray
actor call costs the actor about 1 ms of CPU, which every publish and every read would pay; a frame costs
it tens of microseconds. Each connection opens with the client's `Hello`: the actor keeps the cluster token
its creator gave it (`Settings.cluster_token`) and, when it has one, closes without an answer every
connection that does not present it (`framing.accept_hello`). The first client of a namespace creates the
actor, so every process of a fleet must share the token; a new token needs a new actor (a new cluster).

Calls other than reads are answered in the order they arrive on a connection, so one worker's publishes
keep their order; reads wait in their own tasks."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from dynserve.config import Settings
from dynserve.errors import ChannelError
from dynserve.events.base import EventBatch, EventPlane
from dynserve.events.memory import MemoryEventPlane
from dynserve.framing import accept_hello, encode_frame, keep_alive, read_frame
from dynserve.protocol import Hello, KVEvent, WorkerInfo

__all__ = ["ACTOR_NAME", "DEFAULT_NAMESPACE", "EventPlaneActor", "RayEventPlane", "connect_event_plane"]

logger = logging.getLogger(__name__)

ACTOR_NAME = "dynserve-event-plane"
DEFAULT_NAMESPACE = "dynserve"
RAY_NAMESPACE = "dynserve"  # the Ray namespace the plane actors live in, shared by every job

_ENCODER = msgspec.msgpack.Encoder()
_READ_LINGER_S = 0.02  # after a read that returned events, the next waits this long so batches gather


class _Call(msgspec.Struct, array_like=True):
    call_id: int
    method: str
    args: msgspec.Raw  # the method's arguments, as a MessagePack array (`_ARGS`)


class _Reply(msgspec.Struct, array_like=True):
    call_id: int
    error: str | None
    result: msgspec.Raw  # the method's result (the caller decodes it); nil when `error` is set


_CALLS = msgspec.msgpack.Decoder(_Call)
_REPLIES = msgspec.msgpack.Decoder(_Reply)
_ARGS = {
    "publish": msgspec.msgpack.Decoder(tuple[str, list[KVEvent]]),
    "read": msgspec.msgpack.Decoder(tuple[str, int, float]),
    "register": msgspec.msgpack.Decoder(tuple[WorkerInfo, float]),
    "deregister": msgspec.msgpack.Decoder(tuple[str]),
    "workers": msgspec.msgpack.Decoder(tuple[()]),
}
_READ_RESULT = msgspec.msgpack.Decoder(tuple[list[EventBatch], str])
_WORKERS_RESULT = msgspec.msgpack.Decoder(list[WorkerInfo])
_NIL = msgspec.Raw(_ENCODER.encode(None))


class EventPlaneActor:
    """A `MemoryEventPlane` served on a TCP socket of the actor's node; `address()` starts the server (once)
    and says where it listens. Every `EventPlane` method is a call on that socket, from clients that presented
    `cluster_token` first (any client when None)."""

    def __init__(self, max_len: int = 100_000, cluster_token: str | None = None) -> None:
        self._plane = MemoryEventPlane(max_len=max_len)
        self._cluster_token = cluster_token
        self._address: tuple[str, int] | None = None
        self._starting: asyncio.Lock | None = None
        self._server: asyncio.Server | None = None

    async def address(self) -> tuple[str, int]:
        self._starting = self._starting or asyncio.Lock()
        async with self._starting:
            if self._address is None:
                import ray

                # this node's own environment and Ray's node IP, as a worker's ports (see Settings)
                bind_host, advertise_host = Settings().serving_addresses(ray.util.get_node_ip_address())
                self._server = await asyncio.start_server(self._serve, bind_host, 0)
                keep_alive(self._server.sockets[0])  # accepted connections inherit it: clients that vanish end
                self._address = (advertise_host, self._server.sockets[0].getsockname()[1])
        return self._address

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not await accept_hello(reader, self._cluster_token):
            peer = writer.get_extra_info("peername")
            logger.warning("refused an event-plane connection from %s (no hello with the cluster token)",
                           peer[0] if peer else "an unknown address")
            writer.close()
            return
        reads: set[asyncio.Task[None]] = set()
        try:
            while (body := await read_frame(reader)) is not None:
                call = _CALLS.decode(body)
                if call.method == "read":  # may wait up to its block_s: in its own task
                    task = asyncio.create_task(self._answer_read(call, writer))
                    reads.add(task)
                    task.add_done_callback(reads.discard)
                else:
                    writer.write(encode_frame(await self._answer(call)))
        except (ChannelError, ConnectionError, msgspec.DecodeError) as exc:
            logger.warning("dropping an event-plane client: %s", exc)
        finally:
            for task in reads:
                task.cancel()
            writer.close()

    async def _answer(self, call: _Call) -> _Reply:
        plane, decoder = self._plane, _ARGS.get(call.method)
        if decoder is None or call.method == "read":
            return _Reply(call.call_id, f"unknown event-plane method {call.method!r}", _NIL)
        try:
            args = decoder.decode(call.args)
            if call.method == "publish":
                await plane.publish(*args)
            elif call.method == "register":
                await plane.register(*args)
            elif call.method == "deregister":
                await plane.deregister(*args)
            else:
                return _Reply(call.call_id, None, msgspec.Raw(_ENCODER.encode(await plane.workers())))
        except (msgspec.DecodeError, ValueError) as exc:
            return _Reply(call.call_id, f"bad {call.method} call: {exc}", _NIL)
        return _Reply(call.call_id, None, _NIL)

    async def _answer_read(self, call: _Call, writer: asyncio.StreamWriter) -> None:
        try:
            cursor, max_batches, block_s = _ARGS["read"].decode(call.args)
            batches, cursor = await self._plane.read(cursor, max_batches=max_batches, block_s=block_s)
            reply = _Reply(call.call_id, None, msgspec.Raw(_ENCODER.encode((batches, cursor))))
        except (msgspec.DecodeError, ValueError) as exc:
            reply = _Reply(call.call_id, f"bad read call: {exc}", _NIL)
        if not writer.is_closing():
            writer.write(encode_frame(reply))


class _PlaneConnection:
    """One client connection to the plane's socket, on the loop that opened it: numbered calls, and a task
    that hands each reply to its caller. When the connection ends, every call waiting on it raises
    ConnectionError, and the client opens a new one for the next call."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.loop = asyncio.get_running_loop()
        self.is_open = True
        self._writer = writer
        self._pending: dict[int, asyncio.Future[bytes]] = {}
        self._ids = itertools.count()
        self._replies = asyncio.create_task(self._read_replies(reader), name="event-plane-replies")

    @classmethod
    async def open(cls, handle: Any, cluster_token: str | None) -> _PlaneConnection:
        try:
            host, port = await asyncio.wait_for(handle.address.remote(), 10.0)
            reader, writer = await asyncio.open_connection(host, port)
            keep_alive(writer.get_extra_info("socket"))
            writer.write(encode_frame(Hello(cluster_token)))  # the first frame: without it nothing is served
        except Exception as exc:  # a dead actor (Ray's errors) or a refused connection
            raise ConnectionError(f"the embedded event plane is unreachable: {exc}") from exc
        return cls(reader, writer)

    async def call(self, method: str, *args: Any) -> bytes:
        if not self.is_open:
            raise ConnectionError("the event plane connection is closed")
        call_id = next(self._ids)
        reply = self._pending[call_id] = self.loop.create_future()
        self._writer.write(encode_frame(_Call(call_id, method, msgspec.Raw(_ENCODER.encode(args)))))
        try:
            return await reply
        finally:
            self._pending.pop(call_id, None)

    async def _read_replies(self, reader: asyncio.StreamReader) -> None:
        error = ConnectionError("the event plane closed the connection (refused: a different cluster token?)")
        answered = False
        try:
            while (body := await read_frame(reader)) is not None:
                reply = _REPLIES.decode(body)
                if not answered:
                    answered, error = True, ConnectionError("the event plane closed the connection")
                waiter = self._pending.pop(reply.call_id, None)
                if waiter is None or waiter.done():  # its caller was cancelled
                    continue
                if reply.error is not None:
                    waiter.set_exception(ValueError(f"event plane: {reply.error}"))
                else:
                    waiter.set_result(bytes(reply.result))
        except (OSError, ChannelError, msgspec.DecodeError) as exc:
            # a reset before any answer is the actor refusing the hello (its close races our unread call)
            what = "closed the connection (refused: a different cluster token?)" if not answered else (
                "connection failed")
            error = ConnectionError(f"the event plane {what}: {exc}")
        finally:
            self.is_open = False
            for waiter in self._pending.values():
                if not waiter.done():
                    waiter.set_exception(error)
            self._pending.clear()
            with contextlib.suppress(RuntimeError):  # the loop closed under a connection nobody closed
                self._writer.close()

    async def close(self) -> None:
        self._replies.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._replies


class RayEventPlane(EventPlane):
    """Client of the namespace's shared `EventPlaneActor` (created on first use, found by name afterwards),
    over a connection to its socket per event loop it is used from, opened on first use there and again
    after it drops."""

    def __init__(self, handle: Any | None = None, *, namespace: str = DEFAULT_NAMESPACE,
                 max_len: int = 100_000, cluster_token: str | None = None) -> None:
        """`max_len`: the batches the actor keeps, when this call creates it. `cluster_token`: presented on
        every connection, and required of every client by the actor this call creates (an actor already
        there keeps the token it was created with)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        name = ACTOR_NAME if namespace == DEFAULT_NAMESPACE else f"{ACTOR_NAME}-{namespace}"
        # The first client creates the actor on its own node (`dynctl serve` does so before any worker starts,
        # so the plane lives with the gateway on the head, not on a worker node that may be lost).
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self._handle = handle or ray.remote(EventPlaneActor).options(
            name=name, namespace=RAY_NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0,
            max_concurrency=1000, scheduling_strategy=here,
            # a process that dies is started again (empty: workers register again at their next heartbeat,
            # routers resync from the gaps); clients find its new socket through `address()`
            max_restarts=-1,
        ).remote(max_len=max_len, cluster_token=cluster_token)
        self._cluster_token = cluster_token
        # by loop: a connection's reader task and futures belong to the loop that opened it
        self._connections: dict[asyncio.AbstractEventLoop, _PlaneConnection] = {}
        self._opening: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}
        self._last_events_s = 0.0

    async def _call(self, method: str, *args: Any) -> bytes:
        loop = asyncio.get_running_loop()
        connection = self._connections.get(loop)
        if connection is None or not connection.is_open:
            for ended in [other for other in self._opening if other.is_closed()]:  # loops that finished
                self._opening.pop(ended)
                self._connections.pop(ended, None)
            opening = self._opening.setdefault(loop, asyncio.Lock())
            async with opening:
                connection = self._connections.get(loop)
                if connection is None or not connection.is_open:
                    connection = self._connections[loop] = await _PlaneConnection.open(self._handle,
                                                                                       self._cluster_token)
        return await connection.call(method, *args)

    async def publish(self, worker_id: str, events: Sequence[KVEvent]) -> None:
        if events:
            await self._call("publish", worker_id, events)

    async def read(self, cursor: str, *, max_batches: int = 1000,
                   block_s: float = 1.0) -> tuple[list[EventBatch], str]:
        """As `EventPlane.read`; a read right after one that returned events first lingers a few ms, so a
        consumer kept busy by a stream of events makes one call per few batches, not one per batch."""
        linger_s = self._last_events_s + _READ_LINGER_S - time.monotonic()
        if linger_s > 0:
            await asyncio.sleep(linger_s)
        batches, cursor = _READ_RESULT.decode(await self._call("read", cursor, max_batches, block_s))
        if batches:
            self._last_events_s = time.monotonic()
        return batches, cursor

    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        await self._call("register", info, ttl_s)

    async def deregister(self, worker_id: str) -> None:
        await self._call("deregister", worker_id)

    async def workers(self) -> list[WorkerInfo]:
        return _WORKERS_RESULT.decode(await self._call("workers"))

    async def close(self) -> None:
        """Close this loop's connection (another loop's ends with its tasks, when that loop finishes)."""
        connection = self._connections.pop(asyncio.get_running_loop(), None)
        if connection is not None:
            await connection.close()



def connect_event_plane(redis_url: str | None, namespace: str = DEFAULT_NAMESPACE, *,
                        cluster_token: str | None = None) -> EventPlane:
    """`namespace`'s plane: on Redis when `redis_url` is given (Redis checks its own credentials, from the
    URL), else embedded in Ray (which must be initialized), reached with `cluster_token`."""
    if redis_url:
        from dynserve.events.redis_plane import RedisEventPlane

        return RedisEventPlane(redis_url, prefix=namespace)
    return RayEventPlane(namespace=namespace, cluster_token=cluster_token)
