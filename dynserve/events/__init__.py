"""The event plane and worker registry: one interface (`base.EventPlane`), two backends.

- `redis_plane.RedisEventPlane`: KV events on one Redis Stream (batched XADD, trimmed with MAXLEN),
  consumers with blocking XREAD; worker records as keys with a TTL lease refreshed by heartbeats.
- `memory.MemoryEventPlane`: the same in one process, for a laptop with no Redis (and for tests).
"""
