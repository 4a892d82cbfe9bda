"""The OpenAI-compatible HTTP gateway (FastAPI).

Owns the request path up to the workers: authentication, validation and preprocessing (chat template,
tokenization), admission (429 when its queue is full, 503 while no worker is ready), fan-out of `n` choices
and prompts, streaming (SSE) or collecting the answer, metrics, and aborting requests whose client went
away. Workers receive token ids; everything user-facing is decided here.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import dynserve
from dynserve.config import Settings
from dynserve.engine.tokenizer import Tokenizer
from dynserve.errors import InvalidRequestError, WorkerUnavailableError
from dynserve.gateway.backend import WorkerSet
from dynserve.gateway.errors import ApiError, BodySizeLimit, install_error_handlers
from dynserve.gateway.metrics import GatewayMetrics
from dynserve.gateway.preprocess import Prepared, prepare_chat, prepare_completion
from dynserve.gateway.responses import DONE, ChoiceState, ResponseBuilder, sse
from dynserve.gateway.schemas import ChatCompletionRequest, CompletionRequest
from dynserve.protocol import GenerateRequest, TokenDelta

__all__ = ["GatewayState", "build_app"]

logger = logging.getLogger(__name__)

Kind = Literal["chat", "completion"]


@dataclass(slots=True)
class GatewayState:
    settings: Settings
    workers: WorkerSet
    tokenizer: Tokenizer
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    num_inflight: int = 0

    @property
    def model_id(self) -> str:
        return self.workers.model_id


def build_app(settings: Settings, workers: WorkerSet, tokenizer: Tokenizer) -> FastAPI:
    """The gateway app; its lifespan connects to `workers` and starts polling their loads."""
    state = GatewayState(settings, workers, tokenizer)
    workers._on_load = state.metrics.observe_load
    workers._on_down = lambda info: state.metrics.observe_down(info.worker_id, info.role)
    workers._on_retry = state.metrics.retries.inc

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await workers.start()
        try:
            yield
        finally:
            await workers.stop()

    app = FastAPI(title="dynserve", version=dynserve.__version__, lifespan=lifespan,
                  description="OpenAI-compatible gateway of dynserve")
    app.state.gateway = state
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_body_bytes=settings.max_body_bytes)

    async def check_api_key(request: Request) -> None:
        if settings.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), settings.api_key.encode()):
            raise ApiError(401, "Incorrect API key provided." if header else "You didn't provide an API key.",
                           code="invalid_api_key")

    @app.get("/health", tags=["ops"], summary="the process is alive")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", tags=["ops"], summary="a worker is connected and answering")
    async def ready() -> dict[str, Any]:
        if not workers.is_ready():
            raise ApiError.unavailable("no worker is ready yet")
        return {"status": "ready", "model": state.model_id,
                "workers": sorted(wid for wid, c in workers.connections.items() if c.is_open)}

    @app.get("/metrics", tags=["ops"], summary="Prometheus metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(check_api_key)], tags=["openai"])
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(check_api_key)], tags=["openai"])
    async def get_model(model_id: str) -> dict[str, Any]:
        _check_model(state, model_id)
        return _model_card(state)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_api_key)], tags=["openai"])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(state, body.model)
        prepared = prepare_chat(body, tokenizer, workers.max_model_len)
        return await _serve(state, "chat", body, prepared, request)

    @app.post("/v1/completions", dependencies=[Depends(check_api_key)], tags=["openai"])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(state, body.model)
        prepared = prepare_completion(body, tokenizer, workers.max_model_len)
        return await _serve(state, "completion", body, prepared, request)

    app.add_middleware(_StatusCounter, metrics=state.metrics)
    return app


class _StatusCounter:
    """ASGI middleware counting answered POSTs under /v1/ by endpoint and status (errors included)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope.get("method") != "POST" or not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(path.removeprefix("/v1/"), str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def _model_card(state: GatewayState) -> dict[str, Any]:
    return {"id": state.model_id, "object": "model", "created": 0, "owned_by": "dynserve",
            "max_model_len": state.workers.max_model_len}


def _check_model(state: GatewayState, model: str) -> None:
    if model != state.model_id:
        raise ApiError(404, f"The model `{model}` does not exist. This server serves `{state.model_id}`.",
                       param="model", code="model_not_found")


def _admit(state: GatewayState) -> None:
    if not state.workers.is_ready():
        state.metrics.rejected.labels("not_ready").inc()
        raise ApiError.unavailable("no worker is ready yet; retry shortly", retry_after_s=2)
    if state.num_inflight >= state.settings.max_queue:
        state.metrics.rejected.labels("queue_full").inc()
        raise ApiError(429, f"the server is at its limit of {state.settings.max_queue} requests in flight; retry "
                       "shortly", type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"})


async def _serve(state: GatewayState, kind: Kind, body: ChatCompletionRequest | CompletionRequest,
                 prepared: Prepared, request: Request) -> Response:
    _admit(state)
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    response_id = f"{prefix}-{secrets.token_hex(12)}"
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    builder = ResponseBuilder(kind, response_id, body.model, state.tokenizer, include_usage=include_usage,
                              num_prompts=len(prepared.prompts))
    requests = [GenerateRequest(request_id=f"{response_id}-{p * prepared.n + i}", token_ids=prompt, params=params)
                for p, prompt in enumerate(prepared.prompts) for i, params in enumerate(prepared.params)]
    state.num_inflight += 1
    state.metrics.inflight.inc()
    run = _Run(state, kind, requests, builder)
    if body.stream:
        return StreamingResponse(run.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await run.collect(request)


class _Run:
    """One HTTP request's choices in flight: fan-out, metrics, and the release of the admission slot."""

    def __init__(self, state: GatewayState, kind: Kind, requests: list[GenerateRequest],
                 builder: ResponseBuilder) -> None:
        self.state, self.kind, self.requests, self.builder = state, kind, requests, builder
        self.endpoint = "chat/completions" if kind == "chat" else "completions"
        self.choices = [ChoiceState(i) for i in range(len(requests))]
        self.start_s = time.perf_counter()
        self.first_token_s: float | None = None
        self.last_token_s: list[float | None] = [None] * len(requests)
        self._released = False

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        self.state.num_inflight -= 1
        self.state.metrics.inflight.dec()
        m = self.state.metrics
        if all(c.finish_reason is not None for c in self.choices):
            m.e2e.labels(self.endpoint).observe(time.perf_counter() - self.start_s)
        firsts = self.choices[:: max(1, len(self.choices) // self.builder.num_prompts)]
        m.prompt_tokens.inc(sum(c.num_prompt_tokens for c in firsts))
        m.cached_tokens.inc(sum(c.num_cached_tokens for c in firsts))

    def _observe(self, index: int, delta: TokenDelta) -> None:
        now = time.perf_counter()
        num_tokens = len(delta.token_ids)
        if self.first_token_s is None:
            self.first_token_s = now
            self.state.metrics.ttft.labels(self.endpoint).observe(now - self.start_s)
        previous = self.last_token_s[index]
        if previous is not None and num_tokens:
            gap_s = (now - previous) / num_tokens
            for _ in range(num_tokens):
                self.state.metrics.itl.labels(self.endpoint).observe(gap_s)
        self.last_token_s[index] = now
        self.state.metrics.generated_tokens.inc(num_tokens)
        self.choices[index].absorb(delta)

    async def _deltas(self) -> AsyncIterator[tuple[int, TokenDelta]]:
        workers = self.state.workers
        if len(self.requests) == 1:
            async with contextlib.aclosing(workers.generate(self.requests[0])) as stream:
                async for delta in stream:
                    yield 0, delta
            return
        queue: asyncio.Queue[tuple[int, TokenDelta | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, request: GenerateRequest) -> None:
            try:
                async with contextlib.aclosing(workers.generate(request)) as stream:
                    async for delta in stream:
                        queue.put_nowait((index, delta))
                queue.put_nowait((index, None))
            except Exception as exc:  # delivered to the consumer, which raises it
                queue.put_nowait((index, exc))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(self.requests)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def stream(self) -> AsyncIterator[bytes]:
        builder = self.builder
        try:
            if self.kind == "chat":
                for i in range(len(self.requests)):
                    yield builder.role_chunk(i)
            async with contextlib.aclosing(self._deltas()) as deltas:
                async for index, delta in deltas:
                    self._observe(index, delta)
                    for chunk in builder.delta_chunks(self.choices[index], delta):
                        yield chunk
            if builder.include_usage:
                yield builder.usage_chunk(self.choices)
        except InvalidRequestError as exc:
            yield _error_event(ApiError.from_invalid(exc))
        except WorkerUnavailableError as exc:
            yield _error_event(ApiError.unavailable(str(exc)))
        finally:
            self._release()
        yield DONE

    async def collect(self, request: Request) -> Response:
        async def run() -> None:
            async with contextlib.aclosing(self._deltas()) as deltas:
                async for index, delta in deltas:
                    self._observe(index, delta)

        async def client_gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work = asyncio.create_task(run())
        watcher = asyncio.create_task(client_gone())
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not work.done():  # the client went away: cancelling aborts every choice on its worker
                work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            self._release()
        if work.cancelled():
            return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
        work.result()  # re-raise InvalidRequestError / WorkerUnavailableError for the handlers
        return Response(msgspec.json.encode(self.builder.full_response(self.choices)),
                        media_type="application/json")


def _error_event(error: ApiError) -> bytes:
    return sse({"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}})
