"""Processes a benchmark starts and stops: a redis-server, a fleet of standalone mockers, dynserve's gateway
following them through the registry, and sglang-router from the peers' virtualenv
(`scripts/setup-peers.sh`).

Each process gets a free port, is waited for until it answers, logs to a file of its own (whose tail is
shown when it fails to come up), and is stopped by its own PID: SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import http.client
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._common import log

__all__ = ["PEERS_VENV", "Service", "ensure_sglang_router", "free_port", "http_status", "start_gateway",
           "start_mockers", "start_redis", "start_sglang_router", "stop_all", "stop_gateway"]

REPO_ROOT = Path(__file__).resolve().parent.parent
PEERS_VENV = REPO_ROOT / ".venv-peers"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_status(port: int, path: str, host: str = "127.0.0.1", timeout_s: float = 1.0) -> int | None:
    """The status of GET http://host:port/path, or None when nothing answers."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    except OSError:
        return None
    finally:
        conn.close()


@dataclass
class Service:
    """One child process and where it logs."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    port: int

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, num_chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def stop(self, grace_s: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def stop_all(services: Sequence[Service]) -> None:
    for service in services:  # signal them all first, so they shut down side by side
        if service.alive():
            service.process.send_signal(signal.SIGTERM)
    for service in services:
        service.stop()


def _spawn(name: str, argv: list[str], log_dir: Path, port: int,
           env: dict[str, str] | None = None) -> Service:
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   cwd=REPO_ROOT, env=env)
    return Service(name, process, log_path, port)


def wait_until(services: Sequence[Service], ready: Callable[[Service], bool], timeout_s: float) -> None:
    """Wait until `ready(service)` holds for every service; RuntimeError (with its log) if one exits or the
    time runs out."""
    pending = list(services)
    deadline_s = time.monotonic() + timeout_s
    while pending:
        for service in list(pending):
            if not service.alive():
                code = service.process.returncode
                raise RuntimeError(f"{service.name} exited ({code}):\n{service.log_tail()}")
            if ready(service):
                pending.remove(service)
        if pending and time.monotonic() > deadline_s:
            late = pending[0]
            raise RuntimeError(f"{late.name} not ready after {timeout_s:.0f} s:\n{late.log_tail()}")
        if pending:
            time.sleep(0.1)


def start_redis(log_dir: Path) -> tuple[Service, str]:
    """A throwaway redis-server on a free port (no persistence); returns it and its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (scripts/setup.sh installs it)")
    port = free_port()
    service = _spawn("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no"], log_dir, port)

    def pong(_service: Service) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    wait_until([service], pong, timeout_s=10)
    return service, f"redis://127.0.0.1:{port}/0"


def start_mockers(num_mockers: int, *, profile: str, speedup: float, redis_url: str, namespace: str,
                  log_dir: Path, timeout_s: float = 120) -> list[Service]:
    """`num_mockers` standalone mockers (`python -m dynserve.cli.mocker`), each an OpenAI server on its
    own port that also registers in `namespace` on Redis and publishes its KV events there; returns once
    every one answers /health."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    services = []
    try:
        for i in range(num_mockers):
            port = free_port()
            argv = [sys.executable, "-m", "dynserve.cli.mocker", "--profile", profile,
                    "--speedup", str(speedup), "--http-port", str(port), "--redis-url", redis_url,
                    "--namespace", namespace]
            services.append(_spawn(f"{namespace}-mocker{i}", argv, log_dir, port, env))
        wait_until(services, lambda s: http_status(s.port, "/health") == 200, timeout_s)
    except BaseException:
        stop_all(services)
        raise
    return services


def ensure_sglang_router(binary: Path | None = None) -> Path:
    """The sglang-router executable: `binary` if given, else the peers' virtualenv's, set up by
    `scripts/setup-peers.sh` when it is missing."""
    if binary is not None:
        if not binary.exists():
            raise RuntimeError(f"{binary} does not exist")
        return binary
    found = PEERS_VENV / "bin" / "sglang-router"
    if not found.exists():
        log("sglang-router is missing: running scripts/setup-peers.sh sglang")
        subprocess.run(["bash", str(REPO_ROOT / "scripts" / "setup-peers.sh"), "sglang"], check=True,
                       stdout=sys.stderr)
    return found


def start_sglang_router(binary: Path, worker_ports: Sequence[int], log_dir: Path, *,
                        policy: str = "cache_aware", timeout_s: float = 60) -> Service:
    """sglang-router in front of the HTTP servers on `worker_ports`, with its defaults otherwise (startup
    checks made frequent so it is ready sooner); returns once /readiness says every worker is healthy."""
    port = free_port()
    argv = [str(binary), "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
            "--worker-urls", *(f"http://127.0.0.1:{p}" for p in worker_ports),
            "--worker-startup-check-interval", "1", "--log-level", "warn",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    service = _spawn("sglang-router", argv, log_dir, port)
    try:
        wait_until([service], lambda s: http_status(s.port, "/readiness") == 200, timeout_s)
    except BaseException:
        service.stop()
        raise
    return service


# ---- dynserve's gateway, in its own process (as `dynctl serve` runs it) ------------------------------


def _gateway_process(settings_json: str, ports: Any) -> None:
    import uvloop

    from dynserve.config import Settings
    from dynserve.events.ray_plane import connect_event_plane
    from dynserve.gateway.server import make_gateway_app, serve_app_async

    settings = Settings.model_validate_json(settings_json)

    async def serve() -> None:
        plane = connect_event_plane(settings.redis_url, settings.namespace)
        infos = await plane.workers()  # the benchmark started this process once all had registered
        await serve_app_async(make_gateway_app(settings, infos, registry=plane), settings, on_ready=ports.put)

    uvloop.run(serve())


def start_gateway(settings: Any) -> tuple[Any, int]:
    """dynserve's gateway with `settings` (a `Settings`: its router, Redis and namespace) in a process of its
    own, over the workers registered in that namespace; returns (process, port) once /ready answers."""
    context = multiprocessing.get_context("spawn")
    ports: Any = context.Queue()
    process = context.Process(target=_gateway_process, args=(settings.model_dump_json(), ports), daemon=True)
    process.start()
    try:
        port = ports.get(timeout=120)
        _wait_until_ready(process, port)
    except BaseException:
        stop_gateway(process)
        raise
    return process, port


def _wait_until_ready(process: Any, port: int, timeout_s: float = 60) -> None:
    """Until the gateway's /ready says a worker is connected and answering (503 before)."""
    deadline_s = time.monotonic() + timeout_s
    while http_status(port, "/ready") != 200:
        if not process.is_alive() or time.monotonic() > deadline_s:
            raise RuntimeError(f"the gateway on port {port} did not get ready")
        time.sleep(0.1)


def stop_gateway(process: Any, grace_s: float = 10) -> None:
    """SIGTERM (a graceful stop), then SIGKILL if it has not ended within `grace_s`."""
    process.terminate()
    process.join(grace_s)
    if process.is_alive():
        log(f"the gateway (pid {process.pid}) ignored SIGTERM for {grace_s:.0f} s: killing it")
        process.kill()
        process.join(5)
