"""A vLLM server as a pool member (`Settings.engine = "vllm"`): `VllmWorker`, the Ray actor a pool starts where
it would start an `EngineWorker`, runs vLLM's OpenAI server (`Settings.vllm_command`, the model, free ports on
its node, prefix caching and the KV-event publisher on, `Settings.vllm_args` appended) as a child process in a
session of its own, waits until it serves, and attaches it (`attached.AttachedWorker`: registered under the
worker id, its KV events relayed to the event plane). It answers the pool as any worker does: `start` (the
`WorkerInfo`), `is_healthy` (the server process alive and answering `/health`), `drain` (leave the registry,
let running requests finish), `stop` (the server's whole process group ended). A pool replaces a worker whose
server died like any dead worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from dynserve.config import Settings, free_port
from dynserve.errors import InvalidRequestError, WorkerUnavailableError
from dynserve.protocol import WorkerInfo
from dynserve.workers.attached import AttachedWorker, WorkerUrl, describe_server

__all__ = ["VllmWorker", "vllm_argv"]

logger = logging.getLogger(__name__)


def _end_with_parent() -> None:
    """In the child, before exec: SIGTERM it when this actor's process dies (a pool ends a worker with
    `ray.kill`, which runs no code of ours)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def vllm_argv(settings: Settings, *, host: str, port: int, events_port: int, replay_port: int) -> list[str]:
    """The command that starts vLLM's server for `settings` (its model, block size, context), serving on
    host:port, publishing KV events on every interface's `events_port` (a wildcard endpoint: vLLM binds it)
    with its replay socket on host:replay_port."""
    if not settings.vllm_command:
        raise InvalidRequestError("--engine vllm needs --vllm-command: how to start vLLM's OpenAI server on a "
                                  "worker's node (e.g. '/opt/vllm/bin/python -m vllm.entrypoints.openai.api_server')",
                                  param="vllm_command")
    if settings.model is None:
        raise InvalidRequestError("--engine vllm needs --model: the model vLLM loads (a Hugging Face directory "
                                  "or name), whose tokenizer the gateway uses too", param="model")
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events_port}",
              "replay_endpoint": f"tcp://{host}:{replay_port}"}
    argv = [*shlex.split(settings.vllm_command), "--model", str(settings.model), "--served-model-name",
            Path(str(settings.model)).name, "--host", host, "--port", str(port), "--block-size",
            str(settings.block_size), "--enable-prefix-caching", "--kv-events-config", json.dumps(events)]
    if settings.max_model_len is not None:
        argv += ["--max-model-len", str(settings.max_model_len)]
    return argv + shlex.split(settings.vllm_args)


class VllmWorker:
    """The Ray actor (see the module's docstring). `publish_events`: register and relay (a pool's workers)."""

    def __init__(self, settings: Settings, worker_id: str, role: str = "both", publish_events: bool = False) -> None:
        if role != "both":
            raise InvalidRequestError(f"a vLLM worker serves whole requests; role {role!r} is dynserve's engine's",
                                      param="prefill_workers")
        self._settings, self.worker_id, self._publish = settings, worker_id, publish_events
        node_ip = None
        with contextlib.suppress(Exception):
            import ray

            node_ip = ray.util.get_node_ip_address()
        self.bind_host, self.host = settings.serving_addresses(node_ip)
        self._process: subprocess.Popen[bytes] | None = None
        self._attached: AttachedWorker | None = None
        self._info: WorkerInfo | None = None
        self._log = Path(tempfile.mkdtemp(prefix=f"dynserve-vllm-{worker_id}-")) / "vllm.log"

    async def start(self, timeout_s: float = 900.0) -> WorkerInfo:
        if self._info is not None:
            return self._info
        port, events_port, replay_port = (free_port(self.bind_host) for _ in range(3))
        argv = vllm_argv(self._settings, host=self.bind_host, port=port, events_port=events_port,
                         replay_port=replay_port)
        logger.info("worker %s: starting vLLM: %s", self.worker_id, shlex.join(argv))
        with open(self._log, "wb") as log_file:
            self._process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True,
                                             preexec_fn=_end_with_parent)
        spec = WorkerUrl("vllm", f"http://{self.host}:{port}", f"tcp://{self.host}:{events_port}",
                         f"tcp://{self.host}:{replay_port}", self.worker_id)
        deadline_s = time.monotonic() + timeout_s
        while not await self._answers(spec.url):
            if self._process.poll() is not None or time.monotonic() > deadline_s:
                tail = self._log.read_text(errors="replace")[-3000:]
                self.stop()
                raise WorkerUnavailableError(f"vLLM did not start for worker {self.worker_id}:\n{tail}",
                                             worker_id=self.worker_id)
            await asyncio.sleep(1.0)
        self._info = await describe_server(spec, worker_id=self.worker_id, block_size=self._settings.block_size,
                                           max_model_len=self._settings.max_model_len)
        if self._publish:
            from dynserve.events.ray_plane import connect_event_plane

            plane = connect_event_plane(self._settings.redis_url, self._settings.namespace,
                                        cluster_token=self._settings.secret("cluster_token"))
            self._attached = AttachedWorker(plane, self._info, spec, lease_s=self._settings.worker_lease_s)
            await self._attached.start()
        return self._info

    @staticmethod
    async def _answers(url: str) -> bool:
        import httpx

        try:
            async with httpx.AsyncClient(base_url=url, timeout=2.0) as client:
                return (await client.get("/health")).status_code == 200 and \
                    (await client.get("/v1/models")).status_code == 200
        except httpx.HTTPError:
            return False

    async def until_dead(self) -> None:
        """Never answers: the pool's call fails when this actor dies, which is how it learns at once."""
        await asyncio.Event().wait()

    async def is_healthy(self) -> bool:
        if self._process is None or self._process.poll() is not None or self._info is None:
            return False
        import httpx

        try:
            async with httpx.AsyncClient(timeout=5.0) as client:
                return (await client.get(f"http://{self._info.host}:{self._info.port}/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def drain(self, timeout_s: float) -> int:
        """Leave the registry (no gateway sends it more), let running requests finish for up to `timeout_s`;
        returns how many were still running."""
        if self._attached is not None:
            await self._attached.stop()
            self._attached = None
        deadline_s = time.monotonic() + timeout_s
        running = await self._running()
        while running and time.monotonic() < deadline_s:
            await asyncio.sleep(0.1)
            running = await self._running()
        return running

    async def _running(self) -> int:
        import httpx

        from dynserve.workers.openai_channel import parse_load

        if self._info is None:
            return 0
        try:
            async with httpx.AsyncClient(timeout=5.0) as client:
                text = (await client.get(f"http://{self._info.host}:{self._info.port}/metrics")).text
        except httpx.HTTPError:
            return 0
        load = parse_load(self._info, text)
        return load.num_running + load.num_waiting

    def stop(self) -> None:
        """End the server's process group (SIGTERM, then SIGKILL)."""
        process, self._process = self._process, None
        if process is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            try:
                process.wait(15)
                return
            except subprocess.TimeoutExpired:
                continue

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()

    def log_tail(self, num_chars: int = 3000) -> str:
        return self._log.read_text(errors="replace")[-num_chars:] if self._log.exists() else ""
