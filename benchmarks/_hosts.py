"""Several hosts on one machine, for tests and benchmarks of what crosses a network.

`Hosts(n)` builds `n` hosts out of Linux namespaces:
- a network namespace per host, its interface `eth1` (one veth end) holding `198.18.0.<i+1>/24`; the other
  ends hang on a bridge in a namespace of their own. 198.18.0.0/24 exists only inside these namespaces and
  nothing routes out of them: the hosts reach each other and nothing else, and loopback is each host's own.
- a PID namespace per host (`unshare --pid --fork --kill-child --mount-proc`, its init a `sleep`): every
  process of the host is started inside it (`nsenter`), so `Host.stop()` (SIGKILL to `unshare`, which takes
  its init and so every process of the namespace with it) ends the host whole, as pulling its plug would.

`RayCluster(hosts, head=0, nodes={1: 1, 2: 1})` starts a Ray head (0 CPUs: nothing is placed there) on one
host and Ray worker nodes on others (with the CPUs given, and a resource `host_<name>` naming the node), each
with its own temp dir. Processes see `UCX_TLS=tcp,self` and
`UCX_NET_DEVICES=eth1`, so NIXL moves pages over TCP between hosts, never through memory they share.

The code that needs a host's network without a process of its own (the test's `openai` client) runs through
`Host.call(fn)`: a thread that joined the host's network namespace, whose sockets stay in it.

Needs root, `ip netns`, `unshare` and `nsenter`; `missing()` says what is missing, for a skip reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from dynserve.config import ray_system_config_flag

__all__ = ["SUBNET", "Host", "HostProcess", "Hosts", "RayCluster", "cluster", "dynctl_serve", "missing"]

SUBNET = "198.18.0"  # a range reserved for benchmarking networks (RFC 2544): never anyone's real address
_CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def missing() -> str | None:
    """Why hosts cannot be built here (not root, a tool missing), or None."""
    if os.geteuid() != 0:
        return "building hosts from network namespaces needs root"
    for tool in ("ip", "unshare", "nsenter", "ss"):
        if shutil.which(tool) is None:
            return f"building hosts needs {tool!r} (iproute2 / util-linux)"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _ip_in(netns: str, *args: str) -> None:
    _ip("-n", netns, *args)


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        return [int(child) for child in path.read_text().split()]
    except OSError:
        return []


class HostProcess(subprocess.Popen):  # type: ignore[type-arg]
    """A process started on a host. `nsenter` forks it into the host's PID namespace and waits for it,
    passing its exit status on but not signals: signals go to the process itself."""

    def send_signal(self, sig: int) -> None:
        for child in _children(self.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, sig)


@dataclass(eq=False)
class Host:
    """One host: a network namespace with one address, and a PID namespace its processes run in."""

    name: str
    ip: str
    netns: str
    _unshare: subprocess.Popen[bytes] | None = None
    _init_pid: int | None = None  # the namespace's init, seen from outside
    _processes: list[HostProcess] = field(default_factory=list)

    def boot(self) -> None:
        self._unshare = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, "unshare", "--pid", "--fork", "--kill-child", "--mount-proc",
             "sleep", "infinity"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # `ip netns exec` execs unshare, which forks the namespace's init: find it as unshare's child
        deadline = time.monotonic() + 10
        while self._init_pid is None:
            pids = _children(self._unshare.pid)
            if pids:
                self._init_pid = int(pids[0])
            elif time.monotonic() > deadline:
                raise RuntimeError(f"host {self.name}: its PID namespace did not start")
            else:
                time.sleep(0.01)

    @property
    def alive(self) -> bool:
        return self._unshare is not None and self._unshare.poll() is None

    def command(self, argv: list[str]) -> list[str]:
        """`argv` as run inside this host: its network, PID and mount namespaces."""
        assert self._init_pid is not None, "boot() first"
        return ["nsenter", "-t", str(self._init_pid), "-n", "-p", "-m", "--", *argv]

    def popen(self, argv: list[str], env: dict[str, str] | None = None, **kwargs: Any) -> HostProcess:
        """Start `argv` on this host (it ends with the host at the latest)."""
        process = HostProcess(self.command(argv), env=env, **kwargs)
        self._processes.append(process)
        return process

    def run(self, argv: list[str], env: dict[str, str] | None = None, timeout_s: float = 120,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(self.command(argv), env=env, capture_output=True, text=True, timeout=timeout_s)
        if check and done.returncode != 0:
            raise RuntimeError(f"on {self.name}: {' '.join(argv)} exited {done.returncode}:\n"
                               f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done

    def listening(self) -> list[tuple[str, int, str]]:
        """(address, port, process name) of every TCP socket listening on this host (the name as the kernel
        keeps it: 15 characters at most, e.g. 'ray::EngineWork')."""
        out = subprocess.run(["ip", "netns", "exec", self.netns, "ss", "-ltnpH"], capture_output=True, text=True,
                             check=True, timeout=30).stdout
        sockets = []
        for line in out.splitlines():
            address, _, port = line.split()[3].rpartition(":")
            process = re.search(r'users:\(\("([^"]+)"', line)
            sockets.append((address.strip("[]"), int(port), process.group(1) if process else ""))
        return sockets

    def call(self, fn: Callable[[], T], timeout_s: float = 600) -> T:
        """`fn()` run on a thread inside this host's network: its sockets are this host's."""
        result: list[Any] = []

        def inside() -> None:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                fd = os.open(f"/run/netns/{self.netns}", os.O_RDONLY)
                try:
                    if libc.setns(fd, _CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), f"setns into {self.netns}")
                finally:
                    os.close(fd)
                result.append((True, fn()))
            except BaseException as exc:  # handed back to the caller's thread
                result.append((False, exc))

        thread = threading.Thread(target=inside, name=f"on-{self.name}", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if not result:
            raise TimeoutError(f"call on host {self.name} did not return within {timeout_s} s")
        ok, value = result[0]
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    def stop(self) -> None:
        """End the host at once: every process in it is killed (SIGKILL), as when a machine loses power."""
        if self._unshare is not None and self._unshare.poll() is None:
            self._unshare.send_signal(signal.SIGKILL)
            self._unshare.wait(10)
        for process in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
        self._processes.clear()


class Hosts:
    """`n` hosts on a bridge: `with Hosts(3) as hosts: hosts[0].ip == "198.18.0.1"`."""

    def __init__(self, num_hosts: int, tag: str | None = None) -> None:
        if not 1 <= num_hosts <= 200:
            raise ValueError("1 to 200 hosts")
        self.tag = tag or uuid.uuid4().hex[:6]
        self.bridge_ns = f"ds{self.tag}-br"
        self.hosts = [Host(chr(ord("a") + i) if i < 26 else f"h{i}", f"{SUBNET}.{i + 1}", f"ds{self.tag}-{i}")
                      for i in range(num_hosts)]

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __len__(self) -> int:
        return len(self.hosts)

    def __enter__(self) -> Hosts:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        _ip("netns", "add", self.bridge_ns)
        _ip_in(self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip_in(self.bridge_ns, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            _ip("netns", "add", host.netns)
            # both ends are created inside the bridge's namespace, then one moves: no name in the root's
            _ip_in(self.bridge_ns, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth1")
            _ip_in(self.bridge_ns, "link", "set", "eth1", "netns", host.netns)
            _ip_in(self.bridge_ns, "link", "set", f"p{i}", "master", "br0", "up")
            _ip_in(host.netns, "addr", "add", f"{host.ip}/24", "dev", "eth1")
            _ip_in(host.netns, "link", "set", "eth1", "up")
            _ip_in(host.netns, "link", "set", "lo", "up")
            host.boot()

    def pull_plug(self, host: Host) -> None:
        """Lose `host` as a machine is lost: its link goes down first, so its connections end silently (no FIN,
        no RST reaches anyone), then every process of it is killed."""
        _ip_in(self.bridge_ns, "link", "set", f"p{self.hosts.index(host)}", "down")
        host.stop()

    def close(self) -> None:
        for host in self.hosts:
            host.stop()
        for netns in [h.netns for h in self.hosts] + [self.bridge_ns]:
            subprocess.run(["ip", "netns", "delete", netns], capture_output=True, timeout=30)


class RayCluster:
    """A Ray head on one host (0 CPUs) and worker nodes on others; `address` is the head's GCS."""

    PORT = 6380

    def __init__(self, hosts: Hosts, *, head: int = 0, nodes: dict[int, float] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.hosts = hosts
        self.head = hosts[head]
        self.nodes = {hosts[i]: cpus for i, cpus in (nodes or {}).items()}
        self.address = f"{self.head.ip}:{self.PORT}"
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled", "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth1",
                    "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}
        # each host's addresses are its own (Ray's node IP): not the one-host loopback of the caller's tests
        for name in ("RAY_ADDRESS", "RAY_TMPDIR", "DYN_ADVERTISE_HOST", "DYN_BIND_HOST"):
            self.env.pop(name, None)
        self.temp_dirs: list[str] = []
        self._ray = str(Path(sys.executable).parent / "ray")

    def __enter__(self) -> RayCluster:
        self._start_node(self.head, ["--head", "--port", str(self.PORT), "--num-cpus", "0",
                                     "--include-dashboard=false", ray_system_config_flag()])
        for host, cpus in self.nodes.items():
            # a custom resource names each node, so a benchmark can place an actor on a given host
            self._start_node(host, ["--address", self.address, "--num-cpus", f"{cpus:g}",
                                    "--resources", json.dumps({f"host_{host.name}": 1})])
        return self

    def __exit__(self, *exc: object) -> None:
        for directory in self.temp_dirs:
            shutil.rmtree(directory, ignore_errors=True)

    def _start_node(self, host: Host, args: list[str]) -> None:
        temp_dir = f"/tmp/ray-{self.hosts.tag}-{host.name}"  # short: Ray's socket paths must fit 107 bytes
        self.temp_dirs.append(temp_dir)
        host.run([self._ray, "start", *args, "--node-ip-address", host.ip, "--temp-dir", temp_dir,
                  "--object-store-memory", str(80 * 2**20), "--disable-usage-stats"],
                 env=self.env, timeout_s=120)

    def wait_for_nodes(self, count: int, timeout_s: float = 60) -> None:
        """Until `count` nodes are alive (head included)."""
        script = "import ray; ray.init(address='auto'); print(sum(n['Alive'] for n in ray.nodes()))"
        deadline = time.monotonic() + timeout_s
        while True:
            done = self.head.run([sys.executable, "-c", script],
                                 env={**self.env, "RAY_ADDRESS": self.address}, check=False)
            if done.returncode == 0 and int(done.stdout.split()[-1]) == count:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} Ray nodes not alive within {timeout_s} s: {done.stdout} {done.stderr}")
            time.sleep(1)


@contextlib.contextmanager
def cluster(num_hosts: int, nodes: dict[int, float], env: dict[str, str] | None = None
            ) -> Iterator[tuple[Hosts, RayCluster]]:
    """Hosts and a Ray cluster on them, both gone on exit."""
    with Hosts(num_hosts) as hosts, RayCluster(hosts, nodes=nodes, env=env) as ray_cluster:
        yield hosts, ray_cluster


@contextlib.contextmanager
def dynctl_serve(ray_cluster: RayCluster, host: Host, *flags: str, timeout_s: float = 240) -> Iterator[str]:
    """`dynctl serve --ray-address` of the cluster on `host`, its gateway on the host's address; yields the
    gateway's URL once it serves, and stops it with SIGINT (it must exit 0) on the way out."""
    dynctl = str(Path(sys.executable).parent / "dynctl")
    process = host.popen([dynctl, "serve", "--ray-address", ray_cluster.address, "--host", host.ip, "--port", "0",
                          *flags], env=ray_cluster.env, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        while not any('"messages"' in line for line in lines):  # the last line of its banner
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dynctl serve did not start on {host.name}:\n{''.join(lines)[-4000:]}")
            lines.append(process.stderr.readline())  # type: ignore[union-attr]
    except BaseException:
        _stop(process)
        raise
    match = re.search(r"http://[^/\s]+:(\d+)/v1", "".join(lines))
    assert match is not None
    # keep reading its log: a full pipe would block the gateway's loop at its next log line
    reader = threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        yield f"http://{host.ip}:{match.group(1)}"
    finally:
        stopping_s = time.monotonic()
        try:
            code = _stop(process)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            reader.join(10)
            process.stderr.close()  # type: ignore[union-attr]
    if code != 0:
        why = "did not exit within 30 s of Ctrl-C (killed)" if code is None else f"exited {code}"
        raise RuntimeError(f"dynctl serve {why}:\n{''.join(lines)[-4000:]}")
    print(f"dynctl serve on {host.name} stopped in {time.monotonic() - stopping_s:.2f} s", file=sys.stderr)


def _stop(process: HostProcess) -> int:
    """Ctrl-C, then SIGKILL after 30 s; the exit code."""
    process.send_signal(signal.SIGINT)
    try:
        return process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)
        raise
