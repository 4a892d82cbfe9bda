"""The event plane and registry, on a real Redis server and on the in-process backend, with the same tests."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import replay_event_plane

from dynserve.events.base import EventPlane
from dynserve.events.memory import MemoryEventPlane
from dynserve.events.redis_plane import RedisEventPlane
from dynserve.protocol import BlockRemoved, BlockStored, SamplingParams, WorkerInfo
from dynserve.router.indexer import KVIndex

_prefixes = itertools.count()


PlaneFactory = Callable[..., EventPlane]


@pytest.fixture(params=[pytest.param("redis", marks=pytest.mark.services), "memory",
                        pytest.param("embedded", marks=pytest.mark.ray)])
def make_plane(request: pytest.FixtureRequest) -> Iterator[PlaneFactory]:
    """Build a plane inside the test's event loop: make_plane(max_len=...); each test gets its own keys
    (on Redis) or its own actor (embedded: a namespace of its own, the actor killed after the test)."""
    if request.param == "memory":
        yield lambda **kw: MemoryEventPlane(**kw)
        return
    prefix = f"test{next(_prefixes)}"
    if request.param == "redis":
        url = request.getfixturevalue("redis_url")
        yield lambda **kw: RedisEventPlane(url, prefix=prefix, **kw)
        return
    ray = request.getfixturevalue("ray_instance")
    from dynserve.events.ray_plane import RayEventPlane

    planes: list[RayEventPlane] = []

    def factory(**kw: Any) -> RayEventPlane:
        planes.append(RayEventPlane(namespace=prefix, **kw))
        return planes[-1]

    yield factory
    for plane in planes[:1]:  # one actor per namespace, whichever plane created it
        ray.kill(plane._handle)


def _info(worker_id: str) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role="both", host="127.0.0.1", port=1, model_id="m", max_model_len=64,
                      block_size=16, num_blocks=8)


def test_batches_arrive_in_order_and_cursors_continue(make_plane: PlaneFactory) -> None:
    async def scenario() -> None:
        plane = make_plane()
        await plane.publish("a", [BlockStored(0, None, [1, 2])])
        await plane.publish("b", [BlockStored(0, None, [7])])
        await plane.publish("a", [BlockRemoved(1, [2]), BlockStored(2, 1, [3])])
        await plane.publish("a", [])  # nothing to send: no entry
        batches, cursor = await plane.read("0", block_s=0.1)
        assert [(b.worker_id, [e.event_id for e in b.events]) for b in batches] == [
            ("a", [0]), ("b", [0]), ("a", [1, 2])]
        assert (await plane.read(cursor, block_s=0.05))[0] == []
        await plane.publish("b", [BlockStored(1, 7, [8])])
        batches, _ = await plane.read(cursor, block_s=0.1)
        assert [b.events[0].event_id for b in batches] == [1]
        await plane.close()

    asyncio.run(scenario())


def test_dollar_cursor_sees_only_new_batches_and_read_blocks(make_plane: PlaneFactory) -> None:
    async def scenario() -> None:
        plane = make_plane()
        await plane.publish("a", [BlockStored(0, None, [1])])
        start = time.monotonic()
        batches, cursor = await plane.read("$", block_s=0.3)
        assert batches == [] and time.monotonic() - start >= 0.25

        async def later() -> None:
            await asyncio.sleep(0.1)
            await plane.publish("a", [BlockStored(1, 1, [2])])

        publisher = asyncio.create_task(later())
        batches, _ = await plane.read(cursor, block_s=2.0)
        await publisher
        assert [b.events[0].event_id for b in batches] == [1]
        await plane.close()

    asyncio.run(scenario())


def test_a_trimmed_log_shows_up_as_a_gap_and_resync_recovers(make_plane: PlaneFactory) -> None:
    async def scenario() -> None:
        plane = make_plane(max_len=10)
        truth: set[int] = set()
        for event_id in range(300):  # Redis trims approximately, in whole nodes: publish well past max_len
            await plane.publish("a", [BlockStored(event_id, None, [event_id])])
            truth.add(event_id)
        batches, _ = await plane.read("0", block_s=0.1)
        assert len(batches) < 300
        index = KVIndex()
        applied = all(index.apply(b.worker_id, b.events) for b in batches)
        assert not applied  # the first kept event is not event 0
        index.resync("a", truth, last_event_id=299)
        assert index.worker_blocks("a") == truth
        await plane.close()

    asyncio.run(scenario())


def test_worker_leases_expire_without_heartbeats(make_plane: PlaneFactory) -> None:
    async def scenario() -> None:
        plane = make_plane()
        await plane.register(_info("w1"), ttl_s=0.4)
        await plane.register(_info("w0"), ttl_s=5)
        assert [w.worker_id for w in await plane.workers()] == ["w0", "w1"]
        for _ in range(3):  # heartbeats keep w1 alive past its first lease
            await asyncio.sleep(0.2)
            await plane.register(_info("w1"), ttl_s=0.4)
        assert [w.worker_id for w in await plane.workers()] == ["w0", "w1"]
        await asyncio.sleep(0.6)
        assert [w.worker_id for w in await plane.workers()] == ["w0"]
        await plane.deregister("w0")
        assert await plane.workers() == []
        await plane.close()

    asyncio.run(scenario())


def test_a_real_engines_events_rebuild_its_cache_in_the_index(make_plane: PlaneFactory, make_engine: Any,
                                                              tokenizer: Any) -> None:
    engine = make_engine(kv_blocks=24)
    prompts = [tokenizer.encode("A shared system prompt for many users. " * 6 + f"Question {i}?") for i in range(6)]
    engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0))  # 24 blocks: some get evicted

    async def scenario() -> None:
        plane = make_plane()
        await plane.publish("w0", engine.drain_kv_events())
        batches, _ = await plane.read("0", block_s=0.1)
        index = KVIndex()
        assert all(index.apply(b.worker_id, b.events) for b in batches)
        assert index.worker_blocks("w0") == set(engine.block_manager.cached_block_hashes())
        index.check_integrity()
        await plane.close()

    asyncio.run(scenario())


def test_a_worker_actor_publishes_its_kv_events_and_registers(worker: Any, gateway: Any) -> None:
    """The session worker publishes on the embedded (Ray) plane: replaying everything it published rebuilds
    exactly its snapshot, and it is listed in the registry."""
    import httpx
    import ray


    handle, _ = worker
    system = "You are a meticulous assistant. " * 20
    for question in ("Why is the sky blue?", "Why is grass green?"):
        httpx.post(f"{gateway.url}/v1/chat/completions", timeout=60, json={
            "model": "SmolLM2-135M-Instruct", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})

    deadline = time.monotonic() + 5
    while True:
        hashes, last_event_id = ray.get(handle.kv_snapshot.remote())
        index, registered = asyncio.run(replay_event_plane())
        if index.last_event_id("w0") == last_event_id:
            break
        assert time.monotonic() < deadline, "published events did not catch up with the snapshot"
    assert index.worker_blocks("w0") == set(hashes) and len(hashes) >= 8  # the shared ~120-token system prompt
    assert "w0" in registered  # beside mockers of other tests, when they ran first on the same default plane


def test_the_embedded_plane_reconnects_after_its_connection_drops(ray_instance: Any) -> None:
    from dynserve.events.ray_plane import RayEventPlane

    async def scenario() -> None:
        plane = RayEventPlane(namespace=f"test{next(_prefixes)}")
        await plane.publish("a", [BlockStored(0, None, [1])])
        connection = plane._connections[asyncio.get_running_loop()]
        connection._writer.transport.abort()  # the socket drops under the client
        await asyncio.sleep(0.05)
        assert not connection.is_open
        await plane.publish("a", [BlockStored(1, 1, [2])])  # on a new connection
        batches, _ = await plane.read("0", block_s=0.1)
        assert [b.events[0].event_id for b in batches] == [0, 1]
        await plane.close()
        ray_instance.kill(plane._handle)  # returns before the actor is gone
        deadline_s = time.monotonic() + 10
        while True:  # once it is, a client cannot connect and says so
            try:
                await RayEventPlane(handle=plane._handle).workers()
            except ConnectionError as exc:
                assert "unreachable" in str(exc)
                break
            assert time.monotonic() < deadline_s, "a killed plane actor still answers"
            await asyncio.sleep(0.05)

    asyncio.run(scenario())
