"""What the operator does to the cluster, as functions of a client (`kube.KubeClient`, or in tests a recording
client) and a resource: no kopf here (`handlers.py` registers these with kopf).

- `reconcile_deployment`: make the children match the spec: create each pool's `DynServePool` once (its
  replicas are then whoever scales it: the planner, an HPA, `kubectl scale`; a change of the pool's replicas
  in the deployment's own spec is applied to it too), server-side apply every other child with the pools'
  current replicas, and delete children the spec no longer asks for.
- `reconcile_pool`: a `DynServePool`'s replicas onto its worker Deployment (its model's, with several models);
  its status from the Deployment.
- `deployment_status`: the deployment's status from its children: per-pool desired and ready pods (another
  model's than the first's keyed MODEL/POOL), the
  conditions Ready, Progressing and Degraded, the gateway's URL, the generation it describes.

Every failure is a `KubernetesError` (its `retryable` tells a transient one) or an `InvalidRequestError` (the
spec: permanent until the user edits it).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any, Protocol

from dynserve.operator.builders import (
    DEPLOYMENT_LABEL, MANAGER, build_children, build_pool_deployment, build_pool_resource, model_key, model_pools,
    pool_key, pool_resource_name,
)
from dynserve.operator.spec import API_VERSION, POOL_KIND, DeploymentSpec, parse_deployment, parse_pool

__all__ = ["SPEC_REPLICAS_ANNOTATION", "Client", "deployment_status", "reconcile_deployment", "reconcile_pool"]

SPEC_REPLICAS_ANNOTATION = "dynserve.io/spec-replicas"  # on a DynServePool: the deployment spec's count last applied
# kinds the operator may have created for a deployment, to find the ones its spec no longer asks for
_OWNED_KINDS = (("v1", "ConfigMap"), ("apps/v1", "Deployment"), ("v1", "Service"), ("v1", "ServiceAccount"),
                ("rbac.authorization.k8s.io/v1", "Role"), ("rbac.authorization.k8s.io/v1", "RoleBinding"),
                ("policy/v1", "PodDisruptionBudget"), ("monitoring.coreos.com/v1", "ServiceMonitor"),
                ("networking.k8s.io/v1", "NetworkPolicy"), (API_VERSION, POOL_KIND))


class Client(Protocol):
    def apply(self, obj: dict[str, Any], *, field_manager: str, force: bool = True,
              subresource: str | None = None) -> dict[str, Any]: ...

    def get(self, api_version: str, kind: str, name: str, namespace: str | None) -> dict[str, Any] | None: ...

    def list(self, api_version: str, kind: str, namespace: str | None,
             label_selector: str | None = None) -> list[dict[str, Any]]: ...

    def patch(self, api_version: str, kind: str, name: str, namespace: str | None, body: dict[str, Any], *,
              subresource: str | None = None) -> dict[str, Any]: ...

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None, *,
               propagation: str = "Foreground") -> bool: ...


def _pool_replicas(client: Client, name: str, namespace: str, spec: DeploymentSpec,
                   uid: str | None) -> dict[str, int]:
    """Each pool's replicas now, creating its DynServePool the first time and passing on a change of the
    deployment spec's count (the user's hand: it wins over the planner's)."""
    replicas = {}
    for index, pool, pool_spec in model_pools(spec):
        key = pool_key(spec, index, pool)
        resource_name = pool_resource_name(name, pool, model_key(spec, index))
        desired = build_pool_resource(name, namespace, spec, pool, uid, index)
        desired["metadata"].setdefault("annotations", {})[SPEC_REPLICAS_ANNOTATION] = str(pool_spec.replicas)
        existing = client.get(API_VERSION, POOL_KIND, resource_name, namespace)
        if existing is None:
            client.apply(desired, field_manager=MANAGER)
            replicas[key] = pool_spec.replicas
            continue
        last = (existing["metadata"].get("annotations") or {}).get(SPEC_REPLICAS_ANNOTATION)
        current = int(existing["spec"]["replicas"])
        if last is not None and int(last) != pool_spec.replicas:
            current = pool_spec.replicas  # the spec's count changed: apply it
        else:  # leave the replicas to whoever scales the pool: apply everything else
            desired["spec"]["replicas"] = current
        client.apply(desired, field_manager=MANAGER)
        replicas[key] = current
    return replicas


def reconcile_deployment(client: Client, name: str, namespace: str, spec_dict: dict[str, Any],
                         uid: str | None) -> list[dict[str, Any]]:
    """Bring the deployment's children to its spec; returns the children applied. Raises
    InvalidRequestError for a bad spec, KubernetesError for a failed call."""
    spec = parse_deployment(spec_dict)
    replicas = _pool_replicas(client, name, namespace, spec, uid)
    children = build_children(name, namespace, spec, uid=uid, replicas=replicas)
    for child in children:
        if child["kind"] != POOL_KIND:
            client.apply(child, field_manager=MANAGER)
    _delete_unwanted(client, name, namespace, children)
    return children


def _delete_unwanted(client: Client, name: str, namespace: str, children: Iterable[dict[str, Any]]) -> None:
    wanted = {(c["kind"], c["metadata"]["name"]) for c in children}
    for api_version, kind in _OWNED_KINDS:
        for obj in client.list(api_version, kind, namespace, label_selector=f"{DEPLOYMENT_LABEL}={name}"):
            if (kind, obj["metadata"]["name"]) not in wanted and _owned_by_operator(obj):
                client.delete(api_version, kind, obj["metadata"]["name"], namespace)


def _owned_by_operator(obj: dict[str, Any]) -> bool:
    return obj["metadata"].get("labels", {}).get("app.kubernetes.io/managed-by") == MANAGER


def reconcile_pool(client: Client, pool_obj: dict[str, Any]) -> dict[str, Any]:
    """Apply a DynServePool's replicas to its worker Deployment; returns the pool's status (replicas,
    readyReplicas, selector). The Deployment is the deployment's to create: until it exists, only the status."""
    meta = pool_obj["metadata"]
    pool = parse_pool(pool_obj.get("spec"))
    deployment_name = pool_resource_name(pool.deployment, pool.pool, pool.model)
    workers = client.get("apps/v1", "Deployment", deployment_name, meta["namespace"])
    if workers is None:
        return {"replicas": 0, "readyReplicas": 0, "observedGeneration": meta.get("generation")}
    if workers["spec"].get("replicas") != pool.replicas:
        parent = client.get(API_VERSION, "DynServeDeployment", pool.deployment, meta["namespace"])
        if parent is not None:
            spec = parse_deployment(parent.get("spec"))
            names = [entry.name for entry in spec.served_models()]
            index = 0 if pool.model is None else names.index(pool.model) if pool.model in names[1:] else None
            if index is not None:  # else a model the deployment no longer serves: its pools are being deleted
                client.apply(build_pool_deployment(pool.deployment, meta["namespace"], spec, pool.pool, pool.replicas,
                                                   parent["metadata"].get("uid"), index), field_manager=MANAGER)
        workers = client.get("apps/v1", "Deployment", deployment_name, meta["namespace"]) or workers
    status = workers.get("status") or {}
    selector = ",".join(f"{k}={v}" for k, v in sorted(workers["spec"]["selector"]["matchLabels"].items()))
    return {"replicas": int(status.get("replicas", 0)), "readyReplicas": int(status.get("readyReplicas", 0)),
            "selector": selector, "observedGeneration": meta.get("generation")}


def _condition(kind: str, ok: bool, reason: str, message: str, generation: int | None,
               previous: dict[str, dict[str, Any]]) -> dict[str, Any]:
    status = "True" if ok else "False"
    before = previous.get(kind)
    since = before["lastTransitionTime"] if before and before.get("status") == status and before.get(
        "lastTransitionTime") else dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    condition = {"type": kind, "status": status, "reason": reason, "message": message, "lastTransitionTime": since}
    if generation is not None:
        condition["observedGeneration"] = generation
    return condition


def deployment_status(client: Client, obj: dict[str, Any]) -> dict[str, Any]:
    """The deployment's `.status` as its children show it now (a bad spec: Degraded, reason InvalidSpec)."""
    meta, generation = obj["metadata"], obj["metadata"].get("generation")
    name, namespace = meta["name"], meta["namespace"]
    previous = {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}
    spec = parse_deployment(obj.get("spec"))
    pools, lagging, failing = {}, [], []
    for index, pool, _pool_spec in model_pools(spec):
        child, key = pool_resource_name(name, pool, model_key(spec, index)), pool_key(spec, index, pool)
        resource = client.get(API_VERSION, POOL_KIND, child, namespace)
        workers = client.get("apps/v1", "Deployment", child, namespace)
        desired = int(resource["spec"]["replicas"]) if resource else _pool_spec.replicas
        ready = int(((workers or {}).get("status") or {}).get("readyReplicas", 0))
        pools[key] = {"desiredReplicas": desired, "readyReplicas": ready}
        if ready < desired:
            lagging.append(f"{key} {ready}/{desired}")
        failing += [f"{key}: {c.get('message', c.get('reason'))}" for c in ((workers or {}).get("status") or {})
                    .get("conditions", []) if c.get("type") == "ReplicaFailure" and c.get("status") == "True"]
    head = client.get("apps/v1", "Deployment", f"{name}-head", namespace)
    head_ready = int(((head or {}).get("status") or {}).get("readyReplicas", 0)) >= 1
    serving = head_ready and any(p["readyReplicas"] > 0 for p in pools.values())
    ready = head_ready and not lagging
    waiting = ([] if head_ready else ["the head (gateway) is not ready"]) + (
        [f"pools not at size: {', '.join(lagging)}"] if lagging else [])
    conditions = [
        _condition("Ready", ready, "AllReady" if ready else ("Serving" if serving else "Starting"),
                   "every pool at size, the gateway serving" if ready else "; ".join(waiting), generation, previous),
        _condition("Progressing", not ready, "Scaling" if not ready else "Done",
                   "; ".join(waiting) if not ready else "nothing to do", generation, previous),
        _condition("Degraded", bool(failing), "ReplicaFailure" if failing else "None",
                   "; ".join(failing) if failing else "no failures", generation, previous),
    ]
    port = spec.gateway.port
    return {"observedGeneration": generation, "conditions": conditions, "pools": pools,
            "gatewayURL": f"http://{name}.{namespace}.svc:{port}/v1",
            "phase": "Degraded" if failing else "Ready" if ready else "Progressing"}


def invalid_status(obj: dict[str, Any], message: str, *, reason: str = "InvalidSpec") -> dict[str, Any]:
    """The status of a deployment that cannot be served until it is edited: its spec is invalid, or the API
    refused one of its children for good (`reason`: the API's, e.g. Forbidden)."""
    generation = obj["metadata"].get("generation")
    previous = {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}
    return {"observedGeneration": generation, "phase": "Degraded", "conditions": [
        _condition("Ready", False, reason, message, generation, previous),
        _condition("Progressing", False, reason, "waiting for the resource to be fixed", generation, previous),
        _condition("Degraded", True, reason, message, generation, previous)]}
