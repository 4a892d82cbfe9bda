"""The embedded event plane: the in-process backend hosted in one named Ray actor per namespace, so workers
and gateways on any node of the Ray cluster share it with no service to run. `connect_event_plane` picks
Redis when a URL is configured and this otherwise.

Namespaces keep deployments that share a Ray cluster or a Redis apart: each has its own event stream and
worker registry (its own actor here, its own key prefix on Redis), so a gateway only ever sees the workers
and KV events of its own namespace.

The actor is detached, in Ray namespace `dynserve`: it belongs to the cluster, not to whichever worker or
gateway happened to create it, so it outlives any of them (a killed worker must not take the registry down
with it) and every job on the cluster finds the same one. It ends with the cluster."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from dynserve.events.base import EventBatch, EventPlane
from dynserve.events.memory import MemoryEventPlane
from dynserve.protocol import KVEvent, WorkerInfo

__all__ = ["ACTOR_NAME", "DEFAULT_NAMESPACE", "EventPlaneActor", "RayEventPlane", "connect_event_plane"]

ACTOR_NAME = "dynserve-event-plane"
DEFAULT_NAMESPACE = "dynserve"
RAY_NAMESPACE = "dynserve"  # the Ray namespace the plane actors live in, shared by every job


_EVENTS = msgspec.msgpack.Decoder(list[KVEvent])
_BATCHES = msgspec.msgpack.Decoder(list[EventBatch])
_ENCODER = msgspec.msgpack.Encoder()
_READ_LINGER_S = 0.02  # after a read that returned events, the next waits this long so batches gather


class EventPlaneActor:
    """A `MemoryEventPlane` behind Ray; every method mirrors `EventPlane`'s. Events cross Ray as MessagePack
    bytes (one `bytes` argument or result), which Ray passes through without pickling every struct."""

    def __init__(self, max_len: int = 100_000) -> None:
        self._plane = MemoryEventPlane(max_len=max_len)

    async def publish(self, worker_id: str, payload: bytes) -> None:
        await self._plane.publish(worker_id, _EVENTS.decode(payload))

    async def read(self, cursor: str, max_batches: int, block_s: float) -> tuple[bytes, str]:
        batches, cursor = await self._plane.read(cursor, max_batches=max_batches, block_s=block_s)
        return _ENCODER.encode(batches), cursor

    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        await self._plane.register(info, ttl_s)

    async def deregister(self, worker_id: str) -> None:
        await self._plane.deregister(worker_id)

    async def workers(self) -> list[WorkerInfo]:
        return await self._plane.workers()


class RayEventPlane(EventPlane):
    """Client of the namespace's shared `EventPlaneActor` (created on first use, found by name afterwards)."""

    def __init__(self, handle: Any | None = None, *, namespace: str = DEFAULT_NAMESPACE) -> None:
        import ray

        name = ACTOR_NAME if namespace == DEFAULT_NAMESPACE else f"{ACTOR_NAME}-{namespace}"
        self._handle = handle or ray.remote(EventPlaneActor).options(
            name=name, namespace=RAY_NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0,
            max_concurrency=1000,
        ).remote()
        self._last_events_s = 0.0

    async def publish(self, worker_id: str, events: Sequence[KVEvent]) -> None:
        if events:
            await self._handle.publish.remote(worker_id, _ENCODER.encode(list(events)))

    async def read(self, cursor: str, *, max_batches: int = 1000,
                   block_s: float = 1.0) -> tuple[list[EventBatch], str]:
        """As `EventPlane.read`; a read right after one that returned events first lingers a few ms, so a
        consumer kept busy by a stream of events makes one actor call per few batches, not one per batch."""
        linger_s = self._last_events_s + _READ_LINGER_S - time.monotonic()
        if linger_s > 0:
            await asyncio.sleep(linger_s)
        payload, cursor = await self._handle.read.remote(cursor, max_batches, block_s)
        batches = _BATCHES.decode(payload)
        if batches:
            self._last_events_s = time.monotonic()
        return batches, cursor

    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        await self._handle.register.remote(info, ttl_s)

    async def deregister(self, worker_id: str) -> None:
        await self._handle.deregister.remote(worker_id)

    async def workers(self) -> list[WorkerInfo]:
        return await self._handle.workers.remote()


def connect_event_plane(redis_url: str | None, namespace: str = DEFAULT_NAMESPACE) -> EventPlane:
    """`namespace`'s plane: on Redis when `redis_url` is given, else embedded in Ray (which must be
    initialized)."""
    if redis_url:
        from dynserve.events.redis_plane import RedisEventPlane

        return RedisEventPlane(redis_url, prefix=namespace)
    return RayEventPlane(namespace=namespace)
