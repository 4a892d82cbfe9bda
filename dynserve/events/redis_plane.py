"""The event plane on Redis: one stream of KV event batches, and worker records with TTL leases.

Stream `<prefix>:kv_events`: each entry is one `EventBatch` (MessagePack in field `b`), appended with
`XADD ... MAXLEN ~ max_len` so the stream stays bounded; a consumer that falls behind the trim loses the
oldest entries and recovers through the index's gap detection. Worker records: key
`<prefix>:worker:<id>` holding the `WorkerInfo`, set with an expiry that heartbeats refresh.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import redis.asyncio as aioredis

from dynserve import shutdown
from dynserve.events.base import EventBatch, EventPlane
from dynserve.protocol import KVEvent, WorkerInfo

__all__ = ["RedisEventPlane"]

CLOSE_TIMEOUT_S = 5.0
_ENCODER = msgspec.msgpack.Encoder()
_BATCH = msgspec.msgpack.Decoder(EventBatch)
_INFO = msgspec.msgpack.Decoder(WorkerInfo)


class RedisEventPlane(EventPlane):
    def __init__(self, url: str, *, prefix: str = "dynserve", max_len: int = 100_000) -> None:
        self._redis = aioredis.Redis.from_url(url)
        self._stream = f"{prefix}:kv_events"
        self._worker_prefix = f"{prefix}:worker:"
        self._max_len = max_len

    async def publish(self, worker_id: str, events: Sequence[KVEvent]) -> None:
        if not events:
            return
        body = _ENCODER.encode(EventBatch(worker_id, list(events)))
        await self._redis.xadd(self._stream, {"b": body}, maxlen=self._max_len, approximate=True)

    async def read(self, cursor: str, *, max_batches: int = 1000,
                   block_s: float = 1.0) -> tuple[list[EventBatch], str]:
        block_ms = max(1, int(block_s * 1000))
        if cursor == "$":  # resolve "only new" to a concrete id, so the next call does not skip entries
            last = await self._redis.xrevrange(self._stream, count=1)
            cursor = last[0][0].decode() if last else "0"
        reply = await self._redis.xread({self._stream: cursor}, count=max_batches, block=block_ms)
        batches: list[EventBatch] = []
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                batches.append(_BATCH.decode(fields[b"b"]))
                cursor = entry_id.decode()
        return batches, cursor

    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        await self._redis.set(self._worker_prefix + info.worker_id, _ENCODER.encode(info),
                              px=max(1, int(ttl_s * 1000)))

    async def deregister(self, worker_id: str) -> None:
        await self._redis.delete(self._worker_prefix + worker_id)

    async def workers(self) -> list[WorkerInfo]:
        keys = [key async for key in self._redis.scan_iter(match=self._worker_prefix + "*", count=1000)]
        if not keys:
            return []
        values = await self._redis.mget(keys)
        return sorted((_INFO.decode(v) for v in values if v is not None), key=lambda i: i.worker_id)

    async def close(self) -> None:
        """Close the connections, within `CLOSE_TIMEOUT_S` (a close that waits on its socket forever, which
        redis-py's asyncio client can, is left behind with a warning); never raises (a failed close is
        logged as a shutdown step's)."""
        await shutdown.step("the Redis connections", self._redis.aclose(), CLOSE_TIMEOUT_S)
