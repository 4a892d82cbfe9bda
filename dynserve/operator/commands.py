"""What each pod of a deployment runs: its container command (`pod_command`: a Ray node, then the pod's one
long-running process) and the variables it sets beside its ConfigMap (`pod_env`). These are the contract
`tests/test_operator_pods.py` runs, unchanged, as processes on hosts made of network namespaces.
"""

from __future__ import annotations

import json
import posixpath
from typing import Any
from urllib.parse import urlparse

from dynserve.operator.hardening import OBJECT_STORE_BYTES, cache_env
from dynserve.operator.spec import DeploymentSpec

__all__ = ["MODELS_DIR", "PRE_STOP", "RAY_PORT", "model_path", "pod_command", "pod_env", "pool_resource"]

RAY_PORT = 6379
MODELS_DIR = "/models"
PRE_STOP = ["/bin/sh", "-c", "ray stop --grace-period 20"]


def pool_resource(role: str) -> str:
    """The Ray resource a pool's worker pods offer and its workers require."""
    return f"dynserve_pool_{role}"


def model_path(spec: DeploymentSpec) -> str | None:
    """Where pods find the model: the spec's path, the file a `uri` is fetched to, or None (the bundled one)."""
    if spec.model.uri:
        return posixpath.join(MODELS_DIR, posixpath.basename(urlparse(spec.model.uri).path) or "model.gguf")
    return spec.model.path


def pod_command(kind: str, *, head_host: str = "", role: str = "", ray_cpus: float = 1.0) -> list[str]:
    """The container command of a head (`kind="head"`), a gateway-only (`"gateway"`) or a pool's worker pod
    (`"worker"`): a shell that starts the pod's Ray node and then the pod's one long-running process. `$POD_IP` comes from the
    pod's environment (the downward API)."""
    ray = (f"ray start --node-ip-address=\"$POD_IP\" --object-store-memory={OBJECT_STORE_BYTES} "
           "--disable-usage-stats")
    if kind == "head":
        script = (f"{ray} --head --port={RAY_PORT} --num-cpus=0 --include-dashboard=false && "
                  f"exec dynctl serve --ray-address=\"$POD_IP:{RAY_PORT}\"")
    elif kind == "gateway":  # a Ray driver needs a node of its own: one with no CPUs, where nothing is placed
        script = (f"{ray} --address={head_host}:{RAY_PORT} --num-cpus=0 && "
                  f"exec dynctl gateway --ray-address={head_host}:{RAY_PORT}")
    else:
        resources = json.dumps({pool_resource(role): 1}, separators=(",", ":"))
        script = (f"exec {ray} --address={head_host}:{RAY_PORT} --num-cpus={ray_cpus:g} "
                  f"--resources='{resources}' --block")
    return ["/bin/sh", "-c", script]


def pod_env(spec: DeploymentSpec) -> list[dict[str, Any]]:
    """The variables every pod sets beside its ConfigMap: its own address (from the downward API), the API key
    and the cluster token from their Secrets."""
    env: list[dict[str, Any]] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "DYN_ADVERTISE_HOST", "value": "$(POD_IP)"},
        {"name": "RAY_AUTH_MODE", "value": "disabled"},  # the cluster's network is the pods' own
        {"name": "RAY_USAGE_STATS_ENABLED", "value": "0"},
        *cache_env(),
    ]
    for name, ref in (("DYN_API_KEY", spec.gateway.api_key_secret), ("DYN_CLUSTER_TOKEN", spec.cluster_token_secret)):
        if ref is not None:
            env.append({"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    return env
