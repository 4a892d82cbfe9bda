"""The kopf handlers: thin shells over `reconcile.py`. Registered on import of this module (kopf's way);
`__main__.py` runs them.

- a `DynServeDeployment` created, changed or found at start-up: its children reconciled, its status written;
  every 10 s: its status again (pods come and go without an event on the resource);
- a `DynServePool` created, its replicas changed (the planner, an HPA, `kubectl scale`) or found at
  start-up: its worker Deployment resized; every 10 s: its status (what `/scale` reports).

Errors: a `KubernetesError` that may pass (conflict, throttling, server error, no connection) is a
`kopf.TemporaryError` (retried after a delay); a bad spec is a `kopf.PermanentError` with the deployment's
status saying why (Degraded, reason InvalidSpec); any other API refusal is permanent until the resource
changes. Each outcome is counted in the operator's metrics (`metrics.py`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import kopf

from dynserve.errors import InvalidRequestError, KubernetesError
from dynserve.operator import metrics
from dynserve.operator.reconcile import (
    deployment_status, invalid_status, reconcile_deployment, reconcile_pool,
)
from dynserve.operator.spec import GROUP, VERSION

__all__ = ["CLIENT", "on_deployment", "on_pool"]

logger = logging.getLogger(__name__)
CLIENT: dict[str, Any] = {}  # "client": the KubeClient the handlers use (set by __main__ or a test)
RETRY_DELAY_S = 10
STATUS_INTERVAL_S = 10.0


def _client() -> Any:
    return CLIENT["client"]


def _body(body: Any) -> dict[str, Any]:
    return {"metadata": dict(body["metadata"]), "spec": dict(body.get("spec") or {}),
            "status": dict(body.get("status") or {})}


def _run(kind: str, what: str, fn: Any) -> Any:
    start_s = time.monotonic()
    try:
        result = fn()
    except InvalidRequestError:
        metrics.record(kind, what, "invalid", time.monotonic() - start_s)
        raise
    except KubernetesError as exc:
        outcome = "retry" if exc.retryable else "failed"
        metrics.record(kind, what, outcome, time.monotonic() - start_s)
        if exc.retryable:
            raise kopf.TemporaryError(str(exc), delay=RETRY_DELAY_S) from exc
        raise kopf.PermanentError(str(exc)) from exc
    metrics.record(kind, what, "ok", time.monotonic() - start_s)
    return result


def on_deployment(body: Any, patch: Any) -> None:
    """Reconcile a DynServeDeployment and write its status into `patch`."""
    obj = _body(body)
    meta = obj["metadata"]
    try:
        children = _run("DynServeDeployment", "reconcile", lambda: reconcile_deployment(
            _client(), meta["name"], meta["namespace"], obj["spec"], meta.get("uid")))
    except InvalidRequestError as exc:
        patch.status.update(invalid_status(obj, str(exc)))
        raise kopf.PermanentError(f"invalid spec: {exc}") from exc
    except kopf.PermanentError as exc:  # the API refused a child for good: say so where users look
        cause = exc.__cause__
        reason = cause.reason if isinstance(cause, KubernetesError) and cause.reason else "Refused"
        patch.status.update(invalid_status(obj, str(exc), reason=reason))
        raise
    metrics.CHILDREN_APPLIED.inc(len(children))
    patch.status.update(_run("DynServeDeployment", "status", lambda: deployment_status(_client(), obj)))


def deployment_status_tick(body: Any, patch: Any) -> None:
    obj = _body(body)
    try:
        status = _run("DynServeDeployment", "status", lambda: deployment_status(_client(), obj))
    except InvalidRequestError as exc:
        status = invalid_status(obj, str(exc))
    patch.status.update(status)


def on_pool(body: Any, patch: Any) -> None:
    """Resize a DynServePool's worker Deployment to its replicas; write the pool's status into `patch`."""
    obj = _body(body)
    try:
        status = _run("DynServePool", "reconcile", lambda: reconcile_pool(_client(), obj))
    except InvalidRequestError as exc:
        raise kopf.PermanentError(f"invalid DynServePool: {exc}") from exc
    patch.status.update(status)


# ---- registration --------------------------------------------------------------------------------------

kopf.on.resume(GROUP, VERSION, "dynservedeployments")(on_deployment)
kopf.on.create(GROUP, VERSION, "dynservedeployments")(on_deployment)
kopf.on.update(GROUP, VERSION, "dynservedeployments", field="spec")(on_deployment)
kopf.timer(GROUP, VERSION, "dynservedeployments", interval=STATUS_INTERVAL_S, idle=STATUS_INTERVAL_S)(
    deployment_status_tick)
kopf.on.resume(GROUP, VERSION, "dynservepools")(on_pool)
kopf.on.create(GROUP, VERSION, "dynservepools")(on_pool)
kopf.on.update(GROUP, VERSION, "dynservepools", field="spec")(on_pool)
kopf.timer(GROUP, VERSION, "dynservepools", interval=STATUS_INTERVAL_S, idle=STATUS_INTERVAL_S)(on_pool)
