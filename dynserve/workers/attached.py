"""OpenAI-compatible servers someone else runs, attached as pool members by URL (`dynctl gateway
--worker-url`): each is described from its own API, registered on the event plane under a worker id with a
lease this process renews, and, for vLLM with its KV-event publisher, its events relayed there re-hashed
(`events.vllm`), so the KV router sees its prefix cache as it sees a dynserve worker's.

A worker URL: `ENGINE=URL[;events=ZMQ][;replay=ZMQ][;id=NAME]`, e.g.
`vllm=http://10.0.0.5:8000;events=tcp://10.0.0.5:5557;replay=tcp://10.0.0.5:5558` (the endpoints given to
vLLM's `--kv-events-config`) or `openai=http://10.0.0.6:30000` (any other server: no events, so the router
remembers where it sent prompts: `--router approximate`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from dynserve.errors import InvalidRequestError, WorkerUnavailableError
from dynserve.events.vllm import VllmEventRelay, VllmTranslator
from dynserve.protocol import WorkerInfo
from dynserve.workers.registration import Registration

__all__ = ["AttachedWorker", "WorkerUrl", "describe_server", "describe_when_up", "parse_worker_url"]

logger = logging.getLogger(__name__)

_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{([^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


@dataclass(frozen=True)
class WorkerUrl:
    engine: str
    url: str
    events: str | None = None
    replay: str | None = None
    worker_id: str | None = None


def parse_worker_url(spec: str) -> WorkerUrl:
    """`ENGINE=URL[;events=ZMQ][;replay=ZMQ][;id=NAME]` (see the module's docstring); InvalidRequestError
    naming what is wrong."""
    head, *options = spec.split(";")
    engine, sep, url = head.partition("=")
    if not sep or engine not in ("vllm", "openai"):
        raise InvalidRequestError(f"worker URL {spec!r}: start with vllm=URL or openai=URL", param="worker_urls")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise InvalidRequestError(f"worker URL {spec!r}: {url!r} is not http://HOST:PORT", param="worker_urls")
    fields: dict[str, str] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in ("events", "replay", "id") or not value:
            raise InvalidRequestError(f"worker URL {spec!r}: unknown option {option!r} (events=, replay=, id=)",
                                      param="worker_urls")
        fields[key] = value
    if engine == "openai" and ("events" in fields or "replay" in fields):
        raise InvalidRequestError(f"worker URL {spec!r}: only vLLM workers publish KV events", param="worker_urls")
    if "replay" in fields and "events" not in fields:
        raise InvalidRequestError(f"worker URL {spec!r}: replay= needs events=", param="worker_urls")
    return WorkerUrl(engine, url.rstrip("/"), fields.get("events"), fields.get("replay"), fields.get("id"))


async def describe_server(spec: WorkerUrl, *, worker_id: str, block_size: int, max_model_len: int | None = None,
                          timeout_s: float = 10.0) -> WorkerInfo:
    """The `WorkerInfo` of the server at `spec`: its served model and context from `/v1/models`; a vLLM
    server's block size and block count from its `vllm:cache_config_info` (else `block_size` and 0)."""
    import httpx

    parts = urlsplit(spec.url)
    async with httpx.AsyncClient(base_url=spec.url, timeout=timeout_s) as client:
        try:
            models = (await client.get("/v1/models")).json()["data"]
            metrics = (await client.get("/metrics")).text if spec.engine == "vllm" else ""
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise WorkerUnavailableError(f"{spec.url} does not answer as an OpenAI server: {exc}",
                                         worker_id=worker_id) from exc
    if not models:
        raise WorkerUnavailableError(f"{spec.url} serves no model", worker_id=worker_id)
    card: dict[str, Any] = models[0]
    num_blocks = 0
    match = _CACHE_INFO.search(metrics)
    if match:
        labels = dict(_LABEL.findall(match.group(1)))
        block_size = int(labels.get("block_size") or block_size)
        num_blocks = int(labels.get("num_gpu_blocks") or 0)
    context = card.get("max_model_len") or max_model_len
    if not context:
        raise InvalidRequestError(f"{spec.url} does not say its context length: give --max-model-len",
                                  param="max_model_len")
    return WorkerInfo(worker_id=worker_id, role="both", host=parts.hostname or "", port=parts.port or 80,
                      model_id=card["id"], max_model_len=int(context), block_size=block_size,
                      num_blocks=num_blocks, metrics_port=parts.port if spec.engine == "vllm" else None,
                      engine=spec.engine)


async def describe_when_up(spec: WorkerUrl, *, worker_id: str, block_size: int, max_model_len: int | None = None,
                           wait_s: float, poll_s: float = 1.0, say: Any = None) -> WorkerInfo:
    """`describe_server`, retried while the server does not answer yet (a sidecar starts beside a server
    still loading its model), for at most `wait_s`; `say` hears one line when waiting starts and one every
    30 s. Raises the last WorkerUnavailableError, naming the wait, once it is over."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    next_word = loop.time()
    while True:
        try:
            return await describe_server(spec, worker_id=worker_id, block_size=block_size,
                                         max_model_len=max_model_len, timeout_s=min(10.0, max(poll_s, 1.0)))
        except WorkerUnavailableError as exc:
            now = loop.time()
            if now >= deadline:
                raise WorkerUnavailableError(f"{exc} (waited {wait_s:g} s)", worker_id=worker_id) from exc
            if say is not None and now >= next_word:
                say(f"waiting for {spec.url} to answer ({exc})")
                next_word = now + 30.0
            await asyncio.sleep(min(poll_s, max(deadline - now, 0.0)))


class AttachedWorker:
    """One attached server on `plane` (an `EventPlane`): registered while `start`ed and while it answers
    `/health` (checked every third of the lease: a server that refuses connections, or has not answered for a
    lease, leaves the registry, and joins again when it answers), its KV events relayed."""

    def __init__(self, plane: Any, info: WorkerInfo, spec: WorkerUrl, *, lease_s: float) -> None:
        self.info, self.spec, self.plane, self.lease_s = info, spec, plane, lease_s
        self.registration = Registration(plane, info.worker_id, lease_s)
        self.registered = False
        self.relay: VllmEventRelay | None = None
        if spec.events is not None:
            translator = VllmTranslator(info.model_id, info.block_size)
            self.relay = VllmEventRelay(self.registration.queue_kv_events, info.worker_id, translator, spec.events,
                                        replay_endpoint=spec.replay)
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        await self.registration.join(self.info)
        self.registered = True
        if self.relay is not None:
            self._tasks.append(asyncio.create_task(self.relay.run(), name=f"kv-relay-{self.info.worker_id}"))
        self._tasks.append(asyncio.create_task(self._watch(), name=f"health-{self.info.worker_id}"))
        logger.info("worker %s: %s at %s (%s)", self.info.worker_id, self.info.engine, self.spec.url,
                    f"KV events from {self.spec.events}" if self.relay else "no KV events")

    async def _watch(self) -> None:
        """Leave the registry when the server refuses connections (it is gone) or has not answered `/health`
        for a whole lease (a slow answer on a busy host is not death); join again when it answers."""
        import httpx

        last_ok_s = time.monotonic()
        async with httpx.AsyncClient(base_url=self.spec.url, timeout=self.lease_s) as client:
            while True:
                await asyncio.sleep(self.lease_s / 3)
                try:
                    healthy = (await client.get("/health")).status_code == 200
                    gone = False
                except httpx.ConnectError:
                    healthy, gone = False, True
                except httpx.HTTPError:
                    healthy, gone = False, False
                now_s = time.monotonic()
                if healthy:
                    last_ok_s = now_s
                if healthy and not self.registered:
                    logger.info("worker %s answers again: it joins the registry", self.info.worker_id)
                    self.registration = Registration(self.plane, self.info.worker_id, self.lease_s)
                    await self.registration.join(self.info)
                    if self.relay is not None:  # what it cached before is gone or unknown: start afresh
                        self.relay.emit = self.registration.queue_kv_events
                        self.registration.queue_kv_events([self.relay.translator.reset()])
                    self.registered = True
                elif self.registered and (gone or now_s - last_ok_s > self.lease_s):
                    logger.warning("worker %s does not answer /health: it leaves the registry", self.info.worker_id)
                    self.registered = False
                    await self.registration.leave()
                    self.registration.cancel()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.registered:
            await self.registration.leave()
        self.registration.cancel()
