"""`dynctl serve` as a benchmark runs it: a child process with a Ray instance of its own, started with
`--port 0`, ready once its banner names the port it bound, stopped with Ctrl-C (SIGINT) as a user stops it.

Each server runs in a session of its own with its own Ray temp directory (short, under /tmp: Ray's socket
paths must stay under 108 bytes), and logs stdout and stderr to a file in the caller's log directory, whose
tail goes into the error when it fails to come up. Stopping it sends SIGINT and waits for `dynctl serve`
to stop its gateway, workers and Ray instance; whatever of its process group is still there after that (or
after a failed start) is killed by the group's id, so no Ray or worker process outlives the benchmark.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from benchmarks._common import file_tail, log
from benchmarks._http import http_get

__all__ = ["DynctlServer", "dynctl_serve", "metric_samples", "scrape_counters", "scrape_worker_samples",
           "tree_cpu_s"]

REPO_ROOT = Path(__file__).resolve().parent.parent
_BANNER = re.compile(r"dynserve is serving \S+(?:, \S+)* at http://[^/\s]+:(\d+)/v1")  # one model or several
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


@dataclass
class DynctlServer:
    """A running `dynctl serve`: its process, the port its gateway bound, where it logs."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    port: int

    def log_tail(self, num_chars: int = 3000) -> str:
        return file_tail(self.log_path, num_chars)

    def cpu_s(self) -> float:
        """CPU seconds used so far by the server and its descendants (those alive now): Ray, the workers."""
        return tree_cpu_s(self.process.pid, waited_children=False)


def tree_cpu_s(pid: int, *, waited_children: bool = True) -> float:
    """User + system CPU seconds of process `pid` and its live descendants (0 for a process gone); with
    `waited_children`, also what the children each has waited for had spent."""
    total = 0.0
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return total
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
        if waited_children:
            total += times.children_user + times.children_system
    return total


@contextlib.contextmanager
def dynctl_serve(name: str, flags: Sequence[str], *, log_dir: Path, env: Mapping[str, str] | None = None,
                 start_timeout_s: float = 300.0, stop_timeout_s: float = 60.0) -> Iterator[DynctlServer]:
    """`dynctl serve --port 0 *flags` (with `env` added to this process's environment) for the `with` block;
    RuntimeError, with the log's tail, if it exits or shows no banner within `start_timeout_s`."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    child_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "RAY_TMPDIR": str(ray_tmp),
                 "RAY_AUTH_MODE": "disabled", **(env or {})}
    child_env.pop("RAY_ADDRESS", None)  # a Ray instance of its own, never a cluster found in the environment
    log_path = log_dir / f"{name}.log"
    argv = [sys.executable, "-m", "dynserve.cli.main", "serve", "--port", "0", *flags]
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   cwd=REPO_ROOT, env=child_env, start_new_session=True)
    try:
        port = _wait_for_banner(process, log_path, start_timeout_s)
        yield DynctlServer(name, process, log_path, port)
    finally:
        _stop(name, process, stop_timeout_s)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _wait_for_banner(process: subprocess.Popen[bytes], log_path: Path, timeout_s: float) -> int:
    deadline_s = time.monotonic() + timeout_s
    while True:
        text = log_path.read_text(errors="replace")
        found = _BANNER.search(text)
        if found is not None:
            return int(found.group(1))
        if process.poll() is not None:
            raise RuntimeError(f"dynctl serve exited ({process.returncode}) before serving:\n{text[-3000:]}")
        if time.monotonic() > deadline_s:
            raise RuntimeError(f"dynctl serve showed no banner within {timeout_s:.0f} s:\n{text[-3000:]}")
        time.sleep(0.2)


def _stop(name: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGINT (Ctrl-C) and a wait for the server to stop; then SIGTERM, SIGKILL to whatever of its process
    group is left (a server that ignored SIGINT, Ray processes it left behind)."""
    group = process.pid  # start_new_session: the server leads a process group of its own
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log(f"{name}: still running {timeout_s:.0f} s after SIGINT")
    _wait_group(process, group, 5.0)  # Ray's processes end a moment after the server
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not _group_alive(process, group):
            return
        log(f"{name}: sending {sig.name} to what is left of its process group")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, sig)
        _wait_group(process, group, 10.0)


def _group_alive(process: subprocess.Popen[bytes], group: int) -> bool:
    process.poll()  # reap the server itself, or it counts as a member
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_group(process: subprocess.Popen[bytes], group: int, timeout_s: float) -> None:
    deadline_s = time.monotonic() + timeout_s
    while _group_alive(process, group) and time.monotonic() < deadline_s:
        time.sleep(0.1)


def scrape_counters(port: int, prefix: str, timeout_s: float = 10.0) -> dict[str, float]:
    """The samples of the gateway's /metrics whose name starts with `prefix`, keyed `name{labels}`; not the
    `_created` ones (a counter's creation time, not a count)."""
    return metric_samples(http_get(f"127.0.0.1:{port}", "/metrics", timeout_s), prefix)


def metric_samples(text: str, prefix: str) -> dict[str, float]:
    """`scrape_counters` of a /metrics page already read: its samples whose name starts with `prefix`, keyed
    `name{labels}`, but the `_created` ones."""
    samples = {}
    for line in text.splitlines():
        found = _SAMPLE.match(line)
        if found is not None and found.group(1).startswith(prefix) and not found.group(1).endswith("_created"):
            samples[found.group(1) + (found.group(2) or "")] = float(found.group(3))
    return samples


_LABEL = re.compile(r'(\w+)="([^"]*)"')


def scrape_worker_samples(gateway_port: int, prefixes: tuple[str, ...]) -> list[tuple[str, dict[str, str], float]]:
    """Every worker's samples whose name starts with one of `prefixes` (but the `_created` ones), read from each
    worker's own /metrics as the gateway's scrape targets list them: (name, labels, value)."""
    groups = json.loads(http_get(f"127.0.0.1:{gateway_port}", "/metrics/targets"))
    addresses = [t for g in groups if g["labels"].get("component") == "worker" for t in g["targets"]]
    samples = []
    for address in addresses:
        for line in http_get(address, "/metrics").splitlines():
            found = _SAMPLE.match(line)
            if found is None or not found.group(1).startswith(prefixes) or found.group(1).endswith("_created"):
                continue
            samples.append((found.group(1), dict(_LABEL.findall(found.group(2) or "")), float(found.group(3))))
    return samples

