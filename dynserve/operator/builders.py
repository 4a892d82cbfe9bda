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
- with several models (`spec.models`): the first model's pools as above, each other model MODEL's as
  `NAME-MODEL-POOL` (labelled `dynserve.io/model: MODEL`, its pods offering `dynserve_pool_mI_ROLE`, its files
  at /models/MODEL), and the gateways told every model and alias (`commands.gateway_model_flags`);
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

import contextlib
import math
from typing import Any

from dynserve import __version__, shutdown
from dynserve.config import Settings
from dynserve.operator.commands import (
    PRE_STOP, RAY_PORT, gateway_model_flags, model_dir, model_path, pod_command, pod_env, source_path,
)
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
    "build_pool", "build_pool_deployment", "build_pool_resource", "child_names", "labels", "model_key", "model_pools",
    "pool_key", "pool_resource_name",
]

METRICS_PORT = 9100  # each worker pod serves its metrics here (its own IP: no two workers share it)
GATEWAY_PORT_NAME = "http"
MANAGER = "dynserve-operator"
DEPLOYMENT_LABEL = f"{GROUP}/deployment"
POOL_LABEL = f"{GROUP}/pool"
MODEL_LABEL = f"{GROUP}/model"  # on another model's pools than the first's: its name in spec.models
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


def pool_resource_name(name: str, pool: str, model: str | None = None) -> str:
    """A pool's DynServePool, worker Deployment and PDB: NAME-POOL for the first (default) model's pools,
    NAME-MODEL-POOL for another model's (`model`: its name in spec.models)."""
    return f"{name}-{pool}" if model is None else f"{name}-{model}-{pool}"


def model_key(spec: DeploymentSpec, model_index: int) -> str | None:
    """The name a model's pools carry: None for the first (default) model, its spec.models name otherwise."""
    return None if model_index == 0 else spec.served_models()[model_index].name


def pool_key(spec: DeploymentSpec, model_index: int, pool: str) -> str:
    """A pool as the status and `replicas` name it: POOL for the default model's, MODEL/POOL for another's."""
    key = model_key(spec, model_index)
    return pool if key is None else f"{key}/{pool}"


def model_pools(spec: DeploymentSpec) -> list[tuple[int, str, PoolSpec]]:
    """(model index, pool name, pool spec) of every pool of every model, the default model's first."""
    return [(index, pool, pool_spec) for index, entry in enumerate(spec.served_models())
            for pool, pool_spec in entry.pools.items()]


def _component(pool: str, model: str | None) -> str:
    return f"pool-{pool}" if model is None else f"pool-{model}-{pool}"


def _pool_labels(pool: str, model: str | None) -> dict[str, str]:
    return {POOL_LABEL: pool} if model is None else {POOL_LABEL: pool, MODEL_LABEL: model}


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
            "DYN_PLANNER_RISE_SPARE_WORKERS": planner.rise_spare_workers,
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


# What a pod's grace period gives beyond the gateway's drain and its shutdown steps' budget: the steps run
# after the budget is spent (`shutdown.MIN_STEP_S` each: at most four in a row in `dynctl serve`), the 2 s the
# drain waits on the responses it cut, and Ray's own stop
GRACE_SPARE_S = 20
# The longest grace period a pod is given, whatever drain the spec asks for (a day)
MAX_GRACE_S = 86_400


def termination_grace_s(spec: DeploymentSpec) -> int:
    """A dynserve pod's grace period between SIGTERM and SIGKILL: the gateway's drain of requests in flight
    (`shutdown_grace_s`, which the spec's `env` may set), its shutdown steps' budget
    (`shutdown.STEPS_BUDGET_S`: the KV consumers, the worker connections, the planner, the pools), and
    `GRACE_SPARE_S`: 70 s by default, at most `MAX_GRACE_S`. A value of `DYN_SHUTDOWN_GRACE_S` that is not a
    number is left to the pod's own settings to refuse."""
    grace_s = Settings.model_fields["shutdown_grace_s"].default
    for var in spec.env:
        if var.name == "DYN_SHUTDOWN_GRACE_S":
            with contextlib.suppress(ValueError):
                grace_s = max(0.0, float(var.value))
    total_s = grace_s + shutdown.STEPS_BUDGET_S + GRACE_SPARE_S
    return MAX_GRACE_S if not math.isfinite(total_s) else min(MAX_GRACE_S, math.ceil(total_s))


def _pod_spec(name: str, spec: DeploymentSpec, container: dict[str, Any], *, node_selector: dict[str, str],
              tolerations: list[Toleration], service_account: str | None = None,
              model_index: int | None = None) -> dict[str, Any]:
    """A pod of `container`; its model files are every model's (a gateway's: `model_index` None) or one
    model's workers'."""
    image = image_of(spec)
    volumes, mounts = writable_volumes(spec)
    container = {"image": image, "imagePullPolicy": spec.image.pull_policy,
                 "envFrom": [{"configMapRef": {"name": f"{name}-config"}}],
                 "env": pod_env(spec), "securityContext": CONTAINER_SECURITY, **container}
    # a token only for a pod that talks to the API server (the head, when the planner scales through it)
    pod: dict[str, Any] = {"securityContext": pod_security(spec), "automountServiceAccountToken": service_account
                           is not None, "containers": [container],
                           "terminationGracePeriodSeconds": termination_grace_s(spec)}
    fetches = _model_files(spec, model_index, volumes, mounts)
    pod["volumes"], container["volumeMounts"] = volumes, mounts
    if fetches:
        pod["initContainers"] = [{
            "name": "fetch-model" if key is None else f"fetch-model-{key}", "image": image,
            "imagePullPolicy": spec.image.pull_policy,
            "command": ["python", "-m", "dynserve.operator.fetch", uri, destination],
            "securityContext": CONTAINER_SECURITY,
            "resources": container_resources(Resources(), cpu="500m", memory_bytes=512 * 2**20),
            "volumeMounts": [m for m in mounts if m["mountPath"] in ("/tmp", directory)]}
            for key, uri, directory, destination in fetches]
    if service_account is not None:
        pod["serviceAccountName"] = service_account
    return _placed(pod, spec, node_selector, tolerations)


def _model_files(spec: DeploymentSpec, model_index: int | None, volumes: list[dict[str, Any]],
                 mounts: list[dict[str, Any]]) -> list[tuple[str | None, str, str, str]]:
    """Add the volumes of the models a pod reads to `volumes` and `mounts` (each model's volume, or an emptyDir
    its `uri` is fetched into, at `model_dir`); returns the fetches its init containers make (model name or
    None for the first, uri, directory, file). A worker of another model than the first also mounts the first
    model's own volume: models may share it."""
    entries = spec.served_models()
    indexes = range(len(entries)) if model_index is None else sorted({0, model_index})
    fetches = []
    for index in indexes:
        entry, key = entries[index], model_key(spec, index)
        if index != model_index and model_index is not None and entry.model.volume is None:
            continue  # the first model's files, in another model's worker: only its shared volume
        volume = entry.model.volume or ({"emptyDir": {}} if entry.model.uri else None)
        if volume is None:
            continue
        directory = model_dir(entry, index)
        volume_name = "models" if key is None else f"models-{key}"
        volumes.append({"name": volume_name, **volume})
        mounts.append({"name": volume_name, "mountPath": directory})
        if entry.model.uri and (model_index is None or index == model_index):
            fetches.append((key, entry.model.uri, directory, str(source_path(entry.model, directory))))
    return fetches


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
        "name": "head", "command": pod_command("head", serve=not serves_vllm, gateway_flags=gateway_model_flags(spec)),
        "ports": ports,
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
    container = {**head, "name": "gateway", "command": pod_command("gateway", head_host=f"{name}-head",
                                                                   gateway_flags=gateway_model_flags(spec)),
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
                        uid: str | None = None, model_index: int = 0) -> dict[str, Any]:
    """The `DynServePool` of one pool (of model `model_index`), at the spec's replicas (its creation value)."""
    pool_spec: PoolSpec = getattr(spec.served_models()[model_index].pools, pool)
    key = model_key(spec, model_index)
    body = {"deployment": name, "pool": pool, "replicas": pool_spec.replicas,
            "minReplicas": pool_spec.min_replicas, "maxReplicas": pool_spec.max_replicas}
    return {"apiVersion": API_VERSION, "kind": POOL_KIND,
            "metadata": _meta(name, namespace, _component(pool, key), spec, uid, pool_resource_name(name, pool, key),
                              _pool_labels(pool, key)),
            "spec": body if key is None else {**body, "model": key}}


def _ray_cpus(pool_spec: PoolSpec) -> float:
    if pool_spec.ray_cpus is not None:
        return pool_spec.ray_cpus
    cpu = pool_spec.resources.requests.get("cpu")
    if cpu is None:
        return 1.0
    text = str(cpu)
    return max(float(text[:-1]) / 1000 if text.endswith("m") else float(text), 0.01)


def build_pool_deployment(name: str, namespace: str, spec: DeploymentSpec, pool: str, replicas: int,
                          uid: str | None = None, model_index: int = 0) -> dict[str, Any]:
    """The worker Deployment of `pool` (of model `model_index`) at `replicas` pods: each a Ray node offering one
    unit of the pool's resource, ready once its worker serves metrics (the worker is up)."""
    pool_spec: PoolSpec = getattr(spec.served_models()[model_index].pools, pool)
    key = model_key(spec, model_index)
    component = _component(pool, key)
    selector = selector_labels(name, component)
    meta = _meta(name, namespace, component, spec, uid, pool_resource_name(name, pool, key), _pool_labels(pool, key))
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
                               ray_cpus=_ray_cpus(pool_spec), model_index=model_index),
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
                                                    tolerations=pool_spec.tolerations, model_index=model_index)}}}


def build_pool(name: str, namespace: str, spec: DeploymentSpec, pool: str, replicas: int,
               uid: str | None = None, model_index: int = 0) -> list[dict[str, Any]]:
    """A pool's worker Deployment and PodDisruptionBudget (one pod down at a time)."""
    key = model_key(spec, model_index)
    component = _component(pool, key)
    pdb = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
           "metadata": _meta(name, namespace, component, spec, uid, pool_resource_name(name, pool, key),
                             _pool_labels(pool, key)),
           "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name, component)}}}
    return [build_pool_deployment(name, namespace, spec, pool, replicas, uid, model_index), pdb]


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
    return {"gateway": name, **{pool_key(spec, index, pool): pool_resource_name(name, pool, model_key(spec, index))
                                for index, pool, _ in model_pools(spec)}}


def build_children(name: str, namespace: str, spec: DeploymentSpec, *, uid: str | None = None,
                   replicas: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """Every child of the deployment; `replicas` (`pool_key` -> pods) are the pools' current sizes (their
    DynServePools'), the spec's when not given."""
    children = [build_config(name, namespace, spec, uid)]
    if spec.event_plane.backend == "redis" and not spec.event_plane.redis_url:
        children += build_redis(name, namespace, spec, uid)
    children += build_head(name, namespace, spec, uid)
    for index, pool, pool_spec in model_pools(spec):
        children.append(build_pool_resource(name, namespace, spec, pool, uid, index))
        count = (replicas or {}).get(pool_key(spec, index, pool), pool_spec.replicas)
        children += build_pool(name, namespace, spec, pool, count, uid, index)
    children.append(_workers_service(name, namespace, spec, uid))
    if spec.observability.service_monitor:
        children.append(build_service_monitor(name, namespace, spec, uid))
    if spec.security.network_policy.enabled:
        children.append(build_network_policy(_meta(name, namespace, "network-policy", spec, uid), spec,
                                             metrics_port=METRICS_PORT))
    return children
