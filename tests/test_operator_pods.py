"""The pods' commands are real: the head and worker Deployments the operator builds are run as they would run
in a cluster, as local processes on hosts made of network and PID namespaces (`benchmarks/_hosts.py`), and
the fleet they make must serve through the official `openai` client. A chart or builder that renders but
would not serve fails here.

What stands in for Kubernetes, and only that: each pod is a host (its own address on 198.18.0.0/24); the pod's
environment is built as the kubelet builds it (the ConfigMap's data, then the container's `env` with `$(VAR)`
references expanded, `status.podIP` from the downward API, Secrets' keys from `SECRETS`); the Services' DNS
names resolve through the hosts' own `/etc/hosts`; a pool scaled up is one more pod started, scaled down one
pod gone. The commands, arguments and variables are the built manifests', unchanged.

Each pod runs locked down as its manifest says: its command runs as the pod's `runAsUser` and `runAsGroup`
(`setpriv`, every capability dropped, no new privileges), and the host's whole filesystem is read-only but for
a fresh tmpfs at each of the container's emptyDir mounts (sized as the emptyDir says): a path the pods write
without declaring it fails here as it would on a read-only root. The image's home directory does not exist.
"""

from __future__ import annotations

import json
import os
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
STAGE = "/mnt"  # where a writable path's old contents wait while the checkout under test is bound back
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
    env = {"PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin", "HOME": "/home/dynserve", "LANG": "C.UTF-8",
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


# Run inside a host's own mount namespace, as root, before the pod's command: a tmpfs at each writable path
# (mode 1777, as an emptyDir) and at each directory the pod's user could not pass on its way to the
# interpreter or the checkout (mode 0755), those bound back where a tmpfs covers them; then every mount but
# the writable ones read-only.
_LOCK_DOWN = """
import json, subprocess, sys
plan = json.loads(sys.argv[1])
def mount(*args):
    subprocess.run(["mount", *args], check=True, capture_output=True)
mount("--make-rprivate", "/")
for path, size, mode in plan["tmpfs"]:
    kept = [k for k in plan["keep"] if k.startswith(path + "/")]
    if kept:
        mount("--rbind", path, plan["stage"])
    mount("-t", "tmpfs", "-o", f"mode={mode}" + (f",size={size}" if size else ""), "tmpfs", path)
    for k in kept:
        subprocess.run(["mkdir", "-p", k], check=True)
        mount("--rbind", plan["stage"] + k[len(path):], k)
    if kept:
        subprocess.run(["umount", "-l", plan["stage"]], check=True)
writable = set(plan["writable"])
with open("/proc/self/mountinfo") as f:
    points = {line.split()[4].encode().decode("unicode_escape") for line in f}
for point in sorted(points - writable):
    if point.split("/")[1] not in ("proc", "sys", "dev"):
        mount("-o", "remount,bind,ro", point)
"""


def writable_paths(deployment: dict[str, Any]) -> list[tuple[str, str | None]]:
    """(mount path, size) of each emptyDir the pod's container mounts: where it may write."""
    pod = deployment["spec"]["template"]["spec"]
    empty_dirs = {v["name"]: v["emptyDir"] for v in pod.get("volumes", []) if "emptyDir" in v}
    mounts = pod["containers"][0].get("volumeMounts", [])
    return [(m["mountPath"], empty_dirs[m["name"]].get("sizeLimit", "").replace("Mi", "m") or None)
            for m in mounts if m["name"] in empty_dirs]


def as_pod_user(deployment: dict[str, Any], argv: list[str]) -> list[str]:
    """`argv` run as the pod's user and group, with no capabilities and no way to gain privileges."""
    security = deployment["spec"]["template"]["spec"]["securityContext"]
    assert security["runAsNonRoot"] and security["runAsUser"] != 0
    return ["setpriv", f"--reuid={security['runAsUser']}", f"--regid={security['runAsGroup']}",
            f"--groups={security['fsGroup']}", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs",
            "--", *argv]


class Pods:
    """Pods on hosts: each host is prepared as a pod's network (the Services' names in its `/etc/hosts`) and
    filesystem (read-only but for its emptyDirs), then runs one container's command as the pod's user."""

    def __init__(self, hosts: Hosts, children: list[dict[str, Any]], log_dir: Path) -> None:
        self.hosts, self.children, self.log_dir = hosts, children, log_dir
        self.deployments = {c["metadata"]["name"]: c for c in children if c["kind"] == "Deployment"}
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.etc_hosts = log_dir / "hosts"
        services = [c["metadata"]["name"] for c in children if c["kind"] == "Service"]
        # the head's Services resolve to the head pod (host a): cluster DNS, as far as these pods need it
        head_services = [s for s in services if s in (NAME, f"{NAME}-head")]
        self.etc_hosts.write_text(f"127.0.0.1 localhost\n{hosts[0].ip} {' '.join(head_services)}\n")
        self.made_dirs: list[Path] = []  # mount points made here, as a container runtime makes them

    def start(self, deployment_name: str, host: Host) -> None:
        host.run(["mount", "--bind", str(self.etc_hosts), "/etc/hosts"])
        deployment = self.deployments[deployment_name]
        writable = writable_paths(deployment)
        for path, _size in writable:
            if not Path(path).exists():
                Path(path).mkdir(parents=True)
                self.made_dirs.append(Path(path))
        # what the image holds: the interpreter, the virtualenv, the code (here: this checkout)
        keep = sorted({str(Path(p).resolve()) for p in (sys.base_prefix, sys.prefix, Path(__file__).parent.parent)})
        closed = {next(a for a in reversed(Path(k).parents) if not a.stat().st_mode & 0o001) for k in keep
                  if any(not a.stat().st_mode & 0o001 for a in Path(k).parents)}
        tmpfs = [(path, size, "1777") for path, size in writable] + [(str(a), None, "0755") for a in closed]
        plan = {"tmpfs": sorted(tmpfs, key=lambda t: len(t[0])), "keep": keep, "stage": STAGE,
                "writable": [path for path, _size in writable]}
        host.run([sys.executable, "-c", _LOCK_DOWN, json.dumps(plan)])
        command = as_pod_user(deployment, deployment["spec"]["template"]["spec"]["containers"][0]["command"])
        with (self.log_dir / f"{host.name}-{deployment_name}.log").open("wb") as log:  # the child keeps its copy
            self.processes[host.name] = host.popen(command, env=pod_environment(self.children, deployment, host.ip),
                                                   stdout=log, stderr=subprocess.STDOUT)

    def stop(self, host: Host, deployment_name: str, grace_s: float = 30) -> None:
        """Stop the pod on `host` as the kubelet does: its preStop hook, SIGTERM, SIGKILL after the grace period."""
        process = self.processes.pop(host.name)
        container = self.deployments[deployment_name]["spec"]["template"]["spec"]["containers"][0]
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
        if pre_stop:
            host.run(as_pod_user(self.deployments[deployment_name], pre_stop), env=pod_environment(self.children, self.deployments[deployment_name], host.ip),
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
        pods = Pods(hosts, children, Path(log_dir))
        try:
            yield hosts, pods
        finally:
            hosts.close()  # the hosts' mounts go with them; then the mount points made for them
            for path in reversed(pods.made_dirs):
                os.rmdir(path)


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
