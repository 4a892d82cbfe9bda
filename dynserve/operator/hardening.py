"""How every pod of a deployment is locked down, as pure functions of its spec (`builders.py` applies them).

What each pod the operator builds keeps (head, gateway-only, workers; the bundled Redis as its image allows):
- it runs as `security.runAsUser` (the image's user, 10001) with `runAsNonRoot`, the container runtime's
  seccomp profile, and its volumes owned by `security.runAsGroup`; each container without privilege
  escalation, with every capability dropped and a read-only root filesystem;
- the only writable paths are emptyDirs: `/tmp` (Ray's session directory, the head's Prometheus data,
  temporary files), `/dev/shm` (memory-backed, sized for Ray's object store, and in a vLLM pod for vLLM's
  shared-memory queues too), `/var/cache/dynserve` (the C++ CPU kernels' and Triton's build caches:
  `XDG_CACHE_HOME`, `TRITON_CACHE_DIR`; vLLM's home and caches: `vllm_env`), `/models` where the model comes
  from a volume, and `security.writablePaths`;
- CPU and memory requests and limits: the spec's, else what the pod needs (`default_memory_bytes`); a limit
  not given is its request, so the pods are Guaranteed unless the spec says otherwise;
- no service-account token, except on the head when the planner scales the pools through the API server;
- `build_network_policy`: ingress only from the deployment's own pods (every port: Ray's, the worker channel,
  KV transfer, the event plane), to the gateway's port from `gatewayFrom`, to the metrics ports from
  `metricsFrom` (a vLLM pool's HTTP port too: its `/metrics`).

`tests/test_operator_pods.py` runs the pods' commands as that user on hosts whose root filesystem is
read-only except these paths, so a path a pod writes but does not declare fails there.
"""

from __future__ import annotations

import math
from typing import Any

from dynserve.config import Settings
from dynserve.operator.spec import DeploymentSpec, Resources

__all__ = [
    "CACHE_DIR", "CONTAINER_SECURITY", "OBJECT_STORE_BYTES", "SHM_BYTES", "build_network_policy", "cache_env",
    "container_resources", "cpu_quantity", "default_memory_bytes", "pod_security", "vllm_env", "writable_volumes",
]

_MIB, _GIB = 2**20, 2**30
OBJECT_STORE_BYTES = 256 * _MIB  # Ray's object store: small, no tensors pass through it
SHM_BYTES = OBJECT_STORE_BYTES + 64 * _MIB  # /dev/shm: the object store and Ray's own headroom
CACHE_DIR = "/var/cache/dynserve"
RUNTIME_BYTES = 1 * _GIB  # a Ray node and the pod's Python process (gateway, worker or head)
PROMETHEUS_BYTES = 512 * _MIB  # the head's own Prometheus, with the planner and no Prometheus named
BUNDLED_MODEL_BYTES = 1 * _GIB  # SmolLM2-135M-Instruct's weights in fp32 (0.5 GiB) and torch's own
GIVEN_MODEL_BYTES = 4 * _GIB  # a model the spec names (about 1B parameters); larger ones set resources
VLLM_BYTES = 8 * _GIB  # vLLM's server and engine processes, CUDA's context, weights staged while loading
VLLM_SHM_BYTES = 1 * _GIB  # vLLM's shared-memory message queues between its processes
DEFAULT_CPU = {"head": "1", "gateway": "1", "vllm": "2", "attach": "500m"}
PROMETHEUS_PEER = {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}

CONTAINER_SECURITY: dict[str, Any] = {
    "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
}


def pod_security(spec: DeploymentSpec) -> dict[str, Any]:
    """The pod's securityContext: its non-root user and group, the runtime's seccomp profile."""
    security = spec.security
    return {"runAsNonRoot": True, "runAsUser": security.run_as_user, "runAsGroup": security.run_as_group,
            "fsGroup": security.run_as_group, "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"}}


def writable_volumes(spec: DeploymentSpec, *, shm_bytes: int = SHM_BYTES) -> tuple[list[dict[str, Any]],
                                                                                  list[dict[str, Any]]]:
    """The emptyDir volumes of a pod and a container's mounts of them: every path it writes."""
    paths = {"tmp": ("/tmp", {}), "shm": ("/dev/shm", {"medium": "Memory", "sizeLimit": _quantity(shm_bytes)}),
             "cache": (CACHE_DIR, {})}
    for i, path in enumerate(spec.security.writable_paths):
        paths[f"writable-{i}"] = (path, {})
    volumes = [{"name": name, "emptyDir": empty_dir} for name, (_path, empty_dir) in paths.items()]
    mounts = [{"name": name, "mountPath": path} for name, (path, _empty_dir) in paths.items()]
    return volumes, mounts


def cache_env() -> list[dict[str, Any]]:
    """The variables pointing build caches into the cache volume (the home directory is read-only)."""
    return [{"name": "XDG_CACHE_HOME", "value": CACHE_DIR}, {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/triton"}]


def vllm_env() -> list[dict[str, Any]]:
    """vLLM's container's variables: its home and every cache it writes (vLLM's, Hugging Face's, Triton's,
    torch's compiler's) in the cache volume, no usage reports (they write to the home directory and call out)."""
    return [*cache_env(), {"name": "HOME", "value": CACHE_DIR},
            {"name": "TORCHINDUCTOR_CACHE_DIR", "value": f"{CACHE_DIR}/torchinductor"},
            {"name": "VLLM_NO_USAGE_STATS", "value": "1"}, {"name": "DO_NOT_TRACK", "value": "1"}]


def default_memory_bytes(spec: DeploymentSpec, kind: str) -> int:
    """What a container of `kind` ("head", "gateway", "worker"; in a vLLM pod "vllm" and "attach") needs when
    the spec says nothing: the runtime and /dev/shm (memory-backed, so counted against the pod), a worker's
    model and KV cache, the head's Prometheus; vLLM's server and its shared memory (its model's weights and KV
    cache are on its GPUs: a CPU build or a larger model sets `resources`)."""
    if kind == "vllm":
        return VLLM_BYTES + VLLM_SHM_BYTES
    total = RUNTIME_BYTES + SHM_BYTES
    if kind == "head" and spec.planner.enabled and not spec.planner.prometheus_url:
        total += PROMETHEUS_BYTES
    if kind == "worker" and spec.engine.mocker is None:
        kv_cache_gib = spec.engine.kv_cache_gib or Settings.model_fields["kv_cache_gib"].default
        given = spec.model.path or spec.model.uri
        total += (GIVEN_MODEL_BYTES if given else BUNDLED_MODEL_BYTES) + math.ceil(kv_cache_gib * _GIB)
    return total


def container_resources(given: Resources, *, cpu: str, memory_bytes: int) -> dict[str, Any]:
    """Requests and limits: the spec's, CPU and memory defaulting to `cpu` and `memory_bytes`; a limit not
    given is its request, and a request not given beside a given limit is that limit (as Kubernetes does)."""
    requests: dict[str, Any] = {"cpu": cpu, "memory": _quantity(memory_bytes)}
    requests.update({key: given.limits[key] for key in ("cpu", "memory") if key in given.limits})
    requests.update(given.requests)
    limits = {"cpu": requests["cpu"], "memory": requests["memory"], **given.limits}
    return {"requests": requests, "limits": limits}


def cpu_quantity(cpus: float) -> str:
    """CPUs as Kubernetes writes them: whole ones as a number, else millicores."""
    return f"{cpus:g}" if float(cpus).is_integer() else f"{round(cpus * 1000)}m"


def _quantity(size_bytes: int) -> str:
    return f"{math.ceil(size_bytes / _MIB)}Mi"


def build_network_policy(meta: dict[str, Any], spec: DeploymentSpec, *, metrics_port: int) -> dict[str, Any]:
    """The deployment's NetworkPolicy (`meta`: its metadata, named after the deployment): its pods admit
    each other on every port, the gateway's port from `gatewayFrom` and the metrics ports from `metricsFrom`."""
    policy, gateway = spec.security.network_policy, spec.gateway
    instance = meta["labels"]["app.kubernetes.io/instance"]
    own = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "dynserve", "app.kubernetes.io/instance": instance}}}
    if policy.gateway_from is not None:
        gateway_from = policy.gateway_from
    else:  # a NodePort or LoadBalancer Service brings clients from outside the cluster: anyone
        gateway_from = [{"podSelector": {}}] if gateway.service_type == "ClusterIP" else []
    gateway_rule: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": gateway.port}]}
    if gateway_from:
        gateway_rule["from"] = gateway_from
    metrics_ports = [gateway.port, metrics_port]
    if spec.pools.vllm is not None and spec.pools.vllm.port not in metrics_ports:
        metrics_ports.append(spec.pools.vllm.port)  # vLLM's /metrics (the gateways reach it as the deployment's own)
    metrics_rule = {"from": policy.metrics_from if policy.metrics_from is not None else [PROMETHEUS_PEER],
                    "ports": [{"protocol": "TCP", "port": port} for port in metrics_ports]}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta,
            "spec": {"podSelector": own["podSelector"], "policyTypes": ["Ingress"],
                     "ingress": [{"from": [own]}, gateway_rule, metrics_rule]}}
