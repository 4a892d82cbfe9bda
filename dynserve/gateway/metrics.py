"""The gateway's Prometheus metrics, on a registry of its own (several gateways may share a process in tests).

Names start `dynserve_`; latencies are histograms in seconds; worker gauges carry `worker_id` and `role`
and are refreshed from the loads the gateway polls from its workers.

Router metrics (`dynserve_router_*`) come from the gateway's `Router` through its observer hook
(`watch_router`): the mode in use, the index's size (read at scrape time), KV event lag, decision latency
(match + select), the chosen worker's overlap ratio, requests routed per worker, and hot-spot picks. A
gateway with one worker has no router: its router histograms stay empty and `dynserve_router_info` unset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from dynserve.gateway.disagg import PrefillPath
from dynserve.protocol import WorkerLoad

if TYPE_CHECKING:
    from dynserve.router.cost import Decision
    from dynserve.router.router import Router

__all__ = ["EndpointSeries", "GatewayMetrics", "observe_many"]

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                      7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)
_DECISION_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
_EVENT_LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


def observe_many(histogram: Any, amount: float, count: int) -> None:
    """`count` observations of `amount` in one step: the tokens of one delta share their gap, and observing
    them one by one (a bucket search and two locked increments each) cost the gateway about 1.5 us a token.
    Uses the internals of prometheus_client's `Histogram` (`_sum`, `_upper_bounds`, `_buckets`), whose
    version requirements.txt pins; `tests/test_router_metrics.py` checks it against `observe`."""
    histogram._sum.inc(amount * count)
    for bucket, bound in zip(histogram._buckets, histogram._upper_bounds):
        if amount <= bound:
            bucket.inc(count)
            return


@dataclass(frozen=True, slots=True)
class EndpointSeries:
    """One endpoint's latency histograms, already labelled."""

    ttft: Any
    itl: Any
    e2e: Any


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("dynserve_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=registry)
        self.ttft = Histogram("dynserve_time_to_first_token_seconds", "Time from request to first token",
                              ["endpoint"], buckets=_LATENCY_BUCKETS_S, registry=registry)
        self.itl = Histogram("dynserve_inter_token_latency_seconds", "Time between consecutive output tokens",
                             ["endpoint"], buckets=_ITL_BUCKETS_S, registry=registry)
        self.e2e = Histogram("dynserve_request_duration_seconds", "Time from request to last token",
                             ["endpoint"], buckets=_LATENCY_BUCKETS_S, registry=registry)
        self.prompt_tokens = Counter("dynserve_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=registry)
        self.generated_tokens = Counter("dynserve_generated_tokens", "Tokens generated", registry=registry)
        self.cached_tokens = Counter("dynserve_cached_prompt_tokens",
                                     "Prompt tokens served from a worker's prefix cache", registry=registry)
        self.inflight = Gauge("dynserve_inflight_requests", "Requests admitted and not yet answered",
                              registry=registry)
        self.rejected = Counter("dynserve_rejected_requests", "Requests refused before running, by reason",
                                ["reason"], registry=registry)
        self.retries = Counter("dynserve_worker_retries", "Requests re-sent to another worker after a failure",
                               registry=registry)
        self.disagg_requests = Counter(
            "dynserve_disagg_requests", "Disaggregated serving: requests by where their prompt was prefilled "
            "(remote: on a prefill worker; short_prompt, prefill_queue, no_prefill_worker: on the decode worker, "
            "and why)", ["path"], registry=registry)
        self.disagg_fallbacks = Counter(
            "dynserve_disagg_fallbacks", "Disaggregated serving: requests prefilled on their decode worker after "
            "the remote prefill failed (prefill_failed) or its KV could not be read (transfer_error, "
            "transfer_timeout, no_blocks, lease_expired)", ["reason"], registry=registry)

        labels = ["worker_id", "role"]
        self.blocks_used = Gauge("dynserve_worker_kv_blocks_used", "KV blocks in use", labels, registry=registry)
        self.blocks_total = Gauge("dynserve_worker_kv_blocks_total", "KV blocks allocated", labels,
                                  registry=registry)
        self.running = Gauge("dynserve_worker_running_requests", "Requests running on the worker", labels,
                             registry=registry)
        self.waiting = Gauge("dynserve_worker_waiting_requests", "Requests queued on the worker", labels,
                             registry=registry)
        self.worker_up = Gauge("dynserve_worker_up", "1 while the gateway's channel to the worker is open", labels,
                               registry=registry)

        self.router_info = Info("dynserve_router", "The gateway's router: its mode", registry=registry)
        self.router_index_blocks = Gauge(
            "dynserve_router_index_blocks", "Distinct KV blocks in the router's index (approximate: memory)",
            registry=registry)
        self.router_index_workers = Gauge(
            "dynserve_router_index_workers", "Workers holding at least one block in the router's index",
            registry=registry)
        self.router_event_lag = Histogram(
            "dynserve_router_event_lag_seconds",
            "Time from a worker publishing a batch of KV events to the router applying it",
            buckets=_EVENT_LAG_BUCKETS_S, registry=registry)
        self.router_decision = Histogram(
            "dynserve_router_decision_seconds", "Time to pick a worker: prefix match and selection", ["mode"],
            buckets=_DECISION_BUCKETS_S, registry=registry)
        self.router_overlap_ratio = Histogram(
            "dynserve_router_overlap_ratio", "Prompt blocks the chosen worker caches, over prompt blocks",
            ["mode"], buckets=_RATIO_BUCKETS, registry=registry)
        self.router_routed = Counter(
            "dynserve_router_routed_requests", "Requests sent to each worker by the router", ["worker_id"],
            registry=registry)
        self.router_hot_spot = Counter(
            "dynserve_router_hot_spot_picks", "Picks made by the hot-spot guard, not by the cost",
            registry=registry)
        self._router_mode = "none"
        self._endpoints: dict[str, EndpointSeries] = {}
        # the children that requests touch, by metric and label values (see `endpoint` for why)
        self._children: dict[tuple[Any, ...], Any] = {}

    def endpoint(self, endpoint: str) -> EndpointSeries:
        """`endpoint`'s latency histograms, labelled on its first request and kept: `labels()` takes a lock
        and validates its arguments, which per token is a measurable share of the gateway's CPU."""
        series = self._endpoints.get(endpoint)
        if series is None:
            series = self._endpoints[endpoint] = EndpointSeries(
                self.ttft.labels(endpoint), self.itl.labels(endpoint), self.e2e.labels(endpoint))
        return series

    def child(self, metric: Any, *values: str) -> Any:
        """`metric.labels(*values)`, labelled once and kept (no series is ever removed from these)."""
        key = (metric, *values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def expect_disaggregation(self) -> None:
        """Export every disaggregation path and fallback reason at 0, so dashboards and alerts see a series
        (and `rate()` a start) before the first request takes it."""
        for path in get_args(PrefillPath):
            self.disagg_requests.labels(path)
        for reason in ("prefill_failed", "transfer_error", "transfer_timeout", "no_blocks", "lease_expired"):
            self.disagg_fallbacks.labels(reason)

    def watch_router(self, router: Router) -> None:
        """Export `router`'s mode and index size, and receive its measurements (sets `router.observer`)."""
        self._router_mode = router.mode
        self.router_info.info({"mode": router.mode})
        self.router_index_blocks.set_function(lambda: router.index_size()[0])
        self.router_index_workers.set_function(lambda: router.index_size()[1])
        router.observer = self

    # ---- RouterObserver --------------------------------------------------------------------------------

    def observe_decision(self, decision: Decision, num_prompt_blocks: int | None, decision_s: float) -> None:
        mode = self._router_mode
        self.child(self.router_decision, mode).observe(decision_s)
        if num_prompt_blocks:
            self.child(self.router_overlap_ratio, mode).observe(decision.overlap_blocks / num_prompt_blocks)
        if decision.hot_spot:
            self.router_hot_spot.inc()

    def observe_routed(self, worker_id: str) -> None:
        self.child(self.router_routed, worker_id).inc()

    def observe_event_lag(self, lag_s: float) -> None:
        self.router_event_lag.observe(lag_s)

    # ---- workers ---------------------------------------------------------------------------------------

    def observe_load(self, load: WorkerLoad) -> None:
        labels = (load.worker_id, load.role)
        self.blocks_used.labels(*labels).set(load.num_blocks_used)
        self.blocks_total.labels(*labels).set(load.num_blocks_total)
        self.running.labels(*labels).set(load.num_running)
        self.waiting.labels(*labels).set(load.num_waiting)
        self.worker_up.labels(*labels).set(1)

    def observe_down(self, worker_id: str, role: str) -> None:
        self.worker_up.labels(worker_id, role).set(0)
