"""KV-aware routing: two worker actors publishing KV events on the embedded event plane (and one more on a
real Redis), gateways routing by prefix overlap, by their own memory (approximate) or round robin, two
gateways sharing one event plane, the router's metrics on /metrics, and a worker killed under the router.

The workers serve a tiny random-weight Llama with the real model's vocabulary (`tests/_tiny_models.py`):
routing, prefix caching and KV events are the same for any weights, and its ~300-token prompts prefill in
milliseconds, not the real model's second."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import needs
from prometheus_client.parser import text_string_to_metric_families


def _launch(ray: Any, worker_ids: list[str], **overrides: Any) -> list[tuple[Any, Any]]:
    """Workers of the tiny model (two threads, no Ray CPUs reserved), publishing their KV events:
    [(handle, info), ...]."""
    from _tiny_models import tiny_model

    from dynserve.config import Settings
    from dynserve.workers.worker import launch_worker

    settings = Settings(dtype="float32", device="cpu", kv_blocks=512, num_threads=2,
                        model=str(tiny_model("llama", tie_word_embeddings=False)), **overrides)
    launched = [launch_worker(settings, worker_id, num_cpus=0, publish_events=True)
                for worker_id in worker_ids]
    return [(handle, ray.get(info_ref, timeout=300)) for handle, info_ref in launched]


@pytest.fixture(scope="module")
@needs("fleet")
def workers(ray_instance: Any) -> Iterator[list[Any]]:
    """t0 and t1 on the embedded event plane: [(handle, info), (handle, info)]."""
    launched = _launch(ray_instance, ["t0", "t1"])
    yield launched
    for handle, _ in launched:
        ray_instance.kill(handle)


@pytest.fixture(scope="module")
@needs("fleet")
def redis_worker(ray_instance: Any, redis_url: str) -> Iterator[Any]:  # noqa: F811
    """r0, publishing its KV events on the real Redis: (handle, info)."""
    [launched] = _launch(ray_instance, ["r0"], redis_url=redis_url)
    yield launched
    ray_instance.kill(launched[0])


def _chat(gateway: Any, model: str, system: str, question: str) -> dict[str, Any]:
    body = {"model": model, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    response = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _cached(answer: dict[str, Any]) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def _wait_for_index(gateway: Any, min_blocks: int) -> None:
    index = gateway.app.state.backend.router.index
    deadline = time.monotonic() + 5
    while index.num_blocks < min_blocks:
        assert time.monotonic() < deadline, "the router's index did not receive the workers' KV events"
        time.sleep(0.02)


def _metrics(gateway: Any) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def _sample(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def _routed_to(gateway: Any) -> dict[str, float]:
    """Requests the gateway's router sent to each worker, from its /metrics."""
    return {dict(labels)["worker_id"]: value for (name, labels), value in _metrics(gateway).items()
            if name == "dynserve_router_routed_requests_total"}


def _wait_until_applied(gateway: Any, worker: Any) -> None:
    """Until the gateway's index has applied every KV event `worker` had published when this was called."""
    import ray

    handle, info = worker
    _hashes, last_event_id = ray.get(handle.kv_snapshot.remote(), timeout=30)
    index = gateway.app.state.backend.router.index
    deadline = time.monotonic() + 10
    while last_event_id is not None:
        applied = index.last_event_id(info.worker_id)
        if applied is not None and applied >= last_event_id:
            return
        assert time.monotonic() < deadline, "the gateway's router did not receive the worker's KV events"
        time.sleep(0.02)


def test_kv_router_sends_a_shared_prefix_back_to_its_worker(make_gateway: Any, workers: Any) -> None:
    model = workers[0][1].model_id
    gateway = make_gateway(infos=[info for _handle, info in workers], router="kv")
    system = "You are the routing test's assistant; answer with care and cite nothing. " * 16  # > 256 tokens
    first = _chat(gateway, model, system, "What is a cache?")
    assert first["usage"]["prompt_tokens"] > 256
    _wait_for_index(gateway, min_blocks=16)
    for question in ("What is a router?", "What is a prefix?"):
        assert _cached(_chat(gateway, model, system, question)) >= 240


def test_approximate_router_remembers_where_a_prefix_went_without_events(make_gateway: Any,
                                                                        workers: Any) -> None:
    model = workers[0][1].model_id
    gateway = make_gateway(infos=[info for _handle, info in workers], router="approximate")
    system = "Approximate routing test: no events are read, the router remembers. " * 18
    first = _chat(gateway, model, system, "What is memory?")
    prompt_blocks = first["usage"]["prompt_tokens"] // 16
    assert prompt_blocks >= 16
    second = _chat(gateway, model, system, "What is forgetting?")
    assert _cached(second) >= 240  # sent where the first went: an engine cache hit
    samples = _metrics(gateway)
    assert _sample(samples, "dynserve_router_info", pool="both", mode="approximate") == 1.0
    assert sum(_routed_to(gateway).values()) == 2.0
    # the index is the router's memory (both prompts, sharing the system prompt's blocks), not the events
    assert prompt_blocks <= _sample(samples, "dynserve_router_index_blocks", pool="both") <= 2 * prompt_blocks
    assert _sample(samples, "dynserve_router_index_workers", pool="both") == 1.0
    assert _sample(samples, "dynserve_router_overlap_ratio_sum", pool="both") > 0.5  # the second pick
    assert _sample(samples, "dynserve_router_decision_seconds_count", pool="both") == 2.0
    assert _sample(samples, "dynserve_router_event_lag_seconds_count", pool="both") == 0.0


@pytest.mark.parametrize("plane", ["embedded", pytest.param("redis", marks=pytest.mark.services)])
def test_two_gateways_on_one_event_plane_route_a_prefix_alike(plane: str, request: pytest.FixtureRequest,
                                                               make_gateway: Any, workers: Any) -> None:
    """A prefix served through gateway A is routed by gateway B to the same worker, from the events alone.
    A lists the workers the other way round, so its cold pick is the worker B would pick cold: only the
    events can send B there."""
    model = workers[0][1].model_id
    if plane == "embedded":
        (first, second), overrides = workers, {}
    else:  # B's cold pick publishes nowhere B reads: only r0's events on Redis can send B to r0
        first, second = workers[0], request.getfixturevalue("redis_worker")
        overrides = {"redis_url": request.getfixturevalue("redis_url")}
    gateway_a = make_gateway(infos=[second[1], first[1]], router="kv", **overrides)
    gateway_b = make_gateway(infos=[first[1], second[1]], router="kv", **overrides)
    system = f"Consistency across gateways ({plane} plane): both read one event stream. " * 18
    assert _cached(_chat(gateway_a, model, system, "Who answers first?")) == 0
    assert _routed_to(gateway_a) == {second[1].worker_id: 1.0}
    _wait_until_applied(gateway_b, second)
    assert _cached(_chat(gateway_b, model, system, "Who answers second?")) >= 240
    assert _routed_to(gateway_b) == {second[1].worker_id: 1.0}
    samples = _metrics(gateway_b)
    assert _sample(samples, "dynserve_router_info", pool="both", mode="kv") == 1.0
    assert _sample(samples, "dynserve_router_event_lag_seconds_count", pool="both") > 0
    assert _sample(samples, "dynserve_router_index_workers", pool="both") >= 1
    assert _sample(samples, "dynserve_router_index_blocks", pool="both") >= 16
    assert _sample(samples, "dynserve_router_overlap_ratio_sum", pool="both") > 0.8


def test_round_robin_alternates_and_ignores_the_cache(make_gateway: Any, workers: Any) -> None:
    model = workers[0][1].model_id
    gateway = make_gateway(infos=[info for _handle, info in workers], router="round_robin")
    system = "Round robin test: every request goes to the next worker in turn, whatever it caches. " * 14
    cached = [_cached(_chat(gateway, model, system, "Hello?")) for _ in range(4)]
    assert cached[0] == 0 and cached[1] == 0  # t0 then t1, both cold
    assert cached[2] >= 240 and cached[3] >= 240  # t0 then t1 again, both warm now


def test_a_killed_worker_leaves_routing_within_1s(make_gateway: Any, workers: Any) -> None:
    import ray

    model = workers[0][1].model_id
    gateway = make_gateway(infos=[info for _handle, info in workers], router="kv")
    assert httpx.get(f"{gateway.url}/ready", timeout=10).json()["workers"] == ["t0", "t1"]
    ray.kill(workers[1][0])
    killed_s = time.monotonic()
    while "t1" in httpx.get(f"{gateway.url}/ready", timeout=10).json()["workers"]:
        assert time.monotonic() - killed_s < 1.0, "the dead worker is still routable after 1 s"
        time.sleep(0.02)
    for i in range(4):  # every request lands on the live worker
        assert _chat(gateway, model, "Be brief.", f"Say {i}.")["choices"][0]["message"]["content"] is not None
