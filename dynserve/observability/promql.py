"""A small client of Prometheus's HTTP API (`/api/v1/query`, `/api/v1/targets`, readiness), for the parts
that read the fleet's metrics back: `dynctl top`, the planner, tests.

Errors are `PrometheusError`s naming the query and what Prometheus said (a PromQL syntax error comes back as
one, with Prometheus's own message); an unreachable server too. Values are floats (NaN included: a quantile
over no observations is a series whose value is NaN, which is not an error).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Self

import httpx

from dynserve.errors import PrometheusError

__all__ = ["PrometheusClient", "Sample", "Target"]


@dataclass(frozen=True, slots=True)
class Sample:
    """One series of an instant query: its labels and its value at the query's time."""

    labels: dict[str, str]
    value: float

    def get(self, label: str, default: str = "") -> str:
        return self.labels.get(label, default)


@dataclass(frozen=True, slots=True)
class Target:
    """One active scrape target: its address, labels after relabelling, health ("up", "down", "unknown")."""

    address: str
    labels: dict[str, str]
    health: str
    last_error: str
    scrape_url: str


class PrometheusClient:
    """Synchronous; one connection pool per client. `url` is Prometheus's base URL (http://host:port)."""

    def __init__(self, url: str, *, timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def ready(self) -> bool:
        """True once Prometheus answers `/-/ready` with 200."""
        try:
            return self._http.get("/-/ready").status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, expr: str, *, at: float | None = None) -> list[Sample]:
        """The instant vector (or scalar, as one unlabelled sample) `expr` evaluates to now (or at `at`, a
        Unix time)."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        data = self._get("/api/v1/query", params, expr)
        kind, result = data["resultType"], data["result"]
        if kind == "vector":
            return [Sample(dict(r["metric"]), _number(r["value"][1])) for r in result]
        if kind == "scalar":
            return [Sample({}, _number(result[1]))]
        raise PrometheusError(f"query returned a {kind}, not an instant vector", url=self.url, query=expr)

    def value(self, expr: str, default: float = math.nan) -> float:
        """The single value of `expr` (its first series), or `default` when it has none."""
        samples = self.query(expr)
        return samples[0].value if samples else default

    def targets(self) -> list[Target]:
        """The active scrape targets (dropped ones are not listed)."""
        data = self._get("/api/v1/targets", {"state": "active"}, None)
        return [Target(address=t["labels"].get("instance", t["discoveredLabels"].get("__address__", "")),
                       labels=dict(t["labels"]), health=t["health"], last_error=t.get("lastError", ""),
                       scrape_url=t.get("scrapeUrl", ""))
                for t in data["activeTargets"]]

    def _get(self, path: str, params: dict[str, str], expr: str | None) -> Any:
        try:
            response = self._http.get(path, params=params)
        except httpx.HTTPError as exc:
            raise PrometheusError(f"cannot reach Prometheus at {self.url}: {exc}", url=self.url,
                                  query=expr) from exc
        try:
            body = response.json()
        except ValueError:
            raise PrometheusError(f"Prometheus answered {response.status_code} without JSON", url=self.url,
                                  query=expr) from None
        if body.get("status") != "success":
            raise PrometheusError(f"Prometheus refused {expr or path}: {body.get('errorType')}: "
                                  f"{body.get('error')}", url=self.url, query=expr)
        return body["data"]


def _number(text: str) -> float:
    return float(text)  # Prometheus writes NaN, +Inf, -Inf as float() reads them
