"""Watching a fleet: the Prometheus side of dynserve. The recording rules (`rules.py`), a Prometheus that
`dynctl serve --prometheus` runs and points at the fleet (`prometheus.py`), a client of Prometheus's HTTP API
(`promql.py`), and the Grafana dashboards, generated with a typed builder (`dashboards.py`).

The metrics themselves are served where they are measured: each worker on its own port
(`workers/metrics.py`), the gateway on `/metrics` (`gateway/metrics.py`). This package imports no other part.
"""
