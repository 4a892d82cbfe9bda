"""What each pod of a deployment runs: its container command (`pod_command`: a Ray node, then the pod's one
long-running process) and the variables it sets beside its ConfigMap (`pod_env`). These are the contract
`tests/test_operator_pods.py` runs, unchanged, as processes on hosts made of network namespaces.

A vLLM pool's pods run two containers: vLLM's OpenAI server (`vllm_command`, `vllm_args`: the flags
`dynctl serve --engine vllm` gives it, `workers/vllm_worker.py:vllm_argv`, on the spec's ports) and a sidecar
(`attach_command`) that waits for it to answer, then runs `dynctl attach` on it: the server on the fleet's
registry under the pod's name, its KV events read on the pod's loopback and relayed to the event plane.
"""

from __future__ import annotations

import json
import posixpath
import shlex
from typing import Any
from urllib.parse import urlparse

from dynserve.config import ray_system_config_flag
from dynserve.operator.hardening import OBJECT_STORE_BYTES, cache_env
from dynserve.operator.spec import DeploymentSpec, ModelEntry, ModelSource, VllmSpec, served_id

__all__ = [
    "MODELS_DIR", "PRE_STOP", "RAY_PORT", "VLLM_COMMAND", "attach_command", "gateway_model_flags", "model_dir",
    "model_path", "pod_command", "pod_env", "pool_resource", "source_path", "vllm_args",
]

RAY_PORT = 6379
MODELS_DIR = "/models"
PRE_STOP = ["/bin/sh", "-c", "ray stop --grace-period 20"]
# vLLM's OpenAI server as a module: the same in every vLLM image, whatever its entrypoint (`vllm serve` in newer ones)
VLLM_COMMAND = ["python3", "-m", "vllm.entrypoints.openai.api_server"]


def pool_resource(role: str, model_index: int = 0) -> str:
    """The Ray resource a pool's worker pods offer and its workers require: `dynserve_pool_ROLE` for the first
    (default) model's pools, `dynserve_pool_mI_ROLE` for the I-th model's (counting from 0), so each model's
    pools follow only the pods made for them (the head's `dynctl serve` names model I's pools `mI-...`)."""
    return f"dynserve_pool_{role}" if model_index == 0 else f"dynserve_pool_m{model_index}_{role}"


def model_dir(entry: ModelEntry, model_index: int) -> str:
    """Where model `model_index`'s volume is mounted and its `uri` fetched to: /models for the first model,
    /models/NAME for the others."""
    return MODELS_DIR if model_index == 0 else posixpath.join(MODELS_DIR, entry.name)


def source_path(source: ModelSource, directory: str = MODELS_DIR) -> str | None:
    """Where pods find a model: its path, the file its `uri` is fetched to in `directory`, or None (the bundled
    one)."""
    if source.uri:
        return posixpath.join(directory, posixpath.basename(urlparse(source.uri).path) or "model.gguf")
    return source.path


def model_path(spec: DeploymentSpec) -> str | None:
    """Where pods find the (first, default) model: the spec's path, the file a `uri` is fetched to, or None."""
    return source_path(spec.model)


def gateway_model_flags(spec: DeploymentSpec) -> list[str]:
    """What a gateway (the head's `dynctl serve`, a gateway-only pod's `dynctl gateway`) is told of the models
    beyond the ConfigMap's `DYN_MODEL`: with several, `--model PATH` for each, the default first (`dynctl serve`
    starts each one's pools, `dynctl gateway` tokenizes with the first and finds the others on the registry);
    each model's `servedModelNames` as `--served-model-name` (`NAME` for the default model, `NAME=MODEL_ID` for
    the others). None for the single-model form."""
    entries = spec.served_models()
    flags: list[str] = []
    if len(entries) > 1:
        for index, entry in enumerate(entries):
            flags += ["--model", str(source_path(entry.model, model_dir(entry, index)))]
    for index, entry in enumerate(entries):
        model_id = served_id(entry.model)
        flags += [arg for alias in entry.served_model_names
                  for arg in ("--served-model-name", alias if index == 0 else f"{alias}={model_id}")]
    return flags


_RAY = f"ray start --node-ip-address=\"$POD_IP\" --object-store-memory={OBJECT_STORE_BYTES} --disable-usage-stats"


def pod_command(kind: str, *, head_host: str = "", role: str = "", ray_cpus: float = 1.0,
                serve: bool = True, model_index: int = 0, gateway_flags: list[str] | None = None) -> list[str]:
    """The container command of a head (`kind="head"`), a gateway-only (`"gateway"`) or a pool's worker pod
    (`"worker"`): a shell that starts the pod's Ray node and then the pod's one long-running process. `$POD_IP`
    comes from the pod's environment (the downward API). `serve=False`: the head runs `dynctl gateway` instead
    of `dynctl serve` (a vLLM pool: no pool of dynserve's workers to start, the attached servers to follow).
    `gateway_flags` (`gateway_model_flags`) follow a gateway's command; a worker of model `model_index` offers
    that model's pool resource."""
    ray = _RAY
    more = "".join(f" {shlex.quote(flag)}" for flag in gateway_flags or [])
    if kind == "head":
        command = "serve" if serve else "gateway"
        # the cluster's system config comes from its head: its workers start at niceness 0
        # (`config.ray_system_config`)
        script = (f"{ray} --head --port={RAY_PORT} --num-cpus=0 --include-dashboard=false "
                  f"{shlex.quote(ray_system_config_flag())} && "
                  f"exec dynctl {command} --ray-address=\"$POD_IP:{RAY_PORT}\"{more}")
    elif kind == "gateway":  # a Ray driver needs a node of its own: one with no CPUs, where nothing is placed
        script = (f"{ray} --address={head_host}:{RAY_PORT} --num-cpus=0 && "
                  f"exec dynctl gateway --ray-address={head_host}:{RAY_PORT}{more}")
    else:
        resources = json.dumps({pool_resource(role, model_index): 1}, separators=(",", ":"))
        script = (f"exec {ray} --address={head_host}:{RAY_PORT} --num-cpus={ray_cpus:g} "
                  f"--resources='{resources}' --block")
    return ["/bin/sh", "-c", script]


def vllm_args(spec: DeploymentSpec, vllm: VllmSpec) -> list[str]:
    """vLLM's server flags: the model (`model.path`, served under its directory's name, as the gateways name
    it), every interface at `vllm.port`, prefix caching and the KV-event publisher on (the wildcard endpoint
    vLLM binds; the replay socket on loopback), the spec's context and batch limits, then `vllm.args`."""
    path = model_path(spec)
    assert path is not None, "parse_deployment requires model.path with a vLLM pool"
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{vllm.events_port}",
              "replay_endpoint": f"tcp://127.0.0.1:{vllm.replay_port}"}
    args = ["--model", path, "--served-model-name", posixpath.basename(path.rstrip("/")), "--host", "0.0.0.0",
            "--port", str(vllm.port), "--block-size", str(vllm.block_size), "--enable-prefix-caching",
            "--kv-events-config", json.dumps(events, separators=(",", ":"))]
    if spec.engine.max_model_len is not None:
        args += ["--max-model-len", str(spec.engine.max_model_len)]
    if spec.engine.max_num_seqs is not None:
        args += ["--max-num-seqs", str(spec.engine.max_num_seqs)]
    return args + list(vllm.args)


def attach_command(spec: DeploymentSpec, vllm: VllmSpec, *, head_host: str) -> list[str]:
    """The vLLM pod's sidecar: wait until the pod's vLLM answers `/health`, then `dynctl attach` it under the
    pod's name (`$POD_NAME`), reached by the gateways at the pod's IP, its events and replay socket on loopback.
    The fleet's registry is its Redis (`DYN_REDIS_URL` from the ConfigMap) or its Ray cluster, which a Ray
    driver joins through a node of its own: one without CPUs, where nothing is placed (as a gateway-only pod's)."""
    health = f"http://127.0.0.1:{vllm.port}/health"
    wait = (f"until python -c 'import urllib.request; urllib.request.urlopen(\"{health}\", timeout=2)' "
            "2>/dev/null; do sleep 2; done")
    worker_url = (f"vllm=http://$POD_IP:{vllm.port};events=tcp://127.0.0.1:{vllm.events_port};"
                  f"replay=tcp://127.0.0.1:{vllm.replay_port};id=$POD_NAME")
    attach = f"exec dynctl attach --worker-url \"{worker_url}\" --block-size {vllm.block_size}"
    if spec.event_plane.backend == "redis":
        script = f"{wait} && {attach}"
    else:
        address = f"{head_host}:{RAY_PORT}"
        script = f"{wait} && {_RAY} --address={address} --num-cpus=0 && {attach} --ray-address={address}"
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
