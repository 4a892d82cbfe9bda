"""`KubeClient` against the stand-in API server (tests/kube_standin.py: no real API server runs here),
reached through a kubeconfig file, so config loading, the bearer token and the raw REST paths are real."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s_client

from dynserve.errors import InvalidRequestError, KubernetesError
from dynserve.operator.kube import KubeClient
from dynserve.operator.spec import API_VERSION, KIND, POOL_KIND
from tests.kube_standin import KubeStandin, write_kubeconfig

NS = "serving"


@pytest.fixture
def standin() -> Iterator[KubeStandin]:
    with KubeStandin() as server:
        yield server


@pytest.fixture
def kube(standin: KubeStandin, tmp_path: Path) -> Iterator[KubeClient]:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", standin.url, namespace=NS)
    with KubeClient.connect(kubeconfig=str(kubeconfig)) as client:
        yield client


def deployment(name: str = "tiny", replicas: int = 1, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": NS},
            "spec": {"pools": {"workers": {"replicas": replicas}}, **spec}}


def pool(name: str = "tiny-workers", replicas: int = 1) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": POOL_KIND, "metadata": {"name": name, "namespace": NS},
            "spec": {"deployment": "tiny", "pool": "workers", "replicas": replicas}}


def config_map(name: str, labels: dict[str, str], owner_uid: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": NS, "labels": labels}
    if owner_uid:
        meta["ownerReferences"] = [{"apiVersion": API_VERSION, "kind": KIND, "name": "tiny", "uid": owner_uid}]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"a": "1"}}


def test_apply_creates_then_updates_and_only_a_spec_change_is_a_new_generation(
        kube: KubeClient, standin: KubeStandin) -> None:
    created = kube.apply(deployment(replicas=1), field_manager="dynctl")
    assert created["metadata"]["generation"] == 1 and created["metadata"]["uid"]

    relabelled = deployment(replicas=1)
    relabelled["metadata"]["labels"] = {"team": "a"}
    same_spec = kube.apply(relabelled, field_manager="dynctl")
    assert same_spec["metadata"]["generation"] == 1
    assert same_spec["metadata"]["uid"] == created["metadata"]["uid"]
    assert same_spec["metadata"]["resourceVersion"] != created["metadata"]["resourceVersion"]

    updated = kube.apply(deployment(replicas=3), field_manager="dynctl")
    assert updated["metadata"]["generation"] == 2
    stored = kube.get(API_VERSION, KIND, "tiny", NS)
    assert stored is not None and stored["spec"]["pools"]["workers"]["replicas"] == 3
    # what went over the wire: server-side apply, our field manager, forced
    applies = standin.writes()
    assert [(r.method, r.content_type, r.query) for r in applies] == [
        ("PATCH", "application/apply-patch+yaml", {"fieldManager": "dynctl", "force": "true"})] * 3
    assert applies[0].path == f"/apis/dynserve.io/v1alpha1/namespaces/{NS}/dynservedeployments/tiny"


def test_get_of_an_absent_object_is_none_and_its_delete_is_false(kube: KubeClient) -> None:
    assert kube.get(API_VERSION, KIND, "absent", NS) is None
    assert kube.get("apps/v1", "Deployment", "absent", NS) is None
    assert kube.delete(API_VERSION, KIND, "absent", NS) is False


def test_delete_removes_the_object_and_what_it_owns(kube: KubeClient, standin: KubeStandin) -> None:
    owner = kube.apply(deployment(), field_manager="dynctl")
    kube.apply(config_map("tiny-config", {"app": "tiny"}, owner["metadata"]["uid"]), field_manager="op")
    kube.apply(config_map("unrelated", {"app": "other"}), field_manager="op")
    assert kube.delete(API_VERSION, KIND, "tiny", NS) is True
    assert standin.writes()[-1].query == {"propagationPolicy": "Foreground"}
    assert kube.get(API_VERSION, KIND, "tiny", NS) is None
    assert kube.get("v1", "ConfigMap", "tiny-config", NS) is None
    assert kube.get("v1", "ConfigMap", "unrelated", NS) is not None


def test_list_selects_by_labels_and_names_each_items_kind(kube: KubeClient) -> None:
    kube.apply(config_map("one", {"app": "tiny", "tier": "a"}), field_manager="op")
    kube.apply(config_map("two", {"app": "tiny", "tier": "b"}), field_manager="op")
    kube.apply(config_map("three", {"app": "other", "tier": "a"}), field_manager="op")
    assert {o["metadata"]["name"] for o in kube.list("v1", "ConfigMap", NS)} == {"one", "two", "three"}
    selected = kube.list("v1", "ConfigMap", NS, label_selector="app=tiny,tier=a")
    assert [(o["apiVersion"], o["kind"], o["metadata"]["name"]) for o in selected] == [("v1", "ConfigMap", "one")]
    assert kube.list("v1", "ConfigMap", "elsewhere") == []


def test_status_subresource_writes_only_status(kube: KubeClient) -> None:
    kube.apply(deployment(), field_manager="dynctl")
    patched = kube.patch(API_VERSION, KIND, "tiny", NS, {"status": {"phase": "Running", "observedGeneration": 1},
                                                         "spec": {"pools": {"workers": {"replicas": 5}}}},
                         subresource="status")
    assert patched["status"] == {"phase": "Running", "observedGeneration": 1}
    assert patched["spec"]["pools"]["workers"]["replicas"] == 1 and patched["metadata"]["generation"] == 1
    # and the main resource ignores status, as with the CRD's status subresource on
    main = kube.patch(API_VERSION, KIND, "tiny", NS, {"status": {"phase": "Failed"}})
    assert main["status"]["phase"] == "Running"


def test_scale_subresource_reads_and_writes_a_pools_replicas(kube: KubeClient) -> None:
    kube.apply(pool(replicas=2), field_manager="dynserve-operator")
    kube.patch(API_VERSION, POOL_KIND, "tiny-workers", NS, {"status": {"replicas": 2, "readyReplicas": 1}},
               subresource="status")
    scale = kube.patch(API_VERSION, POOL_KIND, "tiny-workers", NS, {"spec": {"replicas": 4}},
                       subresource="scale")
    assert (scale["kind"], scale["spec"], scale["status"]["replicas"]) == ("Scale", {"replicas": 4}, 2)
    stored = kube.get(API_VERSION, POOL_KIND, "tiny-workers", NS)
    assert stored is not None
    assert stored["spec"]["replicas"] == 4 and stored["metadata"]["generation"] == 2


def _conflict(kube: KubeClient) -> None:
    kube.apply(deployment(), field_manager="dynctl")
    kube.patch(API_VERSION, KIND, "tiny", NS, {"metadata": {"resourceVersion": "stale"}, "spec": {"router": {}}})


@pytest.mark.parametrize(("make_error", "status", "reason", "retryable"), [
    (lambda kube: kube.apply(deployment(replicas=-1), field_manager="dynctl"), 422, "Invalid", False),
    (lambda kube: kube.apply(deployment(router={"mode": "fastest"}), field_manager="dynctl"), 422, "Invalid",
     False),
    (lambda kube: kube.patch(API_VERSION, KIND, "absent", NS, {"spec": {}}), 404, "NotFound", False),
    (_conflict, 409, "Conflict", True),
], ids=["negative-replicas", "unknown-router-mode", "patch-absent", "stale-resource-version"])
def test_refusals_are_kubernetes_errors_with_status_reason_and_retryable(
        kube: KubeClient, make_error: Any, status: int, reason: str, retryable: bool) -> None:
    with pytest.raises(KubernetesError) as caught:
        make_error(kube)
    assert (caught.value.status, caught.value.reason, caught.value.retryable) == (status, reason, retryable)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("status", "reason", "retryable"), [
    (429, "TooManyRequests", True), (500, "InternalError", True), (403, "Forbidden", False)])
def test_server_side_failures_keep_their_status(kube: KubeClient, standin: KubeStandin, status: int, reason: str,
                                                retryable: bool) -> None:
    standin.fail_next(status, reason)
    with pytest.raises(KubernetesError) as caught:
        kube.get(API_VERSION, KIND, "tiny", NS)
    assert (caught.value.status, caught.value.reason, caught.value.retryable) == (status, reason, retryable)


def test_the_kubeconfig_token_is_what_authenticates(standin: KubeStandin) -> None:
    # a client built by hand without the kubeconfig's token is refused: the fixture's calls work only because
    # `connect` loaded it
    bare = KubeClient(k8s_client.ApiClient(k8s_client.Configuration(host=standin.url)))
    with pytest.raises(KubernetesError) as caught:
        bare.get(API_VERSION, KIND, "tiny", NS)
    assert (caught.value.status, caught.value.reason, caught.value.retryable) == (401, "Unauthorized", False)


def test_no_server_is_a_retryable_error_naming_it(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    kube = KubeClient.connect(kubeconfig=str(write_kubeconfig(tmp_path / "kubeconfig", url)))
    with pytest.raises(KubernetesError) as caught:
        kube.apply(deployment(), field_manager="dynctl")
    assert caught.value.status is None and caught.value.retryable
    assert url in str(caught.value) and "refused" in str(caught.value)


def test_an_unknown_kind_fails_before_any_request(kube: KubeClient, standin: KubeStandin) -> None:
    with pytest.raises(InvalidRequestError, match="StatefulSet"):
        kube.get("apps/v1", "StatefulSet", "x", NS)
    with pytest.raises(InvalidRequestError, match="apps/v1"):
        kube.get("extensions/v1beta1", "Deployment", "x", NS)
    assert standin.requests == []
