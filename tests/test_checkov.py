"""The manifests as a platform team's security review sees them: checkov's Kubernetes checks, offline, on what
`dynctl deploy --dry-run --render` prints for the README's example, for a fuller deployment (a model
fetched by URI, the planner, gateway-only pods, a bundled Redis, Secrets, a pinned digest) and for the README's
vLLM pool, and on the Helm chart's default render. Each workload (a Deployment, with the checks on its pods) fails at most 2 checks, each
one listed in the README's security section with the reason it stays; nothing else fails at all.

checkov runs once for the whole file, in a subprocess (its import sets up logging of its own), over one
directory holding every render. It is installed by `make setup` (requirements-checkov.txt says how and why).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import helm_python
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DYNCTL = str(Path(sys.executable).parent / "dynctl")
README_YAML = re.search(r"```yaml\n# tiny\.yaml\n(.*?)```", (REPO / "README.md").read_text(),
                        re.DOTALL).group(1)  # type: ignore[union-attr]
VLLM_YAML = re.search(r"```yaml\n# qwen\.yaml\n(.*?)```", (REPO / "README.md").read_text(),
                      re.DOTALL).group(1)  # type: ignore[union-attr]
FULL = {
    "apiVersion": "dynserve.io/v1alpha1", "kind": "DynServeDeployment", "metadata": {"name": "llama"},
    "spec": {
        "model": {"uri": "https://models.example.com/llama-3.2-1b-instruct-q8_0.gguf", "dtype": "bfloat16"},
        "image": {"digest": "sha256:" + "0123456789abcdef" * 4},  # what an installer pins
        "gateway": {"replicas": 2, "apiKeySecret": {"name": "llama-api-key"}},
        "clusterTokenSecret": {"name": "llama-cluster"},
        "pools": {"prefill": {"replicas": 1}, "decode": {"replicas": 2}},
        "eventPlane": {"backend": "redis"},
        "planner": {"enabled": True},
        "observability": {"serviceMonitor": True},
    },
}
MAX_FAILED_PER_WORKLOAD = 2
# checkov's Runner on a directory of manifests; prints each failed check as JSON
_SCAN = """
import json, sys
from checkov.kubernetes.runner import Runner
from checkov.runner_filter import RunnerFilter
report = Runner().run(root_folder=sys.argv[1], runner_filter=RunnerFilter(framework=["kubernetes"]))
print(json.dumps({"passed": len(report.passed_checks),
                  "failed": [[c.check_id, c.resource] for c in report.failed_checks]}))
"""


def _dynctl_render(path: Path, namespace: str) -> subprocess.Popen[str]:
    return subprocess.Popen([DYNCTL, "deploy", "-f", str(path), "-n", namespace, "--dry-run", "--render"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def scan(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, set[str]]]:
    """Render -> resource ("Kind/namespace/name"; a pod's checks under its Deployment) -> failed check ids."""
    root = tmp_path_factory.mktemp("renders")
    (root / "readme.in.yaml").write_text(README_YAML)
    (root / "full.in.yaml").write_text(yaml.safe_dump(FULL))
    (root / "vllm.in.yaml").write_text(VLLM_YAML)
    # a namespace of its own, as deployments get (the `default` namespace is a finding of its own: CKV_K8S_21)
    renders = {"readme": _dynctl_render(root / "readme.in.yaml", "ml"),
               "full": _dynctl_render(root / "full.in.yaml", "serving"),
               "vllm": _dynctl_render(root / "vllm.in.yaml", "inference")}
    (root / "out").mkdir()
    with helm_python.Chart.load(REPO / "deploy" / "helm" / "dynserve") as chart:
        manifests = chart.render({}, name="serve", namespace="dynserve-system")
    (root / "out" / "chart.yaml").write_text("\n---\n".join(t for p, t in sorted(manifests.items())
                                                            if not p.endswith("NOTES.txt")))
    for name, process in renders.items():
        out, err = process.communicate(timeout=60)
        assert process.returncode == 0, err
        (root / "out" / f"{name}.yaml").write_text(out)
    done = subprocess.run([sys.executable, "-c", _SCAN, str(root / "out")], capture_output=True, text=True,
                          timeout=120, check=True)
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["passed"] > 100, "checkov checked next to nothing"
    by_render: dict[str, dict[str, set[str]]] = {"readme": defaultdict(set), "full": defaultdict(set),
                                                 "vllm": defaultdict(set), "chart": defaultdict(set)}
    namespaces = {"ml": "readme", "serving": "full", "inference": "vllm", "dynserve-system": "chart"}
    for check_id, resource in report["failed"]:
        kind, namespace, name = resource.split(".")[:3]
        # a graph check on a pod (no NetworkPolicy) counts against its Deployment
        by_render[namespaces[namespace]][f"{'Deployment' if kind == 'Pod' else kind}/{namespace}/{name}"].add(
            check_id)
    return by_render


def _readme_exceptions() -> dict[str, str]:
    """Check id -> why it stays, from the README's table of checks that still fail."""
    section = (REPO / "README.md").read_text().split("### What a security review still finds", 1)[1]
    return dict(re.findall(r"^\| `(CKV\d?_K8S_\d+)` \| [^|]+ \| ([^|]+) \|$", section.split("\n\n##", 1)[0],
                           re.MULTILINE))


@pytest.mark.parametrize("render", ["readme", "full", "vllm", "chart"])
def test_each_workload_fails_at_most_two_checks_and_nothing_else_fails(
        scan: dict[str, dict[str, set[str]]], render: str) -> None:
    failed = scan[render]
    assert all(resource.startswith("Deployment/") for resource in failed), dict(failed)
    assert {r: sorted(c) for r, c in failed.items() if len(c) > MAX_FAILED_PER_WORKLOAD} == {}


def test_every_check_that_still_fails_is_named_in_the_readme_with_its_reason(
        scan: dict[str, dict[str, set[str]]]) -> None:
    remaining = {check for failed in scan.values() for checks in failed.values() for check in checks}
    named = _readme_exceptions()
    assert remaining == set(named), f"still failing: {sorted(remaining)}; the README names {sorted(named)}"
    assert all(len(reason.strip()) > 20 for reason in named.values())


def test_the_readmes_example_fails_only_for_an_unpinned_digest(scan: dict[str, dict[str, set[str]]]) -> None:
    """Hardened by default: what the installer does not give (a digest) is the one finding."""
    assert dict(scan["readme"]) == {f"Deployment/ml/tiny-{w}": {"CKV_K8S_43"} for w in ("head", "prefill", "decode")}


def test_a_vllm_pool_fails_only_for_unpinned_digests_and_its_sidecars_liveness(
        scan: dict[str, dict[str, set[str]]]) -> None:
    assert dict(scan["vllm"]) == {"Deployment/inference/qwen-head": {"CKV_K8S_43"},
                                  "Deployment/inference/qwen-workers": {"CKV_K8S_43", "CKV_K8S_8"}}


def test_checkovs_requirements_leave_every_pin_of_requirements_txt_alone() -> None:
    """checkov is installed without the dependencies it declares; what it imports besides ours is pinned in
    its own file, none of it a distribution requirements.txt pins (so nothing of ours moves)."""
    def names(path: Path) -> set[str]:
        return {re.sub(r"[-_.]+", "-", line.split("==")[0]).lower()
                for line in path.read_text().splitlines() if "==" in line and not line.startswith("#")}
    ours, checkovs = names(REPO / "requirements.txt"), names(REPO / "requirements-checkov.txt")
    assert "checkov" in checkovs and ours.isdisjoint(checkovs), ours & checkovs
