"""The two CustomResourceDefinitions, as data built from `spec.py`'s models: `DynServeDeployment` (a serving
graph) and `DynServePool` (one of its pools, with a `/scale` subresource HPA, KEDA, `kubectl scale` and the
planner drive). `deploy/helm/dynserve/crds/` is this module's output (`python -m dynserve.operator.crd
--write`); a test fails when the two drift.

The openAPIV3Schema is structural (every field typed, no `$ref`, no `anyOf` of types): pydantic's JSON
schema with references inlined, optional fields as their type, `int | str` quantities as
`x-kubernetes-int-or-string`, free-form objects as `x-kubernetes-preserve-unknown-fields`. Rules that span
fields are CEL `x-kubernetes-validations` (the API server enforces them; `parse_deployment` enforces the same
for `dynctl deploy` and the operator).
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import yaml

from dynserve.operator.spec import (
    GROUP, KIND, POOL_KIND, VERSION, DeploymentSpec, PoolResourceSpec,
)

__all__ = ["CRD_DIR", "deployment_crd", "openapi_schema", "pool_crd", "write_crds"]

CRD_DIR = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "dynserve" / "crds"
_DROP = {"title", "default_factory"}


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_inline(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        return _inline(copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[1]]), defs)
    return {key: _inline(value, defs) for key, value in node.items() if key not in _DROP}


def _structural(node: dict[str, Any]) -> dict[str, Any]:
    """One pydantic JSON-schema node as a structural OpenAPI v3 node."""
    node = dict(node)
    int_or_string = node.pop("int_or_string", False)
    variants = node.pop("anyOf", None)
    if variants is not None:
        typed = [v for v in variants if v.get("type") != "null"]
        if {v.get("type") for v in typed} == {"integer", "string"}:
            node["x-kubernetes-int-or-string"] = True
        elif len(typed) == 1:
            node = {**typed[0], **node}
        else:
            raise ValueError(f"cannot express {variants} structurally")
    if node.get("default") is None:
        node.pop("default", None)
    if "const" in node:
        node["enum"] = [node.pop("const")]
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(bound), (int, float)) and not isinstance(node[bound], bool):
            node[plain], node[bound] = node[bound], True  # OpenAPI v3.0: a flag on the plain bound
    if node.get("type") == "object":
        if "properties" in node:
            node["properties"] = {k: _structural(v) for k, v in node["properties"].items()}
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            if int_or_string:
                node["additionalProperties"] = {"x-kubernetes-int-or-string": True}
            else:
                node["additionalProperties"] = _structural(extra)
        elif extra is not None:  # False (closed: a structural schema prunes unknown fields) or True
            node.pop("additionalProperties")
        if node.pop("x-kubernetes-preserve-unknown-fields", False) or (
                "properties" not in node and "additionalProperties" not in node):
            node["x-kubernetes-preserve-unknown-fields"] = True
    if node.get("type") == "array":
        node["items"] = _structural(node["items"])
    if "x-kubernetes-preserve-unknown-fields" in node and "type" not in node:
        node["type"] = "object"
    return node


def openapi_schema(model: type[Any]) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of a pydantic model (camelCase fields, defaults included)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _structural(_inline(raw, defs))


def _condition() -> dict[str, Any]:
    return {"type": "object", "required": ["type", "status"], "properties": {
        "type": {"type": "string"}, "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
        "reason": {"type": "string"}, "message": {"type": "string"},
        "lastTransitionTime": {"type": "string", "format": "date-time"},
        "observedGeneration": {"type": "integer"}}}


def _crd(kind: str, plural: str, short: str, version: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}", "labels": {"app.kubernetes.io/part-of": "dynserve"}},
        "spec": {"group": GROUP, "scope": "Namespaced",
                 "names": {"kind": kind, "listKind": f"{kind}List", "plural": plural, "singular": kind.lower(),
                           "shortNames": [short], "categories": ["dynserve"]},
                 "versions": [{"name": VERSION, "served": True, "storage": True, **version}]},
    }


def deployment_crd() -> dict[str, Any]:
    spec = openapi_schema(DeploymentSpec)
    layout = [{"rule": "has(self.workers) != (has(self.prefill) && has(self.decode)) && "
                       "(has(self.prefill) == has(self.decode))",
               "message": "give workers (aggregated) or both prefill and decode (disaggregated)"}]
    spec["properties"]["pools"]["x-kubernetes-validations"] = layout
    spec["properties"]["models"]["items"]["properties"]["pools"]["x-kubernetes-validations"] = layout
    pool_status = {"type": "object", "properties": {
        "desiredReplicas": {"type": "integer"}, "readyReplicas": {"type": "integer"}}}
    status = {"type": "object", "properties": {
        "observedGeneration": {"type": "integer"},
        "conditions": {"type": "array", "items": _condition(), "x-kubernetes-list-type": "map",
                       "x-kubernetes-list-map-keys": ["type"]},
        "pools": {"type": "object", "additionalProperties": pool_status},
        "gatewayURL": {"type": "string"},
        "phase": {"type": "string"}}}
    return _crd(KIND, "dynservedeployments", "dsd", {
        "schema": {"openAPIV3Schema": {"type": "object", "required": ["spec"], "properties": {
            "apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"},
            "spec": spec, "status": status}}},
        "subresources": {"status": {}},
        "additionalPrinterColumns": [
            {"name": "Ready", "type": "string", "jsonPath": ".status.conditions[?(@.type=='Ready')].status"},
            {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
            {"name": "URL", "type": "string", "jsonPath": ".status.gatewayURL"},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}],
    })


def pool_crd() -> dict[str, Any]:
    spec = openapi_schema(PoolResourceSpec)
    status = {"type": "object", "properties": {
        "replicas": {"type": "integer"}, "readyReplicas": {"type": "integer"},
        "selector": {"type": "string"}, "observedGeneration": {"type": "integer"}}}
    return _crd(POOL_KIND, "dynservepools", "dsp", {
        "schema": {"openAPIV3Schema": {"type": "object", "required": ["spec"], "properties": {
            "apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"},
            "spec": spec, "status": status}}},
        "subresources": {"status": {}, "scale": {"specReplicasPath": ".spec.replicas",
                                                 "statusReplicasPath": ".status.replicas",
                                                 "labelSelectorPath": ".status.selector"}},
        "additionalPrinterColumns": [
            {"name": "Deployment", "type": "string", "jsonPath": ".spec.deployment"},
            {"name": "Pool", "type": "string", "jsonPath": ".spec.pool"},
            {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas"},
            {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}],
    })


def crd_files() -> dict[str, str]:
    """File name -> YAML text of each CRD, as `deploy/helm/dynserve/crds/` holds them."""
    header = "# Generated by `python -m dynserve.operator.crd --write` from dynserve/operator/spec.py: edit that.\n"
    return {f"{crd['metadata']['name']}.yaml": header + yaml.safe_dump(crd, sort_keys=False, width=120)
            for crd in (deployment_crd(), pool_crd())}


def write_crds(directory: Path = CRD_DIR) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in crd_files().items():
        (directory / name).write_text(text)
        paths.append(directory / name)
    return paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write the CRDs to {CRD_DIR}")
    if parser.parse_args().write:
        for path in write_crds():
            print(path)
    else:
        print("---\n".join(crd_files().values()), end="")
