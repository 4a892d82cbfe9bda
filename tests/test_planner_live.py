"""The planner live: `dynctl serve --planner` over mocker pools of two models, reading a real Prometheus it
runs, one planner loop per model within one shared budget. A step of load on the default model makes it add
workers within 3 intervals; idleness takes a model's pool down (to zero, with `--planner-idle-s`) and the
next request for that model wakes it and is served, not refused, whatever the other model does; a manual
override holds; no request fails throughout. (The decisions themselves are tested on synthetic observations
in tests/test_planner_core.py; the readers' queries and the series here, without a fleet.)"""

from __future__ import annotations

import asyncio
import math
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from conftest import needs
from dynserve.model.resolve import default_model_path
from dynserve.observability.dashboards import build_all, expand_variables, panel_queries
from dynserve.observability.promql import PrometheusClient
from dynserve.planner.core import PlannerConfig, PlannerCore
from dynserve.planner.live import (ArrivalRate, FleetPlannerMetrics, PlannerMetrics, PoolActuator,
                                   PrometheusReader)

DYNCTL = str(Path(sys.executable).with_name("dynctl"))
MODEL = "SmolLM2-135M-Instruct"
SECOND = "second-model"  # a second id for the same GGUF (a mocker reads only its tokenizer)
INTERVAL_S = 2.0
# mockers of this machine's engine at 10x: the shipped `cpu` capacity profile, scaled by the speedup; the
# default model's pool may grow to 4 while the second model holds its one worker: a budget of 5
COMMAND = [DYNCTL, "serve", "--mocker", "cpu", "--mocker-speedup", "10", "--workers", "1", "--planner",
           "--planner-interval-s", str(INTERVAL_S), "--planner-window-s", "3", "--scrape-interval-s", "1",
           "--planner-ttft-ms", "150", "--planner-itl-ms", "15", "--planner-max-workers", "4",
           "--planner-max-total-workers", "5", "--planner-idle-s", "12", "--port", "0"]


class _Watch:
    """Polls GET /planner every 0.2 s from a thread: (monotonic time, targets, serving) over time."""

    def __init__(self, url: str) -> None:
        self.url, self.samples = url, []  # type: ignore[var-annotated]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=5) as http:
            while not self._stop.wait(0.2):
                state = http.get(f"{self.url}/planner").json()
                self.samples.append((time.monotonic(), state["targets"]["both"], state["serving"]["both"]))

    def first(self, predicate: Any, after_s: float, timeout_s: float) -> float:
        """Seconds from `after_s` to the first sample after it where predicate(target, serving) holds."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for at_s, target, serving in list(self.samples):
                if at_s >= after_s and predicate(target, serving):
                    return at_s - after_s
            time.sleep(0.2)
        raise AssertionError(f"not within {timeout_s} s: {self.samples[-20:]}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


async def _load(url: str, concurrency: int, duration_s: float) -> list[int]:
    statuses: list[int] = []
    body = {"model": MODEL, "max_tokens": 48, "messages": [{"role": "user", "content": "tell me a story " * 40}]}

    async def user(http: httpx.AsyncClient) -> None:
        end_s = time.monotonic() + duration_s
        while time.monotonic() < end_s:
            statuses.append((await http.post(f"{url}/v1/chat/completions", json=body)).status_code)

    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.gather(*(user(http) for _ in range(concurrency)))
    return statuses


def test_a_models_planner_reads_only_its_models_series() -> None:
    fleet_wide = PrometheusReader(None, ("both",), window_s=3).queries()  # type: ignore[arg-type]
    own = PrometheusReader(None, ("both",), window_s=3, model="coder").queries()  # type: ignore[arg-type]
    assert "waiting_for_worker" in fleet_wide and "waiting_for_worker" not in own  # the gateway's gauge is
    assert own["rate"] == 'sum(rate(dynserve_requests_admitted_total{model="coder"}[3s]))'  # fleet-wide
    assert all('{model="coder"}' in expr for expr in own.values()), own
    assert not any("model=" in expr for expr in fleet_wide.values())
    at_one_minute = PrometheusReader(None, ("both",), model="coder").queries()  # type: ignore[arg-type]
    assert at_one_minute["isl"].startswith('sum(rate(dynserve_request_prompt_tokens_sum{model="coder"}[1m]))')


def test_every_models_planner_series_carry_its_model_in_one_collector() -> None:
    config = PlannerConfig(mode="load")
    parts = [PlannerMetrics(PlannerCore(config, ("both",)), lambda n=n: {"both": n}, model=name)
             for n, name in ((2, "chat"), (0, "coder"))]
    registry = CollectorRegistry()
    registry.register(FleetPlannerMetrics(parts))
    text = generate_latest(registry).decode()
    assert 'dynserve_planner_workers_serving{model="chat",pool="both"} 2.0' in text
    assert 'dynserve_planner_workers_serving{model="coder",pool="both"} 0.0' in text
    assert text.count("# TYPE dynserve_planner_workers_serving gauge") == 1
    assert 'dynserve_planner_target_latency_seconds{kind="itl",model="coder"}' in text


class _StartingPool:
    """A fake of our own `WorkerPool` interface as the actuator uses it: a policy's target, and workers that
    start only when the test lets them."""

    class _Policy:
        target = 1

    def __init__(self) -> None:
        self.policy = self._Policy()
        self.started = asyncio.Event()

    async def add(self) -> None:
        self.policy.target += 1
        await self.started.wait()

    async def remove(self) -> None:
        self.policy.target -= 1


def test_a_scale_up_decided_while_workers_start_is_applied_at_once() -> None:
    async def scenario() -> None:
        pool = _StartingPool()
        actuator = PoolActuator({"prefill": pool})
        await asyncio.wait_for(actuator.scale("prefill", 3), 1.0)  # returns with two workers still starting
        assert actuator.current() == {"prefill": 3}
        await asyncio.wait_for(actuator.scale("prefill", 5), 1.0)  # not held behind the first two
        assert actuator.current() == {"prefill": 5}
        await asyncio.wait_for(actuator.scale("prefill", 4), 1.0)
        assert actuator.current() == {"prefill": 4}
        pool.started.set()
        await asyncio.wait_for(actuator.wait(), 1.0)

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def prometheus_url() -> Iterator[list[str]]:
    yield []  # filled by `fleet`


@pytest.fixture(scope="module")
@needs('fleet', 'ray', 'services')
def fleet(prometheus_url: list[str], tmp_path_factory: pytest.TempPathFactory,
          dynctl_serve_on_test_ray: Any) -> Iterator[str]:
    second = tmp_path_factory.mktemp("models") / f"{SECOND}.gguf"
    second.symlink_to(default_model_path().resolve())
    with dynctl_serve_on_test_ray([*COMMAND, "--model", str(default_model_path()), "--model", str(second)],
                            180) as served:
        assert "Planner: sla mode" in served.banner and SECOND in served.banner, served.banner
        # Prometheus hands new targets to its scrapers every 5 s: the fleet is watched once all are up
        match = re.search(r"Prometheus: (http://\S+?)[;\s]", served.banner)
        assert match is not None, served.banner
        prometheus_url.append(match.group(1))
        with PrometheusClient(match.group(1)) as prometheus:
            deadline_s = time.monotonic() + 30
            while [t.health for t in prometheus.targets()] != ["up"] * 3:  # the gateway, a worker per model
                assert time.monotonic() < deadline_s, prometheus.targets()
                time.sleep(0.2)
        # one request for the default model: its idle time (12 s) counts from here, not from the planner's
        # start, however long Prometheus took (the second model's counts from the start)
        url = f"http://127.0.0.1:{served.port}"
        answer = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                            json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert answer.status_code == 200, answer.text
        yield url
    assert served.code == 0, served.rest


def test_a_load_step_scales_up_within_3_intervals_and_idleness_scales_to_zero_and_back(fleet: str) -> None:
    watch = _Watch(fleet)
    try:
        # the load comes at once: before the idle fleet (12 s without a request) goes to zero
        watch.first(lambda target, serving: target == serving == 1, time.monotonic(), 3)
        started_s = time.monotonic()
        loaded: dict[str, list[int]] = {}
        thread = threading.Thread(target=lambda: loaded.setdefault("statuses", asyncio.run(_load(fleet, 16, 14))))
        thread.start()
        scale_up_s = watch.first(lambda target, _serving: target > 1, started_s, 3 * INTERVAL_S + 1)
        assert scale_up_s <= 3 * INTERVAL_S, scale_up_s
        watch.first(lambda target, serving: serving == target > 1, started_s, 30)  # the new workers serve
        thread.join()
        statuses = loaded["statuses"]
        assert len(statuses) > 50 and set(statuses) == {200}, sorted(set(statuses))
        idle_s = time.monotonic()
        watch.first(lambda target, serving: target == serving == 0, idle_s, 50)  # down, then to zero
        targets = [target for at_s, target, _ in watch.samples if at_s >= idle_s]
        assert targets == sorted(targets, reverse=True), targets  # only ever down while idle
        woken_s = time.monotonic()
        answer = httpx.post(f"{fleet}/v1/chat/completions", timeout=120,
                            json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert answer.status_code == 200, answer.text  # held while a worker started, then served
        assert time.monotonic() - woken_s < 30
        assert httpx.get(f"{fleet}/planner", timeout=10).json()["serving"]["both"] >= 1
    finally:
        watch.stop()


def test_a_second_model_idles_to_zero_on_its_own_and_its_next_request_wakes_it(fleet: str) -> None:
    def second() -> dict[str, Any]:
        return httpx.get(f"{fleet}/planner", timeout=10).json()["models"][SECOND]

    deadline_s = time.monotonic() + 60  # never sent a request: idle since the start
    while not (second()["targets"]["both"] == second()["serving"]["both"] == 0):
        assert time.monotonic() < deadline_s, second()
        time.sleep(0.5)
    client = openai.OpenAI(base_url=f"{fleet}/v1", api_key="unused", timeout=120, max_retries=0)
    woken_s = time.monotonic()
    answer = client.chat.completions.create(model=SECOND, max_tokens=4,
                                            messages=[{"role": "user", "content": "hi"}])
    assert answer.model == SECOND and answer.choices[0].finish_reason == "length"  # held, then served
    assert time.monotonic() - woken_s < 30
    assert second()["serving"]["both"] >= 1
    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.code == "model_not_found"


def test_a_manual_override_holds_until_released(fleet: str, prometheus_url: list[str]) -> None:
    with httpx.Client(timeout=10) as http:
        state = http.put(f"{fleet}/planner/pools/both", json={"workers": 2}).json()
        assert state["overrides"] == {"both": 2}
        assert http.put(f"{fleet}/planner/pools/both", json={"workers": 9}).status_code == 400  # over the max
        assert http.put(f"{fleet}/planner/pools/nope", json={"workers": 1}).status_code == 404
        deadline_s = time.monotonic() + 30
        while http.get(f"{fleet}/planner").json()["serving"]["both"] != 2:
            assert time.monotonic() < deadline_s
            time.sleep(0.2)
        time.sleep(3 * INTERVAL_S)  # idle, yet the override holds
        state = http.get(f"{fleet}/planner").json()
        assert state["targets"]["both"] == 2 and state["last_decision"]["reasons"]["both"] == "override"
        # the planner's dashboard: every query is valid PromQL here, and what an override shows has data once
        # Prometheus has scraped it (every second; a busy machine can hold a scrape back)
        wanted = ("Workers wanted by pool", "Workers serving by pool", "Overrides in force")
        queries = [(title, expand_variables(expr))
                   for title, expr in panel_queries(build_all()["dynserve-planner"])]
        deadline_s = time.monotonic() + 20
        with PrometheusClient(prometheus_url[0]) as prometheus:
            while True:
                answered = {title: prometheus.query(expr) for title, expr in queries}
                if all(answered[title] for title in wanted):
                    break
                assert time.monotonic() < deadline_s, ([t for t in wanted if not answered[t]], answered,
                                                       prometheus.targets())
                time.sleep(0.5)
        assert http.delete(f"{fleet}/planner/pools/both").json()["overrides"] == {}
        metrics = http.get(f"{fleet}/metrics").text
        assert f'dynserve_planner_workers_target{{model="{MODEL}",pool="both"}}' in metrics
        assert f'dynserve_planner_workers_target{{model="{SECOND}",pool="both"}}' in metrics
        assert (f'dynserve_planner_decisions_total{{model="{MODEL}",pool="both",reason="override"}} 1.0'
                in metrics)
        assert http.put(f"{fleet}/planner/pools/both?model=nope", json={"workers": 1}).status_code == 404


def test_the_arrival_rate_counts_the_last_window_exactly() -> None:
    count = [0]
    rate = ArrivalRate(lambda: count[0], window_s=3.0)
    assert math.isnan(rate.read(0.0))  # one sample: no rate yet
    count[0] = 2
    assert rate.read(1.0) == pytest.approx(2.0)  # the oldest sample while none is a window old
    for now_s, total in ((2.0, 4), (3.0, 10), (4.0, 19)):
        count[0] = total
        last = rate.read(now_s)
    assert last == pytest.approx((19 - 2) / 3.0)  # since the sample at 1.0, exactly the window before 4.0
    assert rate.read(4.5) == pytest.approx((19 - 2) / 3.5)  # no sample at 1.5: the newest older one, 1.0
