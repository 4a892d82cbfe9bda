"""A DynServeDeployment serving several models (`spec.models`): the CRD and `parse_deployment` refusing what
one head's `dynctl serve` cannot run, each model's pools built as children of their own (names, selectors, Ray
resources and model files that never mix two models), the gateways told every model and alias, and the
reconcile steps against the stand-in API server (`tests/kube_standin.py`)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dynserve.cli.options import settings_from
from dynserve.errors import InvalidRequestError
from dynserve.operator.builders import build_children
from dynserve.operator.crd import deployment_crd
from dynserve.operator.kube import KubeClient
from dynserve.operator.reconcile import deployment_status, reconcile_deployment, reconcile_pool
from dynserve.operator.spec import API_VERSION, KIND, POOL_KIND, parse_deployment
from dynserve.workers.pool import node_resource
from tests._kube import validate, validate_all
from tests.kube_standin import KubeStandin, write_kubeconfig

NS = "serving"
SMOL = {"name": "smol", "model": {"uri": "https://models.example.com/smollm2.Q8_0.gguf"},
        "pools": {"workers": {"replicas": 2}}, "servedModelNames": ["small"]}
QWEN = {"name": "qwen", "model": {"path": "/models/qwen/Qwen3-0.6B", "volume": {"persistentVolumeClaim": {
    "claimName": "qwen-weights"}}}, "pools": {"workers": {"replicas": 1, "maxReplicas": 4}},
    "servedModelNames": ["q", "qwen3"]}
TWO = {"models": [SMOL, QWEN], "engine": {"kvCacheGib": 0.5}}
TWO_DISAGG = {"models": [{**SMOL, "pools": {"prefill": {"replicas": 1}, "decode": {"replicas": 2}}},
                         {**QWEN, "pools": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}}],
              "gateway": {"replicas": 2}, "eventPlane": {"backend": "redis"}}


def resource(spec: dict[str, Any], name: str = "duo") -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": NS}, "spec": spec}


def _by(children: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(c for c in children if c["kind"] == kind and c["metadata"]["name"] == name)


def _pod(children: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return _by(children, "Deployment", name)["spec"]["template"]["spec"]


# ---- the spec and the CRD ----------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", [TWO, TWO_DISAGG], ids=["aggregated", "disaggregated"])
def test_a_two_model_spec_validates_against_the_crd_and_its_children_offline(spec: dict[str, Any]) -> None:
    validate(resource(spec))
    children = build_children("duo", NS, parse_deployment(spec), uid="u-1")
    validate_all(children)
    assert len({(c["kind"], c["metadata"]["name"]) for c in children}) == len(children)


@pytest.mark.parametrize(("spec", "message"), [
    ({**TWO, "pools": {"workers": {"replicas": 1}}}, r"spec: give models .* not both: pools beside models"),
    ({**TWO, "model": {"path": "/models/a.gguf"}}, r"spec: give models .* not both: model beside models"),
    ({"models": []}, r"spec\.models"),
    ({"models": [SMOL, {**QWEN, "name": "smol"}]}, r"spec\.models: the model name 'smol' is given twice"),
    ({"models": [SMOL, {**QWEN, "name": "Qwen_3"}]}, r"spec\.models\.1\.name"),
    ({"models": [SMOL, {"name": "bundled"}]}, r"spec\.models: bundled: name its weights"),
    ({"models": [{"name": "bundled"}, QWEN]}, r"spec\.models: bundled: name its weights"),
    ({"models": [SMOL, {**QWEN, "pools": {"prefill": {}, "decode": {}}}]},
     r"spec\.models: every model serves aggregated .* \(smol: aggregated, qwen: disaggregated\)"),
    ({"models": [SMOL, {**QWEN, "model": {"path": "/models/q", "dtype": "bfloat16"}}]}, r"spec\.models: every "
     r"model runs one dtype"),
    ({"models": [SMOL, {**QWEN, "servedModelNames": ["small"]}]},
     r"spec\.models: the name 'small' stands for two models \(smol and qwen\)"),
    ({"models": [SMOL, {**QWEN, "servedModelNames": ["smollm2"]}]}, r"the name 'smollm2' stands for two models"),
    ({"models": [SMOL, {**QWEN, "servedModelNames": ["q=Qwen3"]}]}, r"spec\.models\.1\.servedModelNames"),
    ({"models": [SMOL, {**QWEN, "pools": {"workers": {"engine": "vllm", "vllm": {"image": "v:1"}}}}]},
     r"spec\.models: qwen: a vLLM pool serves in the single-model form"),
    ({**TWO, "env": [{"name": "DYN_MODELS_FILE", "value": "/models/m.yaml"}]}, r"spec\.env: DYN_MODELS_FILE is "
     r"set by the operator"),
    ({**TWO, "planner": {"enabled": True}}, r"spec\.planner: on Kubernetes the planner scales the DynServePools of "
     r"one model"),
])
def test_what_one_head_cannot_serve_is_refused_naming_why(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        parse_deployment(spec)


def test_the_crd_keys_models_by_name_and_holds_the_cross_model_rules() -> None:
    spec = deployment_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    models = spec["properties"]["models"]
    assert (models["x-kubernetes-list-type"], models["x-kubernetes-list-map-keys"]) == ("map", ["name"])
    assert models["items"]["required"] == ["name"] and models["maxItems"] == 8
    entry = models["items"]["properties"]
    # a model's pools and source are the single-model form's, the same layout rule included
    assert entry["pools"]["x-kubernetes-validations"] == spec["properties"]["pools"]["x-kubernetes-validations"]
    assert entry["model"]["properties"] == spec["properties"]["model"]["properties"]
    messages = " ".join(r["message"] for r in spec["x-kubernetes-validations"])
    for words in ("not both", "one dtype", "every one disaggregated", "single-model form", "names its weights",
                  "the planner scales the DynServePools of one model"):
        assert words in messages, words


def test_the_schema_refuses_a_bad_alias_and_an_unknown_field_of_a_model() -> None:
    import jsonschema

    for bad in ({**QWEN, "servedModelNames": ["a b"]}, {**QWEN, "replicas": 2}, {**QWEN, "name": "-q"}):
        with pytest.raises(jsonschema.ValidationError):
            validate(resource({"models": [SMOL, bad]}))


# ---- the children --------------------------------------------------------------------------------------------

def test_a_one_model_list_renders_as_the_single_model_form() -> None:
    """The one-entry case: nothing a deployment of `model` and `pools` has today changes name, pod or flag."""
    single = {"model": SMOL["model"], "pools": SMOL["pools"]}
    listed = {"models": [{k: v for k, v in SMOL.items() if k != "servedModelNames"}]}
    assert build_children("duo", NS, parse_deployment(listed), uid="u") == build_children(
        "duo", NS, parse_deployment(single), uid="u")


def test_each_model_gets_pools_of_its_own_that_never_select_the_others_pods() -> None:
    children = build_children("duo", NS, parse_deployment(TWO_DISAGG), uid="u-1")
    pools = {c["metadata"]["name"]: c["spec"] for c in children if c["kind"] == POOL_KIND}
    assert pools == {
        "duo-prefill": {"deployment": "duo", "pool": "prefill", "replicas": 1, "minReplicas": 0, "maxReplicas": 8},
        "duo-decode": {"deployment": "duo", "pool": "decode", "replicas": 2, "minReplicas": 0, "maxReplicas": 8},
        "duo-qwen-prefill": {"deployment": "duo", "pool": "prefill", "replicas": 1, "minReplicas": 0,
                             "maxReplicas": 8, "model": "qwen"},
        "duo-qwen-decode": {"deployment": "duo", "pool": "decode", "replicas": 1, "minReplicas": 0,
                            "maxReplicas": 8, "model": "qwen"}}
    workers = [c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] in pools]
    for deployment in workers:
        selector = deployment["spec"]["selector"]["matchLabels"]
        selected = [d["metadata"]["name"] for d in workers
                    if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert selected == [deployment["metadata"]["name"]]  # its own pods only
        pdb = _by(children, "PodDisruptionBudget", deployment["metadata"]["name"])
        assert pdb["spec"]["selector"]["matchLabels"] == selector
    assert _by(children, "Deployment", "duo-qwen-decode")["metadata"]["labels"]["dynserve.io/model"] == "qwen"


def test_each_models_pods_offer_its_own_ray_resource_and_mount_its_own_files() -> None:
    children = build_children("duo", NS, parse_deployment(TWO_DISAGG))
    for index, model in enumerate(("", "qwen-")):  # the resource a pool of the head's model I follows
        for pool in ("prefill", "decode"):
            command = _pod(children, f"duo-{model}{pool}")["containers"][0]["command"][-1]
            assert f"--resources='{{\"{node_resource(pool, index)}\":1}}'" in command, (model, pool)
    assert node_resource("both", 1) == "dynserve_pool_m1_both" and node_resource("both") == "dynserve_pool_both"
    children = build_children("duo", NS, parse_deployment(TWO))
    smol, qwen = _pod(children, "duo-workers"), _pod(children, "duo-qwen-workers")
    # smol's file is fetched into its pods' emptyDir at /models; qwen's volume is at /models/qwen in its own
    assert [i["command"][-2:] for i in smol["initContainers"]] == [
        ["https://models.example.com/smollm2.Q8_0.gguf", "/models/smollm2.Q8_0.gguf"]]
    assert "initContainers" not in qwen
    assert {m["mountPath"]: m["name"] for m in qwen["containers"][0]["volumeMounts"]}["/models/qwen"] == "models-qwen"
    assert {"name": "models-qwen", "persistentVolumeClaim": {"claimName": "qwen-weights"}} in qwen["volumes"]
    assert "/models" not in {m["mountPath"] for m in qwen["containers"][0]["volumeMounts"]}
    # the head reads every model's tokenizer: both models' files
    head = _pod(children, "duo-head")
    assert {m["mountPath"] for m in head["containers"][0]["volumeMounts"]} >= {"/models", "/models/qwen"}
    assert [i["name"] for i in head["initContainers"]] == ["fetch-model"]


def test_a_model_sharing_the_first_ones_volume_reads_it_at_models() -> None:
    shared = {"persistentVolumeClaim": {"claimName": "weights"}}
    spec = parse_deployment({"models": [{"name": "a", "model": {"path": "/models/a.gguf", "volume": shared}},
                                        {"name": "b", "model": {"path": "/models/b.gguf"}}]})
    pod = _pod(build_children("duo", NS, spec), "duo-b-workers")
    assert {"name": "models", **shared} in pod["volumes"]
    assert "--model /models/a.gguf --model /models/b.gguf" in _pod(build_children("duo", NS, spec), "duo-head")[
        "containers"][0]["command"][-1]


def _serve_flags(command: list[str], verb: str) -> argparse.Namespace:
    """The flags after `dynctl VERB` in a pod's shell script, parsed as dynctl parses them."""
    import shlex

    from dynserve.cli.main import _build_parser

    words = shlex.split(command[-1].split("exec dynctl ", 1)[1])
    assert words[0] == verb
    return _build_parser().parse_args([w.replace('"$POD_IP:6379"', "10.0.0.1:6379") for w in words])


def test_every_gateway_is_told_every_model_and_alias_as_dynctl_parses_them() -> None:
    children = build_children("duo", NS, parse_deployment(TWO_DISAGG))
    for name, verb in (("duo-head", "serve"), ("duo-gateway", "gateway")):
        settings = settings_from(_serve_flags(_pod(children, name)["containers"][0]["command"], verb))
        assert settings.model == "/models/smollm2.Q8_0.gguf", name
        assert settings.extra_models == ["/models/qwen/Qwen3-0.6B"], name
        # the default model's alias plain, the other's bound to its id (the directory's name)
        assert settings.served_model_names == ["small", "q=Qwen3-0.6B", "qwen3=Qwen3-0.6B"], name
    config = _by(children, "ConfigMap", "duo-config")["data"]
    assert config["DYN_MODEL"] == "/models/smollm2.Q8_0.gguf"


# ---- reconcile, against the stand-in API server -------------------------------------------------------------

@pytest.fixture
def client(tmp_path: Path) -> Iterator[KubeClient]:
    with KubeStandin() as standin:
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", standin.url, namespace=NS)
        with KubeClient.connect(kubeconfig=str(kubeconfig)) as kube:
            yield kube


def test_reconcile_scales_each_models_pool_on_its_own_and_reports_each(client: KubeClient) -> None:
    obj = client.apply(resource(TWO), field_manager="test")
    reconcile_deployment(client, "duo", NS, obj["spec"], obj["metadata"]["uid"])
    for name, replicas in (("duo-workers", 2), ("duo-qwen-workers", 1)):
        deployment = client.get("apps/v1", "Deployment", name, NS)
        assert deployment is not None and deployment["spec"]["replicas"] == replicas, name
    # kubectl scale on qwen's pool: its Deployment follows, smol's stays
    client.patch(API_VERSION, POOL_KIND, "duo-qwen-workers", NS, {"spec": {"replicas": 3}}, subresource="scale")
    pool = client.get(API_VERSION, POOL_KIND, "duo-qwen-workers", NS)
    assert pool is not None
    status = reconcile_pool(client, pool)
    assert status["selector"] == ("app.kubernetes.io/component=pool-qwen-workers,app.kubernetes.io/instance=duo,"
                                  "app.kubernetes.io/name=dynserve")
    replicas = {n: (client.get("apps/v1", "Deployment", n, NS) or {})["spec"]["replicas"]
                for n in ("duo-workers", "duo-qwen-workers")}
    assert replicas == {"duo-workers": 2, "duo-qwen-workers": 3}
    qwen_pod = (client.get("apps/v1", "Deployment", "duo-qwen-workers", NS) or {})["spec"]["template"]["spec"]
    assert "dynserve_pool_m1_both" in qwen_pod["containers"][0]["command"][-1]
    # reconciling again keeps the scaled count; the status names each model's pool
    reconcile_deployment(client, "duo", NS, obj["spec"], obj["metadata"]["uid"])
    assert (client.get("apps/v1", "Deployment", "duo-qwen-workers", NS) or {})["spec"]["replicas"] == 3
    status = deployment_status(client, obj)
    assert status["pools"] == {"workers": {"desiredReplicas": 2, "readyReplicas": 0},
                               "qwen/workers": {"desiredReplicas": 3, "readyReplicas": 0}}


def test_a_model_taken_out_of_the_list_loses_its_pools(client: KubeClient) -> None:
    obj = client.apply(resource(TWO), field_manager="test")
    reconcile_deployment(client, "duo", NS, obj["spec"], obj["metadata"]["uid"])
    reconcile_deployment(client, "duo", NS, {"models": [SMOL]}, obj["metadata"]["uid"])
    assert client.get(API_VERSION, POOL_KIND, "duo-qwen-workers", NS) is None
    assert client.get("apps/v1", "Deployment", "duo-qwen-workers", NS) is None
    assert client.get("apps/v1", "Deployment", "duo-workers", NS) is not None
