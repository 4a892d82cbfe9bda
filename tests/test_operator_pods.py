"""The pods' commands are real: the head and worker Deployments the operator builds are run as they would run
in a cluster, as local processes on hosts made of network and PID namespaces (`benchmarks/_hosts.py`), and
the fleet they make must serve through the official `openai` client. A chart or builder that renders but
would not serve fails here.

What stands in for Kubernetes, and only that: each pod is a host (its own address on 198.18.0.0/24, its own
`/tmp/ray`); the pod's environment is built as the kubelet builds it (the ConfigMap's data, then the container's
`env` with `$(VAR)` references expanded, `status.podIP` from the downward API, Secrets' keys from `SECRETS`);
the Services' DNS names resolve through the hosts' own `/etc/hosts`; a pool scaled up is one more pod
started, scaled down one pod gone. The commands, arguments and variables are the built manifests', unchanged.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import needs

from benchmarks._hosts import Host, Hosts, missing
from dynserve.operator.builders import build_children
from dynserve.operator.spec import parse_deployment

pytestmark = pytest.mark.skipif(missing() is not None, reason=missing() or "")

NAME, NAMESPACE = "smol", "ml"
RAY_DIR = Path("/tmp/ray")  # where `ray start` keeps its session by default
MODEL = "SmolLM2-135M-Instruct"
VENV_BIN = str(Path(sys.executable).parent)
SECRETS = {("smol-cluster", "token"): "pods-test-cluster-token-0123456789"}  # the Secrets the pods read
SPEC = {
    "gateway": {"replicas": 2},  # the head's gateway and one gateway-only pod
    "clusterTokenSecret": {"name": "smol-cluster"},  # every internal socket requires it
    "pools": {"prefill": {"replicas": 1}, "decode": {"replicas": 1, "maxReplicas": 4}},
    "engine": {"mocker": "cpu", "mockerSpeedup": 10},
    # every prompt is prefilled remotely, so both pools serve each request
    "env": [{"name": "DYN_DISAGG_LOCAL_PREFILL_TOKENS", "value": "0"}],
}


def _expand(value: str, env: dict[str, str]) -> str:
    """`$(VAR)` as the kubelet expands it in an env value: a defined variable's value, else left as written."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def pod_environment(children: list[dict[str, Any]], deployment: dict[str, Any], pod_ip: str) -> dict[str, str]:
    """The container's environment as the kubelet builds it: the image's (PATH to the venv), its envFrom
    ConfigMaps, then its env entries in order."""
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    configs = {c["metadata"]["name"]: c["data"] for c in children if c["kind"] == "ConfigMap"}
    env = {"PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8",
           # what this machine's NIXL needs between hosts (in a cluster: the image's or the node's UCX setup)
           "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth1"}
    for source in container.get("envFrom", []):
        env.update(configs[source["configMapRef"]["name"]])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = _expand(var["value"], env)
        elif var["valueFrom"].get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[var["name"]] = pod_ip
        elif "secretKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = SECRETS[(ref["name"], ref["key"])]
        else:
            raise AssertionError(f"the test cannot stand in for {var}")
    return env


class Pods:
    """Pods on hosts: each host is prepared as a pod's network (its `/tmp` private, the Services' names in its
    `/etc/hosts`), then runs one container's command."""

    def __init__(self, hosts: Hosts, children: list[dict[str, Any]], log_dir: Path) -> None:
        self.hosts, self.children, self.log_dir = hosts, children, log_dir
        self.deployments = {c["metadata"]["name"]: c for c in children if c["kind"] == "Deployment"}
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.etc_hosts = log_dir / "hosts"
        services = [c["metadata"]["name"] for c in children if c["kind"] == "Service"]
        # the head's Services resolve to the head pod (host a): cluster DNS, as far as these pods need it
        head_services = [s for s in services if s in (NAME, f"{NAME}-head")]
        self.etc_hosts.write_text(f"127.0.0.1 localhost\n{hosts[0].ip} {' '.join(head_services)}\n")

    def start(self, deployment_name: str, host: Host) -> None:
        host.run(["mount", "--bind", str(self.etc_hosts), "/etc/hosts"])
        # Ray's session directory, the pod's own (not all of /tmp: the checkout under test may live there)
        RAY_DIR.mkdir(exist_ok=True)
        host.run(["mount", "-t", "tmpfs", "tmpfs", str(RAY_DIR)])
        deployment = self.deployments[deployment_name]
        command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
        with (self.log_dir / f"{host.name}-{deployment_name}.log").open("wb") as log:  # the child keeps its copy
            self.processes[host.name] = host.popen(command, env=pod_environment(self.children, deployment, host.ip),
                                                   stdout=log, stderr=subprocess.STDOUT)

    def stop(self, host: Host, deployment_name: str, grace_s: float = 30) -> None:
        """Stop the pod on `host` as the kubelet does: its preStop hook, SIGTERM, SIGKILL after the grace period."""
        process = self.processes.pop(host.name)
        container = self.deployments[deployment_name]["spec"]["template"]["spec"]["containers"][0]
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
        if pre_stop:
            host.run(pre_stop, env=pod_environment(self.children, self.deployments[deployment_name], host.ip),
                     timeout_s=grace_s)
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace_s)
        finally:
            host.stop()

    def logs(self) -> str:
        return "\n".join(f"==== {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.log_dir.glob("*.log")))


@pytest.fixture(scope="module")
@needs('netns', 'fleet', 'ray')
def pods() -> Iterator[tuple[Hosts, Pods]]:
    children = build_children(NAME, NAMESPACE, parse_deployment(SPEC), uid="0a1b")
    with Hosts(5) as hosts, tempfile.TemporaryDirectory(prefix="dynserve-pods-", dir="/var/tmp") as log_dir:
        yield hosts, Pods(hosts, children, Path(log_dir))


def _gateway(hosts: Hosts, index: int = 0) -> str:
    return f"http://{hosts[index].ip}:8000"


def _worker_up(hosts: Hosts, index: int = 0) -> float:
    text = hosts[0].call(lambda: httpx.get(f"{_gateway(hosts, index)}/metrics", timeout=10).text)
    return sum(float(v) for v in re.findall(r"^dynserve_gateway_worker_up\{[^}]*\} (\S+)$", text, re.MULTILINE))


def _wait(what: str, ok: Any, pods: Pods, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if ok():
                return
        except (httpx.HTTPError, OSError):
            pass
        dead = {name: p.returncode for name, p in pods.processes.items() if p.poll() is not None}
        if dead or time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s (exited: {dead})\n{pods.logs()}")
        time.sleep(1)


def _chat(url: str) -> list[str]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    answers = []
    for i in range(4):
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Hello {i}!"}],
                                              max_tokens=8)
        assert chat.usage.completion_tokens == 8
        answers.append(chat.choices[0].message.content)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count."}],
                                            max_tokens=8, stream=True)
    answers.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    return answers


def test_the_built_pods_serve_and_a_pool_follows_its_pods(pods: tuple[Hosts, Pods]) -> None:
    hosts, fleet = pods
    a, b, c, d, e = hosts[0], hosts[1], hosts[2], hosts[3], hosts[4]
    fleet.start(f"{NAME}-head", a)
    fleet.start(f"{NAME}-prefill", b)
    fleet.start(f"{NAME}-decode", c)
    fleet.start(f"{NAME}-gateway", e)
    url = _gateway(hosts)
    _wait("the gateway ready with both pools' workers",
          lambda: a.call(lambda: httpx.get(f"{url}/ready", timeout=5).status_code == 200) and _worker_up(hosts) == 2,
          fleet)
    assert all(a.call(lambda: _chat(url))), "empty answers"
    # the gateway-only pod serves the same fleet
    _wait("the second gateway ready", lambda: _worker_up(hosts, 4) == 2, fleet)
    assert all(a.call(lambda: _chat(_gateway(hosts, 4))))
    metrics = a.call(lambda: httpx.get(f"{url}/metrics", timeout=10).text)
    assert re.search(r'^dynserve_disagg_requests_total\{[^}]*path="remote"[^}]*\} [1-9]', metrics, re.MULTILINE), \
        metrics[-2000:]
    # each worker serves on its pod's address, its metrics at the port the manifests name
    for host in (b, c):
        assert (host.ip, 9100) in [(addr, port) for addr, port, _p in host.listening()], host.listening()

    # scale the decode pool up by a pod (what the operator does when its DynServePool's replicas grow)
    fleet.start(f"{NAME}-decode", d)
    _wait("a third worker on the new pod", lambda: _worker_up(hosts) == 3, fleet)
    # and down by one: the kubelet stops the pod (SIGTERM to its command, here `ray start --block`, which stops
    # the node's Ray processes), the pool shrinks with it and serving goes on
    fleet.stop(d, f"{NAME}-decode")
    _wait("back to two workers", lambda: _worker_up(hosts) == 2, fleet, timeout_s=90)
    assert all(a.call(lambda: _chat(url)))
    assert fleet.processes[a.name].poll() is None, fleet.logs()
