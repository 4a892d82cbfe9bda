"""`dynctl deploy / status / delete` run as a user runs them (the installed `dynctl`, a subprocess each)
against the stand-in API server (tests/kube_standin.py: no real API server runs here) through a kubeconfig.

The example deployed is the one in `dynserve/cli/deploy.py`'s docstring (the README's), read from there, so
the documented commands are the tested ones. No operator runs here either: where a test needs one, a test
thread stands in for it by writing the status the operator would write.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dynserve.cli import deploy as deploy_cli
from dynserve.errors import InvalidRequestError
from dynserve.operator.kube import KubeClient
from dynserve.operator.reconcile import invalid_status
from dynserve.operator.spec import API_VERSION, KIND
from tests._kube import validate, validate_all
from tests.kube_standin import KubeStandin, write_kubeconfig

DYNCTL = str(Path(sys.executable).parent / "dynctl")
NS = "serving"
_DOC = deploy_cli.__doc__ or ""
EXAMPLE_YAML = re.search(r"# tiny\.yaml\n(.*?)\n\n", _DOC, re.DOTALL).group(1)  # type: ignore[union-attr]
README_YAML = re.search(r"```yaml\n# tiny\.yaml\n(.*?)```", (Path(__file__).parents[1] / "README.md").read_text(),
                        re.DOTALL).group(1)  # type: ignore[union-attr]
# the README's vLLM pool ("Your engines")
VLLM_YAML = re.search(r"```yaml\n# qwen\.yaml\n(.*?)```", (Path(__file__).parents[1] / "README.md").read_text(),
                      re.DOTALL).group(1)  # type: ignore[union-attr]
# the README's two models ("Several models behind the one gateway"): a file, and the same from flags
DUO_YAML = re.search(r"```yaml\n# duo\.yaml\n(.*?)```", (Path(__file__).parents[1] / "README.md").read_text(),
                     re.DOTALL).group(1)  # type: ignore[union-attr]
DUO_FLAGS = shlex.split(re.search(r"\ndynctl deploy (--name duo [^#\n]*)", (Path(__file__).parents[1] /
                                                                           "README.md").read_text()).group(1))  # type: ignore[union-attr]
EXAMPLE_FLAGS = shlex.split(
    re.search(r"dynctl deploy (--name tiny [^#\n]*)", _DOC).group(1))  # type: ignore[union-attr]


@pytest.fixture
def standin() -> Iterator[KubeStandin]:
    with KubeStandin() as server:
        yield server


@pytest.fixture
def kubeconfig(standin: KubeStandin, tmp_path: Path) -> str:
    return str(write_kubeconfig(tmp_path / "kubeconfig", standin.url, namespace=NS))


@pytest.fixture
def example(tmp_path: Path) -> str:
    path = tmp_path / "tiny.yaml"
    path.write_text(EXAMPLE_YAML)
    return str(path)


def dynctl(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DYNCTL, *args], capture_output=True, text=True, timeout=timeout_s, check=False)


def play_operator(standin: KubeStandin, kubeconfig: str, statuses: list[dict[str, Any]], *,
                  pause_s: float = 0.8) -> threading.Thread:
    """Stands in for the operator: once `tiny` exists, writes each status in turn (observedGeneration "now"
    means the resource's current generation), `pause_s` apart."""

    def run() -> None:
        with KubeClient.connect(kubeconfig=kubeconfig) as kube:
            deadline_s = time.monotonic() + 30
            while (obj := kube.get(API_VERSION, KIND, "tiny", NS)) is None and time.monotonic() < deadline_s:
                time.sleep(0.05)
            assert obj is not None
            for status in statuses:
                generation = obj["metadata"]["generation"]
                observed = status["observedGeneration"]
                observed = generation if observed == "now" else observed
                kube.patch(API_VERSION, KIND, "tiny", NS, {"status": {**status, "observedGeneration": observed}},
                           subresource="status")
                time.sleep(pause_s)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# statuses shaped as dynserve/operator/reconcile.py's deployment_status writes them
def ready(generation: Any, url: str = "http://tiny.serving.svc:8000/v1") -> dict[str, Any]:
    return {"observedGeneration": generation, "phase": "Ready", "gatewayURL": url,
            "pools": {"prefill": {"desiredReplicas": 2, "readyReplicas": 2},
                      "decode": {"desiredReplicas": 1, "readyReplicas": 1}},
            "conditions": [
                {"type": "Ready", "status": "True", "reason": "AllReady",
                 "message": "every pool at size, the gateway serving"},
                {"type": "Degraded", "status": "False", "reason": "None", "message": "no failures"}]}


def progressing() -> dict[str, Any]:
    return {"observedGeneration": "now", "phase": "Progressing", "gatewayURL": "http://tiny.serving.svc:8000/v1",
            "pools": {"prefill": {"desiredReplicas": 2, "readyReplicas": 0},
                      "decode": {"desiredReplicas": 1, "readyReplicas": 1}},
            "conditions": [{"type": "Ready", "status": "False", "reason": "Serving",
                            "message": "pools not at size: prefill 0/2"}]}


# ---- dry runs ------------------------------------------------------------------------------------------------

def test_the_example_file_and_its_flags_give_one_valid_resource_and_children_that_validate(
        example: str, kubeconfig: str, standin: KubeStandin) -> None:
    rendered = dynctl("deploy", "-f", example, "--dry-run", "--render", "--kubeconfig", kubeconfig)
    from_flags = dynctl("deploy", *EXAMPLE_FLAGS, "--dry-run", "--kubeconfig", kubeconfig)
    assert rendered.returncode == 0 and from_flags.returncode == 0, rendered.stderr + from_flags.stderr
    resource, *children = yaml.safe_load_all(rendered.stdout)
    validate(resource)
    assert resource == yaml.safe_load(from_flags.stdout)
    assert resource["metadata"] == {"name": "tiny", "namespace": NS}  # the kubeconfig context's namespace
    assert resource["spec"]["pools"] == {"prefill": {"replicas": 2}, "decode": {"replicas": 1}}
    validate_all(children)
    kinds = {(c["kind"], c["metadata"]["name"]) for c in children}
    assert {("DynServePool", "tiny-prefill"), ("DynServePool", "tiny-decode"),
            ("ConfigMap", "tiny-config")} <= kinds
    assert standin.requests == []  # a dry run reads the kubeconfig file, never the cluster


def test_flags_land_on_their_fields(tmp_path: Path) -> None:
    # in-process: the flag -> field mapping, each flag once (the subprocess tests above cover the shell)
    parser = argparse.ArgumentParser()
    deploy_cli.add_kube_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args([
        "deploy", "--name", "big", "--model", "https://example.com/m/llama.gguf", "--dtype", "bfloat16",
        "--image", "registry:5000/team/dynserve:1.2", "--workers", "3", "--gpus", "1", "--cpus", "4",
        "--memory", "16Gi", "--router", "approximate", "--transfer-backend", "tcp", "--redis-url",
        "redis://r:6379/0", "--planner", "--ttft-ms", "200", "--itl-ms", "20", "--min-replicas", "1",
        "--max-replicas", "6", "--api-key-secret", "keys", "--service-type", "LoadBalancer", "--service-monitor"])
    resource = deploy_cli.resource_from(args, "default")
    validate(resource)
    spec = resource["spec"]
    assert spec["model"] == {"uri": "https://example.com/m/llama.gguf", "dtype": "bfloat16"}
    assert spec["image"] == {"repository": "registry:5000/team/dynserve", "tag": "1.2"}
    assert spec["pools"] == {"workers": {"replicas": 3, "minReplicas": 1, "maxReplicas": 6, "resources": {
        "requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"nvidia.com/gpu": 1}}}}
    assert spec["eventPlane"] == {"backend": "redis", "redisUrl": "redis://r:6379/0"}
    assert spec["planner"] == {"enabled": True, "ttftMs": 200.0, "itlMs": 20.0}
    assert spec["gateway"] == {"serviceType": "LoadBalancer", "apiKeySecret": {"name": "keys"}}
    assert (spec["router"], spec["transfer"], spec["observability"]) == (
        {"mode": "approximate"}, {"backend": "tcp"}, {"serviceMonitor": True})
    # a flag's layout replaces the file's: the example's prefill/decode become aggregated workers
    (tmp_path / "tiny.yaml").write_text(EXAMPLE_YAML)
    args = parser.parse_args(["deploy", "-f", str(tmp_path / "tiny.yaml"), "--workers", "2",
                              "--model", "/m/x.gguf"])
    assert deploy_cli.resource_from(args, "default")["spec"] == {
        "model": {"path": "/m/x.gguf"}, "pools": {"workers": {"replicas": 2}}, "engine": {"mocker": "cpu"}}


def test_the_readmes_vllm_pool_renders_manifests_that_validate(kubeconfig: str, tmp_path: Path) -> None:
    (tmp_path / "qwen.yaml").write_text(VLLM_YAML)
    rendered = dynctl("deploy", "-f", str(tmp_path / "qwen.yaml"), "--dry-run", "--render", "--kubeconfig", kubeconfig)
    assert rendered.returncode == 0, rendered.stderr
    resource, *children = yaml.safe_load_all(rendered.stdout)
    validate(resource)
    validate_all(children)
    pool = next(c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] == "qwen-workers")
    assert [c["image"] for c in pool["spec"]["template"]["spec"]["containers"]] == [
        "vllm/vllm-openai:v0.10.2", "ghcr.io/dynserve/dynserve:0.1.0"]


def test_the_engine_flags_land_on_the_workers_pool(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    deploy_cli.add_kube_commands(parser.add_subparsers(dest="command"))
    digest = "sha256:" + "0f" * 32
    args = parser.parse_args([
        "deploy", "--engine", "vllm", "--vllm-image", f"vllm/vllm-openai:v0.10.2@{digest}", "--vllm-args",
        "--dtype bfloat16 --max-num-batched-tokens 8192", "--vllm-block-size", "32", "--model", "/models/q",
        "--workers", "2"])
    resource = deploy_cli.resource_from(args, "default")
    validate(resource)
    assert resource["spec"]["pools"] == {"workers": {"replicas": 2, "engine": "vllm", "vllm": {
        "image": "vllm/vllm-openai:v0.10.2", "digest": digest, "blockSize": 32,
        "args": ["--dtype", "bfloat16", "--max-num-batched-tokens", "8192"]}}}
    # over the README's file: the flags win; --engine dynserve drops its vllm block
    (tmp_path / "qwen.yaml").write_text(VLLM_YAML)
    args = parser.parse_args(["deploy", "-f", str(tmp_path / "qwen.yaml"), "--vllm-image", "mine/vllm:1"])
    assert deploy_cli.resource_from(args, "default")["spec"]["pools"]["workers"]["vllm"]["image"] == "mine/vllm:1"
    args = parser.parse_args(["deploy", "-f", str(tmp_path / "qwen.yaml"), "--engine", "dynserve"])
    workers = deploy_cli.resource_from(args, "default")["spec"]["pools"]["workers"]
    assert "vllm" not in workers and workers.get("engine", "dynserve") == "dynserve"
    # vLLM serves aggregated: the flags say so before the spec does
    args = parser.parse_args(["deploy", "--vllm-image", "v:1", "--prefill-workers", "1", "--decode-workers", "1"])
    with pytest.raises(InvalidRequestError, match="--vllm-image: vLLM runs only in the aggregated workers pool"):
        deploy_cli.resource_from(args, "default")
    args = parser.parse_args(["deploy", "--engine", "vllm", "--prefill-workers", "1", "--decode-workers", "1"])
    with pytest.raises(InvalidRequestError, match="spec.pools.prefill.engine: vLLM serves whole requests"):
        deploy_cli.resource_from(args, "default")


def _head_flags(children: list[dict[str, Any]], name: str) -> list[str]:
    head = next(c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] == f"{name}-head")
    script = head["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    return shlex.split(script.split("exec dynctl serve ", 1)[1])[1:]  # after --ray-address


def test_the_readmes_two_models_render_manifests_that_validate_from_a_file_and_from_flags(
        kubeconfig: str, tmp_path: Path, standin: KubeStandin) -> None:
    (tmp_path / "duo.yaml").write_text(DUO_YAML)
    from_file = dynctl("deploy", "-f", str(tmp_path / "duo.yaml"), "--dry-run", "--render", "--kubeconfig", kubeconfig)
    from_flags = dynctl("deploy", *DUO_FLAGS, "--kubeconfig", kubeconfig)
    assert from_file.returncode == 0 and from_flags.returncode == 0, from_file.stderr + from_flags.stderr
    smol, gemma = "/models/SmolLM2-135M-Instruct.Q4_1.gguf", "/models/gemma-3-270m-q4_k_m.gguf"
    for result, gemma_pool, replicas in ((from_file, "duo-gemma-workers", [2, 1]),
                                         (from_flags, "duo-gemma-3-270m-q4-k-m-workers", [2, 2])):
        resource, *children = yaml.safe_load_all(result.stdout)
        validate(resource)
        validate_all(children)
        assert "model" not in resource["spec"] and "pools" not in resource["spec"]
        assert [m["pools"]["workers"]["replicas"] for m in resource["spec"]["models"]] == replicas
        pools = {c["metadata"]["name"]: c["spec"] for c in children if c["kind"] == "DynServePool"}
        assert set(pools) == {"duo-workers", gemma_pool}
        assert pools[gemma_pool]["model"] == gemma_pool.removeprefix("duo-").removesuffix("-workers")
        assert _head_flags(children, "duo") == ["--model", smol, "--model", gemma, "--served-model-name", "small",
                                                "--served-model-name", "tiny=gemma-3-270m-q4_k_m"]
    assert standin.requests == []


def test_model_flags_over_a_file_of_one_or_several_models(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    deploy_cli.add_kube_commands(parser.add_subparsers(dest="command"))
    (tmp_path / "tiny.yaml").write_text(EXAMPLE_YAML)
    (tmp_path / "duo.yaml").write_text(DUO_YAML)

    def spec(*flags: str) -> dict[str, Any]:
        resource = deploy_cli.resource_from(parser.parse_args(["deploy", *flags]), "default")
        validate(resource)
        return dict(resource["spec"])

    # two models over the tiny file: each gets its disaggregated layout, the pool flags and the dtype
    duo = spec("-f", str(tmp_path / "tiny.yaml"), "--model", "https://x.example/a.Q8_0.gguf", "--model", "/m/b",
               "--gpus", "1", "--dtype", "bfloat16")
    assert [(m["name"], m["model"]) for m in duo["models"]] == [
        ("a", {"uri": "https://x.example/a.Q8_0.gguf", "dtype": "bfloat16"}), ("b", {"path": "/m/b", "dtype": "bfloat16"})]
    for entry in duo["models"]:
        assert entry["pools"] == {"prefill": {"replicas": 2, "resources": {"limits": {"nvidia.com/gpu": 1}}},
                                  "decode": {"replicas": 1, "resources": {"limits": {"nvidia.com/gpu": 1}}}}
    # over the two-model file: the layout flag reaches every model, an alias the model it names
    duo = spec("-f", str(tmp_path / "duo.yaml"), "--workers", "3", "--served-model-name", "sm")
    assert [m["pools"] for m in duo["models"]] == [{"workers": {"replicas": 3}}] * 2
    assert duo["models"][0]["servedModelNames"] == ["small", "sm"]
    # an alias alone turns one model into a one-entry list (the same children: the one-model case)
    assert spec("--model", "/m/a.gguf", "--served-model-name", "alpha")["models"] == [
        {"name": "a", "model": {"path": "/m/a.gguf"}, "pools": {"workers": {"replicas": 1}},
         "servedModelNames": ["alpha"]}]
    with pytest.raises(InvalidRequestError, match=r"--served-model-name x=nope: no model 'nope' is given"):
        spec("--model", "/m/a.gguf", "--model", "/m/b.gguf", "--served-model-name", "x=nope")
    with pytest.raises(InvalidRequestError, match=r"--model: the file serves several models"):
        spec("-f", str(tmp_path / "duo.yaml"), "--model", "/m/c.gguf")
    with pytest.raises(InvalidRequestError, match=r"spec.models: the name 'a' stands for two models \(a and a-1\)"):
        spec("--model", "/m/a.gguf", "--model", "/n/a.gguf")


@pytest.mark.parametrize(("flags", "spec_file", "named"), [
    (["--prefill-workers", "1"], None, "spec.pools"),
    ([], {"env": [{"name": "PATH", "value": "/bin"}]}, "spec.env.0.name"),
    (["--workers", "1", "--min-replicas", "2"], None, "minReplicas <= replicas"),
], ids=["prefill-without-decode", "env-not-a-setting", "min-over-replicas"])
def test_bad_input_exits_2_naming_the_field_and_sends_nothing(
        flags: list[str], spec_file: dict[str, Any] | None, named: str, kubeconfig: str, standin: KubeStandin,
        tmp_path: Path) -> None:
    if spec_file is not None:
        (tmp_path / "bad.yaml").write_text(yaml.safe_dump(spec_file))
        flags = [*flags, "-f", str(tmp_path / "bad.yaml")]
    result = dynctl("deploy", *flags, "--kubeconfig", kubeconfig)
    assert result.returncode == 2, result.stderr
    assert named in result.stderr and result.stderr.startswith("dynctl: invalid input:")
    assert standin.requests == []


# ---- applying and following ----------------------------------------------------------------------------------

def test_deploy_applies_and_waits_for_a_current_ready_status(
        example: str, kubeconfig: str, standin: KubeStandin) -> None:
    # a Ready left over from generation 0 must not end the wait: the test thread, standing in for the operator,
    # writes it first, then a current Progressing, then a current Ready
    operator = play_operator(standin, kubeconfig, [ready(0, url="http://stale"), progressing(), ready("now")])
    result = dynctl("deploy", "-f", example, "--kubeconfig", kubeconfig, "--timeout", "30")
    operator.join(10)
    assert result.returncode == 0, result.stderr
    assert "http://tiny.serving.svc:8000/v1" in result.stdout and "http://stale" not in result.stdout
    assert "prefill 0/2 ready" in result.stderr and "pools not at size: prefill 0/2" in result.stderr
    (apply,) = [r for r in standin.writes() if r.content_type == "application/apply-patch+yaml"]
    assert apply.query == {"fieldManager": "dynctl", "force": "true"}
    stored = standin.stored(API_VERSION, "dynservedeployments", NS, "tiny")
    assert stored is not None and stored["spec"] == yaml.safe_load(EXAMPLE_YAML)["spec"]


def test_deploy_fails_at_once_when_the_operator_finds_the_spec_invalid(
        example: str, kubeconfig: str, standin: KubeStandin) -> None:
    # the very status the operator writes for a spec it cannot serve (Degraded, reason InvalidSpec)
    invalid = invalid_status({"metadata": {"generation": 1}}, "spec.engine.mocker: unknown profile 'cpu'")
    play_operator(standin, kubeconfig, [{**invalid, "observedGeneration": "now"}])
    started_s = time.monotonic()
    result = dynctl("deploy", "-f", example, "--kubeconfig", kubeconfig, "--timeout", "60", "--output", "json")
    assert result.returncode == 1
    assert time.monotonic() - started_s < 20
    assert "is Degraded (InvalidSpec): spec.engine.mocker: unknown profile 'cpu'" in result.stderr
    assert yaml.safe_load(result.stdout)["status"]["phase"] == "Degraded"  # --output json: the final resource


def test_deploy_exits_1_at_its_timeout_when_no_status_comes(example: str, kubeconfig: str) -> None:
    result = dynctl("deploy", "-f", example, "--kubeconfig", kubeconfig, "--timeout", "1.5")
    assert result.returncode == 1
    assert "was not Ready after 1.5 s" in result.stderr
    assert "waiting for the operator to see generation 1" in result.stderr


# ---- status and delete ---------------------------------------------------------------------------------------

@pytest.fixture
def deployed(kubeconfig: str, example: str) -> Callable[[], dict[str, Any]]:
    """`tiny` applied and made Ready (by the test, standing in for the operator), with an owned child."""

    def make() -> dict[str, Any]:
        resource = {**yaml.safe_load(EXAMPLE_YAML), "metadata": {"name": "tiny", "namespace": NS}}
        with KubeClient.connect(kubeconfig=kubeconfig) as kube:
            obj = kube.apply(resource, field_manager="dynctl")
            kube.patch(API_VERSION, KIND, "tiny", NS, {"status": ready(1)}, subresource="status")
            kube.apply({"apiVersion": "v1", "kind": "ConfigMap", "data": {}, "metadata": {
                "name": "tiny-config", "namespace": NS, "ownerReferences": [
                    {"apiVersion": API_VERSION, "kind": KIND, "name": "tiny", "uid": obj["metadata"]["uid"]}]}},
                field_manager="dynserve-operator")
            return obj

    return make


def test_status_shows_conditions_pools_and_url_and_delete_removes_everything(
        deployed: Callable[[], dict[str, Any]], kubeconfig: str, standin: KubeStandin) -> None:
    deployed()
    shown = dynctl("status", "tiny", "--kubeconfig", kubeconfig)
    assert shown.returncode == 0, shown.stderr
    for text in ("Ready", "AllReady", "prefill", "decode", "http://tiny.serving.svc:8000/v1"):
        assert text in shown.stdout
    assert re.search(r"prefill\s*\S\s*2\s*\S\s*2", shown.stdout)  # desired 2, ready 2

    removed = dynctl("delete", "tiny", "--kubeconfig", kubeconfig, "--wait")
    assert removed.returncode == 0, removed.stderr
    assert standin.stored(API_VERSION, "dynservedeployments", NS, "tiny") is None
    assert standin.stored("v1", "configmaps", NS, "tiny-config") is None  # its child went with it


def test_status_and_delete_of_an_unknown_name_exit_1(kubeconfig: str) -> None:
    for command in ("status", "delete"):
        result = dynctl(command, "absent", "--kubeconfig", kubeconfig)
        assert result.returncode == 1
        assert result.stderr.strip() == f"dynctl: DynServeDeployment {NS}/absent not found"


def test_an_unreachable_cluster_is_one_line_naming_the_server(tmp_path: Path) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", "http://127.0.0.1:9")  # discard: nobody listens
    result = dynctl("status", "tiny", "--kubeconfig", str(kubeconfig))
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "http://127.0.0.1:9" in result.stderr, result.stderr


def test_the_readmes_example_is_the_tested_one() -> None:
    """The README's Kubernetes section shows the example these tests deploy (so `dynctl deploy -f tiny.yaml
    --dry-run --render` on it prints the manifests the first test here validates)."""
    assert yaml.safe_load(README_YAML) == yaml.safe_load(EXAMPLE_YAML)
