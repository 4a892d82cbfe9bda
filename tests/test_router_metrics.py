"""The router's Prometheus metrics, read from the gateway's registry with a real `Router` (no model, no
HTTP): mode, index size, decision latency, overlap ratio, routed requests per worker, hot-spot picks, and
the lag of KV events consumed from a real in-process event plane. (tests/test_routing.py reads the same
metrics from a real gateway's /metrics.)"""

from __future__ import annotations

import asyncio
import time

import pytest

from dynserve.events.memory import MemoryEventPlane
from dynserve.gateway.metrics import GatewayMetrics, observe_many
from dynserve.hashing import hash_blocks
from dynserve.protocol import BlockStored, KVSnapshot
from dynserve.router.router import Router

BLOCK_SIZE, SALT = 4, 7


def _value(metrics: GatewayMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


@pytest.mark.parametrize("mode", ["kv", "approximate"])
def test_decisions_show_mode_latency_overlap_and_routed_counts(mode: str) -> None:
    router = Router(mode, block_size=BLOCK_SIZE, salt=SALT)  # type: ignore[arg-type]
    metrics = GatewayMetrics()
    metrics.watch_router(router)
    prompt = list(range(32))  # 8 blocks
    if mode == "kv":  # what the worker's events would have told the index
        router.index.apply("a", [BlockStored(0, None, hash_blocks(prompt[:24], BLOCK_SIZE, SALT))])
    for request_id in ("r1", "r2"):
        worker, _ = router.pick(prompt, ["a", "b"], {})
        router.routed(request_id, worker, 8)
        router.finished(request_id)
    assert _value(metrics, "dynserve_router_info", pool="both", mode=mode) == 1.0
    assert _value(metrics, "dynserve_router_routed_requests_total", pool="both", worker_id="a") == 2.0
    assert _value(metrics, "dynserve_router_decision_seconds_count", pool="both") == 2.0
    decision_s = _value(metrics, "dynserve_router_decision_seconds_sum", pool="both")
    assert decision_s is not None and 0 < decision_s < 0.5
    # kv: 6 of 8 blocks cached both times; approximate: none the first time, all 8 the second
    ratio_sum = _value(metrics, "dynserve_router_overlap_ratio_sum", pool="both")
    assert ratio_sum == pytest.approx(1.5 if mode == "kv" else 1.0)
    assert _value(metrics, "dynserve_router_index_blocks", pool="both") == (6.0 if mode == "kv" else 8.0)
    assert _value(metrics, "dynserve_router_index_workers", pool="both") == 1.0
    assert _value(metrics, "dynserve_router_hot_spot_picks_total", pool="both") == 0.0


def test_approximate_memory_size_shrinks_at_scrape_once_expired() -> None:
    now_s = [0.0]
    router = Router("approximate", block_size=BLOCK_SIZE, salt=SALT, approx_ttl_s=30.0,
                    clock=lambda: now_s[0])
    metrics = GatewayMetrics()
    metrics.watch_router(router)
    router.pick(list(range(16)), ["a", "b"], {})
    assert _value(metrics, "dynserve_router_index_blocks", pool="both") == 4.0
    now_s[0] = 30.0
    assert _value(metrics, "dynserve_router_index_blocks", pool="both") == 0.0


def test_hot_spot_picks_are_counted() -> None:
    router = Router("kv", block_size=BLOCK_SIZE, salt=SALT, hot_spot_ratio=1.5, hot_spot_min_blocks=50)
    metrics = GatewayMetrics()
    metrics.watch_router(router)
    prompt = list(range(400))  # 100 blocks, all cached on a
    router.index.apply("a", [BlockStored(0, None, hash_blocks(prompt, BLOCK_SIZE, SALT))])
    router.routed("r1", "a", 40)
    assert router.pick(prompt, ["a", "b"], {}) == ("a", 100)  # lopsided, but under 50 blocks: cost 40 vs 100
    router.routed("r2", "a", 20)
    assert router.pick(prompt, ["a", "b"], {}) == ("b", 0)  # 60 blocks, 60 / 30 > 1.5: load wins
    assert _value(metrics, "dynserve_router_hot_spot_picks_total", pool="both") == 1.0


def test_baseline_modes_count_routes_but_no_overlap() -> None:
    router = Router("round_robin", block_size=BLOCK_SIZE, salt=SALT)
    metrics = GatewayMetrics()
    metrics.watch_router(router)
    for request_id in ("r1", "r2", "r3"):
        router.routed(request_id, router.pick(list(range(8)), ["a", "b"], {})[0], 2)
    assert _value(metrics, "dynserve_router_routed_requests_total", pool="both", worker_id="a") == 2.0
    assert _value(metrics, "dynserve_router_routed_requests_total", pool="both", worker_id="b") == 1.0
    assert _value(metrics, "dynserve_router_decision_seconds_count", pool="both") == 3.0
    assert _value(metrics, "dynserve_router_overlap_ratio_count", pool="both") == 0.0  # exported at 0, never observed


def test_event_lag_is_measured_from_the_publish_time_on_the_batch() -> None:
    router = Router("kv", block_size=BLOCK_SIZE, salt=SALT)
    metrics = GatewayMetrics()
    metrics.watch_router(router)

    async def no_snapshot(worker_id: str) -> KVSnapshot:
        raise AssertionError("no gap in this stream")

    async def scenario() -> None:
        plane = MemoryEventPlane()
        consumer = asyncio.create_task(router.consume(plane, no_snapshot))
        before_s = time.time()
        await plane.publish("a", [BlockStored(0, None, [11, 12])])
        await plane.publish("b", [BlockStored(0, None, [11])])
        while router.index.num_blocks < 2 or router.index.last_event_id("b") is None:
            await asyncio.sleep(0.005)
        elapsed_s = time.time() - before_s
        consumer.cancel()
        assert _value(metrics, "dynserve_router_event_lag_seconds_count", pool="both") == 2.0
        lag_sum_s = _value(metrics, "dynserve_router_event_lag_seconds_sum", pool="both")
        assert lag_sum_s is not None and 0 <= lag_sum_s <= 2 * elapsed_s

    asyncio.run(scenario())


@pytest.mark.parametrize("amount", [0.0, 0.0004, 0.001, 0.0031, 0.5, 7.0])
def test_observe_many_exposes_what_as_many_observes_would(amount: float) -> None:
    from prometheus_client import generate_latest

    one_by_one, at_once = GatewayMetrics(), GatewayMetrics()
    for _ in range(5):
        one_by_one.endpoint("completions", "m").itl.observe(amount)
    observe_many(at_once.endpoint("completions", "m").itl, amount, 5)
    exposed = [[line for line in generate_latest(m.registry).decode().splitlines()
                if line.startswith("dynserve_inter_token_latency_seconds") and "_created" not in line]
               for m in (one_by_one, at_once)]
    assert exposed[0] == exposed[1] and any(line.endswith(" 5.0") for line in exposed[0])
