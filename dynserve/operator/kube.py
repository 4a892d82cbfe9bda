"""`KubeClient`: the thin synchronous Kubernetes API client the operator and `dynctl deploy` share.

It speaks to the API server through the official `kubernetes` package's `ApiClient` (its configuration
loading, authentication and TLS) but calls the raw REST paths itself (`param_serialize` + `call_api`), so
built-in kinds and our custom resources go through one path and come back as plain dicts. It knows the
kinds in `KINDS` and nothing else: any other kind is an InvalidRequestError before a request is made.

Invariants:
- every failure of a call is a `KubernetesError` (never the package's ApiException or a urllib3 error):
  `status` is the HTTP status and `reason` the API's Status reason (NotFound, Conflict, Invalid, ...);
  `status` is None when no answer came (no connection, TLS failure, timeout), and the message then names
  the server;
- `get` answers None and `delete` False for an object that does not exist; every other 404 is an error;
- writes are server-side apply (`apply`, the operator's and dynctl's way to create and update) or JSON
  merge patches (`patch`, for status and scale subresources); nothing here reads or writes local state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Self

import urllib3
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from dynserve.errors import InvalidRequestError, KubernetesError
from dynserve.operator.spec import API_VERSION, KIND, POOL_KIND

__all__ = ["APPLY_PATCH", "KINDS", "MERGE_PATCH", "KubeClient", "ResourceKind", "default_namespace"]

APPLY_PATCH = "application/apply-patch+yaml"
MERGE_PATCH = "application/merge-patch+json"
DEFAULT_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class ResourceKind:
    """Where a kind lives in the API: its group/version, the plural in its paths, whether it is namespaced."""

    api_version: str
    plural: str
    namespaced: bool = True

    def collection_path(self, namespace: str | None) -> str:
        root = f"/api/{self.api_version}" if "/" not in self.api_version else f"/apis/{self.api_version}"
        if not self.namespaced:
            return f"{root}/{self.plural}"
        if not namespace:
            raise InvalidRequestError(f"{self.plural} are namespaced: give a namespace", param="namespace")
        return f"{root}/namespaces/{namespace}/{self.plural}"


KINDS: dict[str, ResourceKind] = {
    "Deployment": ResourceKind("apps/v1", "deployments"),
    "Service": ResourceKind("v1", "services"),
    "ConfigMap": ResourceKind("v1", "configmaps"),
    "ServiceAccount": ResourceKind("v1", "serviceaccounts"),
    "Pod": ResourceKind("v1", "pods"),
    "Event": ResourceKind("v1", "events"),
    "Role": ResourceKind("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ResourceKind("rbac.authorization.k8s.io/v1", "rolebindings"),
    "PodDisruptionBudget": ResourceKind("policy/v1", "poddisruptionbudgets"),
    "NetworkPolicy": ResourceKind("networking.k8s.io/v1", "networkpolicies"),
    "ServiceMonitor": ResourceKind("monitoring.coreos.com/v1", "servicemonitors"),
    "PrometheusRule": ResourceKind("monitoring.coreos.com/v1", "prometheusrules"),
    KIND: ResourceKind(API_VERSION, "dynservedeployments"),
    POOL_KIND: ResourceKind(API_VERSION, "dynservepools"),
}


def _resource_kind(api_version: str | None, kind: str | None) -> ResourceKind:
    known = KINDS.get(kind or "")
    if known is None:
        raise InvalidRequestError(f"KubeClient does not know the kind {kind!r}; it knows {', '.join(KINDS)}",
                                  param="kind")
    if api_version != known.api_version:
        raise InvalidRequestError(f"KubeClient knows {kind} as {known.api_version}, not {api_version!r}",
                                  param="apiVersion")
    return known


def default_namespace(*, kubeconfig: str | None = None, context: str | None = None) -> str:
    """The namespace of the kubeconfig's (current or given) context, else "default". Reads only the file:
    no connection, and no error when there is no kubeconfig."""
    try:
        contexts, current = k8s_config.list_kube_config_contexts(config_file=kubeconfig)
    except (k8s_config.ConfigException, OSError):
        return "default"
    chosen = next((c for c in contexts if c.get("name") == context), None) if context else current
    return ((chosen or {}).get("context") or {}).get("namespace") or "default"


class KubeClient:
    """Synchronous calls to one API server; objects in and out are plain dicts (the API's JSON)."""

    def __init__(self, api_client: k8s_client.ApiClient, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._api = api_client
        self._timeout_s = timeout_s

    @classmethod
    def connect(cls, *, kubeconfig: str | None = None, context: str | None = None,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> KubeClient:
        """A client for the kubeconfig file's current (or given) context (`kubeconfig`, else $KUBECONFIG or
        ~/.kube/config), else, with neither file nor context given, the in-cluster service account. Makes no
        request; KubernetesError (status None) when no configuration can be loaded. Requests are not retried
        when the server cannot be reached."""
        configuration = k8s_client.Configuration()
        try:
            try:
                k8s_config.load_kube_config(config_file=kubeconfig, context=context,
                                            client_configuration=configuration)
            except k8s_config.ConfigException:
                if kubeconfig or context:
                    raise
                k8s_config.load_incluster_config(client_configuration=configuration)
        except (k8s_config.ConfigException, OSError) as exc:
            where = f"from {kubeconfig}" if kubeconfig else "(no kubeconfig, not in a cluster)"
            raise KubernetesError(f"cannot load a Kubernetes configuration {where}: {exc}",
                                  status=None) from None
        # a refused connection is reported at once (the caller decides whether to retry: `retryable`); one
        # retry covers a pooled keep-alive connection the server closed while it sat idle
        configuration.retries = urllib3.Retry(total=1, connect=0)
        return cls(k8s_client.ApiClient(configuration), timeout_s=timeout_s)

    @property
    def host(self) -> str:
        """The API server's URL."""
        return str(self._api.configuration.host)

    def close(self) -> None:
        self._api.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the calls ---------------------------------------------------------------------------------------

    def apply(self, obj: dict[str, Any], *, field_manager: str, force: bool = True,
              subresource: str | None = None) -> dict[str, Any]:
        """Server-side apply `obj` (created if absent): the fields it names become `field_manager`'s; with
        `force`, taken over from other managers rather than answered with 409 Conflict. Returns the object."""
        metadata = obj.get("metadata") or {}
        path = self._object_path(obj.get("apiVersion"), obj.get("kind"), metadata.get("name"),
                                 metadata.get("namespace"), subresource)
        query = [("fieldManager", field_manager)] + ([("force", "true")] if force else [])
        what = f"apply {_describe(obj.get('kind'), metadata.get('name'), metadata.get('namespace'))}"
        result = self._call("PATCH", path, query=query, body=obj, content_type=APPLY_PATCH, what=what)
        assert result is not None
        return result

    def get(self, api_version: str, kind: str, name: str, namespace: str | None) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        path = self._object_path(api_version, kind, name, namespace)
        return self._call("GET", path, what=f"get {_describe(kind, name, namespace)}", absent_ok=True)

    def list(self, api_version: str, kind: str, namespace: str | None,
             label_selector: str | None = None) -> list[dict[str, Any]]:
        """The objects of `kind` in `namespace` (matching `label_selector`, e.g. "a=b,c=d"), each with its
        apiVersion and kind set (the API leaves them out of a list's items)."""
        resource = _resource_kind(api_version, kind)
        query = [("labelSelector", label_selector)] if label_selector else []
        result = self._call("GET", resource.collection_path(namespace), query=query,
                            what=f"list {kind} in {namespace or 'the cluster'}")
        assert result is not None
        items = result.get("items") or []
        return [{"apiVersion": api_version, "kind": kind, **item} for item in items]

    def patch(self, api_version: str, kind: str, name: str, namespace: str | None, body: dict[str, Any], *,
              subresource: str | None = None) -> dict[str, Any]:
        """A JSON merge patch (RFC 7386) of the object or of its `subresource` ("status", "scale")."""
        path = self._object_path(api_version, kind, name, namespace, subresource)
        what = f"patch {_describe(kind, name, namespace)}" + (f" ({subresource})" if subresource else "")
        result = self._call("PATCH", path, body=body, content_type=MERGE_PATCH, what=what)
        assert result is not None
        return result

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None, *,
               propagation: str = "Foreground") -> bool:
        """Delete the object (its dependents per `propagation`: Foreground, Background, Orphan); False when
        it did not exist."""
        path = self._object_path(api_version, kind, name, namespace)
        result = self._call("DELETE", path, query=[("propagationPolicy", propagation)],
                            what=f"delete {_describe(kind, name, namespace)}", absent_ok=True)
        return result is not None

    # ---- plumbing ----------------------------------------------------------------------------------------

    @staticmethod
    def _object_path(api_version: str | None, kind: str | None, name: str | None, namespace: str | None,
                     subresource: str | None = None) -> str:
        resource = _resource_kind(api_version, kind)
        if not name:
            raise InvalidRequestError(f"a {kind} needs metadata.name", param="metadata.name")
        path = f"{resource.collection_path(namespace)}/{name}"
        return f"{path}/{subresource}" if subresource else path

    def _call(self, method: str, path: str, *, what: str, query: list[tuple[str, str]] | None = None,
              body: dict[str, Any] | None = None, content_type: str | None = None,
              absent_ok: bool = False) -> dict[str, Any] | None:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        try:
            request = self._api.param_serialize(method, path, query_params=query or None, header_params=headers,
                                                body=body, auth_settings=["BearerToken"])
            response = self._api.call_api(*request, _request_timeout=self._timeout_s)
            data = response.read()
        except ApiException as exc:  # raised by the package before any answer (TLS, a body it cannot send)
            raise KubernetesError(f"cannot {what} at {self.host}: {exc.reason}", status=None) from None
        except urllib3.exceptions.HTTPError as exc:
            raise KubernetesError(f"cannot reach the Kubernetes API at {self.host} to {what}: "
                                  f"{_connection_problem(exc)}", status=None) from None
        if 200 <= response.status < 300:
            return json.loads(data) if data else {}
        if response.status == 404 and absent_ok:
            return None
        reason, message = _status_of(data, response)
        raise KubernetesError(f"cannot {what}: {response.status} {reason}: {message}", status=response.status,
                              reason=reason)


def _describe(kind: str | None, name: str | None, namespace: str | None) -> str:
    return f"{kind} {namespace}/{name}" if namespace else f"{kind} {name}"


def _status_of(data: bytes | None, response: Any) -> tuple[str, str]:
    """(reason, message) of an error answer: from its Status body, else the HTTP reason phrase."""
    try:
        status = json.loads(data or b"")
    except ValueError:
        status = None
    if isinstance(status, dict) and status.get("kind") == "Status":
        return str(status.get("reason") or response.reason), " ".join(str(status.get("message", "")).split())
    text = (data or b"").decode("utf-8", "replace").strip()
    return str(response.reason), " ".join(text.split())[:200] or str(response.reason)


def _connection_problem(exc: urllib3.exceptions.HTTPError) -> str:
    """The root of a urllib3 failure in a few words ("[Errno 111] Connection refused", "timed out")."""
    cause: BaseException = exc
    if isinstance(cause, urllib3.exceptions.MaxRetryError) and cause.reason is not None:
        cause = cause.reason
    text = str(cause)
    marker = "Failed to establish a new connection: "
    if marker in text:
        return text.split(marker, 1)[1]
    if isinstance(cause, urllib3.exceptions.TimeoutError):
        return "timed out"
    return text.split(": ", 1)[1] if text.startswith("<") and ": " in text else text
