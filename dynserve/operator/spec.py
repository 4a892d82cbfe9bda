"""The `DynServeDeployment` and `DynServePool` resources as typed models: what a user writes, what the
operator reads, what `dynctl deploy` validates, and (through `crd.py`) the CRDs' own openAPIV3Schema.

Field names are the resource's (camelCase on the wire, snake_case in Python). Invariants every parsed spec
keeps (`parse_deployment` raises InvalidRequestError naming the field otherwise):
- `pools` is either aggregated (`workers` only) or disaggregated (`prefill` and `decode`, no `workers`);
- each pool has `minReplicas <= replicas <= maxReplicas`;
- a pool's `engine` is dynserve's unless it is the aggregated `workers` pool, which may run vLLM's OpenAI server
  (`engine: vllm` with a `vllm` block naming its image, and no `vllm` block otherwise); a deployment with a vLLM
  pool names `model.path` (a Hugging Face directory vLLM loads and the gateways tokenize with), runs no
  mocker and no planner (`dynctl serve`, where the planner runs, does not serve a pool of vLLM pods);
- `model` gives at most one of `path` and `uri`; `env` sets only `DYN_*` variables that name a setting and
  none the operator sets itself;
- several models (`models`, each with its `model` and `pools`) or one (`model` and `pools`), never both; with
  `models`, `model` and `pools` read as the first model's (the gateway's default model), the one-entry list
  is the single-model form, and each model's pools are its own DynServePools (`builders.py`). The models
  share one layout (every one aggregated, or every one disaggregated: `dynctl serve` on the head runs one
  layout for all), one dtype, one `engine` and no planner (on Kubernetes it scales the DynServePools of one
  model); with several models each names its weights (`path` or `uri`: the bundled model serves alone); none
  runs vLLM (a vLLM pool serves in the single-model form); no name a client may ask for (a model's id or a
  `servedModelNames` alias) stands for two models.
"""

from __future__ import annotations

import posixpath
import re
from typing import Annotated, Any, Literal
from urllib.parse import urlparse

import pydantic
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel

from dynserve.config import Settings
from dynserve.errors import InvalidRequestError

__all__ = [
    "API_VERSION", "GROUP", "KIND", "POOL_KIND", "POOL_ROLES", "RUN_AS_UID", "VERSION", "DeploymentSpec",
    "ModelEntry", "PoolSpec", "PoolResourceSpec", "SecuritySpec", "VllmSpec", "WorkersPoolSpec", "parse_deployment", "parse_pool",
]

GROUP, VERSION = "dynserve.io", "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND, POOL_KIND = "DynServeDeployment", "DynServePool"
POOL_ROLES = {"workers": "both", "prefill": "prefill", "decode": "decode"}  # pool name -> the workers' role
DEFAULT_IMAGE = "ghcr.io/dynserve/dynserve"
RUN_AS_UID = 10001  # the image's user and group (deploy/docker/Dockerfile's USER): not root, above host UIDs
# where the pods write: every other path of their root filesystem is read-only (`hardening.py` mounts these)
OPERATOR_WRITABLE_PATHS = frozenset({"/tmp", "/dev/shm", "/var/cache/dynserve", "/models"})

# DYN_* variables the operator sets from the spec itself (or per pod): `env` may not set them
OPERATOR_ENV = frozenset({
    "DYN_MODEL", "DYN_DTYPE", "DYN_HOST", "DYN_PORT", "DYN_API_KEY", "DYN_RAY_ADDRESS", "DYN_ADVERTISE_HOST",
    "DYN_BIND_HOST", "DYN_PREFILL_WORKERS", "DYN_DECODE_WORKERS", "DYN_WORKERS", "DYN_POOLS_FOLLOW_NODES",
    "DYN_REDIS_URL", "DYN_ROUTER", "DYN_TRANSFER_BACKEND", "DYN_PLANNER", "DYN_PROMETHEUS", "DYN_PROMETHEUS_URL",
    "DYN_WORKER_METRICS_PORT", "DYN_NAMESPACE", "DYN_MOCKER", "DYN_CLUSTER_TOKEN",
    "DYN_EXTRA_MODELS", "DYN_MODELS_FILE", "DYN_SERVED_MODEL_NAMES",  # spec.models
})
# vLLM's server flags the operator sets from the spec (`vllm.args` may not repeat them; vLLM reads `_` as `-`)
VLLM_OPERATOR_FLAGS = ("model", "served-model-name", "host", "port", "block-size", "kv-events-config")
_VLLM_FLAG_PATTERN = "^--(" + "|".join(f.replace("-", "[-_]") for f in VLLM_OPERATOR_FLAGS) + ")(=|$)"
_DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class KeyRef(_Model):
    """A key of a Kubernetes Secret."""

    name: str = Field(min_length=1, description="the Secret's name (in the resource's namespace)")
    key: str = Field("api-key", min_length=1, description="the key within it")


class TokenRef(_Model):
    """The key of a Kubernetes Secret holding a cluster token (16 to 512 characters)."""

    name: str = Field(min_length=1, description="the Secret's name (in the resource's namespace)")
    key: str = Field("token", min_length=1, description="the key within it")


class ModelSource(_Model):
    path: str | None = Field(None, description="a GGUF file or Hugging Face directory on the volume (mounted "
                             "at /models), or in the image; default: the image's bundled SmolLM2-135M-Instruct")
    uri: str | None = Field(None, description="an http(s) URL of a GGUF file an init container fetches into "
                            "the volume before the pod starts")
    volume: dict[str, Any] | None = Field(
        None, description="a Pod volume source mounted at /models (e.g. {persistentVolumeClaim: {claimName: "
        "models}}); default: an emptyDir", json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="weights' dtype")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSource:
        if self.path and self.uri:
            raise ValueError("give path or uri, not both")
        return self


class ImageSpec(_Model):
    repository: str = Field(DEFAULT_IMAGE, min_length=1, description="the dynserve image (deploy/docker)")
    tag: str | None = Field(None, description="default: the operator's own version")
    digest: str | None = Field(None, pattern=_DIGEST_PATTERN, description="pin the image by its "
                               "digest (sha256:...): the pods run exactly it, whatever the tag points to later")
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "Always", description="Always: each pod start checks the registry with its own pull secret (layers "
        "already on the node are not fetched again), so no pod runs a private image another pulled")
    pull_secrets: list[str] = Field(default_factory=list, description="names of image pull Secrets")


class Resources(_Model):
    """A container's resource requests and limits (quantities as Kubernetes writes them: 2, "500m", "4Gi";
    GPUs as `nvidia.com/gpu` limits). CPU and memory not given default to what the pod needs (the model, its
    KV cache, Ray's object store in /dev/shm); a limit not given is the request (Guaranteed QoS)."""

    requests: dict[str, int | str] = Field(default_factory=dict, json_schema_extra={"int_or_string": True})
    limits: dict[str, int | str] = Field(default_factory=dict, json_schema_extra={"int_or_string": True})


class Toleration(_Model):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class GatewaySpec(_Model):
    replicas: int = Field(1, ge=1, description="gateway pods behind the Service: the head's, and replicas - 1 "
                          "gateway-only pods (each routes with its own view of the workers' KV events)")
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(
        "ClusterIP", description="the gateway Service's type")
    port: int = Field(8000, ge=1, le=65535, description="the OpenAI API's port")
    api_key_secret: KeyRef | None = Field(None, description="require 'Authorization: Bearer <key>' with the "
                                          "key in this Secret")
    resources: Resources = Field(default_factory=Resources, description="the head pod's (Ray head, gateway, "
                                 "router, planner)")
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)


class PoolSpec(_Model):
    """A pool of dynserve's engine workers (`prefill` and `decode` are always: `WorkersPoolSpec` may run vLLM)."""

    replicas: int = Field(1, ge=0, description="worker pods (one worker each); the planner, an HPA or "
                          "`kubectl scale dynservepool` change it at run time")
    min_replicas: int = Field(0, ge=0, description="the planner's lower bound")
    max_replicas: int = Field(8, ge=1, description="the planner's upper bound")
    engine: Literal["dynserve"] = Field("dynserve", description="dynserve's engine: a disaggregated pool moves KV "
                                        "pages between dynserve's own workers (only the workers pool runs vLLM)")
    resources: Resources = Field(default_factory=Resources, description="each worker container's (GPUs: "
                                 "limits nvidia.com/gpu)")
    ray_cpus: float | None = Field(None, gt=0, description="CPUs the pod's Ray node offers; default: its CPU "
                                   "request, else 1 (dynserve's engine only)")
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)

    @field_validator("engine", mode="before")
    @classmethod
    def _engine_of_this_pool(cls, engine: Any) -> Any:
        if engine == "vllm" and "vllm" not in cls.model_fields:
            raise ValueError("vLLM serves whole requests: only the aggregated workers pool runs it (a "
                             "disaggregated pool moves KV pages between dynserve's own workers)")
        return engine

    @model_validator(mode="after")
    def _bounds(self) -> PoolSpec:
        if not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ValueError(f"need minReplicas <= replicas <= maxReplicas (got {self.min_replicas} <= "
                             f"{self.replicas} <= {self.max_replicas})")
        return self


class VllmSpec(_Model):
    """How a vLLM pool's pods run vLLM's OpenAI server (`python3 -m vllm.entrypoints.openai.api_server`): the
    image, the ports, the KV block size; the model is `model.path`, the GPUs the pool's `resources`."""

    image: str = Field(min_length=1, max_length=512, pattern=r"^[^\s@]+$", description="vLLM's image and tag, "
                       "e.g. vllm/vllm-openai:v0.10.2 (CUDA) or a vLLM CPU build's")
    digest: str | None = Field(None, pattern=_DIGEST_PATTERN, description="pin vLLM's image by its digest "
                               "(sha256:...)")
    args: list[Annotated[str, Field(min_length=1, max_length=512)]] = Field(
        default_factory=list, max_length=32, description="more flags for vLLM's server (e.g. --dtype bfloat16, "
        "--tensor-parallel-size 2, --gpu-memory-utilization 0.9); not those the operator sets: --model, "
        "--served-model-name, --host, --port, --block-size, --kv-events-config",
        json_schema_extra={"x-kubernetes-validations": [{
            "rule": f"self.all(a, !a.matches('{_VLLM_FLAG_PATTERN}'))",
            "message": "a flag the operator sets from the spec (model.path, vllm.port, vllm.blockSize)"}]})
    port: int = Field(8000, ge=1, le=65535, description="vLLM's HTTP port (the OpenAI API, /health, /metrics)")
    events_port: int = Field(5557, ge=1, le=65535, description="vLLM's KV-event publisher (ZMQ PUB, every "
                             "interface: vLLM binds a wildcard endpoint)")
    replay_port: int = Field(5558, ge=1, le=65535, description="vLLM's KV-event replay socket (loopback: the "
                             "pod's attach sidecar alone reads it)")
    block_size: int = Field(16, ge=16, le=256, multiple_of=16, description="tokens per KV block: a multiple of "
                            "16 (vLLM's CPU build needs a multiple of 32)")

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{
        "rule": "self.port != self.eventsPort && self.port != self.replayPort && self.eventsPort != self.replayPort",
        "message": "port, eventsPort and replayPort must differ"}]})

    @field_validator("args")
    @classmethod
    def _args_leave_the_operators_flags(cls, args: list[str]) -> list[str]:
        for arg in args:
            if re.match(_VLLM_FLAG_PATTERN, arg):
                raise ValueError(f"{arg}: the operator sets it from the spec (model.path, vllm.port, "
                                 "vllm.blockSize)")
        return args

    @model_validator(mode="after")
    def _ports_differ(self) -> VllmSpec:
        if len({self.port, self.events_port, self.replay_port}) < 3:
            raise ValueError("port, eventsPort and replayPort must differ")
        return self


# the CRD's own check of a workers pool's engine (its `oneOf`, in values.schema.json too): engine dynserve and no
# vllm block, or engine vllm with one
_ENGINE_AND_BLOCK = [{"properties": {"engine": {"enum": ["dynserve"]}}, "not": {"required": ["vllm"]}},
                     {"required": ["engine", "vllm"], "properties": {"engine": {"enum": ["vllm"]}}}]


class WorkersPoolSpec(PoolSpec):
    """The aggregated pool: dynserve's engine workers, or vLLM's OpenAI servers (`engine: vllm`)."""

    engine: Literal["dynserve", "vllm"] = Field(  # type: ignore[assignment]
        "dynserve", description="what each pod runs: dynserve's engine (a Ray node the head's pool places a "
        "worker on), or vllm: vLLM's OpenAI server (`vllm`) beside a `dynctl attach` sidecar that puts it on "
        "the fleet's registry and relays its KV events")
    vllm: VllmSpec | None = Field(None, description="engine vllm: its image, flags, ports and block size")

    model_config = ConfigDict(json_schema_extra={"oneOf": _ENGINE_AND_BLOCK, "x-kubernetes-validations": [{
        "rule": "(has(self.engine) && self.engine == 'vllm') == has(self.vllm)",
        "message": "engine vllm needs a vllm block (its image), and a vllm block needs engine vllm"}]})

    @model_validator(mode="after")
    def _vllm_block_with_its_engine(self) -> WorkersPoolSpec:
        if self.engine == "vllm" and self.vllm is None:
            raise ValueError("engine vllm needs vllm.image: the vLLM image its pods run")
        if self.engine != "vllm" and self.vllm is not None:
            raise ValueError("a vllm block needs engine: vllm (this pool runs dynserve's engine)")
        return self


class Pools(_Model):
    workers: WorkersPoolSpec | None = Field(None, description="aggregated serving: workers that prefill and "
                                            "decode (dynserve's engine or vLLM)")
    prefill: PoolSpec | None = Field(None, description="disaggregated serving: prefill workers")
    decode: PoolSpec | None = Field(None, description="disaggregated serving: decode workers")

    @model_validator(mode="after")
    def _layout(self) -> Pools:
        aggregated, disaggregated = self.workers is not None, (self.prefill, self.decode) != (None, None)
        if aggregated == disaggregated or (disaggregated and (self.prefill is None or self.decode is None)):
            raise ValueError("give `workers` (aggregated) or both `prefill` and `decode` (disaggregated)")
        return self

    def items(self) -> list[tuple[str, PoolSpec]]:
        """(pool name, spec) of the pools given, in a fixed order."""
        return [(name, spec) for name in POOL_ROLES if (spec := getattr(self, name)) is not None]

    @property
    def vllm(self) -> VllmSpec | None:
        """The workers pool's `vllm` block when it runs vLLM (only that pool may)."""
        return self.workers.vllm if self.workers is not None and self.workers.engine == "vllm" else None


def served_id(source: ModelSource) -> str | None:
    """The id the gateway serves a model under (as `model.resolve.model_id_of` names it: a GGUF file's name up
    to its first dot, a directory's name), or None for the image's bundled model."""
    given = urlparse(source.uri).path if source.uri else source.path
    if given is None:
        return None
    base = posixpath.basename(given.rstrip("/")) or "model.gguf"
    return base.split(".")[0] if base.endswith(".gguf") or source.uri else base


_ALIAS_PATTERN = r"^[^\s=]+$"


class ModelEntry(_Model):
    """One model of a deployment serving several (`spec.models`): its weights, its pools, the other names
    clients may ask for it by."""

    name: str = Field(min_length=1, max_length=20, pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$", description="the "
                      "model's key: its DynServePools and worker Deployments are NAME-MODEL-POOL (the first "
                      "model's keep NAME-POOL)")
    model: ModelSource = Field(default_factory=ModelSource, description="its weights, as spec.model: the first "
                               "model's volume is mounted at /models, another's at /models/MODEL (its uri is "
                               "fetched there)")
    pools: Pools = Field(default_factory=lambda: Pools(workers=WorkersPoolSpec()), description="its workers, "
                         "as spec.pools (every model with the same layout)")
    served_model_names: list[Annotated[str, Field(min_length=1, max_length=128, pattern=_ALIAS_PATTERN)]] = Field(
        default_factory=list, max_length=8, description="other names clients may ask for it by (the gateway's "
        "--served-model-name)", json_schema_extra={"x-kubernetes-list-type": "set"})


class EngineSpec(_Model):
    kv_cache_gib: float | None = Field(None, gt=0, description="each worker's KV cache")
    max_num_seqs: int | None = Field(None, ge=1)
    max_model_len: int | None = Field(None, ge=16)
    mocker: str | None = Field(None, description="serve simulated workers with this timing profile (no model "
                               "is loaded): for trying a fleet's behaviour without its hardware")
    mocker_speedup: float | None = Field(None, gt=0)


class RouterSpec(_Model):
    mode: Literal["kv", "approximate", "round_robin", "random", "least_loaded"] = "kv"
    overlap_weight: float | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0)


class TransferSpec(_Model):
    backend: Literal["auto", "nixl", "tcp"] = "auto"
    timeout_seconds: float | None = Field(None, gt=0)


class EventPlaneSpec(_Model):
    backend: Literal["embedded", "redis"] = Field("embedded", description="embedded: in the Ray cluster "
                                                  "(nothing else to run); redis: a Redis")
    redis_url: str | None = Field(None, description="redis: this Redis; default: one the operator runs")
    redis_image: str = Field("redis:7.4-alpine", description="the bundled Redis's image")

    @model_validator(mode="after")
    def _url_only_for_redis(self) -> EventPlaneSpec:
        if self.redis_url and self.backend != "redis":
            raise ValueError("redisUrl needs backend: redis")
        return self


class PlannerSpec(_Model):
    enabled: bool = False
    mode: Literal["sla", "load"] = "sla"
    ttft_ms: float | None = Field(None, gt=0)
    itl_ms: float | None = Field(None, gt=0)
    interval_seconds: float | None = Field(None, gt=0)
    max_total_workers: int | None = Field(None, ge=1)
    idle_seconds: float | None = Field(None, gt=0, description="scale every pool to zero after this long idle")
    rise_spare_workers: int | None = Field(None, ge=0, description="the sla mode: workers a prefilling pool "
                                           "keeps over its need while its rate rises; 0: none")
    profile: str | None = Field(None, description="the capacity profile's shipped name")
    prometheus_url: str | None = Field(None, description="the Prometheus the planner reads; default: one the "
                                       "head pod runs, scraping the fleet")


class ObservabilitySpec(_Model):
    service_monitor: bool = Field(False, description="a ServiceMonitor (Prometheus Operator) for the gateway "
                                  "and the workers")
    scrape_interval_seconds: int = Field(15, ge=1)


class NetworkPolicySpec(_Model):
    """The deployment's NetworkPolicy (ingress; egress is left open): every port between the deployment's
    own pods (Ray's, the worker channel, KV transfer, the event plane), the gateway's port from
    `gatewayFrom`, the gateway's and the workers' metrics ports from `metricsFrom`; nothing else."""

    enabled: bool = Field(True, description="false: no NetworkPolicy (a cluster whose own policies cover the "
                          "namespace)")
    gateway_from: list[dict[str, Any]] | None = Field(
        None, description="NetworkPolicy peers (podSelector, namespaceSelector, ipBlock) that may reach the "
        "gateway's port; default: the namespace's pods, or anyone with serviceType NodePort or LoadBalancer")
    metrics_from: list[dict[str, Any]] | None = Field(
        None, description="NetworkPolicy peers that may scrape the metrics ports; default: Prometheus pods "
        "(label app.kubernetes.io/name: prometheus) of any namespace")


class SecuritySpec(_Model):
    """How the pods are locked down: a non-root user, no privilege escalation, no capabilities, the runtime's
    seccomp profile, a read-only root filesystem with emptyDirs where they write, and a NetworkPolicy."""

    run_as_user: int = Field(RUN_AS_UID, ge=1, description="the pods' user ID (never 0: runAsNonRoot); the "
                             "image's user is 10001")
    run_as_group: int = Field(RUN_AS_UID, ge=0, description="the pods' group ID, also the volumes' group "
                              "(fsGroup)")
    # absolute, no `.` or `..` segment; the CRD refuses a repeat (a set) and the paths already writable (CEL)
    writable_paths: list[Annotated[str, Field(pattern=r"^(/[A-Za-z0-9_-][A-Za-z0-9._-]*)+$", max_length=255)]] = Field(
        default_factory=list, max_length=16, description="more directories the pods may write, each an emptyDir "
        "(the root filesystem is read-only; /tmp, /dev/shm, /var/cache/dynserve and /models are already writable)",
        json_schema_extra={"x-kubernetes-list-type": "set", "x-kubernetes-validations": [{
            "rule": "self.all(p, !(p in ['/tmp', '/dev/shm', '/var/cache/dynserve', '/models']) && "
                    "!p.matches('^/(proc|sys|dev)(/|$)'))",
            "message": "a path already writable, or under /proc, /sys or /dev"}]})
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)

    @field_validator("writable_paths")
    @classmethod
    def _paths_are_new_directories(cls, paths: list[str]) -> list[str]:
        for path in paths:
            if path in OPERATOR_WRITABLE_PATHS or path.split("/")[1] in ("proc", "sys", "dev"):
                raise ValueError(f"{path}: already writable, or under /proc, /sys or /dev")
        if len(set(paths)) != len(paths):
            raise ValueError("a path given twice")
        return paths


class EnvVar(_Model):
    name: str = Field(pattern=r"^DYN_[A-Z0-9_]+$")
    value: str


def check_models(models: list[ModelEntry]) -> None:
    """ValueError naming what makes `models` one fleet `dynctl serve` cannot run (see the module's invariants)."""
    names = [entry.name for entry in models]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"the model name {twice[0]!r} is given twice: each model's pools are named after it")
    layouts = {entry.name: entry.pools.workers is None for entry in models}
    if len(set(layouts.values())) > 1:
        raise ValueError("every model serves aggregated (workers) or every one disaggregated (prefill and "
                         "decode): dynctl serve on the head runs one layout for all (" + ", ".join(
                             f"{n}: {'disaggregated' if d else 'aggregated'}" for n, d in layouts.items()) + ")")
    dtypes = {entry.name: entry.model.dtype for entry in models}
    if len(set(dtypes.values())) > 1:
        raise ValueError("every model runs one dtype (the head's dynctl serve gives its workers one): " + ", ".join(
            f"{n}: {d}" for n, d in dtypes.items()))
    for entry in models:
        if entry.pools.vllm is not None:
            raise ValueError(f"{entry.name}: a vLLM pool serves in the single-model form (spec.model and "
                             "spec.pools)")
    for entry in models if len(models) > 1 else []:
        if served_id(entry.model) is None:
            raise ValueError(f"{entry.name}: name its weights (model.path or model.uri): the image's bundled model "
                             "serves a deployment of one model")
    taken: dict[str, str] = {}
    for entry in models:
        model_id = served_id(entry.model)
        for served_name in ([model_id] if model_id else []) + entry.served_model_names:
            if taken.setdefault(served_name, entry.name) != entry.name:
                raise ValueError(f"the name {served_name!r} stands for two models ({taken[served_name]} and "
                                 f"{entry.name}): a client asking for it would get either")


# the same rules for the API server (CEL; the names' uniqueness is the list's map key); a pool given without
# `workers` is a disaggregated one
_DISAGGREGATED = "has({0}.pools) && !has({0}.pools.workers)"
_DTYPE = "(has({0}.model) && has({0}.model.dtype) ? {0}.model.dtype : 'float32')"
_MODELS_RULES = [
    {"rule": "!has(self.models) || self.models.all(m, (" + _DISAGGREGATED.format("m") + ") == ("
             + _DISAGGREGATED.format("self.models[0]") + "))",
     "message": "every model serves aggregated (workers) or every one disaggregated (prefill and decode)"},
    {"rule": "!has(self.models) || self.models.all(m, " + _DTYPE.format("m") + " == " + _DTYPE.format(
        "self.models[0]") + ")", "message": "every model runs one dtype"},
    {"rule": "!has(self.models) || self.models.all(m, !has(m.pools) || !has(m.pools.workers) || "
             "!has(m.pools.workers.engine) || m.pools.workers.engine != 'vllm')",
     "message": "a vLLM pool serves in the single-model form (spec.model and spec.pools)"},
    {"rule": "!has(self.models) || size(self.models) == 1 || self.models.all(m, has(m.model) && "
             "(has(m.model.path) || has(m.model.uri)))",
     "message": "with several models, each names its weights (model.path or model.uri)"},
    {"rule": "!has(self.models) || size(self.models) == 1 || !has(self.planner) || !has(self.planner.enabled) || "
             "!self.planner.enabled",
     "message": "on Kubernetes the planner scales the DynServePools of one model: serve several models without it"},
    {"rule": "!has(self.models) || !has(self.model) && !has(self.pools)",
     "message": "give models (several models) or model and pools (one model), not both"},
]

_HAS_VLLM_POOL = ("has(self.pools) && has(self.pools.workers) && has(self.pools.workers.engine) && "
                  "self.pools.workers.engine == 'vllm'")


class DeploymentSpec(_Model):
    model: ModelSource = Field(default_factory=ModelSource)
    models: list[ModelEntry] | None = Field(
        None, min_length=1, max_length=8, description="several models behind the one gateway, each with its own "
        "pools (instead of model and pools; the first is the default model)",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
    image: ImageSpec = Field(default_factory=ImageSpec)
    gateway: GatewaySpec = Field(default_factory=GatewaySpec)
    pools: Pools = Field(default_factory=lambda: Pools(workers=WorkersPoolSpec()))
    engine: EngineSpec = Field(default_factory=EngineSpec)
    router: RouterSpec = Field(default_factory=RouterSpec)
    transfer: TransferSpec = Field(default_factory=TransferSpec)
    event_plane: EventPlaneSpec = Field(default_factory=EventPlaneSpec)
    planner: PlannerSpec = Field(default_factory=PlannerSpec)
    observability: ObservabilitySpec = Field(default_factory=ObservabilitySpec)
    cluster_token_secret: TokenRef | None = Field(
        None, description="the Secret key holding the fleet's cluster token: every internal socket (worker "
        "channel, event plane, TCP KV transfer) then serves only the deployment's own pods (strongly advised)")
    env: list[EnvVar] = Field(default_factory=list, description="more dynserve settings for every pod, as "
                              "DYN_* variables")
    security: SecuritySpec = Field(default_factory=SecuritySpec)

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        *_MODELS_RULES,
        {"rule": f"!({_HAS_VLLM_POOL}) || has(self.model) && has(self.model.path)",
         "message": "a vLLM pool needs model.path: a Hugging Face directory vLLM loads and the gateways tokenize with"},
        {"rule": f"!({_HAS_VLLM_POOL}) || !has(self.planner) || !has(self.planner.enabled) || !self.planner.enabled",
         "message": "the planner runs in dynctl serve, which does not serve a pool of vLLM pods: scale its "
                    "DynServePool (kubectl scale, an HPA)"},
        {"rule": f"!({_HAS_VLLM_POOL}) || !has(self.engine) || !has(self.engine.mocker)",
         "message": "engine.mocker simulates dynserve's engine, not vLLM"}]})

    @model_validator(mode="before")
    @classmethod
    def _one_form(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("models") is not None:
            both = [key for key in ("model", "pools") if data.get(key) is not None]
            if both:
                raise ValueError(f"give models (several models, each with its model and pools) or model and pools "
                                 f"(one model), not both: {' and '.join(both)} beside models")
        return data

    @field_validator("models")
    @classmethod
    def _models_one_fleet(cls, models: list[ModelEntry] | None) -> list[ModelEntry] | None:
        if models is not None:
            check_models(models)
        return models

    @model_validator(mode="after")
    def _first_model_is_the_default(self) -> DeploymentSpec:
        if self.models is None:
            return self
        first = self.models[0]
        return self.model_copy(update={"model": first.model, "pools": first.pools})

    @field_validator("pools")
    @classmethod
    def _vllm_pool_has_its_model(cls, pools: Pools, info: ValidationInfo) -> Pools:
        model = info.data.get("model")
        if pools.vllm is not None and model is not None and not model.path:
            raise ValueError("a vLLM pool needs model.path: a Hugging Face directory vLLM loads and the gateways "
                             "tokenize with (on model.volume, mounted at /models in every pod); model.uri and the "
                             "bundled model are dynserve's engine's")
        return pools

    @field_validator("engine")
    @classmethod
    def _no_mocker_for_vllm(cls, engine: EngineSpec, info: ValidationInfo) -> EngineSpec:
        pools = info.data.get("pools")
        if pools is not None and pools.vllm is not None and engine.mocker is not None:
            raise ValueError("engine.mocker simulates dynserve's engine, not vLLM")
        return engine

    @field_validator("planner")
    @classmethod
    def _no_planner_for_vllm(cls, planner: PlannerSpec, info: ValidationInfo) -> PlannerSpec:
        if planner.enabled and len(info.data.get("models") or []) > 1:
            raise ValueError("on Kubernetes the planner scales the DynServePools of one model (dynctl serve "
                             "refuses --planner-kubernetes with several): serve several models without it and scale "
                             "each model's DynServePools (kubectl scale, an HPA)")
        pools = info.data.get("pools")
        if pools is not None and pools.vllm is not None and planner.enabled:
            raise ValueError("the planner runs in dynctl serve, which does not serve a pool of vLLM pods yet: "
                             "scale its DynServePool (kubectl scale, an HPA) instead")
        return planner

    @field_validator("env")
    @classmethod
    def _env_names_settings(cls, env: list[EnvVar]) -> list[EnvVar]:
        for var in env:
            if var.name.removeprefix("DYN_").lower() not in Settings.model_fields:
                raise ValueError(f"{var.name} is not a dynserve setting")
            if var.name in OPERATOR_ENV:
                raise ValueError(f"{var.name} is set by the operator from the spec")
        return env

    def served_models(self) -> list[ModelEntry]:
        """Each model the deployment serves, the default (first) one first: `models`, or the single-model form
        as its one entry."""
        return list(self.models) if self.models is not None else [ModelEntry(name="default", model=self.model,
                                                                              pools=self.pools)]

    @property
    def disaggregated(self) -> bool:
        return self.pools.workers is None


class PoolResourceSpec(_Model):
    """A `DynServePool`: one pool of a `DynServeDeployment`, the unit its `/scale` subresource scales."""

    deployment: str = Field(min_length=1, description="the DynServeDeployment it belongs to")
    model: str | None = Field(None, description="the name of the deployment's model (spec.models) it serves, "
                              "unless that is the first (the default) one")
    pool: Literal["workers", "prefill", "decode"]
    replicas: int = Field(ge=0)
    min_replicas: int = Field(0, ge=0)
    max_replicas: int = Field(8, ge=1)


def _problems(exc: pydantic.ValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"] if not str(p).startswith("function-after"))
        message = error["msg"].removeprefix("Value error, ")
        parts.append(f"spec.{where}: {message}" if where else f"spec: {message}")
    return "; ".join(parts)


def parse_deployment(spec: dict[str, Any] | None) -> DeploymentSpec:
    """A `DynServeDeployment`'s `.spec` as a `DeploymentSpec`; InvalidRequestError names each bad field."""
    try:
        return DeploymentSpec.model_validate(spec or {})
    except pydantic.ValidationError as exc:
        raise InvalidRequestError(_problems(exc), param="spec") from None


def parse_pool(spec: dict[str, Any] | None) -> PoolResourceSpec:
    """A `DynServePool`'s `.spec`; InvalidRequestError names each bad field."""
    try:
        return PoolResourceSpec.model_validate(spec or {})
    except pydantic.ValidationError as exc:
        raise InvalidRequestError(_problems(exc), param="spec") from None
