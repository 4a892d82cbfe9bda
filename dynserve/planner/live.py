"""The planner live: thin connectors around the pure core (`core.py`).

- `PrometheusReader` turns the fleet's metrics into an `Observation`: the gateway's rate of admitted requests
  (the offered load) and the mean ISL and OSL of finished ones, and per pool (the workers' `role`) its TTFT
  and ITL (the mean in the sla mode, whose corrections compare it with the profile's expected mean; a
  quantile, p90 by default, in the load mode), queued and running requests, and the requests the gateway
  holds for a worker. Over `window_s`: at 60 s it reads the recording rules of `observability/rules.py`
  where they exist, otherwise the raw series. With a `model` it reads only that model's series (one planner
  per model).
- `Actuator` is what carries a decision out: `PoolActuator` grows and shrinks Ray `WorkerPool`s (a removed
  worker drains first: no request is cut, a prefill's leased blocks are released or expire);
  `kubernetes.KubernetesActuator` patches the `DynServePool`s of a deployment the operator runs.
- `PlannerMetrics`: the planner's own `dynserve_planner_*` series (decided and serving workers per pool,
  predicted load, observed against target TTFT and ITL, needs and corrections, decisions by reason), labelled
  with the model; `FleetPlannerMetrics` merges the models' into one collector.
- `ArrivalRate`: the rate of the gateway's own count of a model's admitted requests over the read window, which
  the loop reads in place of the scraped rate where the planner runs in the gateway (`dynctl serve`).
- `PlannerLoop`: every `interval_s` (and at once when `wake` is called: a request is waiting for a fleet at
  zero) read, decide, act, record. A failed read skips the interval (the fleet keeps its size); a failed
  scaling is logged and retried by the next decision.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from dynserve.errors import PrometheusError
from dynserve.observability.promql import PrometheusClient
from dynserve.planner.core import Decision, Observation, PlannerCore, PoolObservation

__all__ = ["Actuator", "ArrivalRate", "FleetPlannerMetrics", "PlannerLoop", "PlannerMetrics", "PoolActuator",
           "PrometheusReader"]

logger = logging.getLogger(__name__)


class PrometheusReader:
    """Reads an `Observation` of `pools` from Prometheus (blocking HTTP; run it off the event loop)."""

    def __init__(self, client: PrometheusClient, pools: tuple[str, ...], *, window_s: float = 60.0,
                 statistic: str = "mean", model: str | None = None) -> None:
        """`statistic`: "mean", or a quantile such as "0.9", of the pools' TTFT and ITL; `model`: read only the
        series of that model (its `model` label: a gateway serving several models has one planner each)."""
        self.client, self.pools, self.model = client, pools, model
        self.window = f"{round(window_s)}s" if window_s != 60 else "1m"
        self.statistic = statistic

    def queries(self) -> dict[str, str]:
        w = self.window
        rules = w == "1m" and self.model is None  # the fleet-wide recording rules; a model's own: raw series
        m = "" if self.model is None else '{model="%s"}' % self.model.replace("\\", "\\\\").replace('"', '\\"')
        queries = {
            # the offered load: requests counted as they are admitted, not as they finish (under overload a
            # fleet finishes only what it can)
            "rate": "dynserve:requests_admitted:rate1m" if rules else (
                f"sum(rate(dynserve_requests_admitted_total{m}[{w}]))"),
            "isl": "dynserve:prompt_tokens:mean1m" if rules else _mean("dynserve_request_prompt_tokens", w, "", m),
            "osl": "dynserve:generation_tokens:mean1m" if rules else _mean("dynserve_request_generation_tokens",
                                                                           w, "", m),
            "workers": f"count by (role) (dynserve_worker_kv_blocks_capacity{m})",
            "waiting": f"sum by (role) (dynserve_worker_waiting_requests{m})",
            "running": f"sum by (role) (dynserve_worker_running_requests{m})",
        }
        if self.model is None:  # the gateway's gauge is fleet-wide; a model's planner asks the gateway itself
            queries["waiting_for_worker"] = "sum(dynserve_gateway_waiting_for_worker_requests)"
        for name, metric in (("ttft", "dynserve_worker_time_to_first_token_seconds"),
                             ("itl", "dynserve_worker_inter_token_latency_seconds")):
            if self.statistic == "mean":
                queries[name] = _mean(metric, w, "role", m)
            else:
                quantile = float(self.statistic)
                rule = f"role:{metric}:p{round(quantile * 100)}"
                queries[name] = rule if rules and quantile in (0.5, 0.9, 0.99) else (
                    f"histogram_quantile({quantile}, sum by (le, role) (rate({metric}_bucket{m}[{w}])))")
        return queries

    def observe(self, now_s: float) -> Observation:
        """The fleet now; raises PrometheusError when Prometheus cannot answer."""
        results = {name: self.client.query(expr) for name, expr in self.queries().items()}

        def scalar(name: str) -> float:
            return results[name][0].value if results.get(name) else math.nan

        def by_role(name: str, default: float) -> dict[str, float]:
            values = {s.get("role"): s.value for s in results[name]}
            return {pool: values.get(pool, default) for pool in self.pools}

        workers, ttft, itl = by_role("workers", 0), by_role("ttft", math.nan), by_role("itl", math.nan)
        waiting, running = by_role("waiting", 0.0), by_role("running", 0.0)
        pools = {pool: PoolObservation(num_workers=int(workers[pool]), ttft_s=ttft[pool], itl_s=itl[pool],
                                       num_waiting=waiting[pool], num_running=running[pool])
                 for pool in self.pools}
        waiting_for_worker = scalar("waiting_for_worker")
        return Observation(now_s=now_s, pools=pools, request_rate_per_s=scalar("rate"),
                           mean_isl=scalar("isl"), mean_osl=scalar("osl"),
                           num_waiting_for_worker=int(waiting_for_worker) if math.isfinite(waiting_for_worker) else 0)


def _mean(metric: str, window: str, by: str, selector: str = "") -> str:
    group = f"sum by ({by}) " if by else "sum"
    return (f"{group}(rate({metric}_sum{selector}[{window}])) / "
            f"{group}(rate({metric}_count{selector}[{window}]))")


class Actuator(Protocol):
    """Carries decisions out: `refresh()` reads the pools' sizes where others may change them too (before each
    decision), `current()` is each pool's worker count as the actuator has set or read it (starting and
    serving workers), `scale(pool, n)` sets the pool's target to `n` workers and returns once the target is set:
    workers start (or drain) after that, so a later decision is applied without waiting for them."""

    async def refresh(self) -> None: ...

    def current(self) -> dict[str, int]: ...

    async def scale(self, pool: str, num_workers: int) -> None: ...


class PoolActuator:
    """Scales Ray `WorkerPool`s (`pools`: pool name -> pool; used through `policy.target`, `add()` and
    `remove()`): new workers start together; removed ones drain (their in-flight requests finish). `scale`
    changes the pool's target before its first await and leaves the starts and drains to background tasks,
    so a second scale-up decided while the first one's workers start is not held behind them."""

    def __init__(self, pools: Mapping[str, Any]) -> None:
        self.pools = dict(pools)
        self._changes: set[asyncio.Task[Any]] = set()  # starts and drains under way

    async def refresh(self) -> None:
        """Nothing to read: only this actuator changes the pools' targets."""

    def current(self) -> dict[str, int]:
        """Each pool's target as the pool keeps it (a dead worker being replaced still counts)."""
        return {name: pool.policy.target for name, pool in self.pools.items()}

    def serving(self) -> dict[str, int]:
        return {name: len(pool.workers()) for name, pool in self.pools.items()}

    async def scale(self, pool: str, num_workers: int) -> None:
        target = self.pools[pool]
        delta = num_workers - target.policy.target
        if delta == 0:
            return
        logger.info("planner: pool %s %d -> %d workers", pool, target.policy.target, num_workers)
        # each add() and remove() changes the pool's target in its first step, before it awaits anything: one
        # yield runs those steps, in order, before this returns
        changes = [asyncio.ensure_future(target.add() if delta > 0 else target.remove()) for _ in range(abs(delta))]
        await asyncio.sleep(0)
        watch = asyncio.create_task(self._watch(pool, delta, changes), name=f"planner-watch-{pool}")
        self._changes.add(watch)
        watch.add_done_callback(self._changes.discard)

    async def wait(self) -> None:
        """Until the starts and drains under way have ended (tests, shutdown)."""
        while self._changes:
            await asyncio.gather(*self._changes, return_exceptions=True)

    @staticmethod
    async def _watch(pool: str, delta: int, changes: list[asyncio.Future[Any]]) -> None:
        results = await asyncio.gather(*changes, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:  # a start that failed is replaced by the pool per its restart policy
            logger.warning("planner: %d of %d %s of pool %s failed: %s", len(failed), abs(delta),
                           "new workers" if delta > 0 else "drains", pool, failed[0])


class PlannerMetrics:
    """One model's planner series, read at scrape time from its last decision, each labelled with the model
    (`FleetPlannerMetrics` is the collector to register: it merges every model's)."""

    def __init__(self, core: PlannerCore, serving: Callable[[], Mapping[str, int]], *, model: str) -> None:
        self.core, self._serving, self.model = core, serving, model
        self.last: Decision | None = None
        self.last_observation: Observation | None = None
        self.decisions: dict[tuple[str, str], int] = {}  # (pool, reason) -> decisions that changed the pool

    def record(self, observation: Observation, decision: Decision, changed: Mapping[str, int]) -> None:
        self.last_observation, self.last = observation, decision
        for pool in changed:
            key = (pool, decision.reasons[pool])
            self.decisions[key] = self.decisions.get(key, 0) + 1

    def collect(self) -> Iterator[Metric]:
        config, decision, observation, model = self.core.config, self.last, self.last_observation, self.model
        decided = GaugeMetricFamily("dynserve_planner_workers_target", "Workers the planner wants per pool",
                                    labels=["model", "pool"])
        serving = GaugeMetricFamily("dynserve_planner_workers_serving", "Workers serving per pool",
                                    labels=["model", "pool"])
        overridden = GaugeMetricFamily("dynserve_planner_override_workers", "A pool's manual override (absent: "
                                       "none)", labels=["model", "pool"])
        for pool, count in self._serving().items():
            serving.add_metric([model, pool], count)
        for pool, count in self.core.overrides.items():
            overridden.add_metric([model, pool], count)
        need = GaugeMetricFamily("dynserve_planner_workers_needed", "Workers the predicted load needs (sla mode, "
                                 "fractional, corrected)", labels=["model", "pool"])
        correction = GaugeMetricFamily("dynserve_planner_correction_ratio", "Observed over the profile's expected "
                                       "latency, smoothed (sla mode)", labels=["model", "pool"])
        observed = GaugeMetricFamily("dynserve_planner_observed_latency_seconds", "The pools' TTFT and ITL as the "
                                     "planner read them", labels=["model", "pool", "kind"])
        if decision is not None:
            for pool, count in decision.targets.items():
                decided.add_metric([model, pool], count)
            for pool, value in decision.needs.items():
                if math.isfinite(value):
                    need.add_metric([model, pool], value)
            for pool, value in decision.corrections.items():
                correction.add_metric([model, pool], value)
        if observation is not None:
            for pool, seen in observation.pools.items():
                for kind, value in (("ttft", seen.ttft_s), ("itl", seen.itl_s)):
                    if math.isfinite(value):
                        observed.add_metric([model, pool, kind], value)
        target = GaugeMetricFamily("dynserve_planner_target_latency_seconds", "The planner's TTFT and ITL targets",
                                   labels=["model", "kind"])
        target.add_metric([model, "ttft"], config.ttft_target_s)
        target.add_metric([model, "itl"], config.itl_target_s)
        predicted = GaugeMetricFamily("dynserve_planner_predicted", "The predicted load of the next interval: "
                                      "request rate (per second), mean ISL and OSL (tokens)",
                                      labels=["model", "quantity"])
        if decision is not None:
            for quantity, value in (("request_rate", decision.predicted_rate_per_s),
                                    ("isl", decision.predicted_isl), ("osl", decision.predicted_osl)):
                if math.isfinite(value):
                    predicted.add_metric([model, quantity], value)
        decisions = CounterMetricFamily("dynserve_planner_decisions", "Changes of a pool's target, by reason",
                                        labels=["model", "pool", "reason"])
        for (pool, reason), count in sorted(self.decisions.items()):
            decisions.add_metric([model, pool, reason], count)
        yield from (decided, serving, overridden, need, correction, observed, target, predicted, decisions)


class FleetPlannerMetrics:
    """The collector of every model's `PlannerMetrics`: one family per series, each model's samples in it."""

    def __init__(self, parts: list[PlannerMetrics]) -> None:
        self.parts = parts

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for part in self.parts:
            for family in part.collect():
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        yield from families.values()


class ArrivalRate:
    """The rate of a count of arrivals (`count`: requests admitted so far) over the last `window_s`, from the
    samples taken at each read: exact, where a scraped rate over a window of a few scrapes reads a rise late
    and, when a scrape is late or missed, reads a busy model at a fraction of its rate."""

    def __init__(self, count: Callable[[], int], window_s: float) -> None:
        self.count, self.window_s = count, window_s
        self._samples: collections.deque[tuple[float, int]] = collections.deque()

    def read(self, now_s: float) -> float:
        """Arrivals per second since the newest sample at least `window_s` old (the oldest one while none is);
        NaN at the first read."""
        count = self.count()
        samples = self._samples
        while len(samples) > 1 and samples[1][0] <= now_s - self.window_s:
            samples.popleft()
        rate = math.nan
        if samples and now_s > samples[0][0]:
            rate = (count - samples[0][1]) / (now_s - samples[0][0])
        samples.append((now_s, count))
        return rate


class PlannerLoop:
    """Runs the core every `interval_s` against the live fleet (see the module doc)."""

    def __init__(self, core: PlannerCore, reader: PrometheusReader, actuator: PoolActuator | Actuator, *,
                 metrics: PlannerMetrics | None = None, clock: Callable[[], float] = time.monotonic,
                 serving: Callable[[], Mapping[str, int]] | None = None,
                 waiting_for_worker: Callable[[], int] | None = None,
                 arrivals: ArrivalRate | None = None) -> None:
        """`serving`: each pool's serving workers now (default: the actuator's counts, as if all served);
        `waiting_for_worker`: the requests the gateway holds now for a worker (fresher than Prometheus's);
        `arrivals`: the gateway's own count of admitted requests, whose rate replaces the scraped one."""
        self.core, self.reader, self.actuator, self.metrics, self.clock = core, reader, actuator, metrics, clock
        self._serving, self._waiting_for_worker, self._arrivals = serving, waiting_for_worker, arrivals
        self._wake = asyncio.Event()
        self._scaling: dict[str, asyncio.Task[None]] = {}
        self.decisions: list[Decision] = []  # the last 1000, oldest first

    def wake(self) -> None:
        """Decide now (a request is waiting for a worker)."""
        self._wake.set()

    async def run(self) -> None:
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.core.config.interval_s)
                self._wake.clear()
                await self.tick()
        finally:
            for task in self._scaling.values():
                task.cancel()

    async def tick(self) -> Decision | None:
        """One read-decide-act round; None when it could not decide (logged). Without Prometheus it still
        wakes a fleet at zero that the gateway holds requests for."""
        try:
            return await self._tick()
        except asyncio.CancelledError:
            raise
        except Exception:  # the planner keeps deciding whatever one round hit
            logger.exception("planner: a round failed")
            return None

    async def _tick(self) -> Decision | None:
        now_s = self.clock()
        waiting = self._waiting_for_worker() if self._waiting_for_worker is not None else 0
        counted = self._arrivals.read(now_s) if self._arrivals is not None else math.nan  # counted at now_s
        await self.actuator.refresh()  # raises: the round is skipped, the pools keep their size
        current = self.actuator.current()
        try:
            observation = await asyncio.to_thread(self.reader.observe, now_s)
        except PrometheusError as exc:
            if not waiting:
                logger.warning("planner: cannot read the fleet's metrics (%s); keeping the pools as they are", exc)
                return None
            observation = Observation(now_s, {p: PoolObservation(current.get(p, 0)) for p in self.core.pools})
        rate = counted if math.isfinite(counted) else observation.request_rate_per_s
        serving = self._serving() if self._serving is not None else current
        pools = {p: PoolObservation(serving.get(p, o.num_workers), o.ttft_s, o.itl_s, o.num_waiting, o.num_running,
                                    num_starting=max(0, current.get(p, 0) - serving.get(p, 0)))
                 for p, o in observation.pools.items()}
        observation = Observation(observation.now_s, pools, rate, observation.mean_isl, observation.mean_osl,
                                  max(observation.num_waiting_for_worker, waiting))
        decision = self.core.decide(observation)
        changed = {p: n for p, n in decision.targets.items() if current.get(p) != n}
        for pool, count in changed.items():
            self._scale(pool, count)
        if self.metrics is not None:
            self.metrics.record(observation, decision, changed)
        self.decisions = [*self.decisions[-999:], decision]
        if changed:
            logger.info("planner: %s", ", ".join(f"{p} -> {n} ({decision.reasons[p]})" for p, n in changed.items()))
        return decision

    def _scale(self, pool: str, count: int) -> None:
        """Set `pool`'s target to `count` in the background; a newer decision for the pool waits until the
        running one has set its target (not for its workers: see `Actuator.scale`) and then applies (the
        actuator's count is what the next decision starts from)."""
        previous = self._scaling.get(pool)

        async def run() -> None:
            if previous is not None and not previous.done():
                with contextlib.suppress(Exception):
                    await previous
            try:
                await self.actuator.scale(pool, count)
            except Exception:
                logger.exception("planner: scaling pool %s to %d failed", pool, count)

        self._scaling[pool] = asyncio.create_task(run(), name=f"planner-scale-{pool}")
