"""The fleet's shared services failing and coming back (found by the chaos drills, `benchmarks.chaos`): the
embedded event plane's actor process dying, a plane that cannot be read for a while, a registry that restarts
empty. Each must cost at most a moment of stale routing, never the gateway's workers or its KV index."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from typing import Any

import httpx

from dynserve.events.base import EventBatch
from dynserve.events.memory import MemoryEventPlane
from dynserve.protocol import BlockStored, KVSnapshot, WorkerInfo
from dynserve.router.router import Router

MODEL = "SmolLM2-135M-Instruct"
_names = itertools.count()


def _info(worker_id: str) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role="both", host="127.0.0.1", port=1, model_id="m", max_model_len=64,
                      block_size=16, num_blocks=8)


def test_the_embedded_plane_comes_back_after_its_process_dies(ray_instance: Any) -> None:
    from dynserve.events.ray_plane import RayEventPlane

    async def scenario() -> None:
        plane = RayEventPlane(namespace=f"recovery{next(_names)}")
        await plane.register(_info("w0"), ttl_s=30)
        for event_id in range(3):
            await plane.publish("w0", [BlockStored(event_id, None, [event_id + 1])])
        _batches, cursor = await plane.read("0", block_s=0.1)
        connection = plane._connections[asyncio.get_running_loop()]
        ray_instance.kill(plane._handle, no_restart=False)  # as a crash: Ray starts it again
        deadline_s = time.monotonic() + 60
        while connection.is_open:  # the old process's socket closes as it dies
            assert time.monotonic() < deadline_s, "the plane actor was not killed"
            await asyncio.sleep(0.05)
        while True:  # the client reconnects to the new process (a new socket) once it is up
            try:
                listed = await plane.workers()
                break
            except ConnectionError:
                assert time.monotonic() < deadline_s, "the plane actor did not come back"
                await asyncio.sleep(0.1)
        assert listed == []  # it starts empty: the workers' next heartbeats register them again
        await plane.register(_info("w0"), ttl_s=30)
        assert [w.worker_id for w in await plane.workers()] == ["w0"]
        await plane.publish("w0", [BlockStored(3, 3, [4])])
        batches, _ = await plane.read(cursor, block_s=1.0)  # a cursor past the new stream's end reads it all
        assert [b.events[0].event_id for b in batches] == [3]
        await plane.close()
        ray_instance.kill(plane._handle)

    asyncio.run(scenario())


class _FlakyPlane(MemoryEventPlane):
    """A plane whose first `failures` reads fail, as a Redis restarting does."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def read(self, cursor: str, *, max_batches: int = 1000,
                   block_s: float = 1.0) -> tuple[list[EventBatch], str]:
        if self.failures:
            self.failures -= 1
            raise ConnectionError("the event plane is restarting")
        return await super().read(cursor, max_batches=max_batches, block_s=block_s)


def test_a_router_keeps_reading_after_the_plane_fails_for_a_while() -> None:
    async def scenario() -> None:
        plane = _FlakyPlane(failures=4)
        router = Router("kv", block_size=16, salt=0)

        async def snapshot(worker_id: str) -> KVSnapshot:
            raise AssertionError("no gap, no snapshot")

        events: Sequence[BlockStored] = [BlockStored(0, None, [11, 12])]
        await plane.publish("w0", events)
        consuming = asyncio.create_task(router.consume(plane, snapshot))
        deadline_s = time.monotonic() + 10
        while router.index.worker_blocks("w0") != {11, 12}:
            assert time.monotonic() < deadline_s, "the router stopped at the plane's failures"
            await asyncio.sleep(0.05)
        consuming.cancel()

    asyncio.run(scenario())


class _Registry(MemoryEventPlane):
    """A registry that can be emptied at once, as a Redis restart empties it."""

    listing: list[WorkerInfo] | None = None

    async def workers(self) -> list[WorkerInfo]:
        return list(self.listing) if self.listing is not None else await super().workers()


def test_a_registry_that_restarts_empty_does_not_empty_the_gateway(make_mocker: Any, make_gateway: Any) -> None:
    infos = [make_mocker(f"rec-{i}", mocker_speedup=20, namespace="recovery-reg")[1] for i in range(2)]
    registry = _Registry()
    registry.listing = infos
    server = make_gateway(infos=infos, registry=registry, namespace="recovery-reg", worker_lease_s=2.0,
                          registry_interval_s=0.1)
    workers = server.app.state.backend
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 200
    registry.listing = []  # the registry restarted: nobody listed until the next heartbeats
    time.sleep(0.5)
    assert sorted(workers.directory.routable_ids()) == ["rec-0", "rec-1"]
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 200
    registry.listing = infos[:1]  # one came back; the other is still missing after the grace: it leaves
    deadline_s = time.monotonic() + 10
    while workers.directory.routable_ids() != ["rec-0"]:
        assert time.monotonic() < deadline_s, workers.directory.routable_ids()
        time.sleep(0.1)
