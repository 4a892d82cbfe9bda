"""A vLLM pool's pod (`pools.workers.engine: vllm`), as a pure function of the spec: vLLM's OpenAI server from
`vllm.image` beside a `dynctl attach` sidecar from dynserve's image, both locked down as `hardening.py` says.

What each such pod keeps:
- container `vllm`: `python3 -m vllm.entrypoints.openai.api_server` with `commands.vllm_args` (the model at
  `model.path`, on `model.volume` at /models), serving on `vllm.port` (named `vllm`: the gateways' route, its
  `/metrics`), the pool's resources (its GPUs: `nvidia.com/gpu` limits), probes on `/health` (the startup one
  allows 30 minutes: weights loaded, kernels compiled), its home and caches in the cache volume
  (`hardening.vllm_env`);
- container `attach`: `commands.attach_command` with the ConfigMap and what every dynserve pod gets
  (`commands.pod_env`: its IP, the cluster token), and its own name for the worker id; ready while the server
  it relays answers. It serves nothing of its own, so it has no liveness probe: when `dynctl attach` fails it
  exits, and the kubelet restarts it;
- no Ray node offering a pool's resource: the head's pools place none of dynserve's workers here (the sidecar
  joins a Ray event plane through a node without CPUs, as a gateway-only pod does);
- one /dev/shm for both: Ray's object store and vLLM's shared-memory queues.
"""

from __future__ import annotations

import copy
from typing import Any

from dynserve.operator.commands import MODELS_DIR, VLLM_COMMAND, attach_command, pod_env, vllm_args
from dynserve.operator.hardening import (
    CONTAINER_SECURITY, DEFAULT_CPU, SHM_BYTES, VLLM_SHM_BYTES, container_resources, default_memory_bytes,
    pod_security, vllm_env, writable_volumes,
)
from dynserve.operator.spec import DeploymentSpec, Resources, VllmSpec

__all__ = ["VLLM_PORT_NAME", "vllm_image", "vllm_pod_spec"]

VLLM_PORT_NAME = "vllm"
# vLLM stops taking requests at SIGTERM: the sidecar, stopped at the same moment, takes it off the registry
# first, and the gateways stop routing to it before it goes
_DRAIN = ["/bin/sh", "-c", "sleep 5"]


def vllm_image(vllm: VllmSpec) -> str:
    return f"{vllm.image}@{vllm.digest}" if vllm.digest else vllm.image


def _probe(port: int | str, period_s: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": "/health", "port": port}, "periodSeconds": period_s, "failureThreshold": failures}


def vllm_pod_spec(name: str, spec: DeploymentSpec, resources: Resources, *, image: str) -> dict[str, Any]:
    """The pod of a vLLM pool of deployment `name` (`image`: dynserve's, for the sidecar; `resources`: the
    pool's, for vLLM's container); placement (node selector, tolerations, pull secrets) is the caller's."""
    vllm = spec.pools.vllm
    assert vllm is not None, "a vLLM pod of a deployment without a vLLM pool"
    volumes, mounts = writable_volumes(spec, shm_bytes=SHM_BYTES + VLLM_SHM_BYTES)
    model_mounts = []
    if spec.model.volume is not None:
        volumes.append({"name": "models", **spec.model.volume})
        model_mounts.append({"name": "models", "mountPath": MODELS_DIR})
    server = {
        "name": "vllm", "image": vllm_image(vllm), "imagePullPolicy": spec.image.pull_policy,
        "command": VLLM_COMMAND, "args": vllm_args(spec, vllm),
        "ports": [{"name": VLLM_PORT_NAME, "containerPort": vllm.port}],
        "env": vllm_env(), "securityContext": copy.deepcopy(CONTAINER_SECURITY),
        "resources": container_resources(resources, cpu=DEFAULT_CPU["vllm"],
                                         memory_bytes=default_memory_bytes(spec, "vllm")),
        "startupProbe": _probe(VLLM_PORT_NAME, 10, 180), "readinessProbe": _probe(VLLM_PORT_NAME, 5, 3),
        "livenessProbe": _probe(VLLM_PORT_NAME, 10, 6),
        "lifecycle": {"preStop": {"exec": {"command": _DRAIN}}},
        "volumeMounts": mounts + model_mounts,
    }
    sidecar = {
        "name": "attach", "image": image, "imagePullPolicy": spec.image.pull_policy,
        "command": attach_command(spec, vllm, head_host=f"{name}-head"),
        "envFrom": [{"configMapRef": {"name": f"{name}-config"}}],
        "env": [*pod_env(spec), {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "securityContext": copy.deepcopy(CONTAINER_SECURITY),
        "resources": container_resources(Resources(), cpu=DEFAULT_CPU["attach"],
                                         memory_bytes=default_memory_bytes(spec, "attach")),
        # ready while the server it relays answers (by number: a probe's port name is its own container's)
        "readinessProbe": _probe(vllm.port, 10, 3),
        "volumeMounts": [dict(m) for m in mounts],
    }
    return {"securityContext": pod_security(spec), "automountServiceAccountToken": False,
            "containers": [server, sidecar], "volumes": volumes, "terminationGracePeriodSeconds": 60}
