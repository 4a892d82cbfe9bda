"""Running the gateway on its HTTP server (`http.py`, on uvloop): in the foreground (`dynctl serve`) or on a
background thread (tests, benchmarks, notebooks) with `GatewayServer`, which waits until the port is bound
and the workers are connected before `start()` returns."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import signal
import threading
from collections.abc import Callable, Sequence

from dynserve.config import Settings
from dynserve.errors import InvalidRequestError
from dynserve.events.base import EventPlane
from dynserve.gateway.app import Gateway, build_app
from dynserve.gateway.backend import make_channel
from dynserve.gateway.directory import WorkerDirectory
from dynserve.gateway.disagg import DisaggregatedBackend
from dynserve.gateway.dispatcher import Backend, Dispatcher
from dynserve.gateway.http import HttpLimits, HttpServer
from dynserve.gateway.state import ServedModel
from dynserve.hashing import model_salt
from dynserve.model.resolve import resolve_model_path
from dynserve.model.tokenizer import Tokenizer
from dynserve.protocol import WorkerInfo
from dynserve.router.router import Router

__all__ = ["GatewayServer", "http_limits", "make_backend", "make_disaggregated_backend", "make_gateway_app", "serve_app",
           "serve_app_async"]


def make_gateway_app(settings: Settings, infos: list[WorkerInfo], tokenizer: Tokenizer | None = None, *,
                     registry: EventPlane | None = None, events: EventPlane | None = None,
                     more_models: Sequence[tuple[list[WorkerInfo], Tokenizer]] = ()) -> Gateway:
    """The gateway over workers already started (their `WorkerInfo`s); loads the tokenizer if not given.
    With several workers, requests are routed by `settings.router` (the kv mode reads the event plane).
    With a `registry`, the workers are those it lists, followed as they come and go (see `WorkerDirectory`).
    `events`: the plane the KV routers read (default: the fleet's, from `settings`). `more_models`: other
    models' workers and tokenizers. With several models, or a registry (where workers of another model may
    appear: they add that model, `discovery.ModelDiscovery`), each model's backend takes only the workers
    announcing it."""
    tokenizer = tokenizer or Tokenizer.load(resolve_model_path(settings.model))
    model_id = infos[0].model_id if (more_models or registry is not None) and infos else None
    served = [ServedModel(model_infos[0].model_id,
                          make_backend(settings, model_infos, registry, model_tokenizer, model_infos[0].model_id),
                          model_tokenizer)
              for model_infos, model_tokenizer in more_models]

    async def make_served(model_infos: list[WorkerInfo]) -> ServedModel:
        """A model the registry announced: its tokenizer from the path its workers gave, a backend of its own."""
        path = model_infos[0].model_path
        assert path is not None
        model_tokenizer = await asyncio.to_thread(Tokenizer.load, path)
        backend = make_backend(settings, model_infos, registry, model_tokenizer, model_infos[0].model_id)
        return ServedModel(model_infos[0].model_id, backend, model_tokenizer)

    return build_app(settings, make_backend(settings, infos, registry, tokenizer, model_id), tokenizer,
                     events=events, more_models=served, registry=registry,
                     make_served=make_served if registry is not None and model_id is not None else None)


def make_backend(settings: Settings, infos: list[WorkerInfo], registry: EventPlane | None = None,
                 tokenizer: Tokenizer | None = None, model_id: str | None = None) -> Backend:
    """The backend over `infos` (or the registry): disaggregated when `settings.prefill_workers` or a prefill
    worker among `infos` says so (prefill and decode dispatchers, each routed by `settings.router`), else
    one dispatcher. `model_id`: only workers serving it are members (a gateway of several models)."""
    if settings.prefill_workers > 0 or any(info.role == "prefill" for info in infos):
        return make_disaggregated_backend(settings, infos, registry, model_id)
    router = make_router(settings, infos, dynamic=registry is not None)
    return Dispatcher(_directory(settings, infos, registry, tokenizer=tokenizer, model_id=model_id), router=router,
                      migration_limit=settings.migration_limit)


def make_disaggregated_backend(settings: Settings, infos: list[WorkerInfo], registry: EventPlane | None = None,
                               model_id: str | None = None) -> DisaggregatedBackend:
    """Prefill and decode dispatchers over the workers of those roles among `infos` (or the registry)."""
    if not infos:
        raise ValueError("a disaggregated gateway needs the info of at least one started worker")
    others = sorted({info.engine for info in infos} - {"dynserve"})
    if others:
        raise InvalidRequestError(f"disaggregated serving moves KV pages between dynserve's own workers; {others[0]} "
                                  "workers serve aggregated only (no --prefill-workers)", param="prefill_workers")
    prefill_infos = [info for info in infos if info.role == "prefill"]
    decode_infos = [info for info in infos if info.role != "prefill"]

    def router() -> Router:
        return Router.from_settings(settings, block_size=infos[0].block_size, salt=model_salt(infos[0].model_id))

    prefill = Dispatcher(_directory(settings, prefill_infos, registry, frozenset({"prefill"}), model_id=model_id),
                         router=router(), migration_limit=settings.migration_limit, pool="prefill")
    decode = Dispatcher(_directory(settings, decode_infos, registry, frozenset({"decode", "both"}), model_id=model_id),
                        router=router(), migration_limit=settings.migration_limit, pool="decode")
    return DisaggregatedBackend(prefill, decode, local_prefill_tokens=settings.disagg_local_prefill_tokens,
                                max_prefill_queue=settings.disagg_max_prefill_queue)


def _directory(settings: Settings, infos: list[WorkerInfo], registry: EventPlane | None,
               roles: frozenset[str] | None = None, tokenizer: Tokenizer | None = None,
               model_id: str | None = None) -> WorkerDirectory:
    return WorkerDirectory(infos, registry=registry, roles=roles, model_id=model_id,
                           registry_interval_s=settings.registry_interval_s,
                           registry_grace_s=settings.worker_lease_s, cluster_token=settings.secret("cluster_token"),
                           channel_factory=functools.partial(make_channel, tokenizer=tokenizer))


def make_router(settings: Settings, infos: list[WorkerInfo], *, dynamic: bool = False) -> Router | None:
    """The router for `infos`; None for one fixed worker (or none known), where there is nothing to choose."""
    if not infos or (len(infos) < 2 and not dynamic):
        return None
    return Router.from_settings(settings, block_size=infos[0].block_size, salt=model_salt(infos[0].model_id))


def serve_app(app: Gateway, settings: Settings, on_ready: Callable[[int], None] | None = None) -> None:
    """Serve in the foreground on uvloop until SIGINT/SIGTERM, then drain (`HttpServer.close`: stop accepting,
    refuse new requests, give those in flight `settings.shutdown_grace_s`; a second signal cuts them) and
    return; `on_ready(port)` runs once the socket is bound and the workers are connected."""
    import uvloop

    uvloop.run(serve_app_async(app, settings, on_ready))


async def serve_app_async(app: Gateway, settings: Settings, on_ready: Callable[[int], None] | None = None) -> None:
    """`serve_app` on the running loop (which must be the main thread's, for the signal handlers)."""
    stop, hurry = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:  # the first signal drains, a second one cuts the grace period short
        (hurry if stop.is_set() else stop).set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal)
    try:
        await _serve(app, settings, stop, on_ready, hurry)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


def http_limits(settings: Settings) -> HttpLimits:
    """The HTTP server's limits from the gateway's settings."""
    return HttpLimits(max_body_bytes=settings.max_body_bytes, max_header_bytes=settings.max_header_bytes,
                      max_headers=settings.max_headers, header_timeout_s=settings.header_timeout_s,
                      keep_alive_timeout_s=settings.keep_alive_timeout_s)


async def _serve(app: Gateway, settings: Settings, stop: asyncio.Event,
                 on_ready: Callable[[int], None] | None, hurry: asyncio.Event | None = None) -> None:
    async with app.lifespan():  # (its end disconnects the workers: after the drain)
        _settle_garbage_collector()
        server = HttpServer(app, host=settings.host, port=settings.port, limits=http_limits(settings))
        port = await server.start()
        if on_ready is not None:
            on_ready(port)
        try:
            await stop.wait()
        finally:
            await server.close(grace_s=settings.shutdown_grace_s, hurry=hurry)


def _settle_garbage_collector() -> None:
    """Move what start-up allocated (modules, the tokenizer, the app) out of the collector's sight and make
    full collections rarer: a request allocates many short-lived objects, and collections that walk the
    whole heap each time showed up as a tenth of the gateway's CPU under load."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


class GatewayServer:
    """The gateway on a background thread: `start()` returns once it answers; `url` is its base URL."""

    def __init__(self, app: Gateway, settings: Settings) -> None:
        self.app, self.settings = app, settings
        self._thread = threading.Thread(target=self._run, name="gateway", daemon=True)
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.host = settings.host
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        import uvloop

        async def main() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()

            def on_ready(port: int) -> None:
                self.port = port
                self._ready.set()

            await _serve(self.app, self.settings, self._stop, on_ready)

        try:
            uvloop.run(main())
        except BaseException as exc:  # reported by start()
            self._error = exc
            self._ready.set()

    def start(self, timeout_s: float = 30.0) -> GatewayServer:
        self._thread.start()
        if not self._ready.wait(timeout_s) or self.port is None:
            raise RuntimeError(f"the gateway did not start: {self._error!r}")
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop already ended
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)

    def __enter__(self) -> GatewayServer:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()
