"""The operator's own Prometheus metrics (`dynserve_operator_*`), on their own registry, served by
`__main__.py` on `--metrics-port`: reconciles by resource kind, step and outcome (ok, retry, failed, invalid),
their duration, and the children applied."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

__all__ = ["CHILDREN_APPLIED", "RECONCILES", "RECONCILE_SECONDS", "REGISTRY", "record"]

REGISTRY = CollectorRegistry(auto_describe=True)
RECONCILES = Counter("dynserve_operator_reconciles", "Reconcile steps by resource kind, step and outcome",
                     ["kind", "step", "outcome"], registry=REGISTRY)
RECONCILE_SECONDS = Histogram("dynserve_operator_reconcile_duration_seconds", "Time of a reconcile step",
                              ["kind", "step"], registry=REGISTRY,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
CHILDREN_APPLIED = Counter("dynserve_operator_children_applied", "Child manifests applied (server-side apply)",
                           registry=REGISTRY)


def record(kind: str, step: str, outcome: str, seconds: float) -> None:
    RECONCILES.labels(kind, step, outcome).inc()
    RECONCILE_SECONDS.labels(kind, step).observe(seconds)
