"""The gateway's Prometheus metrics, on a registry of its own (several gateways may share a process in tests).

Names start `dynserve_`; latencies are histograms in seconds; worker gauges carry `worker_id` and `role`
and are refreshed from the loads the gateway polls from its workers.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dynserve.protocol import WorkerLoad

__all__ = ["GatewayMetrics"]

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                      7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)


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

    def observe_load(self, load: WorkerLoad) -> None:
        labels = (load.worker_id, load.role)
        self.blocks_used.labels(*labels).set(load.num_blocks_used)
        self.blocks_total.labels(*labels).set(load.num_blocks_total)
        self.running.labels(*labels).set(load.num_running)
        self.waiting.labels(*labels).set(load.num_waiting)
        self.worker_up.labels(*labels).set(1)

    def observe_down(self, worker_id: str, role: str) -> None:
        self.worker_up.labels(worker_id, role).set(0)
