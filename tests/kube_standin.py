"""A stand-in for the Kubernetes API server, for tests: no real API server (nor kind, nor envtest) can run
here, so this in-process HTTP server implements only the endpoints `KubeClient` and `dynctl` use, the way
the real one answers them:

- server-side apply (PATCH, `application/apply-patch+yaml`, `fieldManager` required): creates the object
  or merges the applied fields into it (unlike the real server, fields a manager stops applying are kept);
- GET of one object or of a collection (`labelSelector` equality terms, `a=b,c=d`);
- JSON merge patch (PATCH, `application/merge-patch+json`; a `metadata.resourceVersion` in the body is a
  precondition: 409 Conflict when stale), of an object or its `status` subresource, and of the `scale`
  subresource of `dynservepools` (an autoscaling/v1 Scale over spec.replicas and status.replicas);
- DELETE, which removes the object and, like the garbage collector, whatever it owns (ownerReferences).

On every write it keeps what the server keeps: `uid`, `resourceVersion` (one counter for all objects),
`creationTimestamp`, `generation` (1, then bumped when `spec` changes); the main resource ignores `status`
and the `status` subresource writes only `status`. DynServeDeployment and DynServePool bodies are checked
against the CRDs' schemas (`tests/_kube.validate`, without CEL rules or defaulting) and refused with 422
Invalid. Errors are `Status` bodies (404 NotFound, 409 Conflict, 422 Invalid, 415, 401). Every request is
logged in `requests`, and `fail_next` makes the next requests fail with a chosen status.

`write_kubeconfig` writes a kubeconfig whose current context points at it, with a bearer token the
stand-in checks (401 Unauthorized otherwise), so tests go through the real config loading path.
"""

from __future__ import annotations

import copy
import datetime
import itertools
import json
import re
import threading
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self
from urllib.parse import parse_qs, urlsplit

import jsonschema
import yaml

from tests._kube import validate

__all__ = ["TOKEN", "KubeStandin", "Request", "write_kubeconfig"]

TOKEN = "standin-token"
_PATH = re.compile(r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))/namespaces/(?P<ns>[^/]+)/"
                   r"(?P<plural>[^/]+)(?:/(?P<name>[^/]+)(?:/(?P<sub>status|scale))?)?$")
# plural -> kind, for the kinds of a List and the names in Status details (its own table, not KubeClient's)
_KINDS = {"deployments": "Deployment", "services": "Service", "configmaps": "ConfigMap",
          "serviceaccounts": "ServiceAccount", "pods": "Pod", "events": "Event", "roles": "Role",
          "rolebindings": "RoleBinding", "poddisruptionbudgets": "PodDisruptionBudget",
          "networkpolicies": "NetworkPolicy",
          "servicemonitors": "ServiceMonitor", "prometheusrules": "PrometheusRule",
          "dynservedeployments": "DynServeDeployment", "dynservepools": "DynServePool"}
_CHECKED_KINDS = {"DynServeDeployment", "DynServePool"}


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    content_type: str | None
    body: Any


class _Refusal(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge_patch(result.get(key), value)
    return result


def _selects(selector: str | None, labels: dict[str, str]) -> bool:
    for term in filter(None, (selector or "").split(",")):
        key, _, value = term.replace("==", "=").partition("=")
        if labels.get(key.strip()) != value.strip():
            return False
    return True


class KubeStandin:
    """The stand-in API server on a free 127.0.0.1 port; a context manager (started on enter)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str, str], dict[str, Any]] = {}  # (group/version, plural, ns, name)
        self.requests: list[Request] = []
        self._failures: list[tuple[int, str]] = []
        self._lock = threading.Lock()
        self._versions = itertools.count(1)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="kube-standin", daemon=True)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def fail_next(self, code: int, reason: str, *, times: int = 1) -> None:
        """Answer the next `times` requests with this error Status, whatever they ask."""
        with self._lock:
            self._failures += [(code, reason)] * times

    def stored(self, api_version: str, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            obj = self.objects.get((api_version, plural, namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def writes(self) -> list[Request]:
        return [r for r in self.requests if r.method in ("PATCH", "POST", "PUT", "DELETE")]

    # ---- the API ---------------------------------------------------------------------------------------

    def _handle(self, method: str, path: str, query: dict[str, str], content_type: str | None,
                body: Any) -> tuple[int, dict[str, Any]]:
        with self._lock:
            if self._failures:
                code, reason = self._failures.pop(0)
                raise _Refusal(code, reason, f"injected by the stand-in: {reason}")
        match = _PATH.match(path)
        if match is None:
            raise _Refusal(404, "NotFound", f"the server could not find the requested resource ({path})")
        api_version = match["core"] or f"{match['group']}/{match['version']}"
        plural, ns, name, sub = match["plural"], match["ns"], match["name"], match["sub"]
        if plural not in _KINDS:
            raise _Refusal(404, "NotFound", f"the server could not find the requested resource ({plural})")
        if sub == "scale" and plural != "dynservepools":
            raise _Refusal(404, "NotFound", f"{plural} have no scale subresource here")
        with self._lock:
            if name is None:
                if method != "GET":
                    raise _Refusal(405, "MethodNotAllowed", f"{method} on a collection is not served here")
                return 200, self._list(api_version, plural, ns, query.get("labelSelector"))
            key = (api_version, plural, ns, name)
            if method == "GET":
                return 200, self._view(self._existing(key), sub)
            if method == "DELETE":
                return 200, self._delete(key)
            if method != "PATCH":
                raise _Refusal(405, "MethodNotAllowed", f"{method} is not served here")
            if content_type == "application/apply-patch+yaml":
                if not query.get("fieldManager"):
                    raise _Refusal(400, "BadRequest", "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: "
                                   "Required value: is required for apply patch")
                return self._apply(key, body, sub)
            if content_type == "application/merge-patch+json":
                return 200, self._merge(key, body, sub)
            raise _Refusal(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - "
                           f"accepted media types include: application/merge-patch+json, "
                           f"application/apply-patch+yaml (not {content_type})")

    def _existing(self, key: tuple[str, str, str, str]) -> dict[str, Any]:
        obj = self.objects.get(key)
        if obj is None:
            group = key[0].rpartition("/")[0]
            resource = f"{key[1]}.{group}" if group else key[1]
            raise _Refusal(404, "NotFound", f'{resource} "{key[3]}" not found')
        return obj

    def _list(self, api_version: str, plural: str, ns: str, selector: str | None) -> dict[str, Any]:
        items = [copy.deepcopy(obj) for (v, p, n, _), obj in sorted(self.objects.items())
                 if (v, p, n) == (api_version, plural, ns)
                 and _selects(selector, obj["metadata"].get("labels") or {})]
        for item in items:  # as the real server lists them: no apiVersion and kind on the items
            item.pop("apiVersion", None)
            item.pop("kind", None)
        return {"apiVersion": api_version, "kind": f"{_KINDS[plural]}List",
                "metadata": {"resourceVersion": str(next(self._versions))}, "items": items}

    @staticmethod
    def _view(obj: dict[str, Any], sub: str | None) -> dict[str, Any]:
        if sub == "scale":
            meta = obj["metadata"]
            return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                    "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion")},
                    "spec": {"replicas": obj["spec"].get("replicas", 0)},
                    "status": {"replicas": (obj.get("status") or {}).get("replicas", 0),
                               "selector": (obj.get("status") or {}).get("selector", "")}}
        return copy.deepcopy(obj)

    def _apply(self, key: tuple[str, str, str, str], body: Any, sub: str | None) -> tuple[int, dict[str, Any]]:
        _check_body(body, key)
        if sub == "scale":
            raise _Refusal(415, "UnsupportedMediaType", "apply to the scale subresource is not served here")
        old = self.objects.get(key)
        if old is None and sub == "status":
            self._existing(key)
        applied = copy.deepcopy(body)
        applied.get("metadata", {}).pop("resourceVersion", None)
        new = _merge_patch(old or {}, applied)
        self._store(key, old, new, sub)
        return (200 if old is not None else 201), self._view(self.objects[key], None)

    def _merge(self, key: tuple[str, str, str, str], body: Any, sub: str | None) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise _Refusal(422, "Invalid", "a merge patch must be a JSON object")
        old = self._existing(key)
        expected = (body.get("metadata") or {}).get("resourceVersion")
        if expected is not None and expected != old["metadata"]["resourceVersion"]:
            raise _Refusal(409, "Conflict", f'Operation cannot be fulfilled on {key[1]} "{key[3]}": the object '
                           "has been modified; please apply your changes to the latest version and try again")
        if sub == "scale":
            replicas = (body.get("spec") or {}).get("replicas")
            if not isinstance(replicas, int):
                raise _Refusal(422, "Invalid", "Scale: spec.replicas: Required value: an integer")
            new = _merge_patch(old, {"spec": {"replicas": replicas}})
        else:
            new = _merge_patch(old, body)
        self._store(key, old, new, sub if sub != "scale" else None)
        return self._view(self.objects[key], sub)

    def _store(self, key: tuple[str, str, str, str], old: dict[str, Any] | None, new: dict[str, Any],
               sub: str | None) -> None:
        """Keep what the server owns (identity, versions, generation) and what the request may not change
        (status on the main resource, everything but status on /status); validate; store."""
        if old is not None:
            if sub == "status":
                new = {**copy.deepcopy(old), "status": new.get("status")}
            elif "status" in old:
                new["status"] = copy.deepcopy(old["status"])
            else:
                new.pop("status", None)
        else:
            new.pop("status", None)
        if new.get("status") is None:
            new.pop("status", None)
        meta = new.setdefault("metadata", {})
        meta["namespace"] = key[2]
        if old is None:
            meta.update(uid=str(uuid.uuid4()), generation=1,
                        creationTimestamp=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        else:
            for field in ("uid", "creationTimestamp", "generation"):
                meta[field] = old["metadata"][field]
            if new.get("spec") != old.get("spec"):
                meta["generation"] = old["metadata"]["generation"] + 1
        if new.get("kind") in _CHECKED_KINDS:
            _check_schema(new, key)
        meta["resourceVersion"] = str(next(self._versions))
        self.objects[key] = new

    def _delete(self, key: tuple[str, str, str, str]) -> dict[str, Any]:
        obj = self._existing(key)
        del self.objects[key]
        uids = {obj["metadata"]["uid"]}
        while True:  # the garbage collector: owned objects go too, and theirs
            owned = [k for k, o in self.objects.items()
                     if any(ref.get("uid") in uids for ref in o["metadata"].get("ownerReferences") or [])]
            if not owned:
                break
            for k in owned:
                uids.add(self.objects.pop(k)["metadata"]["uid"])
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                "details": {"name": key[3], "kind": key[1], "uid": obj["metadata"]["uid"]}}

    # ---- HTTP ------------------------------------------------------------------------------------------

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                url = urlsplit(self.path)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip() or None
                try:
                    body = yaml.safe_load(raw) if raw else None  # JSON is YAML: one parser for apply's body
                except yaml.YAMLError:
                    body = raw.decode("utf-8", "replace")
                with standin._lock:
                    standin.requests.append(Request(self.command, url.path, query, content_type, body))
                try:
                    if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                        raise _Refusal(401, "Unauthorized", "Unauthorized")
                    code, answer = standin._handle(self.command, url.path, query, content_type, body)
                except _Refusal as exc:
                    code, answer = exc.code, {"kind": "Status", "apiVersion": "v1", "metadata": {},
                                              "status": "Failure", "message": exc.message,
                                              "reason": exc.reason, "code": exc.code}
                data = json.dumps(answer).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PATCH = do_DELETE = do_POST = do_PUT = _serve

            def log_message(self, format: str, *args: Any) -> None:  # the base class's names
                pass

        return Handler


def _check_body(body: Any, key: tuple[str, str, str, str]) -> None:
    if not (isinstance(body, dict) and isinstance(body.get("metadata"), dict) and body["metadata"].get("name")):
        raise _Refusal(422, "Invalid", "Object 'metadata.name' is missing or the body is not an object")
    if body["metadata"]["name"] != key[3]:
        raise _Refusal(400, "BadRequest", f"the name of the object ({body['metadata']['name']}) does not match "
                       f"the name on the URL ({key[3]})")
    if _KINDS[key[1]] != body.get("kind"):
        raise _Refusal(400, "BadRequest", f"the kind {body.get('kind')!r} does not match the URL ({key[1]})")


def _check_schema(obj: dict[str, Any], key: tuple[str, str, str, str]) -> None:
    """The CRD's schema, as the API server checks it; metadata as a user writes it (what the server adds
    itself is not the schema's business)."""
    user_meta = {k: v for k, v in obj["metadata"].items()
                 if k in ("name", "namespace", "labels", "annotations", "ownerReferences")}
    try:
        validate({**obj, "metadata": user_meta})
    except jsonschema.ValidationError as exc:
        where = ".".join(str(p) for p in exc.absolute_path) or "<root>"
        message = exc.message
        raise _Refusal(422, "Invalid", f'{obj["kind"]}.{key[0].partition("/")[0]} "{key[3]}" is invalid: '
                       f"{where}: Invalid value: {message}") from None


def write_kubeconfig(path: Path, server_url: str, *, namespace: str = "default",
                     context: str = "standin") -> Path:
    """A kubeconfig at `path` whose current context is `context`, for the API server at `server_url`."""
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": context, "preferences": {},
        "clusters": [{"name": "standin", "cluster": {"server": server_url}}],
        "users": [{"name": "standin", "user": {"token": TOKEN}}],
        "contexts": [{"name": context, "context": {"cluster": "standin", "user": "standin",
                                                   "namespace": namespace}}],
    }
    path.write_text(yaml.safe_dump(config))
    return path
