"""The gateway application: the completion routes on their lean path (`completions.py`), and everything
else (models, health, readiness, metrics, OpenAPI) on FastAPI behind an ASGI bridge (`http.py`).

`build_app` wires one `GatewayState` (settings, workers, tokenizer, metrics, admission count) into both.
The FastAPI lifespan connects to the workers and polls their loads; the OpenAPI document describes the
completion routes too, from the same pydantic schemas that validate them.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import dynserve
from dynserve import shutdown
from dynserve.config import Settings
from dynserve.events.base import EventBatch, EventPlane
from dynserve.gateway.admission import Admission
from dynserve.gateway.asgi import AsgiHandler
from dynserve.gateway.completions import COMPLETION_ROUTES, CompletionRoutes
from dynserve.gateway.discovery import MakeServed, ModelDiscovery
from dynserve.gateway.dispatcher import Backend
from dynserve.gateway.errors import ApiError, install_error_handlers
from dynserve.gateway.http import Exchange
from dynserve.gateway.schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
)
from dynserve.gateway.state import GatewayState, ServedModel
from dynserve.model.tokenizer import Tokenizer
from dynserve.protocol import KVEvent, WorkerInfo

__all__ = ["Gateway", "build_app", "scrape_targets"]


class Gateway:
    """The gateway's request handler: POSTs to the completion routes go to `completions`, the rest through
    the ASGI bridge to `api` (FastAPI); `lifespan()` is the FastAPI app's, connecting to the workers."""

    def __init__(self, state: GatewayState, api: FastAPI) -> None:
        self.state, self.api = state, api
        self.completions = CompletionRoutes(state)
        self.other = AsgiHandler(api, (state.settings.host, state.settings.port))

    async def __call__(self, exchange: Exchange) -> None:
        if exchange.method == b"POST" and exchange.path in COMPLETION_ROUTES:
            await self.completions(exchange)
        else:
            await self.other(exchange)

    def lifespan(self) -> AbstractAsyncContextManager[Any]:
        return self.api.router.lifespan_context(self.api)


def build_app(settings: Settings, backend: Backend, tokenizer: Tokenizer, *, events: EventPlane | None = None,
              more_models: Sequence[ServedModel] = (), registry: EventPlane | None = None,
              make_served: MakeServed | None = None) -> Gateway:
    """The gateway app of the default model (`backend`, `tokenizer`) and `more_models`; its lifespan connects
    to every backend's workers and starts polling their loads, and feeds each KV router from `events`
    (default: the fleet's plane, from `settings`). With a `registry` and `make_served`, models its workers
    announce are added as they appear (`discovery.ModelDiscovery`)."""
    state = GatewayState(settings, backend, tokenizer, list(more_models))
    backends = [served.backend for served in state.models.values()]
    if settings.admission_ttft_ms is not None:
        # it starts low and grows while first tokens come in time: a burst at start-up cannot blow the target
        state.admission = Admission(settings.admission_ttft_ms / 1000, max_limit=float(settings.max_queue),
                                    initial_limit=min(4.0, float(settings.max_queue)), clock=time.monotonic)
    for served in state.models.values():
        pools = served.backend.pools()
        if len(pools) > 1:
            state.metrics.expect_disaggregation()
        for pool, dispatcher in pools:
            if dispatcher.router is not None:  # another model's pools: labelled "<model>/<pool>"
                label = pool if served.backend is backend else f"{served.model_id}/{pool}"
                state.metrics.watch_router(dispatcher.router, pool=label)
    discovery = None
    if registry is not None and make_served is not None:
        discovery = ModelDiscovery(state, registry, make_served, functools.partial(_attach, settings, state, events),
                                   interval_s=settings.registry_interval_s, grace_s=settings.worker_lease_s)
    api = FastAPI(title="dynserve", version=dynserve.__version__,
                  lifespan=_lifespan(settings, backends, events, discovery),
                  description="OpenAI-compatible gateway of dynserve")
    install_error_handlers(api)
    _add_ops_routes(api, state, backend)
    _add_model_routes(api, state)
    api.openapi = lambda: _openapi_with_completions(api)  # type: ignore[method-assign]
    return Gateway(state, api)


# How long each of the lifespan's shutdown steps may take before it is left behind (`shutdown.step`; all of
# them together: `shutdown.STEPS_BUDGET_S`, or `dynctl serve`'s budget they share)
SHUTDOWN_STEP_S = 10.0


def _lifespan(settings: Settings, backends: list[Backend], events: EventPlane | None,
              discovery: ModelDiscovery | None) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The FastAPI lifespan: connect to the workers, feed each KV router from the event plane, and follow the
    registry for new models."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await asyncio.gather(*(backend.start() for backend in backends))
        stops = [_consume_kv_events(settings, backend, events) for backend in backends]
        following = asyncio.create_task(discovery.run(), name="model-discovery") if discovery else None
        try:
            yield
        finally:  # each step bounded (`shutdown.step`), and all of them: none must keep the process up
            with shutdown.budget():
                if following is not None:
                    following.cancel()
                    await shutdown.step("model discovery", asyncio.gather(following, return_exceptions=True),
                                        SHUTDOWN_STEP_S)
                    await shutdown.step("model discovery's registry",
                                        discovery.close(), SHUTDOWN_STEP_S)  # type: ignore[union-attr]
                await shutdown.step("KV event consumers", asyncio.gather(*(stop() for stop in stops)),
                                    SHUTDOWN_STEP_S)
                await shutdown.step("worker connections",
                                    asyncio.gather(*(backend.stop() for backend in backends)),
                                    SHUTDOWN_STEP_S)

    return lifespan


def _consume_kv_events(settings: Settings, backend: Backend,
                       events: EventPlane | None) -> Callable[[], Awaitable[None]]:
    """Feed each of `backend`'s KV routers from `events` (default: a connection to the fleet's plane); returns
    what stops them."""
    consumers, planes = [], []
    for _pool, dispatcher in backend.pools():
        if dispatcher.router is not None and dispatcher.router.mode == "kv":
            from dynserve.events.ray_plane import connect_event_plane

            if events is not None:
                plane = events
            else:
                planes.append(plane := connect_event_plane(settings.redis_url, settings.namespace,
                                                           cluster_token=settings.secret("cluster_token")))
            members = _MembersEvents(plane, dispatcher.directory.channels)
            consumers.append(asyncio.create_task(dispatcher.router.consume(members, backend.snapshot),
                                                 name="kv-events"))

    async def stop() -> None:
        for consumer in consumers:
            consumer.cancel()
        await asyncio.gather(*consumers, return_exceptions=True)
        await asyncio.gather(*(plane.close() for plane in planes), return_exceptions=True)

    return stop


class _MembersEvents(EventPlane):
    """The fleet's event plane as one pool's KV router reads it: only the batches of the pool's members.

    The plane carries every model's workers; a router fed them all would index the whole fleet (each of N
    models' indexes a copy of all N models' blocks, every event applied N times). A worker's batches from
    before its pool admits it are skipped: its first batch after that is a gap, which the router resyncs
    from the worker's snapshot."""

    def __init__(self, plane: EventPlane, members: Mapping[str, object]) -> None:
        self.plane, self.members = plane, members

    async def read(self, cursor: str, *, max_batches: int = 1000,
                   block_s: float = 1.0) -> tuple[list[EventBatch], str]:
        batches, cursor = await self.plane.read(cursor, max_batches=max_batches, block_s=block_s)
        return [batch for batch in batches if batch.worker_id in self.members], cursor

    async def publish(self, worker_id: str, events: Sequence[KVEvent]) -> None:
        await self.plane.publish(worker_id, events)

    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        await self.plane.register(info, ttl_s)

    async def deregister(self, worker_id: str) -> None:
        await self.plane.deregister(worker_id)

    async def workers(self) -> list[WorkerInfo]:
        return await self.plane.workers()


async def _attach(settings: Settings, state: GatewayState, events: EventPlane | None,
                  served: ServedModel) -> Callable[[], Awaitable[None]]:
    """A discovered model's routers: its metrics (pools labelled "<model>/<pool>") and its KV events."""
    for pool, dispatcher in served.backend.pools():
        if dispatcher.router is not None:
            state.metrics.watch_router(dispatcher.router, pool=f"{served.model_id}/{pool}")
    return _consume_kv_events(settings, served.backend, events)


def _add_ops_routes(api: FastAPI, state: GatewayState, backend: Backend) -> None:
    """Liveness, readiness, metrics and the fleet's scrape targets; no API key, but for the metrics routes
    when `metrics_require_key` is set (and a key is configured)."""

    async def check_metrics_key(request: Request) -> None:
        if state.settings.metrics_require_key:
            state.check_api_key(request.headers.get("authorization"))

    @api.get("/health", tags=["ops"], summary="the process is alive")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/ready", tags=["ops"], summary="a worker of the default model is connected and answering (`models`: "
             "each model's readiness)")
    async def ready() -> dict[str, Any]:
        if not backend.is_ready():
            raise ApiError.unavailable("no worker is ready yet")
        return {"status": "ready", "model": state.model_id,
                "workers": backend.pools()[0][1].directory.routable_ids(),  # the pool that answers: both or decode
                "models": {model_id: served.is_ready() for model_id, served in state.models.items()}}

    @api.get("/metrics", dependencies=[Depends(check_metrics_key)], tags=["ops"], summary="Prometheus metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @api.get("/metrics/targets", dependencies=[Depends(check_metrics_key)], tags=["ops"],
             summary="Prometheus HTTP service discovery: this gateway and its workers' metrics endpoints")
    async def metrics_targets(request: Request) -> list[dict[str, Any]]:
        return scrape_targets(request.headers.get("host", f"{state.settings.host}:{state.settings.port}"),
                              [served.backend for served in state.models.values()])


def scrape_targets(gateway_address: str, backends: list[Backend]) -> list[dict[str, Any]]:
    """Prometheus's HTTP SD document for the fleet this gateway serves: the gateway (at the address its
    scraper reached it by) and every member worker of every model's `backends` that serves metrics, one target
    group each, labelled
    `component` (dynserve workers' series carry their own `worker_id`, `role`, `model`; another engine's
    worker gets them, and `worker_engine`, as target labels). The registry decides the
    members, so a worker that joins is listed by the next refresh and one that leaves or dies is not."""
    groups: list[dict[str, Any]] = [{"targets": [gateway_address], "labels": {"component": "gateway"}}]
    for _pool, dispatcher in [pool for backend in backends for pool in backend.pools()]:
        channels = dispatcher.directory.channels
        for worker_id in sorted(channels):
            info = channels[worker_id].info
            if info.metrics_port is not None:
                host = f"[{info.host}]" if ":" in info.host else info.host
                labels = {"component": "worker"}
                if info.engine != "dynserve":  # its series carry none of ours: the recording rules map them
                    labels.update(worker_id=info.worker_id, role=info.role, model=info.model_id,
                                  worker_engine=info.engine)
                groups.append({"targets": [f"{host}:{info.metrics_port}"], "labels": labels})
    return groups


def _add_model_routes(api: FastAPI, state: GatewayState) -> None:
    """The OpenAI model routes (behind the API key)."""

    async def check_api_key(request: Request) -> None:
        state.check_api_key(request.headers.get("authorization"))

    @api.get("/v1/models", dependencies=[Depends(check_api_key)], tags=["openai"])
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(name, served) for name, served in state.names.items()]}

    @api.get("/v1/models/{model_id:path}", dependencies=[Depends(check_api_key)], tags=["openai"])
    async def get_model(model_id: str) -> dict[str, Any]:
        return _model_card(model_id, state.model(model_id))


def _model_card(name: str, served: ServedModel) -> dict[str, Any]:
    """OpenAI's model object, with `root` (the model a name stands for) and `max_model_len`, as vLLM adds
    them, and `ready`: a worker of it answers."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "dynserve", "root": served.model_id,
            "max_model_len": served.backend.max_model_len, "ready": served.is_ready()}


# one event of a completion stream (OpenAPI before 3.2 describes a stream's events, one at a time)
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string", "description": "a chunk as JSON (`chat.completion.chunk` or `text_completion`; the usage "
    "chunk has empty `choices`), an `{\"error\": ...}` object if the stream fails after it began, and `[DONE]` "
    "last"}}}


def _openapi_with_completions(api: FastAPI) -> dict[str, Any]:
    """FastAPI's document plus the completion routes, described from their request and response schemas,
    with every status they answer (the HTTP server's own 408, 413 and 431 included)."""
    if api.openapi_schema is not None:
        return api.openapi_schema
    from fastapi.openapi.utils import get_openapi

    document = get_openapi(title=api.title, version=api.version, description=api.description, routes=api.routes)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})

    def ref(model: type[Any]) -> dict[str, str]:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    error = {"content": {"application/json": {"schema": ref(ErrorResponse)}}}
    for path, request, response, summary in (
        ("/v1/chat/completions", ChatCompletionRequest, ChatCompletionResponse,
         "Create a chat completion (stream with SSE)"),
        ("/v1/completions", CompletionRequest, CompletionResponse, "Create a text completion (stream with SSE)"),
    ):
        document["paths"][path] = {"post": {
            "tags": ["openai"], "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref(request)}}},
            "responses": {
                "200": {"description": "the completion (JSON), or with `stream` a text/event-stream of `data:` "
                                       "chunks ending with `data: [DONE]`",
                        "content": {"application/json": {"schema": ref(response)},
                                    "text/event-stream": {"schema": _SSE_EVENT}}},
                "400": {"description": "invalid parameter, malformed JSON or HTTP", **error},
                "401": {"description": "missing or wrong API key", **error},
                "404": {"description": "unknown model", **error},
                "408": {"description": "the request did not arrive in time (header_timeout_s)", **error},
                "413": {"description": "body over max_body_bytes", **error},
                "429": {"description": "max_queue requests already in flight (Retry-After)", **error},
                "431": {"description": "request line and headers over max_header_bytes, or more than "
                                       "max_headers fields", **error},
                "503": {"description": "no worker is ready or every worker failed the request, or the server "
                                       "is shutting down (Retry-After)", **error},
            },
        }}
    api.openapi_schema = document
    return document
