"""Running the gateway app under uvicorn: in the foreground (`dynctl serve`) or on a background thread
(tests, benchmarks, notebooks) with `GatewayServer`, which waits until the port is bound and the workers are
connected before `start()` returns."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI

from dynserve.config import Settings
from dynserve.engine.loader import resolve_model_path
from dynserve.engine.tokenizer import Tokenizer
from dynserve.gateway.app import build_app
from dynserve.gateway.backend import WorkerSet
from dynserve.hashing import model_salt
from dynserve.protocol import WorkerInfo
from dynserve.router.router import Router

__all__ = ["GatewayServer", "make_gateway_app", "serve_app"]


def make_gateway_app(settings: Settings, infos: list[WorkerInfo], tokenizer: Tokenizer | None = None) -> Any:
    """The gateway over workers already started (their `WorkerInfo`s); loads the tokenizer if not given.
    With several workers, requests are routed by `settings.router` (the kv mode reads the event plane)."""
    tokenizer = tokenizer or Tokenizer.load(resolve_model_path(settings.model))
    return build_app(settings, WorkerSet(infos, router=make_router(settings, infos)), tokenizer)


def make_router(settings: Settings, infos: list[WorkerInfo]) -> Router | None:
    if len(infos) < 2:
        return None
    return Router.from_settings(settings, block_size=infos[0].block_size, salt=model_salt(infos[0].model_id))


def _config(app: FastAPI, settings: Settings) -> uvicorn.Config:
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", access_log=False,
                          loop="uvloop", http="httptools", timeout_graceful_shutdown=5, lifespan="on")


def serve_app(app: FastAPI, settings: Settings, on_ready: Callable[[int], None] | None = None) -> None:
    """Serve in the foreground on uvloop until SIGINT/SIGTERM; `on_ready(port)` runs once the socket is
    bound and the workers are connected."""
    import uvloop

    uvloop.run(_serve_app(app, settings, on_ready))


async def _serve_app(app: FastAPI, settings: Settings, on_ready: Callable[[int], None] | None) -> None:
    server = uvicorn.Server(_config(app, settings))
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started and on_ready is not None:
        on_ready(server.servers[0].sockets[0].getsockname()[1])
    await task


class GatewayServer:
    """The gateway on a background thread: `start()` returns once it answers; `url` is its base URL."""

    def __init__(self, app: FastAPI, settings: Settings) -> None:
        self.app = app
        self._server = uvicorn.Server(_config(app, settings))
        self._thread = threading.Thread(target=self._server.run, name="gateway", daemon=True)
        self.host = settings.host
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> GatewayServer:
        self._thread.start()
        deadline = threading.Event()
        for _ in range(int(timeout_s / 0.02)):
            if self._server.started:
                self.port = self._server.servers[0].sockets[0].getsockname()[1]
                return self
            if not self._thread.is_alive():
                break
            deadline.wait(0.02)
        raise RuntimeError("the gateway did not start")

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)

    def __enter__(self) -> GatewayServer:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()
