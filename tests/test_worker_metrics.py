"""A worker's own metrics endpoint: a mocker worker (in this process, no Ray) serving requests over its
channel, its `/metrics` read over HTTP as Prometheus would; the lock-free histograms against
prometheus_client's own; `promtool check metrics` on the output. (tests/test_observability.py scrapes a
whole fleet with a real Prometheus.)"""

from __future__ import annotations

import asyncio
import subprocess
import threading
from typing import Any

import httpx
import pytest
from conftest import read_until_closed
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dynserve.config import Settings
from dynserve.engine.core import EngineStats
from dynserve.protocol import GenerateRequest, SamplingParams
from dynserve.workers.channel import WorkerConnection
from dynserve.workers.metrics import StepHistogram, WorkerMetrics
from dynserve.workers.mocker import MockEngine
from dynserve.workers.worker import EngineWorker

LABELS = {"worker_id": "w0", "role": "both", "model": "SmolLM2-135M-Instruct"}


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **extra: str) -> float:
    return samples[(name, frozenset({**LABELS, **extra}.items()))]


async def _serve_and_scrape(settings: Settings, prompts: list[list[int]], max_tokens: int) -> tuple[str, Any]:
    worker = EngineWorker(settings, "w0")
    info = await worker.start()
    try:
        assert info.metrics_port is not None
        connection = WorkerConnection(info)
        await connection.connect()

        async def run(i: int, prompt: list[int]) -> int:
            request = GenerateRequest(request_id=f"r{i}", token_ids=prompt,
                                      params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            return sum([len(d.token_ids) async for d in connection.generate(request)])

        counts = await asyncio.gather(*(run(i, p) for i, p in enumerate(prompts)))
        assert counts == [max_tokens] * len(prompts)
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"http://{info.host}:{info.metrics_port}/metrics")).text
        await connection.close()
        return text, worker
    finally:
        await worker.stop()


def test_a_worker_serves_its_steps_queue_kv_and_cache_at_the_source() -> None:
    settings = Settings(mocker="cpu", mocker_speedup=50, kv_blocks=256)
    prompt = list(range(100, 164)) + [200] * 20  # 84 tokens: 5 full blocks and a partial one
    text, worker = asyncio.run(_serve_and_scrape(settings, [prompt], 8))
    samples = _samples(text)
    assert _value(samples, "dynserve_worker_kv_blocks_capacity") == 256
    assert _value(samples, "dynserve_worker_generated_tokens_total") == 8
    assert _value(samples, "dynserve_worker_prefix_cache_queried_tokens_total") == 84
    assert _value(samples, "dynserve_worker_prefix_cache_hit_tokens_total") == 0
    assert _value(samples, "dynserve_worker_time_to_first_token_seconds_count") == 1
    steps = _value(samples, "dynserve_worker_step_duration_seconds_count")
    assert steps >= 8  # a prefill step and 7 decodes at least
    assert _value(samples, "dynserve_worker_step_prefill_tokens_sum") == 84
    assert _value(samples, "dynserve_worker_step_decode_tokens_sum") == 7
    assert _value(samples, "dynserve_worker_inter_token_latency_seconds_count") == 7
    assert _value(samples, "dynserve_worker_step_batch_size_sum") == steps  # one request in every step
    assert _value(samples, "dynserve_worker_kv_transfer_failures_total", reason="transfer_timeout") == 0
    assert _value(samples, "dynserve_worker_waiting_requests") == 0
    assert worker.engine.stats.num_generated_tokens == 8


def test_prefix_hits_and_batches_are_counted_under_concurrency() -> None:
    settings = Settings(mocker="cpu", mocker_speedup=50, kv_blocks=256)
    shared = list(range(100, 164))

    async def main() -> str:
        worker = EngineWorker(settings, "w0")
        info = await worker.start()
        connection = WorkerConnection(info)
        await connection.connect()

        async def run(i: int) -> None:
            request = GenerateRequest(request_id=f"r{i}", token_ids=shared + [300 + i] * 8,
                                      params=SamplingParams(max_tokens=6, ignore_eos=True))
            async for _delta in connection.generate(request):
                pass

        await run(0)  # caches the shared blocks
        await asyncio.gather(*(run(i) for i in range(1, 5)))
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"http://{info.host}:{info.metrics_port}/metrics")).text
        await connection.close()
        await worker.stop()
        return text

    samples = _samples(asyncio.run(main()))
    assert _value(samples, "dynserve_worker_prefix_cache_hit_tokens_total") == 4 * 64
    assert _value(samples, "dynserve_worker_prefix_cache_queried_tokens_total") == 5 * 72
    # the four concurrent requests decoded together: some step had more than one of them
    assert _value(samples, "dynserve_worker_step_batch_size_bucket", le="1.0") < _value(
        samples, "dynserve_worker_step_batch_size_count")
    assert _value(samples, "dynserve_worker_generated_tokens_total") == 30


def test_worker_metrics_pass_promtool() -> None:
    text, _worker = asyncio.run(_serve_and_scrape(Settings(mocker="cpu", mocker_speedup=50), [list(range(40))], 4))
    checked = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                             timeout=30)
    assert checked.returncode == 0 and not (checked.stdout + checked.stderr).strip(), checked


def test_no_metrics_port_when_switched_off() -> None:
    async def main() -> Any:
        worker = EngineWorker(Settings(mocker="cpu", worker_metrics=False), "w0")
        info = await worker.start()
        await worker.stop()
        return info

    info = asyncio.run(main())
    assert info.metrics_port is None


@pytest.mark.parametrize("values", [[0.0004, 0.003, 0.003, 0.7, 9.0, 0.001], [5.0] * 3, []])
def test_step_histogram_exports_what_prometheus_clients_histogram_does(values: list[float]) -> None:
    bounds = (0.0005, 0.001, 0.0025, 0.005, 0.5, 1.0)
    registry = CollectorRegistry()
    reference = Histogram("h_seconds", "doc", buckets=bounds, registry=registry)
    ours = StepHistogram(bounds)
    for value in values:
        reference.observe(value)
        ours.observe(value)

    class _One:
        def collect(self) -> Any:
            yield ours.family("o_seconds", "doc", ["w", "r", "m"])

    mine = CollectorRegistry()
    mine.register(_One())
    expected = {(name.replace("h_", "o_"), labels): v for (name, labels), v in
                _samples(generate_latest(registry).decode()).items() if not name.endswith("_created")}
    got = {(name, frozenset((k, v) for k, v in labels if k == "le")): value
           for (name, labels), value in _samples(generate_latest(mine).decode()).items()}
    assert got == pytest.approx(expected)


def test_inter_token_latency_skips_a_step_after_idle() -> None:
    metrics = WorkerMetrics("w", "decode", MockEngine(Settings(mocker="cpu")))
    stats = EngineStats(last_batch_size=3, last_prefill_tokens=0, last_decode_tokens=3)
    metrics.record_step(stats, 0.01, 10.0, after_idle=True)  # first step after idle: no previous token here
    assert metrics.itl.sum == 0
    metrics.record_step(stats, 0.01, 10.02, after_idle=False)
    assert metrics.itl.counts[metrics.itl.bounds.index(0.02)] == 3
    assert metrics.itl.sum == pytest.approx(0.06)
    assert metrics.step_duration.counts[metrics.step_duration.bounds.index(0.01)] == 2


def test_ops_run_in_eager_torch_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    from dynserve.engine.kernels import eager

    metrics = WorkerMetrics("w", "decode", MockEngine(Settings(mocker="cpu")))
    monkeypatch.setattr(eager, "_FALLBACKS", type(eager._FALLBACKS)())  # this test's own record
    eager.note_fallback("triton", "gelu_tanh_mul")
    eager.note_fallback("triton", "gelu_tanh_mul")
    eager.note_fallback("triton", "qkv bias and q/k norm")
    families = {f.name: f for f in metrics.collect()}
    assert [s.value for s in families["dynserve_worker_engine_op_fallbacks"].samples] == [3.0]


def test_neither_a_stalled_nor_a_trickling_client_holds_off_a_scrape() -> None:
    """One client connects and says nothing; another sends bytes that never make a request line (as a stale
    peer that took the port for a worker's channel sends it frames), more often than the client timeout, so
    no read of it ever times out. A scrape behind both is answered (one server thread for all never answered
    it: a ReadTimeout), the silent client is dropped after the timeout, and the trickling one when its
    request's deadline is up (a timeout per read kept it, and its thread, for as long as it trickled)."""
    import socket
    import time

    from dynserve.workers.metrics import serve_metrics

    registry = CollectorRegistry()
    Histogram("probe_seconds", "a series to serve", registry=registry).observe(0.1)
    server, port = serve_metrics(registry, "127.0.0.1", 0, client_timeout_s=0.5)
    stalled = socket.create_connection(("127.0.0.1", port))  # connects, then says nothing
    trickling = socket.create_connection(("127.0.0.1", port))
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.2):
            try:
                trickling.sendall(b"\x00\x13frame")
            except OSError:
                return

    sender = threading.Thread(target=trickle, daemon=True)
    sender.start()
    try:
        time.sleep(0.3)  # both connections are with the server first
        start_s = time.monotonic()
        response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
        assert response.status_code == 200 and "probe_seconds_count 1.0" in response.text
        assert time.monotonic() - start_s < 5
        stalled.settimeout(5)
        assert stalled.recv(1) == b""  # dropped after the timeout
        assert read_until_closed(trickling, within_s=5) is not None  # its request's deadline: 0.5 s
    finally:
        stop.set()
        sender.join()
        stalled.close()
        trickling.close()
        server.shutdown()
        server.server_close()


def test_a_connection_over_the_cap_is_refused_and_a_scrape_comes_once_one_ends() -> None:
    """At most `max_connections` connections are served at once: one more is answered 503 and closed as it
    comes (not queued on a thread of its own), and once a held one ends a scrape is answered again."""
    import socket
    import time

    from dynserve.workers.metrics import serve_metrics

    registry = CollectorRegistry()
    Histogram("probe_seconds", "a series to serve", registry=registry).observe(0.1)
    server, port = serve_metrics(registry, "127.0.0.1", 0, client_timeout_s=30, max_connections=2)
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    try:
        over = socket.create_connection(("127.0.0.1", port))
        try:
            answer = read_until_closed(over, within_s=5)
            assert answer is not None and answer.startswith(b"HTTP/1.0 503 Service Unavailable\r\n"), answer
        finally:
            over.close()
        held.pop().close()  # its thread sees the end and gives its slot back
        deadline_s = time.monotonic() + 5
        while True:
            try:
                response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
                if response.status_code != 503:
                    break
            except httpx.TransportError:  # refused (answered 503 and closed): the slot was not back yet
                pass
            assert time.monotonic() < deadline_s, "no scrape answered after a held connection ended"
            time.sleep(0.05)
        assert response.status_code == 200 and "probe_seconds_count 1.0" in response.text
    finally:
        for sock in held:
            sock.close()
        server.shutdown()
        server.server_close()
