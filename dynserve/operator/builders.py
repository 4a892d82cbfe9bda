"""Every child of a `DynServeDeployment`, as pure functions of its spec: `build_*(...) -> dict`, no I/O.

What one deployment `NAME` becomes (all in its namespace, owned by it, labelled with the recommended
`app.kubernetes.io/*` labels and `dynserve.io/deployment: NAME`):
- ConfigMap `NAME-config`: the dynserve settings every pod reads (`DYN_*`, `config.py`'s names);
- the head, Deployment `NAME-head` (one pod: a Ray head with 0 CPUs, so no worker lands there, and `dynctl
  serve` on it: gateway, router, planner, and with the planner and no Prometheus given, a Prometheus; with a
  vLLM pool `dynctl gateway`, following the attached vLLM servers, instead) and
  Service `NAME-head` (Ray's GCS port, for the worker pods to join); with `gateway.replicas` > 1, Deployment
  `NAME-gateway` of `dynctl gateway` pods joining the head's cluster; Service `NAME` is the OpenAI API over
  every gateway pod;
- per pool (`workers`, or `prefill` and `decode`): a `DynServePool` `NAME-POOL` (the `/scale` unit, created
  with the spec's replicas and afterwards owned by whoever scales it), Deployment `NAME-POOL` whose pods are
  Ray nodes offering the resource `dynserve_pool_ROLE` (one unit each: the head's pools follow the nodes
  offering it, one worker per pod), a PodDisruptionBudget; a headless Service `NAME-workers` for the
  workers' metrics; a vLLM pool's pods instead run vLLM's server and a `dynctl attach` sidecar
  (`vllm_pods.py`);
- with the planner: ServiceAccount `NAME-head` and a Role and RoleBinding letting it scale the DynServePools;
- with a bundled Redis event plane: Deployment and Service `NAME-redis`;
- with `observability.serviceMonitor`: a ServiceMonitor for the gateway's and the workers' metrics;
- unless `security.networkPolicy.enabled` is false, NetworkPolicy `NAME`.

Every pod is locked down as `hardening.py` says: non-root, no capabilities, a read-only root filesystem with
emptyDirs where it writes, resources, no service-account token unless the planner scales through it.

The pods' commands and environment (`commands.py`: `pod_command`, `pod_env`) are what a test runs as local
processes on hosts made of network namespaces (`tests/test_operator_pods.py`).
"""

from __future__ import annotations

from typing import Any

from dynserve import __version__
from dynserve.operator.commands import MODELS_DIR, PRE_STOP, RAY_PORT, model_path, pod_command, pod_env
from dynserve.operator.hardening import (
    CONTAINER_SECURITY, DEFAULT_CPU, build_network_policy, container_resources, cpu_quantity,
    default_memory_bytes, pod_security, writable_volumes,
)
from dynserve.operator.spec import (
    API_VERSION, GROUP, KIND, POOL_KIND, POOL_ROLES, DeploymentSpec, PoolSpec, Resources, Toleration,
)
from dynserve.operator.vllm_pods import VLLM_PORT_NAME, vllm_pod_spec

__all__ = [
    "GATEWAY_PORT_NAME", "METRICS_PORT", "RAY_PORT", "build_children", "build_config", "build_head",
    "build_pool", "build_pool_deployment", "build_pool_resource", "child_names", "labels", "pool_resource_name",
]

METRICS_PORT = 9100  # each worker pod serves its metrics here (its own IP: no two workers share it)
GATEWAY_PORT_NAME = "http"
MANAGER = "dynserve-operator"
DEPLOYMENT_LABEL = f"{GROUP}/deployment"
POOL_LABEL = f"{GROUP}/pool"
GATEWAY_LABEL = f"{GROUP}/gateway"  # on every pod serving the OpenAI API (the head's and gateway-only ones)


def labels(name: str, component: str, spec: DeploymentSpec | None = None) -> dict[str, str]:
    """The recommended labels of a child; `selector_labels` is the subset that never changes."""
    version = (spec.image.tag if spec is not None and spec.image.tag else None) or __version__
    return {**selector_labels(name, component), "app.kubernetes.io/version": version,
            "app.kubernetes.io/part-of": "dynserve", "app.kubernetes.io/managed-by": MANAGER,
            DEPLOYMENT_LABEL: name}


def selector_labels(name: str, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "dynserve", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": component}


def pool_resource_name(name: str, pool: str) -> str:
    return f"{name}-{pool}"


def _meta(name: str, namespace: str, component: str, spec: DeploymentSpec, uid: str | None,
          child: str | None = None, extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": child or name, "namespace": namespace,
                            "labels": {**labels(name, component, spec), **(extra_labels or {})}}
    if uid is not None:
        meta["ownerReferences"] = [{"apiVersion": API_VERSION, "kind": KIND, "name": name, "uid": uid,
                                    "controller": True, "blockOwnerDeletion": True}]
    return meta


# ---- settings ----------------------------------------------------------------------------------------------

def build_config(name: str, namespace: str, spec: DeploymentSpec, uid: str | None = None) -> dict[str, Any]:
    """ConfigMap `NAME-config`: the `DYN_*` settings of every pod (head and workers)."""
    data: dict[str, Any] = {
        "DYN_DTYPE": spec.model.dtype, "DYN_HOST": "0.0.0.0", "DYN_PORT": spec.gateway.port,
        "DYN_NAMESPACE": f"{namespace}.{name}", "DYN_POOLS_FOLLOW_NODES": "true",
        "DYN_WORKER_METRICS_PORT": METRICS_PORT, "DYN_ROUTER": spec.router.mode,
        "DYN_TRANSFER_BACKEND": spec.transfer.backend, "DYN_MODEL": model_path(spec),
        "DYN_OVERLAP_WEIGHT": spec.router.overlap_weight, "DYN_ROUTER_TEMPERATURE": spec.router.temperature,
        "DYN_TRANSFER_TIMEOUT_S": spec.transfer.timeout_seconds, "DYN_KV_CACHE_GIB": spec.engine.kv_cache_gib,
        "DYN_MAX_NUM_SEQS": spec.engine.max_num_seqs, "DYN_MAX_MODEL_LEN": spec.engine.max_model_len,
        "DYN_MOCKER": spec.engine.mocker, "DYN_MOCKER_SPEEDUP": spec.engine.mocker_speedup,
    }
    for pool, pool_spec in spec.pools.items():
        key = {"workers": "DYN_WORKERS", "prefill": "DYN_PREFILL_WORKERS", "decode": "DYN_DECODE_WORKERS"}[pool]
        data[key] = max(pool_spec.replicas, 1)
    if spec.event_plane.backend == "redis":
        data["DYN_REDIS_URL"] = spec.event_plane.redis_url or f"redis://{name}-redis:6379/0"
    if spec.planner.enabled:
        planner = spec.planner
        data.update({
            "DYN_PLANNER": "true", "DYN_PLANNER_MODE": planner.mode, "DYN_PLANNER_TTFT_MS": planner.ttft_ms,
            "DYN_PLANNER_ITL_MS": planner.itl_ms, "DYN_PLANNER_INTERVAL_S": planner.interval_seconds,
            "DYN_PLANNER_MAX_TOTAL_WORKERS": planner.max_total_workers,
            "DYN_PLANNER_IDLE_S": planner.idle_seconds, "DYN_PLANNER_PROFILE": planner.profile,
            "DYN_PLANNER_KUBERNETES": f"{namespace}/{name}",
        })
        for pool, pool_spec in spec.pools.items():
            infix = {"workers": "", "prefill": "prefill_", "decode": "decode_"}[pool]
            data[f"DYN_PLANNER_MIN_{infix.upper()}WORKERS"] = pool_spec.min_replicas
            data[f"DYN_PLANNER_MAX_{infix.upper()}WORKERS"] = pool_spec.max_replicas
        if planner.prometheus_url:
            data["DYN_PROMETHEUS_URL"] = planner.prometheus_url
        else:
            data["DYN_PROMETHEUS"] = "true"
    for var in spec.env:
        data[var.name] = var.value
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(name, namespace, "config", spec, uid, f"{name}-config"),
            "data": {key: _env_text(value) for key, value in sorted(data.items()) if value is not None}}


def _env_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else f"{value:g}" if isinstance(value, float) else str(value)


def image_of(spec: DeploymentSpec) -> str:
    """The pods' image: the repository at the spec's tag (default: the operator's version), pinned to the
    spec's digest when it gives one."""
    image = f"{spec.image.repository}:{spec.image.tag or __version__}"
    return f"{image}@{spec.image.digest}" if spec.image.digest else image


def _tolerations(tolerations: list[Toleration]) -> list[dict[str, Any]]:
    return [t.model_dump(by_alias=True, exclude_none=True) for t in tolerations]


def _pod_spec(name: str, spec: DeploymentSpec, container: dict[str, Any], *, node_selector: dict[str, str],
              tolerations: list[Toleration], service_account: str | None = None) -> dict[str, Any]:
    image = image_of(spec)
    volumes, mounts = writable_volumes(spec)
    container = {"image": image, "imagePullPolicy": spec.image.pull_policy,
                 "envFrom": [{"configMapRef": {"name": f"{name}-config"}}],
                 "env": pod_env(spec), "securityContext": CONTAINER_SECURITY, **container}
    # a token only for a pod that talks to the API server (the head, when the planner scales through it)
    pod: dict[str, Any] = {"securityContext": pod_security(spec), "automountServiceAccountToken": service_account
                           is not None, "containers": [container], "terminationGracePeriodSeconds": 60}
    volume = spec.model.volume or ({"emptyDir": {}} if spec.model.uri else None)
    if volume is not None:
        volumes.append({"name": "models", **volume})
        mounts.append({"name": "models", "mountPath": MODELS_DIR})
    pod["volumes"], container["volumeMounts"] = volumes, mounts
    if spec.model.uri:
        pod["initContainers"] = [{
            "name": "fetch-model", "image": image, "imagePullPolicy": spec.image.pull_policy,
            "command": ["python", "-m", "dynserve.operator.fetch", spec.model.uri, model_path(spec)],
            "securityContext": CONTAINER_SECURITY,
            "resources": container_resources(Resources(), cpu="500m", memory_bytes=512 * 2**20),
            "volumeMounts": [m for m in mounts if m["mountPath"] in ("/tmp", MODELS_DIR)]}]
    if service_account is not None:
        pod["serviceAccountName"] = service_account
    return _placed(pod, spec, node_selector, tolerations)


def _placed(pod: dict[str, Any], spec: DeploymentSpec, node_selector: dict[str, str],
            tolerations: list[Toleration]) -> dict[str, Any]:
    """`pod` with its node selector, tolerations and image pull secrets."""
    if node_selector:
        pod["nodeSelector"] = dict(node_selector)
    if tolerations:
        pod["tolerations"] = _tolerations(tolerations)
    if spec.image.pull_secrets:
        pod["imagePullSecrets"] = [{"name": secret} for secret in spec.image.pull_secrets]
    return pod


# ---- the head --------------------------------------------------------------------------------------------

def build_head(name: str, namespace: str, spec: DeploymentSpec, uid: str | None = None) -> list[dict[str, Any]]:
    """The head's Deployment, its Ray Service (`NAME-head`) and the gateway's Service (`NAME`); with the
    planner, its ServiceAccount, Role and RoleBinding."""
    port = spec.gateway.port
    ports = [{"name": GATEWAY_PORT_NAME, "containerPort": port}, {"name": "ray-gcs", "containerPort": RAY_PORT}]
    serves_vllm = spec.pools.vllm is not None  # the gateway waits for the first vLLM server, however long it loads
    container = {
        "name": "head", "command": pod_command("head", serve=not serves_vllm), "ports": ports,
        "readinessProbe": {"httpGet": {"path": "/ready", "port": GATEWAY_PORT_NAME}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/health", "port": GATEWAY_PORT_NAME}, "periodSeconds": 10,
                          "failureThreshold": 6},
        # the model loads and the first workers join before the gateway answers
        "startupProbe": {"httpGet": {"path": "/health", "port": GATEWAY_PORT_NAME}, "periodSeconds": 5,
                         "failureThreshold": 360 if serves_vllm else 120},
        "resources": container_resources(spec.gateway.resources, cpu=DEFAULT_CPU["head"],
                                         memory_bytes=default_memory_bytes(spec, "head")),
    }
    account = f"{name}-head" if spec.planner.enabled else None
    selector = selector_labels(name, "head")
    meta = _meta(name, namespace, "head", spec, uid, f"{name}-head", {GATEWAY_LABEL: "true"})
    children: list[dict[str, Any]] = [
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
         "spec": {"replicas": 1, "strategy": {"type": "Recreate"},  # one Ray head, never two
                  "selector": {"matchLabels": selector},
                  "template": {"metadata": {"labels": meta["labels"]},
                               "spec": _pod_spec(name, spec, container, node_selector=spec.gateway.node_selector,
                                                 tolerations=spec.gateway.tolerations, service_account=account)}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta(name, namespace, "head", spec, uid, f"{name}-head"),
         "spec": {"selector": selector, "ports": [{"name": "ray-gcs", "port": RAY_PORT, "targetPort": "ray-gcs"}]}},
        {"apiVersion": "v1", "kind": "Service",
         "metadata": _meta(name, namespace, "gateway", spec, uid, extra_labels={f"{GROUP}/metrics": "true"}),
         "spec": {"type": spec.gateway.service_type,
                  "selector": {"app.kubernetes.io/instance": name, GATEWAY_LABEL: "true"},
                  "ports": [{"name": GATEWAY_PORT_NAME, "port": port, "targetPort": GATEWAY_PORT_NAME}]}},
    ]
    if spec.gateway.replicas > 1:
        children.append(_gateway_deployment(name, namespace, spec, uid, container))
    if account is not None:
        children += _planner_rbac(name, namespace, spec, uid, account)
    return children


def _gateway_deployment(name: str, namespace: str, spec: DeploymentSpec, uid: str | None,
                        head: dict[str, Any]) -> dict[str, Any]:
    """The gateway-only pods: the head container's probes and resources, `dynctl gateway` as command."""
    meta = _meta(name, namespace, "gateway", spec, uid, f"{name}-gateway", {GATEWAY_LABEL: "true"})
    container = {**head, "name": "gateway", "command": pod_command("gateway", head_host=f"{name}-head"),
                 "ports": [p for p in head["ports"] if p["name"] == GATEWAY_PORT_NAME]}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
            "spec": {"replicas": spec.gateway.replicas - 1, "selector": {"matchLabels": selector_labels(name, "gateway")},
                     "template": {"metadata": {"labels": meta["labels"]},
                                  "spec": _pod_spec(name, spec, container, node_selector=spec.gateway.node_selector,
                                                    tolerations=spec.gateway.tolerations)}}}


def _planner_rbac(name: str, namespace: str, spec: DeploymentSpec, uid: str | None,
                  account: str) -> list[dict[str, Any]]:
    meta = _meta(name, namespace, "head", spec, uid, account)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": _meta(name, namespace, "head", spec, uid, f"{name}-planner"),
         "rules": [{"apiGroups": [GROUP], "resources": ["dynservepools"], "verbs": ["get", "list", "watch", "patch"]},
                   {"apiGroups": [GROUP], "resources": ["dynservepools/scale"], "verbs": ["get", "patch", "update"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": _meta(name, namespace, "head", spec, uid, f"{name}-planner"),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": f"{name}-planner"},
         "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]},
    ]


# ---- pools -----------------------------------------------------------------------------------------------

def build_pool_resource(name: str, namespace: str, spec: DeploymentSpec, pool: str,
                        uid: str | None = None) -> dict[str, Any]:
    """The `DynServePool` of one pool, at the spec's replicas (its creation value)."""
    pool_spec: PoolSpec = getattr(spec.pools, pool)
    component = f"pool-{pool}"
    return {"apiVersion": API_VERSION, "kind": POOL_KIND,
            "metadata": _meta(name, namespace, component, spec, uid, pool_resource_name(name, pool),
                              {POOL_LABEL: pool}),
            "spec": {"deployment": name, "pool": pool, "replicas": pool_spec.replicas,
                     "minReplicas": pool_spec.min_replicas, "maxReplicas": pool_spec.max_replicas}}


def _ray_cpus(pool_spec: PoolSpec) -> float:
    if pool_spec.ray_cpus is not None:
        return pool_spec.ray_cpus
    cpu = pool_spec.resources.requests.get("cpu")
    if cpu is None:
        return 1.0
    text = str(cpu)
    return max(float(text[:-1]) / 1000 if text.endswith("m") else float(text), 0.01)


def build_pool_deployment(name: str, namespace: str, spec: DeploymentSpec, pool: str, replicas: int,
                          uid: str | None = None) -> dict[str, Any]:
    """The worker Deployment of `pool` at `replicas` pods: each a Ray node offering one unit of the pool's
    resource, ready once its worker serves metrics (the worker is up)."""
    pool_spec: PoolSpec = getattr(spec.pools, pool)
    component = f"pool-{pool}"
    selector = selector_labels(name, component)
    meta = _meta(name, namespace, component, spec, uid, pool_resource_name(name, pool), {POOL_LABEL: pool})
    template_labels = {**meta["labels"], f"{GROUP}/worker": "true"}
    if pool == "workers" and spec.pools.vllm is not None:
        pod = _placed(vllm_pod_spec(name, spec, pool_spec.resources, image=image_of(spec)), spec,
                      pool_spec.node_selector, pool_spec.tolerations)
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
                "spec": {"replicas": replicas, "selector": {"matchLabels": selector},
                         "template": {"metadata": {"labels": template_labels}, "spec": pod}}}
    container = {
        "name": "worker",
        "command": pod_command("worker", head_host=f"{name}-head", role=POOL_ROLES[pool],
                               ray_cpus=_ray_cpus(pool_spec)),
        "ports": [{"name": "metrics", "containerPort": METRICS_PORT}],
        "readinessProbe": {"tcpSocket": {"port": "metrics"}, "periodSeconds": 5},
        # a node whose worker is gone (and not replaced) restarts: the head's pool places a new one on it
        "livenessProbe": {"tcpSocket": {"port": "metrics"}, "periodSeconds": 10, "failureThreshold": 6},
        # the node joins the head and the worker loads the model before it serves
        "startupProbe": {"tcpSocket": {"port": "metrics"}, "periodSeconds": 5, "failureThreshold": 120},
        # `ray start --block` does not end on SIGTERM: stopping the node's Ray processes ends it
        "lifecycle": {"preStop": {"exec": {"command": PRE_STOP}}},
        "resources": container_resources(pool_spec.resources, cpu=cpu_quantity(_ray_cpus(pool_spec)),
                                         memory_bytes=default_memory_bytes(spec, "worker")),
    }
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
            "spec": {"replicas": replicas, "selector": {"matchLabels": selector},
                     "template": {"metadata": {"labels": template_labels},
                                  "spec": _pod_spec(name, spec, container, node_selector=pool_spec.node_selector,
                                                    tolerations=pool_spec.tolerations)}}}


def build_pool(name: str, namespace: str, spec: DeploymentSpec, pool: str, replicas: int,
               uid: str | None = None) -> list[dict[str, Any]]:
    """A pool's worker Deployment and PodDisruptionBudget (one pod down at a time)."""
    component = f"pool-{pool}"
    pdb = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
           "metadata": _meta(name, namespace, component, spec, uid, pool_resource_name(name, pool), {POOL_LABEL: pool}),
           "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name, component)}}}
    return [build_pool_deployment(name, namespace, spec, pool, replicas, uid), pdb]


def _workers_service(name: str, namespace: str, spec: DeploymentSpec, uid: str | None) -> dict[str, Any]:
    ports = [{"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"}]
    if spec.pools.vllm is not None:  # vLLM serves its /metrics on its HTTP port
        ports.append({"name": VLLM_PORT_NAME, "port": spec.pools.vllm.port, "targetPort": VLLM_PORT_NAME})
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(name, namespace, "workers", spec, uid, f"{name}-workers",
                              {f"{GROUP}/metrics": "true"}),
            "spec": {"clusterIP": "None", "selector": {"app.kubernetes.io/instance": name, f"{GROUP}/worker": "true"},
                     "ports": ports}}


# ---- optional parts --------------------------------------------------------------------------------------

def build_redis(name: str, namespace: str, spec: DeploymentSpec, uid: str | None = None) -> list[dict[str, Any]]:
    selector = selector_labels(name, "redis")
    meta = _meta(name, namespace, "redis", spec, uid, f"{name}-redis")
    container = {"name": "redis", "image": spec.event_plane.redis_image, "imagePullPolicy": spec.image.pull_policy,
                 "args": ["--save", "", "--appendonly", "no"],  # the event plane is rebuilt from the workers
                 "ports": [{"name": "redis", "containerPort": 6379}],
                 "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
                 "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10, "failureThreshold": 6},
                 "securityContext": CONTAINER_SECURITY,
                 "resources": container_resources(Resources(), cpu="250m", memory_bytes=256 * 2**20),
                 # its working directory; nothing is saved there (no snapshots, no append-only file)
                 "volumeMounts": [{"name": "data", "mountPath": "/data"}]}
    pod = {"securityContext": pod_security(spec), "automountServiceAccountToken": False, "containers": [container],
           "volumes": [{"name": "data", "emptyDir": {}}]}
    return [
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
         "spec": {"replicas": 1, "selector": {"matchLabels": selector},
                  "template": {"metadata": {"labels": meta["labels"]}, "spec": pod}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta(name, namespace, "redis", spec, uid, f"{name}-redis"),
         "spec": {"selector": selector, "ports": [{"name": "redis", "port": 6379, "targetPort": "redis"}]}},
    ]


def build_service_monitor(name: str, namespace: str, spec: DeploymentSpec, uid: str | None = None) -> dict[str, Any]:
    interval = f"{spec.observability.scrape_interval_seconds}s"
    ports = [GATEWAY_PORT_NAME, "metrics"] + ([VLLM_PORT_NAME] if spec.pools.vllm is not None else [])
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": _meta(name, namespace, "metrics", spec, uid),
            "spec": {"selector": {"matchLabels": {"app.kubernetes.io/instance": name, f"{GROUP}/metrics": "true"}},
                     "endpoints": [{"port": port, "path": "/metrics", "interval": interval} for port in ports]}}


def child_names(name: str, spec: DeploymentSpec) -> dict[str, str]:
    """What a user looks for: the gateway's Service and each pool's DynServePool."""
    return {"gateway": name, **{pool: pool_resource_name(name, pool) for pool, _ in spec.pools.items()}}


def build_children(name: str, namespace: str, spec: DeploymentSpec, *, uid: str | None = None,
                   replicas: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """Every child of the deployment; `replicas` (pool -> pods) are the pools' current sizes (their
    DynServePools'), the spec's when not given."""
    children = [build_config(name, namespace, spec, uid)]
    if spec.event_plane.backend == "redis" and not spec.event_plane.redis_url:
        children += build_redis(name, namespace, spec, uid)
    children += build_head(name, namespace, spec, uid)
    for pool, pool_spec in spec.pools.items():
        children.append(build_pool_resource(name, namespace, spec, pool, uid))
        children += build_pool(name, namespace, spec, pool, (replicas or {}).get(pool, pool_spec.replicas), uid)
    children.append(_workers_service(name, namespace, spec, uid))
    if spec.observability.service_monitor:
        children.append(build_service_monitor(name, namespace, spec, uid))
    if spec.security.network_policy.enabled:
        children.append(build_network_policy(_meta(name, namespace, "network-policy", spec, uid), spec,
                                             metrics_port=METRICS_PORT))
    return children
