"""The operator without a cluster: its CRDs, the pure builders of every child, and its handlers and reconcile
steps called directly against the stand-in API server (`tests/kube_standin.py`, which records every request;
no real API server runs here), through the same `KubeClient` the operator runs with. Also the planner's
Kubernetes actuator against the same stand-in."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kopf
import pytest

from dynserve.config import Settings
from dynserve.errors import InvalidRequestError, KubernetesError
from dynserve.operator import handlers, metrics
from dynserve.operator.builders import build_children, labels, pod_command
from dynserve.operator.commands import vllm_args
from dynserve.operator.crd import CRD_DIR, crd_files, deployment_crd, pool_crd
from dynserve.operator.kube import KubeClient
from dynserve.operator.reconcile import deployment_status, reconcile_deployment, reconcile_pool
from dynserve.operator.spec import API_VERSION, KIND, OPERATOR_WRITABLE_PATHS, POOL_KIND, parse_deployment
from dynserve.planner.kubernetes import ANNOTATION, KubernetesActuator, planner_pools
from dynserve.workers.pool import node_resource
from dynserve.workers.vllm_worker import vllm_argv
from tests._kube import structural_problems, validate, validate_all
from tests.kube_standin import KubeStandin, write_kubeconfig

NS = "serving"
DISAGG = {
    "model": {"uri": "https://models.example.com/smol/smollm2.gguf", "dtype": "bfloat16"},
    "pools": {"prefill": {"replicas": 1, "maxReplicas": 2, "resources": {"requests": {"cpu": "4", "memory": "8Gi"}}},
              "decode": {"replicas": 2, "minReplicas": 1, "maxReplicas": 6,
                         "resources": {"limits": {"nvidia.com/gpu": 1}},
                         "nodeSelector": {"gpu": "h100"},
                         "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}},
    "gateway": {"serviceType": "LoadBalancer", "apiKeySecret": {"name": "dynserve-key"}},
    "clusterTokenSecret": {"name": "smol-cluster"},
    "router": {"mode": "kv", "overlapWeight": 4},
    "eventPlane": {"backend": "redis"},
    "planner": {"enabled": True, "ttftMs": 400, "itlMs": 40, "riseSpareWorkers": 0},
    "observability": {"serviceMonitor": True},
    "env": [{"name": "DYN_KV_BLOCKS", "value": "4096"}],
}
VLLM = {
    "model": {"path": "/models/Qwen3-0.6B", "volume": {"persistentVolumeClaim": {"claimName": "models"}}},
    "pools": {"workers": {"replicas": 2, "engine": "vllm",
                          "vllm": {"image": "vllm/vllm-openai:v0.10.2", "args": ["--dtype", "bfloat16"], "blockSize": 32},
                          "resources": {"limits": {"nvidia.com/gpu": 1}}}},
    "engine": {"maxModelLen": 4096},
    "clusterTokenSecret": {"name": "smol-cluster"},
    "observability": {"serviceMonitor": True},
}
SPECS = {"default": {}, "aggregated": {"pools": {"workers": {"replicas": 3}}, "engine": {"mocker": "cpu"},
                                       "gateway": {"replicas": 3}},
         "disaggregated": DISAGG, "vllm": VLLM,
         "external-redis": {"eventPlane": {"backend": "redis", "redisUrl": "redis://redis.infra:6379/2"},
                            "planner": {"enabled": True, "prometheusUrl": "http://prometheus.monitoring:9090"}}}


def resource(spec: dict[str, Any], name: str = "smol") -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": NS}, "spec": spec}


# ---- the CRDs ----------------------------------------------------------------------------------------------

def test_the_chart_ships_the_crds_the_code_defines() -> None:
    for name, text in crd_files().items():
        assert (CRD_DIR / name).read_text() == text, f"{name} drifted: python -m dynserve.operator.crd --write"


def test_the_crds_are_structural_and_valid_with_scale_and_status_subresources() -> None:
    for crd in (deployment_crd(), pool_crd()):
        validate(crd)
        version = crd["spec"]["versions"][0]
        assert structural_problems(version["schema"]["openAPIV3Schema"]) == []
        assert "status" in version["subresources"]
        assert version["additionalPrinterColumns"]
    scale = pool_crd()["spec"]["versions"][0]["subresources"]["scale"]
    assert scale == {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                     "labelSelectorPath": ".status.selector"}


@pytest.mark.parametrize("spec", list(SPECS.values()), ids=list(SPECS))
def test_example_resources_validate_against_the_crd(spec: dict[str, Any]) -> None:
    validate(resource(spec))
    parse_deployment(spec)


@pytest.mark.parametrize(("spec", "field"), [
    ({"pools": {"prefill": {"replicas": 1}}}, "pools"),
    ({"pools": {"workers": {"replicas": 1}, "decode": {"replicas": 1}}}, "pools"),
    ({"pools": {"workers": {"replicas": 9, "maxReplicas": 4}}}, "pools.workers"),
    ({"model": {"path": "/models/a.gguf", "uri": "https://x/a.gguf"}}, "model"),
    ({"env": [{"name": "DYN_NOT_A_SETTING", "value": "1"}]}, "env"),
    ({"env": [{"name": "DYN_REDIS_URL", "value": "redis://x"}]}, "env"),
    ({"eventPlane": {"redisUrl": "redis://x"}}, "eventPlane"),
    ({"gateway": {"replicas": 0}}, "gateway.replicas"),
    ({"security": {"runAsUser": 0}}, "security.runAsUser"),
    ({"security": {"writablePaths": ["data"]}}, "security.writablePaths"),
    ({"security": {"writablePaths": ["/data/../etc"]}}, "security.writablePaths"),
    ({"security": {"writablePaths": ["/tmp"]}}, "security.writablePaths"),
    ({"security": {"writablePaths": ["/data", "/data"]}}, "security.writablePaths"),
    ({"image": {"digest": "sha256:abc"}}, "image.digest"),
    # vLLM: aggregated only, with its image, the model it loads, flags the operator does not set
    ({"pools": {"prefill": {"engine": "vllm"}, "decode": {}}}, "pools.prefill.engine"),
    ({"pools": {"workers": {"engine": "vllm"}}, "model": {"path": "/models/q"}}, "pools.workers"),
    ({"pools": {"workers": {"vllm": {"image": "v:1"}}}}, "pools.workers"),
    ({**VLLM, "pools": {"workers": {"engine": "vllm", "vllm": {"image": "v:1", "args": ["--port=9000"]}}}},
     "pools.workers.vllm.args"),
    ({**VLLM, "pools": {"workers": {"engine": "vllm", "vllm": {"image": "v:1", "blockSize": 24}}}},
     "pools.workers.vllm.blockSize"),
    ({**VLLM, "pools": {"workers": {"engine": "vllm", "vllm": {"image": "v:1", "eventsPort": 8000}}}},
     "pools.workers.vllm"),
    ({**VLLM, "model": {"uri": "https://x/q.gguf"}}, "pools"),
    ({**VLLM, "planner": {"enabled": True}}, "planner"),
    ({**VLLM, "engine": {"mocker": "cpu"}}, "engine"),
])
def test_a_bad_spec_names_its_field(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError, match=rf"spec\.{field}"):
        parse_deployment(spec)


# ---- the builders ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", list(SPECS.values()), ids=list(SPECS))
def test_every_child_validates_offline_and_is_owned_and_labelled(spec: dict[str, Any]) -> None:
    children = build_children("smol", NS, parse_deployment(spec), uid="u-1")
    validate_all(children)
    assert len({(c["kind"], c["metadata"]["name"]) for c in children}) == len(children)
    for child in children:
        meta = child["metadata"]
        assert meta["namespace"] == NS
        assert meta["ownerReferences"] == [{"apiVersion": API_VERSION, "kind": KIND, "name": "smol", "uid": "u-1",
                                            "controller": True, "blockOwnerDeletion": True}]
        for key in ("name", "instance", "component", "part-of", "managed-by", "version"):
            assert f"app.kubernetes.io/{key}" in meta["labels"], (child["kind"], key)


@pytest.mark.parametrize("spec", list(SPECS.values()), ids=list(SPECS))
def test_the_config_map_sets_only_dynserve_settings_that_parse(spec: dict[str, Any]) -> None:
    config = build_children("smol", NS, parse_deployment(spec))[0]
    assert config["kind"] == "ConfigMap"
    for key in config["data"]:
        assert key.startswith("DYN_") and key[4:].lower() in Settings.model_fields, key
    Settings.model_validate({k[4:].lower(): v for k, v in config["data"].items()})  # every value parses


def _by(children: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(c for c in children if c["kind"] == kind and c["metadata"]["name"] == name)


@pytest.mark.parametrize("bad", [{"runAsUser": 0}, {"writablePaths": ["relative"]}, {"writablePaths": ["/a/.."]},
                                 {"networkPolicy": {"enabled": "no"}}])
def test_the_crds_schema_refuses_a_relaxation_that_is_not_one(bad: dict[str, Any]) -> None:
    """What the API server refuses before the operator sees it (a repeated path too: the list is a set)."""
    with pytest.raises(jsonschema.ValidationError):
        validate(resource({"security": bad}))


@pytest.mark.parametrize("pools", [
    {"prefill": {"engine": "vllm"}, "decode": {}},  # a disaggregated pool runs dynserve's engine only
    {"workers": {"engine": "vllm"}},  # without its vllm block
    {"workers": {"vllm": {"image": "v:1"}}},  # a vllm block, the engine left at dynserve
    {"workers": {"engine": "vllm", "vllm": {"args": ["--dtype", "half"]}}},  # no image
    {"workers": {"engine": "vllm", "vllm": {"image": "v:1", "blockSize": 24}}},
])
def test_the_crds_schema_refuses_a_vllm_pool_that_cannot_run(pools: dict[str, Any]) -> None:
    with pytest.raises(jsonschema.ValidationError):
        validate(resource({"model": {"path": "/models/q"}, "pools": pools}))


def test_the_crds_cel_rules_hold_what_its_schema_cannot() -> None:
    """Rules across fields (the API server runs them; parse_deployment refuses the same, tested above)."""
    spec = deployment_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = " ".join(r["rule"] for r in spec["x-kubernetes-validations"])
    assert "has(self.model.path)" in rules and "self.planner.enabled" in rules and "self.engine.mocker" in rules
    vllm = spec["properties"]["pools"]["properties"]["workers"]["properties"]["vllm"]
    flags = vllm["properties"]["args"]["x-kubernetes-validations"][0]["rule"]
    for flag in ("--port", "--model", "--block-size", "--kv-events-config"):
        assert re.search(flags.split("'")[1], flag), flag
    assert not re.search(flags.split("'")[1], "--max-model-len")


def test_the_paths_the_pods_write_are_the_ones_the_crd_keeps_from_writable_paths() -> None:
    spec = parse_deployment({"model": {"uri": "https://x/m.gguf"}})
    pod = _by(build_children("smol", NS, spec), "Deployment", "smol-workers")["spec"]["template"]["spec"]
    mounted = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounted == OPERATOR_WRITABLE_PATHS
    rule = deployment_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["security"]["properties"]["writablePaths"]["x-kubernetes-validations"][0]["rule"]
    assert set(re.findall(r"'(/[^']*)'", rule.split("]")[0])) == mounted


@pytest.mark.parametrize("spec", list(SPECS.values()), ids=list(SPECS))
def test_every_pod_runs_locked_down_with_resources_and_probes(spec: dict[str, Any]) -> None:
    parsed = parse_deployment(spec)
    for deployment in (c for c in build_children("smol", NS, parsed) if c["kind"] == "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        # a token only for the head, and only when its planner scales the pools through the API server
        head_with_planner = deployment["metadata"]["name"] == "smol-head" and parsed.planner.enabled
        assert pod["automountServiceAccountToken"] is head_with_planner
        writable = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        for container in pod["containers"] + pod.get("initContainers", []):
            assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                                    "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
            for quantity in ("cpu", "memory"):
                assert container["resources"]["limits"][quantity] == container["resources"]["requests"][quantity]
            assert {m["name"] for m in container["volumeMounts"]} <= writable | {"models"}
        for container in pod["containers"]:
            assert "readinessProbe" in container, deployment["metadata"]["name"]
            # a vLLM pod's sidecar serves nothing a liveness probe could ask (README: CKV_K8S_8)
            assert ("livenessProbe" in container) == (container["name"] != "attach"), deployment["metadata"]["name"]
        if pod["containers"][0]["name"] != "redis":
            shm = next(v for v in pod["volumes"] if v["name"] == "shm")
            # Ray's 256 MiB object store, and in a vLLM pod vLLM's 1 GiB of queues
            size = "1344Mi" if pod["containers"][0]["name"] == "vllm" else "320Mi"
            assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": size}
            for container in pod["containers"]:
                assert {"name": "XDG_CACHE_HOME", "value": "/var/cache/dynserve"} in container["env"]


def test_memory_defaults_fit_the_model_and_the_spec_wins() -> None:
    def worker(spec: dict[str, Any]) -> dict[str, Any]:
        children = build_children("smol", NS, parse_deployment(spec))
        return _by(children, "Deployment", "smol-workers")["spec"]["template"]["spec"]["containers"][0]["resources"]
    # the bundled model: runtime 1 GiB + /dev/shm 320 MiB + weights 1 GiB + the KV cache
    assert worker({})["requests"] == {"cpu": "1", "memory": "3392Mi"}
    assert worker({"engine": {"kvCacheGib": 4}})["limits"]["memory"] == "6464Mi"
    assert worker({"engine": {"mocker": "cpu"}})["requests"]["memory"] == "1344Mi"  # no weights, no tensors
    given = worker({"pools": {"workers": {"resources": {"requests": {"cpu": "4", "memory": "16Gi"},
                                                        "limits": {"memory": "20Gi"}}}}})
    assert given == {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"cpu": "4", "memory": "20Gi"}}


def test_a_pods_grace_period_covers_the_drain_and_the_shutdown_steps() -> None:
    """SIGKILL must not come before the gateway has drained (`shutdown_grace_s`) and run its shutdown steps
    (their budget): 20 + 30 + 20 s to spare by default, more when the spec's env lengthens the drain, and
    at most a day (`inf` is a drain the settings take)."""
    def graces(spec: dict[str, Any]) -> set[int]:
        children = build_children("smol", NS, parse_deployment(spec))
        return {child["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
                for child in children if child["kind"] == "Deployment"}

    assert graces({}) == {70}
    assert graces({"env": [{"name": "DYN_SHUTDOWN_GRACE_S", "value": "90.5"}]}) == {141}
    assert graces({"env": [{"name": "DYN_SHUTDOWN_GRACE_S", "value": "inf"}]}) == {86_400}


def test_the_network_policy_opens_the_gateway_to_the_namespace_and_the_rest_only_inside() -> None:
    policy = _by(build_children("smol", NS, parse_deployment({})), "NetworkPolicy", "smol")["spec"]
    own = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "dynserve", "app.kubernetes.io/instance": "smol"}}}
    assert policy["podSelector"] == own["podSelector"] and policy["policyTypes"] == ["Ingress"]
    inside, gateway, metrics = policy["ingress"]
    assert inside == {"from": [own]}  # every port (Ray's, worker channel, transfer, event plane) between its pods
    assert gateway == {"from": [{"podSelector": {}}], "ports": [{"protocol": "TCP", "port": 8000}]}
    assert metrics["ports"] == [{"protocol": "TCP", "port": 8000}, {"protocol": "TCP", "port": 9100}]
    assert metrics["from"][0]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}
    # a LoadBalancer brings clients from outside the cluster; peers given replace the defaults; or none at all
    public = build_children("smol", NS, parse_deployment({"gateway": {"serviceType": "LoadBalancer"}}))
    assert "from" not in _by(public, "NetworkPolicy", "smol")["spec"]["ingress"][1]
    ingress = {"podSelector": {"matchLabels": {"app": "ingress"}}}
    narrowed = build_children("smol", NS, parse_deployment({"security": {"networkPolicy": {"gatewayFrom": [ingress]}}}))
    assert _by(narrowed, "NetworkPolicy", "smol")["spec"]["ingress"][1]["from"] == [ingress]
    off = build_children("smol", NS, parse_deployment({"security": {"networkPolicy": {"enabled": False}}}))
    assert not [c for c in off if c["kind"] == "NetworkPolicy"]


def test_a_relaxed_spec_changes_the_uid_and_adds_writable_paths() -> None:
    spec = parse_deployment({"security": {"runAsUser": 2000, "runAsGroup": 0, "writablePaths": ["/data/scratch"]},
                             "image": {"digest": "sha256:" + "ab" * 32}})
    pod = _by(build_children("smol", NS, spec), "Deployment", "smol-workers")["spec"]["template"]["spec"]
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (2000, 0)
    assert {"name": "writable-0", "mountPath": "/data/scratch"} in pod["containers"][0]["volumeMounts"]
    assert {"name": "writable-0", "emptyDir": {}} in pod["volumes"]
    assert pod["containers"][0]["image"].endswith(":0.1.0@sha256:" + "ab" * 32)


def test_disaggregated_children_carry_the_spec_to_the_pods() -> None:
    children = build_children("smol", NS, parse_deployment(DISAGG))
    config = _by(children, "ConfigMap", "smol-config")["data"]
    assert config["DYN_MODEL"] == "/models/smollm2.gguf" and config["DYN_DTYPE"] == "bfloat16"
    assert config["DYN_REDIS_URL"] == "redis://smol-redis:6379/0"
    assert config["DYN_PLANNER_KUBERNETES"] == f"{NS}/smol" and config["DYN_PROMETHEUS"] == "true"
    assert (config["DYN_PLANNER_MIN_DECODE_WORKERS"], config["DYN_PLANNER_MAX_DECODE_WORKERS"]) == ("1", "6")
    assert config["DYN_PLANNER_RISE_SPARE_WORKERS"] == "0"  # a setting the spec gives, not its default
    assert "DYN_PLANNER_IDLE_S" not in config  # one it leaves out: the fleet's default
    decode = _by(children, "Deployment", "smol-decode")
    pod = decode["spec"]["template"]["spec"]
    assert decode["spec"]["replicas"] == 2
    # the GPU the spec asks for; CPU and memory by default: a Ray CPU, the runtime, /dev/shm, a named model
    # (4 GiB) and the KV cache (1 GiB), each limit its request
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "1", "memory": "6464Mi"},
                                                 "limits": {"cpu": "1", "memory": "6464Mi", "nvidia.com/gpu": 1}}
    assert pod["nodeSelector"] == {"gpu": "h100"} and pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["initContainers"][0]["command"][-2:] == [DISAGG["model"]["uri"], "/models/smollm2.gguf"]
    # the pod's Ray node offers the resource the head's pool asks its workers for, with the pod's CPUs
    command = pod["containers"][0]["command"][-1]
    assert f'"{node_resource("decode")}":1' in command and "--address=smol-head:6379" in command
    assert "--num-cpus=4" in _by(children, "Deployment", "smol-prefill")["spec"]["template"]["spec"][
        "containers"][0]["command"][-1]
    head = _by(children, "Deployment", "smol-head")["spec"]["template"]["spec"]
    assert head["serviceAccountName"] == "smol-head"
    assert {"name": "DYN_API_KEY", "valueFrom": {"secretKeyRef": {"name": "dynserve-key", "key": "api-key"}}} in \
        head["containers"][0]["env"]
    for deployment in ("smol-head", "smol-decode", "smol-prefill"):  # every pod of the fleet has the token
        env = _by(children, "Deployment", deployment)["spec"]["template"]["spec"]["containers"][0]["env"]
        assert {"name": "DYN_CLUSTER_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": "smol-cluster", "key": "token"}}} in env
    assert _by(children, "Service", "smol")["spec"]["type"] == "LoadBalancer"
    role = _by(children, "Role", "smol-planner")
    assert {"apiGroups": ["dynserve.io"], "resources": ["dynservepools/scale"],
            "verbs": ["get", "patch", "update"]} in role["rules"]
    assert _by(children, "DynServePool", "smol-decode")["spec"] == {
        "deployment": "smol", "pool": "decode", "replicas": 2, "minReplicas": 1, "maxReplicas": 6}


def test_a_vllm_pool_runs_vllms_server_beside_a_sidecar_that_attaches_it() -> None:
    children = build_children("smol", NS, parse_deployment(VLLM))
    pool = _by(children, "Deployment", "smol-workers")
    pod = pool["spec"]["template"]["spec"]
    server, sidecar = pod["containers"]
    assert pool["spec"]["replicas"] == 2 and "initContainers" not in pod
    # vLLM's OpenAI server from its image, on the model's volume, with the pool's GPU
    assert (server["name"], server["image"]) == ("vllm", "vllm/vllm-openai:v0.10.2")
    assert server["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    args = server["args"]
    flags = dict(zip(args[:-2], args[1:-1], strict=True))
    assert (flags["--model"], flags["--served-model-name"]) == ("/models/Qwen3-0.6B", "Qwen3-0.6B")
    assert (flags["--host"], flags["--port"], flags["--block-size"], flags["--max-model-len"]) == (
        "0.0.0.0", "8000", "32", "4096")
    assert "--enable-prefix-caching" in args and args[-2:] == ["--dtype", "bfloat16"]  # `args` come last
    assert json.loads(flags["--kv-events-config"]) == {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://127.0.0.1:5558"}
    assert server["ports"] == [{"name": "vllm", "containerPort": 8000}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["httpGet"] == {"path": "/health", "port": "vllm"}
    assert server["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "models"}} in pod["volumes"]
    assert {"name": "models", "mountPath": "/models"} in server["volumeMounts"]
    env = {e["name"]: e.get("value") for e in server["env"]}
    assert env["HOME"].startswith("/var/cache/dynserve") and env["VLLM_NO_USAGE_STATS"] == "1"
    assert {m["mountPath"] for m in server["volumeMounts"]} == OPERATOR_WRITABLE_PATHS
    # the sidecar: dynserve's image, once vLLM answers, attaches it under the pod's name through the head's Ray
    assert sidecar["image"] == "ghcr.io/dynserve/dynserve:0.1.0"
    script = sidecar["command"][-1]
    wait, join, attach = script.split(" && ")
    assert wait.startswith("until python -c") and "http://127.0.0.1:8000/health" in wait
    assert "--address=smol-head:6379 --num-cpus=0" in join and "--resources" not in join  # no pool of ours here
    assert attach == ('exec dynctl attach --worker-url "vllm=http://$POD_IP:8000;events=tcp://127.0.0.1:5557;'
                      'replay=tcp://127.0.0.1:5558;id=$POD_NAME" --block-size 32 --ray-address=smol-head:6379')
    sidecar_env = {e["name"]: e for e in sidecar["env"]}
    assert sidecar_env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert sidecar_env["DYN_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "smol-cluster"
    assert sidecar["envFrom"] == [{"configMapRef": {"name": "smol-config"}}]
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}  # by number: not its port
    # the head's gateway follows the attached servers (no pool of dynserve's workers to start)
    head = _by(children, "Deployment", "smol-head")["spec"]["template"]["spec"]["containers"][0]
    assert head["command"][-1].endswith('exec dynctl gateway --ray-address="$POD_IP:6379"')
    # vLLM's /metrics: Prometheus reaches port 8000, the ServiceMonitor scrapes it through the workers Service
    policy = _by(children, "NetworkPolicy", "smol")["spec"]["ingress"]
    assert {"protocol": "TCP", "port": 8000} in policy[2]["ports"] and policy[0] == {"from": [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "dynserve", "app.kubernetes.io/instance": "smol"}}}]}
    assert {"name": "vllm", "port": 8000, "targetPort": "vllm"} in _by(children, "Service", "smol-workers")[
        "spec"]["ports"]
    assert "vllm" in [e["port"] for e in _by(children, "ServiceMonitor", "smol")["spec"]["endpoints"]]
    assert pool["spec"]["template"]["metadata"]["labels"]["dynserve.io/worker"] == "true"


def test_a_vllm_pool_gets_the_flags_dynctl_serve_gives_vllm() -> None:
    """One vLLM command line in two places (the operator's pods, `dynctl serve --engine vllm`'s actors)."""
    spec = parse_deployment(VLLM)
    settings = Settings(model="/models/Qwen3-0.6B", vllm_command="vllm", block_size=32, max_model_len=4096)
    served = vllm_argv(settings, host="10.0.0.5", port=8000, events_port=5557, replay_port=5558)
    assert [a for a in served if a.startswith("--")] == [
        a for a in vllm_args(spec, spec.pools.vllm) if a.startswith("--") and a not in ("--dtype",)]  # type: ignore[arg-type]


def test_the_head_runs_a_ray_head_without_cpus_then_dynctl_serve() -> None:
    from dynserve.config import ray_system_config

    ray_system_config()["object_spilling_config"] = "{}"  # as ray.init adds to the config it is given
    script = pod_command("head")[-1]
    assert "ray start" in script and "--head" in script and "--num-cpus=0" in script
    assert "'--system-config={\"worker_niceness\":0}'" in script  # the cluster's workers start at niceness 0
    assert script.rstrip().endswith('exec dynctl serve --ray-address="$POD_IP:6379"')
    assert labels("smol", "head")["app.kubernetes.io/instance"] == "smol"


# ---- reconcile and the handlers, against the stand-in API server ------------------------------------------

@pytest.fixture
def kube(tmp_path: Path) -> Iterator[tuple[KubeStandin, KubeClient]]:
    with KubeStandin() as standin:
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", standin.url, namespace=NS)
        with KubeClient.connect(kubeconfig=str(kubeconfig)) as client:
            handlers.CLIENT["client"] = client
            yield standin, client
            handlers.CLIENT.clear()


def _create(client: KubeClient, spec: dict[str, Any], name: str = "smol") -> dict[str, Any]:
    return client.apply(resource(spec, name), field_manager="test")


def _pool(client: KubeClient, name: str) -> dict[str, Any]:
    obj = client.get(API_VERSION, POOL_KIND, name, NS)
    assert obj is not None
    return obj


def _deployment_replicas(client: KubeClient, name: str) -> int:
    obj = client.get("apps/v1", "Deployment", name, NS)
    assert obj is not None
    return int(obj["spec"]["replicas"])


def test_reconcile_creates_every_child_and_leaves_a_scaled_pool_to_its_scaler(
        kube: tuple[KubeStandin, KubeClient]) -> None:
    _standin, client = kube
    obj = _create(client, DISAGG)
    children = reconcile_deployment(client, "smol", NS, obj["spec"], obj["metadata"]["uid"])
    for child in children:
        stored = client.get(child["apiVersion"], child["kind"], child["metadata"]["name"], NS)
        assert stored is not None, child["metadata"]["name"]
        assert stored["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    assert _deployment_replicas(client, "smol-decode") == 2
    # an HPA (or kubectl scale) scales the pool through /scale; the pool handler resizes its Deployment
    client.patch(API_VERSION, POOL_KIND, "smol-decode", NS, {"spec": {"replicas": 5}}, subresource="scale")
    status = reconcile_pool(client, _pool(client, "smol-decode"))
    assert _deployment_replicas(client, "smol-decode") == 5
    assert status["selector"] == ("app.kubernetes.io/component=pool-decode,app.kubernetes.io/instance=smol,"
                                  "app.kubernetes.io/name=dynserve")
    # reconciling the deployment again (any edit, or the operator restarting) keeps the scaler's count
    reconcile_deployment(client, "smol", NS, obj["spec"], obj["metadata"]["uid"])
    assert _pool(client, "smol-decode")["spec"]["replicas"] == 5
    assert _deployment_replicas(client, "smol-decode") == 5
    # a change of the count in the deployment's own spec is the user's: it applies
    spec = {**DISAGG, "pools": {**DISAGG["pools"], "decode": {**DISAGG["pools"]["decode"], "replicas": 3}}}
    reconcile_deployment(client, "smol", NS, spec, obj["metadata"]["uid"])
    assert _pool(client, "smol-decode")["spec"]["replicas"] == 3 and _deployment_replicas(client, "smol-decode") == 3


def test_children_the_spec_no_longer_asks_for_are_deleted(kube: tuple[KubeStandin, KubeClient]) -> None:
    _standin, client = kube
    obj = _create(client, DISAGG)
    reconcile_deployment(client, "smol", NS, obj["spec"], obj["metadata"]["uid"])
    assert client.get("monitoring.coreos.com/v1", "ServiceMonitor", "smol", NS) is not None
    plain = {k: v for k, v in DISAGG.items() if k not in ("observability", "eventPlane", "planner")}
    reconcile_deployment(client, "smol", NS, plain, obj["metadata"]["uid"])
    for api_version, kind, name in (("monitoring.coreos.com/v1", "ServiceMonitor", "smol"),
                                    ("apps/v1", "Deployment", "smol-redis"), ("v1", "Service", "smol-redis"),
                                    ("rbac.authorization.k8s.io/v1", "Role", "smol-planner")):
        assert client.get(api_version, kind, name, NS) is None, (kind, name)
    assert client.get("apps/v1", "Deployment", "smol-decode", NS) is not None


def _run_handler(fn: Any, obj: dict[str, Any]) -> dict[str, Any]:
    patch = kopf.Patch()
    fn(body=obj, patch=patch)
    return dict(patch.get("status", {}))


def test_the_deployment_handler_writes_a_status_that_follows_the_pods(kube: tuple[KubeStandin, KubeClient]) -> None:
    _standin, client = kube
    obj = _create(client, SPECS["aggregated"])
    status = _run_handler(handlers.on_deployment, obj)
    assert status["phase"] == "Progressing" and status["observedGeneration"] == obj["metadata"]["generation"]
    assert status["pools"] == {"workers": {"desiredReplicas": 3, "readyReplicas": 0}}
    assert status["gatewayURL"] == f"http://smol.{NS}.svc:8000/v1"
    ready = {c["type"]: c["status"] for c in status["conditions"]}
    assert ready == {"Ready": "False", "Progressing": "True", "Degraded": "False"}
    # the pods come up (the stand-in's Deployments get the status a controller would write)
    client.patch("apps/v1", "Deployment", "smol-head", NS, {"status": {"readyReplicas": 1}}, subresource="status")
    client.patch("apps/v1", "Deployment", "smol-workers", NS, {"status": {"replicas": 3, "readyReplicas": 3}},
                 subresource="status")
    status = deployment_status(client, {**obj, "status": status})
    assert status["phase"] == "Ready"
    assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "True"
    pool_status = _run_handler(handlers.on_pool, _pool(client, "smol-workers"))
    assert (pool_status["replicas"], pool_status["readyReplicas"]) == (3, 3)


def test_a_bad_spec_is_permanent_and_says_why_in_the_status(kube: tuple[KubeStandin, KubeClient]) -> None:
    _standin, client = kube
    obj = {**resource({}), "metadata": {"name": "smol", "namespace": NS, "generation": 2, "uid": "u"},
           "spec": {"pools": {"workers": {"replicas": 5, "maxReplicas": 2}}}}
    patch = kopf.Patch()
    with pytest.raises(kopf.PermanentError, match="maxReplicas"):
        handlers.on_deployment(body=obj, patch=patch)
    degraded = {c["type"]: c for c in patch["status"]["conditions"]}["Degraded"]
    assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"


def test_api_failures_are_retried_or_permanent_by_their_kind(kube: tuple[KubeStandin, KubeClient]) -> None:
    standin, client = kube
    obj = _create(client, SPECS["aggregated"])
    before = metrics.RECONCILES.labels("DynServeDeployment", "reconcile", "retry")._value.get()
    standin.fail_next(503, "ServiceUnavailable")
    with pytest.raises(kopf.TemporaryError):
        handlers.on_deployment(body=obj, patch=kopf.Patch())
    assert metrics.RECONCILES.labels("DynServeDeployment", "reconcile", "retry")._value.get() == before + 1
    standin.fail_next(403, "Forbidden")
    patch = kopf.Patch()
    with pytest.raises(kopf.PermanentError):
        handlers.on_deployment(body=obj, patch=patch)
    assert {c["type"]: c for c in patch["status"]["conditions"]}["Degraded"]["reason"] == "Forbidden"
    _run_handler(handlers.on_deployment, obj)  # and a later event succeeds


# ---- the planner's actuator ----------------------------------------------------------------------------------

def test_the_planner_scales_pools_through_scale_and_holds_a_hand_set_count(
        kube: tuple[KubeStandin, KubeClient]) -> None:
    standin, client = kube
    obj = _create(client, DISAGG)
    reconcile_deployment(client, "smol", NS, obj["spec"], obj["metadata"]["uid"])
    hand_set: list[tuple[str, int]] = []
    actuator = KubernetesActuator(client, NS, planner_pools("smol", ("prefill", "decode")),
                                  on_hand_set=lambda role, n: hand_set.append((role, n)), serving=dict)

    async def run() -> None:
        await actuator.refresh()
        assert actuator.current() == {"prefill": 1, "decode": 2} and hand_set == []
        await actuator.scale("decode", 4)
        await actuator.refresh()
        assert actuator.current()["decode"] == 4 and hand_set == []  # its own write is no override
        # someone runs `kubectl scale dynservepool smol-decode --replicas 1`
        client.patch(API_VERSION, POOL_KIND, "smol-decode", NS, {"spec": {"replicas": 1}}, subresource="scale")
        await actuator.refresh()
        assert hand_set == [("decode", 1)] and actuator.current()["decode"] == 1

    asyncio.run(run())
    pool = _pool(client, "smol-decode")
    assert pool["metadata"]["annotations"][ANNOTATION] == "4"
    assert any(r.path.endswith("/dynservepools/smol-decode/scale") and r.method == "PATCH" for r in standin.requests)


def test_the_actuator_reports_a_vanished_pool(kube: tuple[KubeStandin, KubeClient]) -> None:
    _standin, client = kube
    actuator = KubernetesActuator(client, NS, {"both": "gone-workers"}, on_hand_set=lambda *_: None, serving=dict)
    with pytest.raises(KubernetesError, match="gone"):
        asyncio.run(actuator.refresh())


def test_more_gateways_are_gateway_only_pods_behind_the_one_service() -> None:
    children = build_children("smol", NS, parse_deployment(SPECS["aggregated"]))
    gateways = _by(children, "Deployment", "smol-gateway")
    assert gateways["spec"]["replicas"] == 2  # and the head's: 3
    command = gateways["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    assert "--num-cpus=0" in command and command.endswith("exec dynctl gateway --ray-address=smol-head:6379")
    selector = _by(children, "Service", "smol")["spec"]["selector"]
    for deployment in (gateways, _by(children, "Deployment", "smol-head")):
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= pod_labels.items(), deployment["metadata"]["name"]
