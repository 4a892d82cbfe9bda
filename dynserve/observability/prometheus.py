"""A Prometheus for one fleet: `dynctl serve --prometheus` runs the `prometheus` binary (the Debian package
`make setup` installs) on a free loopback port, scraping the gateway and following the workers as they join
and leave, with dynserve's recording rules loaded.

It follows the fleet through HTTP service discovery: the gateway serves the current targets at
`/metrics/targets` (itself and every worker in the registry with a metrics port), and Prometheus re-reads
that list every `refresh_s`, so a new worker is scraped within one refresh and a dead one stops being a
target once the registry drops it. The same document serves an existing Prometheus (`scrape_config`).

`PrometheusServer` owns the process and its working directory (configuration, rules, TSDB; removed on
`stop` unless it was given one). Its configuration is built by a pure function (`scrape_config`), so tests
and an operator's ConfigMap get the same text. A gateway whose `/metrics` requires the API key
(`metrics_require_key`) is scraped with it: the configuration names a credentials file (only the process's
owner can read it), never the key itself.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Self

import httpx

from dynserve.config import free_port
from dynserve.errors import PrometheusError
from dynserve.observability.rules import render_rules

__all__ = ["PrometheusServer", "scrape_config"]

logger = logging.getLogger(__name__)

RULES_NAME = "dynserve-rules.yml"
CREDENTIALS_NAME = "gateway-api-key"  # in the working directory, mode 0600


def scrape_config(targets_url: str, *, scrape_interval_s: float = 15.0, refresh_s: float | None = None,
                  rule_files: tuple[str, ...] = (RULES_NAME,), job: str = "dynserve",
                  credentials_file: str | None = None) -> str:
    """Prometheus's configuration (YAML) scraping the fleet whose gateway serves `targets_url` (its
    `/metrics/targets`), evaluating `rule_files` at the scrape interval. `refresh_s` (default: the scrape
    interval, at least 1 s) is how often the target list is re-read. `credentials_file`: a file holding the
    gateway's API key, sent as 'Authorization: Bearer' on the discovery requests and every scrape (a worker's
    metrics port ignores it)."""
    interval = _duration(scrape_interval_s)
    refresh = _duration(max(1.0, refresh_s if refresh_s is not None else scrape_interval_s))
    timeout = _duration(min(scrape_interval_s, 10.0))
    rules = "".join(f"  - {name}\n" for name in rule_files)
    auth, sd_auth = _authorization(credentials_file, 4), _authorization(credentials_file, 8)
    return (
        "# dynserve: one job, every target from the gateway's HTTP service discovery\n"
        "global:\n"
        f"  scrape_interval: {interval}\n"
        f"  scrape_timeout: {timeout}\n"
        f"  evaluation_interval: {interval}\n"
        f"rule_files:\n{rules}"
        "scrape_configs:\n"
        f"  - job_name: {job}\n"
        f"{auth}"
        "    http_sd_configs:\n"
        f"      - url: {targets_url}\n"
        f"        refresh_interval: {refresh}\n"
        f"{sd_auth}"
    )


def _authorization(credentials_file: str | None, indent: int) -> str:
    """An `authorization` block (bearer, from `credentials_file`) at `indent` spaces; empty without a file."""
    if credentials_file is None:
        return ""
    pad = " " * indent
    return f"{pad}authorization:\n{pad}  type: Bearer\n{pad}  credentials_file: {credentials_file}\n"


def _duration(seconds: float) -> str:
    milliseconds = round(seconds * 1000)
    return f"{milliseconds // 1000}s" if milliseconds % 1000 == 0 else f"{milliseconds}ms"


class PrometheusServer:
    """One `prometheus` process scraping the fleet behind `targets_url`. `start()` returns its URL once it is
    ready; `stop()` ends it (SIGTERM, then SIGKILL after 10 s)."""

    def __init__(self, targets_url: str, *, scrape_interval_s: float = 5.0, refresh_s: float | None = None,
                 host: str = "127.0.0.1", port: int | None = None, workdir: Path | None = None,
                 binary: str = "prometheus", bearer_token: str | None = None) -> None:
        """`bearer_token`: the gateway's API key, when its `/metrics` requires it."""
        self.targets_url, self.scrape_interval_s, self.refresh_s = targets_url, scrape_interval_s, refresh_s
        self._bearer_token = bearer_token
        self.host, self.port = host, port
        self.binary = binary
        self._own_workdir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="dynserve-prometheus-")) if workdir is None else workdir
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "prometheus.log"

    def start(self, timeout_s: float = 30.0) -> str:
        """`launch`, then `wait_ready`."""
        self.launch()
        return self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Write the configuration and rules and start the process (it ends with the thread that launched it:
        launch from a thread that lives as long as the server should, e.g. the main one)."""
        binary = shutil.which(self.binary)
        if binary is None:
            raise PrometheusError(f"no {self.binary!r} binary on PATH (make setup installs the Debian package "
                                  "'prometheus')", url="")
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / RULES_NAME).write_text(render_rules())
        credentials = None
        if self._bearer_token is not None:
            credentials = self.workdir / CREDENTIALS_NAME
            credentials.touch(mode=0o600)  # readable by this user only, before the key is in it
            credentials.chmod(0o600)
            credentials.write_text(self._bearer_token)
        config = self.workdir / "prometheus.yml"
        config.write_text(scrape_config(self.targets_url, scrape_interval_s=self.scrape_interval_s,
                                        refresh_s=self.refresh_s,
                                        credentials_file=None if credentials is None else str(credentials)))
        if self.port is None:
            self.port = free_port(self.host)
        command = [binary, f"--config.file={config}", f"--web.listen-address={self.url.removeprefix('http://')}",
                   f"--storage.tsdb.path={self.workdir / 'data'}", "--storage.tsdb.retention.time=1d"]
        # SIGTERM when the thread that started it ends (Linux's parent-death signal, set by util-linux's
        # setpriv before it execs Prometheus): a Prometheus never outlives a `dynctl serve` that was killed
        setpriv = shutil.which("setpriv")
        if setpriv is not None:
            command = [setpriv, "--pdeathsig", "TERM", *command]
        else:
            logger.warning("no setpriv (util-linux): a Prometheus left by a killed dynctl serve keeps running")
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
                                            start_new_session=True)

    def wait_ready(self, timeout_s: float = 30.0) -> str:
        """Wait until the launched process answers `/-/ready`; its URL. Raises PrometheusError (with the end
        of its log) when it exits or is not ready in time."""
        assert self.process is not None, "launch() first"
        self._wait_ready(timeout_s)
        logger.info("prometheus serving %s (pid %d, data in %s)", self.url, self.process.pid, self.workdir)
        return self.url

    def _wait_ready(self, timeout_s: float) -> None:
        process = self.process  # `stop` (another thread, Ctrl-C) may clear the attribute meanwhile
        if process is None:
            raise PrometheusError("prometheus was stopped while starting", url=self.url)
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=1.0) as client:
            while True:
                if process.poll() is not None:
                    raise PrometheusError(f"prometheus exited with code {process.returncode}: {self._log_tail()}",
                                          url=self.url)
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/-/ready").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    tail = self._log_tail()  # before `stop` removes the working directory with the log
                    self.stop()
                    raise PrometheusError(f"prometheus was not ready within {timeout_s:g} s: {tail}", url=self.url)
                time.sleep(0.1)

    def _log_tail(self, num_lines: int = 5) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").strip().splitlines()[-num_lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()
