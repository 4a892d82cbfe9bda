"""What the chaos benchmark reads from a running fleet and the faults it injects into it.

Reading: the gateway's `/metrics/targets` (the workers it routes to, each at its metrics address) and
`/metrics` (`dynserve_gateway_worker_up`, the retry, migration and fallback counters, how many KV-event
batches its routers applied), and each worker's own `/metrics` (role, running requests, KV blocks held by
requests). Finding a process: only among the descendants of the fleet's `dynctl serve` (its local Ray's
raylet and every actor are), so another Ray cluster on the machine is never touched: a worker by the
metrics port it listens on, the embedded event plane by its actor's process title.

Faults: SIGKILL of one process (a worker, the event-plane actor, a gateway); a Redis restart (SIGKILL, then
a new redis-server on the same port, empty as a real one without persistence would come back); a gateway
alone over the fleet (`dynctl gateway --ray-address`), started, killed and started again on the same port.

`watch_recovery` samples a predicate of the fleet every 0.2 s after a fault and reports when the fleet was
back at full capacity for good.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from benchmarks._common import log
from benchmarks._http import http_get
from benchmarks._services import Service, http_status

__all__ = ["EventFlow", "Gauges", "Recovery", "StandaloneGateway", "WorkerView", "actor_pid", "counters",
           "gcs_address", "http_ready", "kill", "listening_pid", "redis_xlen", "restart_redis", "scrape",
           "used_blocks", "wait_no_used_blocks", "watch_recovery", "worker_addresses", "worker_up", "workers"]

REPO_ROOT = Path(__file__).resolve().parent.parent
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')
SAMPLE_INTERVAL_S = 0.2


# ---- reading -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gauges:
    """One scrape: (name, labels) -> value."""

    samples: list[tuple[str, dict[str, str], float]]

    def total(self, name: str, **labels: str) -> float:
        return sum(v for n, found, v in self.samples
                   if n == name and all(found.get(k) == w for k, w in labels.items()))

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for n, found, v in self.samples:
            if n == name:
                out[found.get(label, "")] = out.get(found.get(label, ""), 0.0) + v
        return out


def scrape(address: str, timeout_s: float = 3.0) -> Gauges:
    """Every sample of `address`'s /metrics."""
    samples = []
    for line in http_get(address, "/metrics", timeout_s).splitlines():
        found = _SAMPLE.match(line)
        if found is not None:
            labels = dict(_LABEL.findall(found.group(2) or ""))
            samples.append((found.group(1), labels, float(found.group(3))))
    return Gauges(samples)


def counters(gateway_port: int) -> dict[str, float]:
    """The gateway's fault counters: retries, migrations and disaggregation fallbacks by reason, the
    requests by path, and KV-event batches its routers applied."""
    g = scrape(f"127.0.0.1:{gateway_port}")
    out = {"retries": g.total("dynserve_gateway_retries_total"),
           "kv_event_batches": g.total("dynserve_router_event_lag_seconds_count")}
    for prefix, name, label in (("migrations", "dynserve_migrations_total", "reason"),
                                ("fallbacks", "dynserve_disagg_fallbacks_total", "reason"),
                                ("disagg", "dynserve_disagg_requests_total", "path"),
                                ("rejected", "dynserve_rejected_requests_total", "reason"),
                                ("status", "dynserve_requests_total", "status")):
        for value, total in g.by_label(name, label).items():
            out[f"{prefix}:{value}"] = total
    return out


def redis_xlen(port: int, key: str) -> int | None:
    """`XLEN key` on the redis-server at `port` (None when it does not answer)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as conn:
            conn.sendall(f"*2\r\n$4\r\nXLEN\r\n${len(key)}\r\n{key}\r\n".encode())
            reply = conn.recv(64)
    except OSError:
        return None
    return int(reply[1:].split(b"\r\n")[0]) if reply.startswith(b":") else None


def worker_addresses(gateway_port: int) -> list[str]:
    """The metrics addresses of the workers the gateway routes to (its Prometheus service discovery)."""
    groups = json.loads(http_get(f"127.0.0.1:{gateway_port}", "/metrics/targets", timeout_s=3.0))
    return sorted(t for g in groups if g["labels"].get("component") == "worker" for t in g["targets"])


@dataclass(frozen=True)
class WorkerView:
    address: str  # its metrics address
    worker_id: str
    role: str
    num_running: float
    used_blocks: float


def workers(gateway_port: int) -> list[WorkerView]:
    """Each worker the gateway lists, as its own metrics describe it (those not answering are left out)."""
    views = []
    for address in worker_addresses(gateway_port):
        try:
            g = scrape(address)
        except (OSError, RuntimeError):
            continue
        labels = next((found for n, found, _v in g.samples if n == "dynserve_worker_kv_blocks_capacity"), {})
        views.append(WorkerView(address, labels.get("worker_id", "?"), labels.get("role", "?"),
                                g.total("dynserve_worker_running_requests")
                                + g.total("dynserve_worker_waiting_requests"),
                                g.total("dynserve_worker_kv_blocks_used")))
    return views


def used_blocks(gateway_port: int) -> dict[str, float]:
    """KV blocks held by requests on each worker (worker id -> blocks); the prefix cache's free blocks are not
    counted."""
    return {w.worker_id: w.used_blocks for w in workers(gateway_port)}


def wait_no_used_blocks(gateway_port: int, timeout_s: float) -> tuple[float, float, dict[str, float]]:
    """With no load: wait until no worker holds a block for a request; (blocks still held, seconds waited,
    per worker). A prefill worker frees blocks its decode worker never took when their lease ends."""
    start_s = time.monotonic()
    while True:
        held = used_blocks(gateway_port)
        total = sum(held.values())
        if total == 0 or time.monotonic() - start_s > timeout_s:
            return total, time.monotonic() - start_s, held
        time.sleep(0.5)


def http_ready(port: int) -> bool:
    """The gateway on `port` answers /ready with 200 (a worker is connected and answering)."""
    return http_status(port, "/ready") == 200


def worker_up(gateway_port: int) -> int:
    return int(scrape(f"127.0.0.1:{gateway_port}").total("dynserve_gateway_worker_up"))


# ---- finding processes -------------------------------------------------------------------------------------


def _descendants(root_pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(root_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def listening_pid(root_pid: int, port: int) -> int | None:
    """The descendant of `root_pid` listening on TCP `port`."""
    for process in _descendants(root_pid):
        with contextlib.suppress(psutil.Error):
            connections = process.net_connections("tcp")
            listening = [c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN]
            if port in listening:
                return process.pid
    return None


def actor_pid(root_pid: int, title: str) -> int | None:
    """The descendant of `root_pid` whose process title starts with `title` (a Ray actor: `ray::Name`)."""
    for process in _descendants(root_pid):
        with contextlib.suppress(psutil.Error):
            if " ".join(process.cmdline()).startswith(title):
                return process.pid
    return None


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def gcs_address(ray_tmp: Path) -> str:
    """The address of the GCS of the Ray instance whose temp dir is `ray_tmp` (its head is on this host)."""
    found = sorted((ray_tmp / "ray" / "session_latest").glob("gcs_server_port_*"))
    if not found:
        raise RuntimeError(f"no Ray session under {ray_tmp}")
    return f"127.0.0.1:{found[0].read_text().strip()}"


# ---- recovery ----------------------------------------------------------------------------------------------


@dataclass
class Recovery:
    """A predicate's samples after a fault: (seconds since the fault, held)."""

    samples: list[tuple[float, bool]] = field(default_factory=list)

    @property
    def recovery_s(self) -> float | None:
        """Seconds from the fault to the first sample of the last run of samples that held (0 if none failed);
        None if the last sample failed."""
        if not self.samples or not self.samples[-1][1]:
            return None
        if all(ok for _t, ok in self.samples):
            return 0.0
        last_bad = max(i for i, (_t, ok) in enumerate(self.samples) if not ok)
        return round(self.samples[last_bad + 1][0], 2)


def watch_recovery(fault_s: float, ready: Callable[[], bool], *, hold_s: float, min_s: float,
                   timeout_s: float) -> Recovery:
    """Sample `ready()` (an exception counts as not ready) until it has held for `hold_s` and `min_s` have
    passed since `fault_s`, or `timeout_s` have."""
    recovery = Recovery()
    held_since_s: float | None = None
    while True:
        now_s = time.monotonic()
        try:
            ok = ready()
        except (OSError, RuntimeError, ValueError) as exc:
            log(f"  not ready: {exc}")
            ok = False
        recovery.samples.append((now_s - fault_s, ok))
        held_since_s = (held_since_s or now_s) if ok else None
        if held_since_s is not None and now_s - held_since_s >= hold_s and now_s - fault_s >= min_s:
            return recovery
        if now_s - fault_s > timeout_s:
            return recovery
        time.sleep(max(0.0, SAMPLE_INTERVAL_S - (time.monotonic() - now_s)))


class EventFlow:
    """Whether the gateway's routers are still applying KV-event batches: true when the count grew within the
    last `window_s` of samples (call `grew` once per sample; the load publishes events all the time)."""

    def __init__(self, gateway_port: int, window_s: float = 1.5) -> None:
        self.port, self.window_s = gateway_port, window_s
        self._seen: list[tuple[float, float]] = []

    def grew(self) -> bool:
        now_s = time.monotonic()
        self._seen.append((now_s, counters(self.port)["kv_event_batches"]))
        older = [count for at_s, count in self._seen if now_s - at_s >= self.window_s]
        return bool(older) and self._seen[-1][1] > older[-1]


# ---- processes the benchmark restarts ----------------------------------------------------------------------


def restart_redis(service: Service, log_dir: Path, down_s: float) -> Service:
    """SIGKILL `service` (a redis-server), wait `down_s`, and start an empty one on the same port."""
    service.process.kill()
    service.process.wait(10)
    time.sleep(down_s)
    binary = shutil.which("redis-server")
    assert binary is not None
    log_path = log_dir / "redis-restarted.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen([binary, "--port", str(service.port), "--bind", "127.0.0.1", "--save", "",
                                    "--appendonly", "no"], stdout=log_file, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
    deadline_s = time.monotonic() + 10
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", service.port), 0.2) as conn:
            conn.sendall(b"PING\r\n")
            if conn.recv(16).startswith(b"+PONG"):
                return Service("redis", process, log_path, service.port)
        if process.poll() is not None or time.monotonic() > deadline_s:
            raise RuntimeError(f"redis-server did not come back on port {service.port}")
        time.sleep(0.05)


class StandaloneGateway:
    """`dynctl gateway --ray-address ADDRESS --port PORT *flags` in a session of its own; `start` waits for
    /ready, `kill` is SIGKILL, `start` again brings it back on the same port."""

    def __init__(self, ray_address: str, port: int, flags: list[str], env: dict[str, str],
                 log_dir: Path) -> None:
        self.argv = [sys.executable, "-m", "dynserve.cli.main", "gateway", "--ray-address", ray_address,
                     "--port", str(port), *flags]
        self.port, self.env, self.log_dir = port, env, log_dir
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = log_dir / "gateway-0.log"
        self.num_starts = 0

    def launch(self) -> None:
        """Start it; return at once."""
        self.num_starts += 1
        self.log_path = self.log_dir / f"gateway-{self.num_starts}.log"
        with open(self.log_path, "wb") as log_file:
            self.process = subprocess.Popen(self.argv, stdout=log_file, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, cwd=REPO_ROOT, env=self.env,
                                            start_new_session=True)

    def start(self, timeout_s: float = 60.0) -> float:
        """Start it and wait until /ready answers 200; the seconds that took."""
        started_s = time.monotonic()
        self.launch()
        assert self.process is not None
        while not http_ready(self.port):
            if self.process.poll() is not None or time.monotonic() - started_s > timeout_s:
                raise RuntimeError(f"dynctl gateway did not get ready:\n{self.log_path.read_text()[-2000:]}")
            time.sleep(0.1)
        return time.monotonic() - started_s

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            kill(self.process.pid)
            self.process.wait(10)

    def stop(self) -> None:
        """SIGTERM (graceful), then SIGKILL to its whole session."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
