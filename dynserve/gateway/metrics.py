"""The gateway's Prometheus metrics, on a registry of its own (several gateways may share a process in tests):
what only the gateway sees. Request-level: requests by endpoint and status, time to first token, inter-token
latency, end-to-end time, prompt and generated length (ISL, OSL), rejections, retries, requeues (requests a
worker handed back unstarted when another joined its pool), disaggregation paths
and fallbacks; and the gateway's channel to each worker (`dynserve_gateway_worker_up`). A worker's own state
(queue, KV, steps, transfers) is served by the worker itself (`workers/metrics.py`), not mirrored here.

Router metrics (`dynserve_router_*`, labelled `pool`: the role of the workers a router picks among) come
from each of the gateway's `Router`s through its observer hook (`watch_router`): the mode in use, the index's
size (read at scrape time; also per KV medium, label `medium`), KV event lag, decision latency (match +
select), the chosen worker's overlap ratio, its prompt blocks held per KV medium (the router's view when it
chose), requests routed per worker, and hot-spot picks. A gateway with one worker has no router.

Names start `dynserve_`, in base units (seconds), counters end in `_total`; `promtool check metrics` is clean
on the output (tests run it).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from dynserve.gateway.backend import BackendObserver
from dynserve.gateway.disagg import PrefillPath
from dynserve.protocol import MEDIA, WorkerInfo, WorkerLoad

if TYPE_CHECKING:
    from dynserve.router.cost import Decision
    from dynserve.router.router import Router

__all__ = ["EndpointSeries", "GatewayMetrics", "RouterSeries", "observe_many"]

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                      7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)
_DECISION_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
_EVENT_LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
_REJECT_REASONS = ("not_ready", "queue_full", "overloaded")
_ENDPOINTS = ("chat/completions", "completions")
_DISAGG_FALLBACK_REASONS = ("prefill_failed", "transfer_error", "transfer_timeout", "no_blocks", "lease_expired")
_PULL_OUTCOMES = ("pulled", "not_needed", "export_failed", "nothing_held", "transfer_error", "transfer_timeout",
                  "no_blocks", "lease_expired")


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
    """One endpoint's latency histograms and one model's token counters, already labelled."""

    ttft: Any
    itl: Any
    e2e: Any
    prompt_tokens: Any
    generation_tokens: Any
    generated_tokens: Any  # the model's counters
    cached_tokens: Any


class GatewayMetrics(BackendObserver):
    """The gateway's series; the backend's observer (`add_observer`)."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("dynserve_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=registry)
        self.admitted = Counter("dynserve_requests_admitted", "Requests admitted to run, counted on arrival (the "
                                "offered load: answered requests lag it by their duration)", ["endpoint", "model"],
                                registry=registry)
        self.ttft = Histogram("dynserve_time_to_first_token_seconds", "Time from request to first token",
                              ["endpoint", "model"], buckets=_LATENCY_BUCKETS_S, registry=registry)
        self.itl = Histogram("dynserve_inter_token_latency_seconds", "Time between consecutive output tokens",
                             ["endpoint", "model"], buckets=_ITL_BUCKETS_S, registry=registry)
        self.e2e = Histogram("dynserve_request_duration_seconds", "Time from request to last token",
                             ["endpoint", "model"], buckets=_LATENCY_BUCKETS_S, registry=registry)
        self.prompt_tokens = Histogram("dynserve_request_prompt_tokens", "Prompt tokens of each prompt of a "
                                       "finished request (input sequence length)", ["endpoint", "model"],
                                       buckets=_TOKENS_BUCKETS,
                                       registry=registry)
        self.generation_tokens = Histogram("dynserve_request_generation_tokens", "Tokens generated for each "
                                           "choice of a finished request (output sequence length)",
                                           ["endpoint", "model"], buckets=_TOKENS_BUCKETS, registry=registry)
        self.generated_tokens = Counter("dynserve_generated_tokens", "Tokens generated", ["model"], registry=registry)
        self.cached_tokens = Counter("dynserve_cached_prompt_tokens",
                                     "Prompt tokens served from a worker's prefix cache", ["model"], registry=registry)
        self.inflight = Gauge("dynserve_inflight_requests", "Requests admitted and not yet answered",
                              registry=registry)
        self.waiting_for_worker = Gauge("dynserve_gateway_waiting_for_worker_requests", "Requests held until a "
                                        "worker is ready (a fleet scaling up from zero)", registry=registry)
        self.rejected = Counter("dynserve_rejected_requests", "Requests refused before running, by reason",
                                ["reason"], registry=registry)
        for reason in _REJECT_REASONS:  # exported at 0: a dashboard's panel has its series from the start
            self.rejected.labels(reason)
        self.retries = Counter("dynserve_gateway_retries", "Requests re-sent to another worker after a failure",
                               registry=registry)
        self.requeues = Counter("dynserve_gateway_requeues", "Requests a worker handed back before starting them "
                                "(a worker joined its pool) and sent to another worker", registry=registry)
        self.migrations = Counter("dynserve_migrations", "Requests moved to another worker mid-stream, by reason "
                                  "(worker_failed: its channel dropped; worker_aborted: it cut the request)",
                                  ["reason"], registry=registry)
        for reason in ("worker_failed", "worker_aborted"):
            self.migrations.labels(reason)
        self.disagg_requests = Counter(
            "dynserve_disagg_requests", "Disaggregated serving: requests by where their prompt was prefilled "
            "(remote: on a prefill worker; short_prompt, prefill_queue, no_prefill_worker: on the decode worker, "
            "and why)", ["path"], registry=registry)
        self.disagg_fallbacks = Counter(
            "dynserve_disagg_fallbacks", "Disaggregated serving: requests prefilled on their decode worker after "
            "the remote prefill failed (prefill_failed) or its KV could not be read (transfer_error, "
            "transfer_timeout, no_blocks, lease_expired)", ["reason"], registry=registry)
        self.kv_pulls = Counter(
            "dynserve_kv_pulls", "Peer pulls (kv_peer_pulls): requests whose worker was to read its prompt's "
            "prefix from another worker's cache, by outcome (pulled; not_needed: its own cache held it by then; "
            "export_failed, nothing_held: the holder gave nothing to read; transfer_error, transfer_timeout, "
            "no_blocks, lease_expired: the read did not happen or failed). All but pulled prefill instead",
            ["outcome"], registry=registry)
        for outcome in _PULL_OUTCOMES:
            self.kv_pulls.labels(outcome)
        self.worker_up = Gauge("dynserve_gateway_worker_up", "1 while the gateway's channel to the worker is "
                               "open, 0 while it is down", ["worker_id", "role"], registry=registry)

        self.router_info = Gauge("dynserve_router_info", "The gateway's routers: 1 per pool, labelled with its "
                                 "mode", ["pool", "mode"], registry=registry)
        self.router_event_lag = Histogram(
            "dynserve_router_event_lag_seconds",
            "Time from a worker publishing a batch of KV events to the router applying it", ["pool"],
            buckets=_EVENT_LAG_BUCKETS_S, registry=registry)
        self.router_decision = Histogram(
            "dynserve_router_decision_seconds", "Time to pick a worker: prefix match and selection", ["pool"],
            buckets=_DECISION_BUCKETS_S, registry=registry)
        self.router_overlap_ratio = Histogram(
            "dynserve_router_overlap_ratio", "Prompt blocks the chosen worker caches, over prompt blocks",
            ["pool"], buckets=_RATIO_BUCKETS, registry=registry)
        self.router_routed = Counter(
            "dynserve_router_routed_requests", "Requests sent to each worker by the router", ["pool", "worker_id"],
            registry=registry)
        self.router_hot_spot = Counter(
            "dynserve_router_hot_spot_picks", "Picks made by the hot-spot guard, not by the cost", ["pool"],
            registry=registry)
        self.router_prompt_blocks = Counter(
            "dynserve_router_prompt_blocks", "Full prompt blocks of the requests placed by a cache-aware "
            "router (kv, approximate)", ["pool"], registry=registry)
        self.router_prompt_hit_blocks = Counter(
            "dynserve_router_prompt_hit_blocks", "Prompt blocks the chosen worker held when the router chose "
            "it, by KV medium (device, host, disk tier; the router's view)", ["pool", "medium"],
            registry=registry)
        self._routers: dict[str, Router] = {}  # pool -> its router, for the index sizes read at scrape time
        registry.register(_RouterIndexCollector(self._routers))
        self._endpoints: dict[tuple[str, str], EndpointSeries] = {}
        # the children that requests touch, by metric and label values (see `endpoint` for why)
        self._children: dict[tuple[Any, ...], Any] = {}
        for endpoint in _ENDPOINTS:  # exported at 0 from the start: `rate()` sees the first requests arrive
            self.child(self.requests, endpoint, "200")

    def expect_model(self, model: str) -> None:
        """Export a served model's request series at 0 (`rate()` then sees its first requests arrive)."""
        for endpoint in _ENDPOINTS:
            self.endpoint(endpoint, model)
            self.child(self.admitted, endpoint, model)

    def endpoint(self, endpoint: str, model: str) -> EndpointSeries:
        """`endpoint`'s request histograms for `model` (a model served: the label's values are bounded),
        labelled on the first such request and kept: `labels()` takes a lock and validates its arguments,
        which per token is a measurable share of the gateway's CPU."""
        key = (endpoint, model)
        series = self._endpoints.get(key)
        if series is None:
            series = self._endpoints[key] = EndpointSeries(
                self.ttft.labels(*key), self.itl.labels(*key), self.e2e.labels(*key),
                self.prompt_tokens.labels(*key), self.generation_tokens.labels(*key),
                self.generated_tokens.labels(model), self.cached_tokens.labels(model))
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
        for reason in _DISAGG_FALLBACK_REASONS:
            self.disagg_fallbacks.labels(reason)

    def watch_router(self, router: Router, pool: str = "both") -> RouterSeries:
        """Export `router`'s mode and index size under `pool`, and receive its measurements (sets
        `router.observer`)."""
        self.router_info.labels(pool, router.mode).set(1)
        self._routers[pool] = router
        series = RouterSeries(self, pool)
        router.observer = series
        return series

    # ---- workers ---------------------------------------------------------------------------------------

    def on_load(self, load: WorkerLoad) -> None:
        self.child(self.worker_up, load.worker_id, load.role).set(1)

    def on_down(self, info: WorkerInfo) -> None:
        self.child(self.worker_up, info.worker_id, info.role).set(0)

    def on_leave(self, info: WorkerInfo) -> None:
        """A worker left the fleet: its channel series goes (a fleet that scales would pile up zeros)."""
        if self._children.pop((self.worker_up, info.worker_id, info.role), None) is not None:
            self.worker_up.remove(info.worker_id, info.role)

    def on_retry(self) -> None:
        self.retries.inc()

    def on_requeue(self) -> None:
        self.requeues.inc()

    def on_migration(self, reason: str) -> None:
        self.migrations.labels(reason).inc()

    def on_disagg(self, path: str) -> None:
        self.disagg_requests.labels(path).inc()

    def on_fallback(self, reason: str) -> None:
        self.disagg_fallbacks.labels(reason).inc()

    def on_pull(self, outcome: str) -> None:
        self.child(self.kv_pulls, outcome).inc()


class RouterSeries:
    """One router's series (its pool's label values, bound once): the `RouterObserver` it reports to."""

    def __init__(self, metrics: GatewayMetrics, pool: str) -> None:
        self._metrics, self._pool = metrics, pool
        self._decision = metrics.router_decision.labels(pool)
        self._overlap = metrics.router_overlap_ratio.labels(pool)
        self._hot_spot = metrics.router_hot_spot.labels(pool)
        self._event_lag = metrics.router_event_lag.labels(pool)
        self._prompt_blocks = metrics.router_prompt_blocks.labels(pool)
        # in `MEDIA` order, as `Decision.blocks_by_medium`; exported at 0 from the start
        self._hit_blocks = [metrics.router_prompt_hit_blocks.labels(pool, medium) for medium in MEDIA]

    def observe_decision(self, decision: Decision, num_prompt_blocks: int | None, decision_s: float) -> None:
        self._decision.observe(decision_s)
        if num_prompt_blocks:
            self._overlap.observe(decision.overlap_blocks / num_prompt_blocks)
            self._prompt_blocks.inc(num_prompt_blocks)
            if decision.blocks_by_medium is None:  # the whole overlap on the device
                if decision.overlap_blocks:
                    self._hit_blocks[0].inc(decision.overlap_blocks)
            else:
                for series, num_blocks in zip(self._hit_blocks, decision.blocks_by_medium, strict=True):
                    if num_blocks:
                        series.inc(num_blocks)
        if decision.hot_spot:
            self._hot_spot.inc()

    def observe_routed(self, worker_id: str) -> None:
        self._metrics.child(self._metrics.router_routed, self._pool, worker_id).inc()

    def observe_event_lag(self, lag_s: float) -> None:
        self._event_lag.observe(lag_s)


class _RouterIndexCollector:
    """The routers' index sizes, in all and per KV medium, read at scrape time (an approximate router's memory
    forgets as time passes)."""

    def __init__(self, routers: dict[str, Router]) -> None:
        self._routers = routers

    def collect(self) -> Iterator[Metric]:
        blocks = GaugeMetricFamily("dynserve_router_index_blocks", "Distinct KV blocks in the router's index "
                                   "(approximate: its memory)", labels=["pool"])
        workers = GaugeMetricFamily("dynserve_router_index_workers", "Workers holding at least one block in "
                                    "the router's index", labels=["pool"])
        by_medium = GaugeMetricFamily("dynserve_router_index_tier_blocks", "KV blocks in the router's index "
                                      "per medium: device, host and disk tiers (a block on two media counts "
                                      "on each)", labels=["pool", "medium"])
        for pool, router in list(self._routers.items()):
            num_blocks, num_workers = router.index_size()
            blocks.add_metric([pool], num_blocks)
            workers.add_metric([pool], num_workers)
            for medium, num_medium_blocks in router.index_blocks_by_medium().items():
                by_medium.add_metric([pool, medium], num_medium_blocks)
        yield blocks
        yield workers
        yield by_medium
