"""KV-aware routing with the real model: two worker actors publishing KV events on the embedded event plane,
gateways routing by prefix overlap or round robin, and a worker killed under the router."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def second_worker(ray_instance: Any) -> Iterator[Any]:
    from dynserve.config import Settings
    from dynserve.workers.worker import launch_worker

    settings = Settings(dtype="float32", device="cpu", kv_blocks=512, num_threads=2)
    handle, info_ref = launch_worker(settings, "w1", num_cpus=1, publish_events=True)
    info = ray_instance.get(info_ref, timeout=300)
    yield handle, info
    ray_instance.kill(handle)


def _chat(gateway: Any, system: str, question: str) -> dict[str, Any]:
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    response = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _cached(answer: dict[str, Any]) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def _wait_for_index(gateway: Any, min_blocks: int) -> None:
    index = gateway.app.state.workers.router.index
    deadline = time.monotonic() + 5
    while index.num_blocks < min_blocks:
        assert time.monotonic() < deadline, "the router's index did not receive the workers' KV events"
        time.sleep(0.02)


def test_kv_router_sends_a_shared_prefix_back_to_its_worker(make_gateway: Any, worker: Any,
                                                            second_worker: Any) -> None:
    gateway = make_gateway(infos=[worker[1], second_worker[1]], router="kv")
    system = "You are the routing test's assistant; answer with care and cite nothing. " * 16  # > 256 tokens
    first = _chat(gateway, system, "What is a cache?")
    assert first["usage"]["prompt_tokens"] > 256
    _wait_for_index(gateway, min_blocks=16)
    for question in ("What is a router?", "What is a prefix?"):
        assert _cached(_chat(gateway, system, question)) >= 240


def test_round_robin_alternates_and_ignores_the_cache(make_gateway: Any, worker: Any, second_worker: Any) -> None:
    gateway = make_gateway(infos=[worker[1], second_worker[1]], router="round_robin")
    system = "Round robin test: every request goes to the next worker in turn, whatever it caches. " * 14
    cached = [_cached(_chat(gateway, system, "Hello?")) for _ in range(4)]
    assert cached[0] == 0 and cached[1] == 0  # w0 then w1, both cold
    assert cached[2] >= 240 and cached[3] >= 240  # w0 then w1 again, both warm now


def test_a_killed_worker_leaves_routing_within_1s(make_gateway: Any, worker: Any, second_worker: Any) -> None:
    import ray

    gateway = make_gateway(infos=[worker[1], second_worker[1]], router="kv")
    assert httpx.get(f"{gateway.url}/ready", timeout=10).json()["workers"] == ["w0", "w1"]
    ray.kill(second_worker[0])
    killed_s = time.monotonic()
    while "w1" in httpx.get(f"{gateway.url}/ready", timeout=10).json()["workers"]:
        assert time.monotonic() - killed_s < 1.0, "the dead worker is still routable after 1 s"
        time.sleep(0.02)
    for i in range(4):  # every request lands on the live worker
        assert _chat(gateway, "Be brief.", f"Say {i}.")["choices"][0]["message"]["content"] is not None
