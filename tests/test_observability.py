"""A fleet watched by a real Prometheus: `dynctl serve --prometheus` with a prefill and a decode mocker
worker, a short load through the official client, then what a user of the fleet reads back through
Prometheus's HTTP API: every target up, the recording rules' series, every dashboard panel's query, `dynctl
top`, and, after a worker is killed, its target gone and its replacement's up. Real Prometheus, real Ray,
real workers; the endpoints' text and the rules pass `promtool`.

The tests of this module share one fleet and run in order: the kill comes last.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
from conftest import needs

from dynserve.observability.dashboards import build_all, expand_variables, panel_queries
from dynserve.observability.promql import PrometheusClient
from dynserve.observability.rules import RULES

DYNCTL = str(Path(sys.executable).with_name("dynctl"))
MODEL = "SmolLM2-135M-Instruct"
NUM_REQUESTS = 12
# long enough that the decode worker reads its KV from the prefill worker (over 32 uncached tokens)
SYSTEM = "You answer questions about observability: metrics, scrapes, rules and dashboards. " * 4


@dataclass
class Fleet:
    url: str  # the gateway's base URL
    prometheus: PrometheusClient


def _prometheus_url(banner: str) -> str:
    match = re.search(r"Prometheus: (http://\S+?)[;\s]", banner)
    assert match is not None, banner
    return match.group(1)


def _wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.5):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if result:
            return result
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(interval_s)


@pytest.fixture(scope="module")
@needs('fleet', 'ray', 'services')
def fleet(dynctl_serve_on_test_ray: Any) -> Iterator[Fleet]:
    command = [DYNCTL, "serve", "--mocker", "cpu", "--mocker-speedup", "4", "--prefill-workers", "1",
               "--decode-workers", "1", "--disagg-local-prefill-tokens", "32", "--prometheus",
               "--scrape-interval-s", "1", "--port", "0"]
    with dynctl_serve_on_test_ray(command, 180) as served:
        url = f"http://127.0.0.1:{served.port}"
        with PrometheusClient(_prometheus_url(served.banner)) as prometheus:
            prometheus_pid = _pid_listening_on(prometheus.url.removeprefix("http://"))
            # scraped before the load, so rates see it arrive (a counter's first sample is its start)
            _wait_for(lambda: [t.health for t in prometheus.targets()] == ["up"] * 3, 30, "three targets up")
            time.sleep(2)
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            for i in range(NUM_REQUESTS):
                stream = client.chat.completions.create(
                    model=MODEL, stream=True, max_tokens=12, temperature=0,
                    messages=[{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": f"Question {i}: what does a scrape do?"}])
                assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].delta.content) > 0
            # every request is in Prometheus, and the rules have run on it (1 s scrapes and evaluations)
            _wait_for(lambda: prometheus.value("sum(dynserve_requests_total)", 0) >= NUM_REQUESTS, 30,
                      "the requests in Prometheus")
            _wait_for(lambda: not math.isnan(prometheus.value("dynserve:time_to_first_token_seconds:p50")), 30,
                      "the TTFT rule's value")
            yield Fleet(url, prometheus)
    assert served.code == 0, served.rest
    # Ctrl-C stopped the Prometheus it ran too
    _wait_for(lambda: _gone(prometheus_pid), 10, "prometheus stopped")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _worker_targets(prometheus: PrometheusClient) -> dict[str, str]:
    """address -> health of the worker targets Prometheus scrapes now."""
    return {t.address: t.health for t in prometheus.targets() if t.labels.get("component") == "worker"}


def test_both_workers_are_up_and_the_rules_answer(fleet: Fleet) -> None:
    prometheus = fleet.prometheus
    targets = {t.address: (t.labels["component"], t.health) for t in prometheus.targets()}
    assert sorted(c for c, _h in targets.values()) == ["gateway", "worker", "worker"], targets
    assert all(h == "up" for _c, h in targets.values()), targets
    roles = {s.get("role"): s.get("worker_id") for s in prometheus.query("dynserve_worker_kv_blocks_capacity")}
    assert set(roles) == {"prefill", "decode"}, roles
    ttft_p50_s = prometheus.value("dynserve:time_to_first_token_seconds:p50")
    raw_p50_s = prometheus.value("histogram_quantile(0.5, sum by (le) "
                                 "(rate(dynserve_time_to_first_token_seconds_bucket[1m])))")
    assert 0 < ttft_p50_s < 5 and 0 < raw_p50_s < 5
    usage = prometheus.query("worker:dynserve_worker_kv_usage:ratio")
    assert {s.get("worker_id") for s in usage} == set(roles.values())
    assert all(0 <= s.value <= 1 for s in usage)
    assert {s.get("role") for s in prometheus.query("role:dynserve_worker_waiting_requests:sum")} == set(roles)
    # what the workers measured at the source: steps, tokens and the decode worker's KV reads
    assert prometheus.value('sum(dynserve_worker_step_duration_seconds_count{role="decode"})') > 0
    assert prometheus.value('sum(dynserve_worker_generated_tokens_total{role="decode"})') > 0
    assert prometheus.value('sum(dynserve_worker_kv_transfer_bytes_total{role="decode"})') > 0
    assert prometheus.value('sum(dynserve_disagg_requests_total{path="remote"})') > 0
    assert prometheus.value("dynserve:prompt_tokens:mean1m") > 32
    for rule in RULES:  # every rule evaluates without error (some are NaN: a prefill worker decodes nothing)
        assert prometheus.query(rule.record), rule.record


def test_every_dashboard_panel_query_returns_a_series(fleet: Fleet) -> None:
    # this fleet runs no planner: the planner dashboard's series are absent, every other panel has data
    dashboards = {stem: dashboard for stem, dashboard in build_all().items() if stem != "dynserve-planner"}
    assert len(dashboards) == 4
    empty = []
    num_queries = 0
    for name, dashboard in dashboards.items():
        for title, expr in panel_queries(dashboard):
            num_queries += 1
            if not fleet.prometheus.query(expand_variables(expr)):  # a PromQL error raises here
                empty.append((name, title, expr))
    assert num_queries >= 30
    assert not empty, empty


def test_dynctl_top_shows_each_worker_and_pool(fleet: Fleet) -> None:
    result = subprocess.run([DYNCTL, "top", "--once", "--output", "json", "--prometheus-url",
                             fleet.prometheus.url], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    view = json.loads(result.stdout)
    text = json.dumps(view)
    for worker_id in ("p-0", "d-0"):
        assert worker_id in text, text
    assert "prefill" in text and "decode" in text
    result = subprocess.run([DYNCTL, "top", "--once", "--prometheus-url", fleet.prometheus.url],
                            capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "160"})
    assert result.returncode == 0, result.stderr
    assert "p-0" in result.stdout and "d-0" in result.stdout, result.stdout


def _promtool_check_metrics(text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                          timeout=30)


def test_promtool_finds_the_gateway_and_worker_metrics_clean(fleet: Fleet) -> None:
    gateway = httpx.get(f"{fleet.url}/metrics", timeout=10).text
    worker_address = next(iter(_worker_targets(fleet.prometheus)))
    worker = httpx.get(f"http://{worker_address}/metrics", timeout=10).text
    assert "dynserve_router_decision_seconds_count" in gateway
    assert "dynserve_worker_step_duration_seconds_count" in worker
    for name, text in (("gateway", gateway), ("worker", worker)):
        checked = _promtool_check_metrics(text)
        assert checked.returncode == 0 and not checked.stdout.strip() and not checked.stderr.strip(), (
            name, checked.stdout, checked.stderr)


def _pid_listening_on(address: str) -> int:
    port = int(address.rsplit(":", 1)[1])
    for connection in psutil.net_connections(kind="tcp"):
        if connection.status == psutil.CONN_LISTEN and connection.laddr.port == port and connection.pid:
            return connection.pid
    raise AssertionError(f"no process listens on {address}")


def test_a_killed_workers_target_goes_and_its_replacement_comes_up(fleet: Fleet) -> None:
    prometheus = fleet.prometheus
    decode = next(s for s in prometheus.query("dynserve_worker_kv_blocks_capacity") if s.get("role") == "decode")
    killed = decode.get("instance")
    before = _worker_targets(prometheus)
    assert before.get(killed) == "up", before
    os.kill(_pid_listening_on(killed), signal.SIGKILL)

    def replaced() -> dict[str, str] | None:
        now = _worker_targets(prometheus)
        if killed in now or len(now) != 2 or any(h != "up" for h in now.values()):
            return None
        return now

    after = _wait_for(replaced, 60, f"worker target {killed} replaced")
    new_address = next(a for a in after if a not in before)
    samples = prometheus.query(f'dynserve_worker_kv_blocks_capacity{{instance="{new_address}"}}')
    assert [s.get("role") for s in samples] == ["decode"]
    # and the fleet serves through the replacement
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="none", max_retries=2)
    answer = client.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert answer.usage is not None and answer.usage.completion_tokens > 0
