"""Refresh what the Helm chart (deploy/helm/dynserve) copies from the rest of the repository.

    .venv/bin/python scripts/sync-chart-files.py          # rewrite the copies
    .venv/bin/python scripts/sync-chart-files.py --check  # exit 1, naming each stale copy

Helm reads only files inside a chart, so the chart keeps copies:
- files/dashboards/*.json: the Grafana dashboards of deploy/grafana (dynserve/observability/dashboards.py);
- files/dynserve-rules.yml: the recording rules of deploy/prometheus (dynserve/observability/rules.py);
- values.schema.json's `example.spec`: the DynServeDeployment CRD's spec schema (dynserve/operator/crd.py),
  rewritten from OpenAPI v3 into JSON Schema draft-07 (what Helm validates values with), closed like the API
  server's structural pruning: a field the CRD does not name is refused.

tests/test_helm_chart.py calls `stale()` and fails on any difference.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "deploy" / "helm" / "dynserve"
SCHEMA_FILE = CHART / "values.schema.json"
CRD_FILE = CHART / "crds" / "dynservedeployments.dynserve.io.yaml"

__all__ = ["CHART", "copies", "example_spec_schema", "stale", "sync", "values_schema"]


def copies() -> dict[Path, Path]:
    """Each copied file in the chart -> its source."""
    pairs = {CHART / "files" / "dashboards" / src.name: src
             for src in sorted((REPO / "deploy" / "grafana").glob("*.json"))}
    pairs[CHART / "files" / "dynserve-rules.yml"] = REPO / "deploy" / "prometheus" / "dynserve-rules.yml"
    return pairs


def _draft7(node: Any) -> Any:
    """One OpenAPI v3.0 (structural CRD) schema node as JSON Schema draft-07."""
    if isinstance(node, list):
        return [_draft7(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _draft7(value) for key, value in node.items()
           if key not in ("x-kubernetes-validations", "x-kubernetes-int-or-string",
                          "x-kubernetes-preserve-unknown-fields", "exclusiveMinimum", "exclusiveMaximum")}
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    for exclusive, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if node.get(exclusive) is True:  # OpenAPI 3.0's boolean flag -> draft-07's numeric bound
            out[exclusive] = out.pop(bound)
    preserves_unknown = node.get("x-kubernetes-preserve-unknown-fields")
    if out.get("type") == "object" and "properties" in out and not preserves_unknown:
        out["additionalProperties"] = False
    return out


def example_spec_schema() -> dict[str, Any]:
    """The schema of `example.spec`: the CRD's `.spec`, as draft-07."""
    crd = yaml.safe_load(CRD_FILE.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return {**_draft7(spec), "description": "a DynServeDeployment's spec (its CRD's schema)"}


def values_schema() -> str:
    """values.schema.json as it should read: the file, with `example.spec` from the CRD."""
    schema = json.loads(SCHEMA_FILE.read_text())
    schema["properties"]["example"]["properties"]["spec"] = example_spec_schema()
    return json.dumps(schema, indent=2) + "\n"


def _wanted() -> dict[Path, str]:
    wanted = {copy: source.read_text() for copy, source in copies().items()}
    wanted[SCHEMA_FILE] = values_schema()
    return wanted


def _extra_copies() -> list[Path]:
    """Dashboards in the chart whose source is gone."""
    return sorted(set((CHART / "files" / "dashboards").glob("*.json")) - set(copies()))


def stale() -> list[Path]:
    """The chart's files that differ from what `sync` would write, or that it would delete."""
    out = [path for path, text in _wanted().items() if not path.exists() or path.read_text() != text]
    return out + _extra_copies()


def sync() -> list[Path]:
    """Rewrite the stale files; returns them."""
    changed = stale()
    for path, text in _wanted().items():
        if path in changed:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    for path in _extra_copies():
        path.unlink()
    return changed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a copy is stale")
    args = parser.parse_args()
    changed = stale() if args.check else sync()
    for path in changed:
        print(f"{'stale' if args.check else 'updated'}: {path.relative_to(REPO)}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
