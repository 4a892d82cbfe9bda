"""Offline checks of Kubernetes manifests, shared by the chart, operator and `dynctl deploy` tests.

`validate(obj)`: a built-in kind against the pinned Kubernetes version's schemas (kubernetes-validate,
strict: an unknown field fails); our own kinds against the CRDs' openAPIV3Schema (`dynserve/operator/crd.py`);
the Prometheus Operator's `ServiceMonitor` and `PrometheusRule` against the subset of their schemas that we
use (`_MONITORING`, written from the Prometheus Operator's API reference, strict like the rest).
"""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate

from dynserve.operator.crd import deployment_crd, pool_crd

__all__ = ["KUBERNETES_VERSION", "structural_problems", "validate", "validate_all"]

KUBERNETES_VERSION = "1.33.0"

_STR = {"type": "string"}
_LABELS = {"type": "object", "additionalProperties": _STR}
_META = {"type": "object", "required": ["name"], "properties": {
    "name": _STR, "namespace": _STR, "labels": _LABELS, "annotations": _LABELS,
    "ownerReferences": {"type": "array"}}, "additionalProperties": False}
_SELECTOR = {"type": "object", "properties": {"matchLabels": _LABELS, "matchExpressions": {"type": "array"}},
             "additionalProperties": False}
_ENDPOINT = {"type": "object", "properties": {
    "port": _STR, "targetPort": {}, "path": _STR, "interval": _STR, "scrapeTimeout": _STR, "scheme": _STR,
    "honorLabels": {"type": "boolean"}, "relabelings": {"type": "array"}, "metricRelabelings": {"type": "array"},
    "authorization": {"type": "object"}}, "additionalProperties": False}
_RULE = {"type": "object", "properties": {
    "record": _STR, "alert": _STR, "expr": {"type": ["string", "integer"]}, "for": _STR, "labels": _LABELS,
    "annotations": _LABELS}, "required": ["expr"], "additionalProperties": False}
_MONITORING: dict[str, dict[str, Any]] = {
    "ServiceMonitor": {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"}, "metadata": _META,
        "spec": {"type": "object", "required": ["selector", "endpoints"], "properties": {
            "selector": _SELECTOR, "endpoints": {"type": "array", "items": _ENDPOINT, "minItems": 1},
            "namespaceSelector": {"type": "object"}, "jobLabel": _STR}, "additionalProperties": False}},
        "additionalProperties": False},
    "PrometheusRule": {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PrometheusRule"}, "metadata": _META,
        "spec": {"type": "object", "required": ["groups"], "properties": {"groups": {"type": "array", "items": {
            "type": "object", "required": ["name", "rules"], "properties": {
                "name": _STR, "interval": _STR, "rules": {"type": "array", "items": _RULE}},
            "additionalProperties": False}}}, "additionalProperties": False}},
        "additionalProperties": False},
}


def _crd_validators() -> dict[str, jsonschema.protocols.Validator]:
    validators = {}
    for crd in (deployment_crd(), pool_crd()):
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        # OpenAPI v3.0 schemas read as JSON Schema draft 4 (boolean exclusiveMinimum); a structural schema is
        # closed: a field it does not name would be pruned by the API server, so here it fails
        validators[crd["spec"]["names"]["kind"]] = jsonschema.Draft4Validator(_closed(schema))
    return validators


def _closed(node: Any) -> Any:
    if isinstance(node, list):
        return [_closed(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _closed(v) for k, v in node.items()}
    if node.get("type") == "object" and "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        node.setdefault("additionalProperties", False)
    if "properties" in node and "metadata" in node["properties"] and node["properties"]["metadata"] == {
            "type": "object"}:
        node["properties"]["metadata"] = _META
    return node


_CRDS = _crd_validators()


def validate(obj: dict[str, Any]) -> None:
    """Raise (jsonschema or kubernetes-validate's ValidationError) unless `obj` is a valid manifest."""
    kind = obj.get("kind")
    if kind in _CRDS:
        assert obj.get("apiVersion") == "dynserve.io/v1alpha1", obj.get("apiVersion")
        _CRDS[kind].validate(obj)
    elif kind in _MONITORING:
        jsonschema.Draft7Validator(_MONITORING[kind]).validate(obj)
    else:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def validate_all(objs: list[dict[str, Any]]) -> None:
    for obj in objs:
        try:
            validate(obj)
        except Exception as exc:
            raise AssertionError(f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}: {exc}") from exc


def structural_problems(schema: dict[str, Any], where: str = "") -> list[str]:
    """What makes an openAPIV3Schema non-structural (Kubernetes' rules): a node without a type (unless it
    preserves unknown fields or is int-or-string), `properties` beside `additionalProperties`, a `$ref`, an
    `anyOf`/`oneOf` that sets types."""
    problems = []
    if "$ref" in schema:
        problems.append(f"{where}: $ref")
    if "type" not in schema and not (schema.get("x-kubernetes-int-or-string")
                                     or schema.get("x-kubernetes-preserve-unknown-fields")):
        problems.append(f"{where}: no type")
    if "properties" in schema and "additionalProperties" in schema:
        problems.append(f"{where}: properties and additionalProperties")
    for key in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(key, []):
            if "type" in branch:
                problems.append(f"{where}: {key} sets a type")
    for name, sub in schema.get("properties", {}).items():
        problems += structural_problems(sub, f"{where}.{name}")
    if isinstance(schema.get("additionalProperties"), dict):
        problems += structural_problems(schema["additionalProperties"], f"{where}[*]")
    if "items" in schema:
        problems += structural_problems(schema["items"], f"{where}[]")
    return problems
